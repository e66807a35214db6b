"""``rlperf bench moe`` on the CPU: registered, refuses to time without a GPU, and its summary states
the targets from the rows (the GPU run itself is bench/device_moe.sh)."""
import pytest
import torch

from rlperf.bench import moe
from rlperf.bench.harness import BenchRow
from rlperf.bench.run import BENCHES
from rlperf.cli import main


def _row(case, kernel, kernel_ms, anchor, anchor_ms, t, **extra):
    return BenchRow("moe", case, kernel, kernel_ms, anchor, anchor_ms, extra={"T": t, **extra})


def test_summary_states_the_targets_at_the_largest_batch():
    rows = [
        _row("gate_up T=1024", "rlperf.grouped_matmul", 1.0, "torch._grouped_mm", 0.1, 1024),
        _row("gate_up T=8192", "rlperf.grouped_matmul", 1.0, "torch._grouped_mm", 0.9, 8192),
        _row("down T=8192", "rlperf.grouped_matmul", 1.0, "torch._grouped_mm", 0.4, 8192),
        _row("gate_up T=8192", "rlperf.grouped_matmul", 1.0, "cublas per-expert loop", 2.0, 8192),
        _row("moe layer T=8192", "invariant", 2.5, "fast", 2.0, 8192, invariant_keeps_probe_bits=True,
             fast_keeps_probe_bits=False),
    ]
    s = moe.summarize(rows)
    assert s["tokens"] == 8192
    assert s["grouped_gemm_vs_grouped_mm_geomean"] == pytest.approx(0.6)
    assert s["grouped_gemm_target_0.8_met"] is False
    assert s["grouped_gemm_vs_cublas_loop_geomean"] == pytest.approx(2.0)
    assert s["invariant_layer_slowdown_vs_fast"] == pytest.approx(1.25) and s["invariant_layer_target_1.3x_met"]
    assert s["invariant_keeps_probe_bits"] and not s["fast_keeps_probe_bits"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_bench_moe_is_registered_and_needs_a_gpu(capsys):
    assert BENCHES["moe"] == "rlperf.bench.moe"
    assert main(["bench", "moe", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
