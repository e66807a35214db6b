"""rlperf train through the real sglang-router: two `rlperf serve` workers, weights pushed as
shared-memory buckets after every update; the run matches the in-process engine's, bit for bit."""
import os
import sys

import pytest

from rlperf.loop import train
from rlperf.rollout.args import ServerArgs
from rlperf.rollout.router import launch_cluster

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")

VOLATILE = ("perf/", "memory/")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, free_ports):
    log_dir = tmp_path_factory.mktemp("logs")
    p0, p1, router_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    # a different random init than the trainer's: the loop's first weight sync must replace it
    args = ServerArgs(model_path="tiny", kernel_backend="reference", num_threads=1, device="cpu", random_seed=5)
    try:
        c = launch_cluster(args, 2, router_port, env=env, log_dir=str(log_dir), ports=[p0, p1])
    except Exception:
        for f in sorted(log_dir.iterdir()):
            sys.stderr.write(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}\n")
        raise
    with c:
        yield c, router_port


def test_router_run_equals_in_process_run(cluster, tmp_path):
    _, port = cluster
    flags = ["--no-progress", "--num-rollout", "2", "--true-on-policy-mode"]
    routed = train(["--output-dir", str(tmp_path / "r"), "--sglang-router-ip", "127.0.0.1",
                    "--sglang-router-port", str(port), *flags])
    local = train(["--output-dir", str(tmp_path / "l"), *flags])
    stable = lambda h: [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in h]  # noqa: E731
    assert stable(routed) == stable(local)
    assert [m["train/train_rollout_logprob_abs_diff"] for m in routed] == [0.0, 0.0]
