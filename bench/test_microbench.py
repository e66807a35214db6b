"""The kernel microbenchmarks under pytest-benchmark (GPU): each case's kernel and anchor, timed alone.

    python -m pytest bench/ --benchmark-only --benchmark-json results/pytest-bench.json
    python -m pytest bench/ --benchmark-only --bench-quick      # the quick sets (or RLPERF_BENCH_QUICK=1)
    pytest-benchmark compare results/*.json                      # runs side by side, group by group

One test per (benchmark, case, side): ``side`` is the ``kernel`` or the ``anchor`` of a case from
the module's ``cases(quick)``, the same pairs ``rlperf bench`` reports. The case's inputs are built
once for all the tests that time calls on them. Each round, pytest-benchmark's setup flushes L2
(where the case does) and synchronizes, outside the timer; the timed call ends with
``torch.cuda.synchronize()``, so pytest-benchmark's clock measures the GPU work to completion,
launch included. Calls under ~50 us therefore read mostly launch and synchronization here; their
GPU times are ``rlperf bench``'s CUDA events and graph replays.

The group is ``bench:case: kernel vs anchor``, so a case's two sides sit together and the
relative column is their ratio. ``extra_info`` holds the names, work and unit, the rate at the
median, the card and the commit. ``rlperf bench`` remains the source of the tables (graph replays,
eager and host times, memory, bit checks).
"""
import gc

import pytest
import torch

from rlperf.bench.harness import BenchCase, environment, flush_l2_cache, rate
from rlperf.bench.run import microbench_cases

pytest.importorskip("pytest_benchmark", reason="these tests are pytest-benchmark's (pip install pytest-benchmark)")

SIDES = ("kernel", "anchor")
ROUNDS = {True: (10, 3), False: (30, 5)}  # {quick: (timed rounds, warm-up rounds)}: rlperf bench's reps
NO_CUDA = "needs CUDA (marker gpu): CPU timings are not performance results"


_CASES: dict[tuple[str, str], BenchCase] = {}
"""(bench, case name) -> case, filled at collection; the tests' parameters are plain strings, so the
JSON's ``params`` read ``{"bench", "case", "side"}`` (and ``compare --group-by param:bench`` works)."""


def pytest_generate_tests(metafunc):
    if "side" in metafunc.fixturenames:
        cases = microbench_cases(metafunc.config.getoption("bench_quick", default=False))
        _CASES.update({(c.bench, c.name): c for c in cases})
        params = [(c.bench, c.name, side) for c in cases for side in SIDES]
        metafunc.parametrize(("bench", "case", "side"), params,
                             ids=[_CASES[b, n].test_id(side) for b, n, side in params])


@pytest.fixture
def bench_case(bench, case) -> BenchCase:
    return _CASES[bench, case]


class _LastWorkload:
    """The last workload built. Tests run in case order, so the cases that share inputs build them
    once, and the previous inputs are freed before the next are built."""

    def __init__(self):
        self.setup = self.workload = None

    def get(self, case):
        if self.setup is not case.setup:
            self.release()
            self.workload = case.setup()
            self.setup = case.setup
        return self.workload

    def release(self):
        self.setup = self.workload = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def workloads():
    last = _LastWorkload()
    yield last
    last.release()


@pytest.fixture(scope="session")
def run_environment():
    return environment()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_microbench(bench_case, side, benchmark, workloads, run_environment, request):
    workload = workloads.get(bench_case)
    name = getattr(bench_case, side)
    for n in (bench_case.kernel, bench_case.anchor):  # as in rlperf bench, a pair missing a side is left out
        if n in workload.unavailable:
            pytest.skip(f"{n} unavailable: {workload.unavailable[n]}")
    fn = workload.calls[name]
    try:
        fn()  # compiles; a third-party or tuning call that cannot run on this stack skips
    except Exception as exc:
        if name not in workload.fallible:
            raise
        workload.unavailable[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
        pytest.skip(f"{name} unavailable: {workload.unavailable[name]}")

    def cold():  # pytest-benchmark's setup, outside the timer
        if bench_case.flush_l2:
            flush_l2_cache()
        torch.cuda.synchronize()

    def call():
        fn()
        torch.cuda.synchronize()

    rounds, warmup = ROUNDS[request.config.getoption("bench_quick", default=False)]
    benchmark.group = f"{bench_case.bench}:{bench_case.name}"
    benchmark.extra_info.update(
        bench=bench_case.bench, case=bench_case.case, side=side, call=name, kernel=bench_case.kernel,
        anchor=bench_case.anchor, work=bench_case.work, unit=bench_case.unit, flush_l2=bench_case.flush_l2,
        params=bench_case.params, card=run_environment["card"], commit=run_environment["commit"],
    )
    benchmark.pedantic(call, setup=cold, rounds=rounds, warmup_rounds=warmup, iterations=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["rate_at_median"] = rate(bench_case.work, bench_case.unit,
                                                      benchmark.stats.stats.median * 1e3)
