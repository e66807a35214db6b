"""``rlperf bench sync --distributed`` (bench/sync_distributed.py): the CPU smoke run goes through the
real endpoints with gloo and checks every engine's checksum; the command refuses what cannot run."""
import os

import pytest
import torch

from rlperf.bench import sync_distributed as D
from rlperf.cli import main

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")


def test_the_gloo_smoke_run_has_a_row_next_to_its_anchor():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    rows = D.measure("tiny", 1, torch.device("cpu"), warmup=0, reps=2, bucket_sizes=(64 << 10,), env=env)
    (row,) = rows  # the checksum of the engine was checked inside, after the first sync
    assert (row.bench, row.kernel, row.anchor) == ("sync-distributed", "broadcast sync (0.0625 MiB buckets)", D.ANCHOR)
    assert row.kernel_ms > 0 and row.anchor_ms > 0 and row.work == 525824 and row.extra["buckets"] == 9
    summary = D.summarize(rows)
    assert summary["target_0.7x"] == "smoke run" and summary["engines"] == 1


@pytest.mark.parametrize("argv, message", [
    (["bench", "matmul", "--distributed"], "--distributed goes with the sync benchmark alone"),
    (["bench", "sync", "--distributed"], "sync --distributed needs at least 2 GPUs, 0 visible"),
])
def test_the_command_refuses_what_cannot_run(argv, message, capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU-only refusals")
    assert main(argv) == 2
    assert message in capsys.readouterr().err
