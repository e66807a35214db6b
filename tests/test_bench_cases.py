"""The microbenchmarks' cases as data (CPU): listing them builds nothing, and pytest-benchmark's
tests (bench/test_microbench.py) are exactly those cases, kernel and anchor side each."""
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlperf.bench import harness
from rlperf.bench.harness import BenchCase, Timing, Workload, by_workload, call_names, time_calls
from rlperf.bench.run import BENCHES, MICROBENCHES, microbench_cases

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("kernel", "anchor")


@pytest.fixture
def no_workloads(monkeypatch):
    """Building a Workload (what every case's setup ends with) fails: listing cases must not build one."""

    def refuse(*args, **kwargs):
        raise AssertionError("a case's setup ran while listing cases")

    for name in MICROBENCHES:
        module = importlib.import_module(BENCHES[name])
        assert hasattr(module, "cases"), f"{name}: a microbenchmark module must expose cases(quick)"
        monkeypatch.setattr(module, "Workload", refuse)


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_cases_are_data_with_unique_names(quick, no_workloads):
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    for name in MICROBENCHES:
        cases = importlib.import_module(BENCHES[name]).cases(quick)
        assert cases, name
        for c in cases:
            assert isinstance(c, BenchCase) and c.bench == name, c
            assert c.kernel and c.anchor and c.kernel != c.anchor, c
            assert c.work > 0 and c.unit in ("TFLOP/s", "GB/s"), c
            assert callable(c.setup), c
        names = [c.name for c in cases]
        assert len(set(names)) == len(names), f"{name}: duplicate cases {sorted(n for n in names if names.count(n) > 1)}"
    if torch.cuda.is_available():
        assert torch.cuda.memory_allocated() == before


def test_quick_sets_are_smaller_and_flatten_skips_l2_flush():
    for name in MICROBENCHES:
        module = importlib.import_module(BENCHES[name])
        assert len(module.cases(True)) <= len(module.cases(False)), name
    assert all(not c.flush_l2 for c in importlib.import_module(BENCHES["flatten"]).cases(True))
    assert all(c.flush_l2 for c in importlib.import_module(BENCHES["matmul"]).cases(True))


def _collected_ids(args: list[str], env: dict) -> tuple[list[str], str]:
    """Test ids of bench/test_microbench.py as pytest sees them: run (every test skips) without CUDA,
    collected only where CUDA would run the benchmarks."""
    collect = torch.cuda.is_available()
    mode = ["--collect-only", "-q"] if collect else ["-v", "-rs"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "bench/test_microbench.py", "-p", "no:cacheprovider", *mode, *args],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = r"^bench/test_microbench\.py::test_microbench\[(.*)\]" + ("$" if collect else " SKIPPED ")
    return re.findall(line, proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("args, env, quick", [
    ([], {"RLPERF_BENCH_QUICK": ""}, False),
    (["--bench-quick"], {"RLPERF_BENCH_QUICK": ""}, True),
    ([], {"RLPERF_BENCH_QUICK": "1"}, True),
], ids=["full", "--bench-quick", "RLPERF_BENCH_QUICK=1"])
def test_pytest_benchmark_ids_are_the_cases(args, env, quick):
    ids, out = _collected_ids(args, env)
    assert ids == [c.test_id(side) for c in microbench_cases(quick) for side in SIDES]
    if not torch.cuda.is_available():  # without CUDA every test skips, saying why
        assert f"{len(ids)} skipped" in out and "needs CUDA" in out, out[-2000:]


def test_by_workload_groups_shared_setups_in_order():
    def a():
        return Workload({})

    def b():
        return Workload({})

    cases = [BenchCase("x", "c1", "k", "a1", setup=a), BenchCase("x", "c2", "k", "a1", setup=b),
             BenchCase("x", "c1", "k2", "a1", setup=a)]
    groups = by_workload(cases)
    assert [s for s, _ in groups] == [a, b]
    assert [[c.case + c.kernel for c in g] for _, g in groups] == [["c1k", "c1k2"], ["c2k"]]
    assert call_names(groups[0][1]) == ["k", "a1", "k2"]


def test_time_calls_shares_timings_and_leaves_out_what_cannot_run(capsys):
    calls = []

    def timer(fn):
        calls.append(fn)
        fn()
        return Timing(1.0, 1.0, 1.0, 1)

    def broken():
        raise RuntimeError("out of shared memory")

    w = Workload({"k": lambda: None, "tuned": broken, "strict": broken}, unavailable={"cudnn": "not built"},
                 fallible={"tuned"})
    times = time_calls(w, ["k", "cudnn", "tuned"], timer, "x")
    assert set(times) == {"k"} and len(calls) == 2
    assert w.unavailable["tuned"] == "RuntimeError: out of shared memory"
    out = capsys.readouterr().out
    assert "x: cudnn left out: not built" in out and "x: tuned left out" in out
    with pytest.raises(RuntimeError):  # a call that is not fallible fails the benchmark
        time_calls(w, ["strict"], timer, "x")


def test_case_row_carries_params_and_renames_sides():
    c = BenchCase("matmul", "M=1", "rlperf.matmul", "cublas", setup=lambda: Workload({}), work=2e9,
                  params={"M": 1})
    row = c.row(2.0, 1.0, kernel="rlperf.matmul/graph", floor_ms=0.5)
    assert (row.kernel, row.anchor, row.case, row.ratio) == ("rlperf.matmul/graph", "cublas", "M=1", 0.5)
    assert row.extra == {"M": 1, "floor_ms": 0.5} and row.rate(1.0) == pytest.approx(harness.rate(2e9, "TFLOP/s", 1.0))
    assert c.test_id("anchor") == "matmul:M=1: rlperf.matmul vs cublas:anchor"
