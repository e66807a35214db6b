"""Benchmark reporting: ratios, tables and BENCHMARKS.md sections (CPU; timing itself needs CUDA)."""
import json

import pytest
import torch

from rlperf.bench.harness import BenchRow, cuda_time, format_table, geomean, write_json
from rlperf.bench.run import update_markdown


def _row(kernel_ms=2.0, anchor_ms=1.0):
    return BenchRow(bench="matmul", case="M=1024 N=4096 K=4096", kernel="triton", kernel_ms=kernel_ms,
                    anchor="cuBLAS", anchor_ms=anchor_ms, work=2 * 1024 * 4096 * 4096)


def test_ratio_is_anchor_over_kernel_and_rates():
    r = _row()
    assert r.ratio == 0.5
    assert r.rate(1.0) == pytest.approx(2 * 1024 * 4096 * 4096 / 1e-3 / 1e12)
    d = r.to_dict()
    assert d["ratio"] == 0.5 and d["anchor_rate"] == pytest.approx(2 * d["kernel_rate"])


def test_table_and_geomean():
    text = format_table([_row(), _row(1.0, 1.0)])
    assert "cuBLAS" in text and "0.500" in text and "1.000" in text
    assert geomean([0.25, 1.0]) == pytest.approx(0.5)


def test_markdown_section_replaced_in_place(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# t\n\nintro\n")
    update_markdown(md, "matmul", "<!-- bench:matmul start -->\nA\n<!-- bench:matmul end -->")
    update_markdown(md, "attention", "<!-- bench:attention start -->\nB\n<!-- bench:attention end -->")
    update_markdown(md, "matmul", "<!-- bench:matmul start -->\nC\n<!-- bench:matmul end -->")
    text = md.read_text()
    assert "intro" in text and "C" in text and "B" in text and "\nA\n" not in text
    assert text.index("C") < text.index("B")  # replaced where it stood


def test_a_section_names_pdl_in_its_command_and_the_environment_records_it(monkeypatch):
    """A result measured with PDL switched off (``RLPERF_PDL=0``; on by default) says so in its BENCHMARKS
    command; the environment records the setting (no PDL on a CPU: there is no launch to mark)."""
    from rlperf.bench.harness import environment
    from rlperf.bench.run import _markdown_section
    from rlperf.kernels import pipeline

    info = {"card": "X", "commit": "abc", "date": "d", "torch": "t", "triton": "3.6.0", "cuda": "13.0"}
    default = _markdown_section("rollout", [_row()], {**info, "programmatic_launch": True}, {})
    off = _markdown_section("rollout", [_row()], {**info, "programmatic_launch": False,
                                                   "programmatic_launch_off": True}, {})
    assert "Command: `rlperf bench rollout" in default and "Command: `RLPERF_PDL=0 rlperf bench rollout" in off
    monkeypatch.setattr(pipeline, "_pdl_on", True)
    on = environment()
    assert on["programmatic_launch"] is (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
    assert on["programmatic_launch_off"] is False
    monkeypatch.setattr(pipeline, "_pdl_on", False)
    assert environment()["programmatic_launch"] is False and environment()["programmatic_launch_off"] is True


def test_json_has_environment_and_rows(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, [_row()], {"card": "X", "commit": "abc"}, {"geo": 0.5})
    data = json.loads(path.read_text())
    assert data["environment"]["card"] == "X" and data["rows"][0]["ratio"] == 0.5


def test_cuda_time_refuses_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="CPU timings"):
        cuda_time(lambda: None)


def test_count_launches_reduces_profiler_events():
    """GPU kernels count unless they are copies or memsets; host launch calls count by API name,
    with CUPTI's version / per-thread suffixes stripped; a graph replay is one call."""
    from types import SimpleNamespace

    import torch

    from rlperf.bench.harness import LaunchCount, count_launches

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=n, device_type=d) for n, d in [
        ("aten::mm", cpu), ("cudaLaunchKernel", cpu), ("ampere_bf16_gemm", cuda),
        ("cuLaunchKernel", cpu), ("_matmul_kernel", cuda), ("cudaLaunchKernel_v7000", cpu),
        ("cudaGraphLaunch", cpu), ("_rmsnorm_kernel", cuda), ("_attn_fwd_kernel", cuda),
        ("cudaMemcpyAsync", cpu), ("Memcpy HtoD (Pageable -> Device)", cuda), ("Memset (Device)", cuda),
        ("cudaStreamSynchronize", cpu), ("cudaLaunchKernelInMyHead", cpu),
    ]]
    assert count_launches(events) == LaunchCount(kernels=4, launch_calls=4)
    assert count_launches([]) == LaunchCount(0, 0)
    assert str(LaunchCount(4, 1)) == "4 kernels / 1 launch calls"


def test_a_cpu_profile_has_no_launches_and_without_cuda_nothing_is_counted(monkeypatch):
    """A real profiler trace of CPU work reduces to zero launches; without CUDA
    :func:`measure_launches` runs nothing and reports ``n/a``, never a number it did not measure."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rlperf.bench.harness import LaunchCount, count_launches, format_launches, launch_fields, measure_launches

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (torch.ones(5) @ torch.ones(5, 3)).sum()
    events = prof.events()
    assert any(e.name == "aten::matmul" for e in events)
    assert count_launches(events) == LaunchCount(0, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    assert measure_launches(lambda: calls.append(1)) is None and calls == []
    assert format_launches(None) == "n/a (no CUDA)"
    assert launch_fields("micro_step", None) == {"micro_step_kernels": "n/a", "micro_step_launch_calls": "n/a"}
    assert launch_fields("x", LaunchCount(7, 2)) == {"x_kernels": 7, "x_launch_calls": 2}


def test_tile_candidates_name_each_tile_by_its_fields():
    from rlperf.bench.harness import tile_candidates
    from rlperf.bench.weight_grad_sweep import CANDIDATES

    assert tile_candidates((64, 128, 128, 8, 5), (128, 256, 64, 8, 4)) == {
        "m64n128k128w8s5": (64, 128, 128, 8, 5), "m128n256k64w8s4": (128, 256, 64, 8, 4)}
    assert list(CANDIDATES)[:2] == ["m64n128k128w8s3", "m64n128k128w8s4"]  # the names the recorded runs quote


def test_sweep_candidate_reports_bits_time_and_failures(tmp_path):
    from rlperf.bench.harness import sweep_candidate, write_sweep_json

    base = torch.arange(6.0)
    assert sweep_candidate(lambda: torch.arange(6.0), base, lambda fn: 0.5) == (0.5, True)
    assert sweep_candidate(lambda: torch.arange(6.0) + 1e-6, base, lambda fn: 0.25) == (0.25, False)

    def too_big():
        raise RuntimeError("out of resource: shared memory, Required: 262144\nmore")

    assert sweep_candidate(too_big, base, lambda fn: 1.0) == (
        "failed: RuntimeError: out of resource: shared memory, Required: 262144", None)
    write_sweep_json(None, [{"a": 1}])  # no --json: nothing written
    path = tmp_path / "rows.json"
    write_sweep_json(path, [{"tile": "m64", "ms": 0.5}])
    doc = json.loads(path.read_text())
    assert doc["rows"] == [{"tile": "m64", "ms": 0.5}] and "environment" in doc
