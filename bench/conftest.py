"""pytest options for the kernel microbenchmarks under pytest-benchmark (``bench/test_microbench.py``).

    python -m pytest bench/ --benchmark-only --benchmark-json results/pytest-bench.json
    python -m pytest bench/ --benchmark-only --bench-quick       # or RLPERF_BENCH_QUICK=1

The CPU test run never collects this folder (pyproject's ``testpaths`` is ``tests``); run it on a GPU.
"""
import os

import pytest

QUICK_ENV = "RLPERF_BENCH_QUICK"


def pytest_addoption(parser):
    parser.getgroup("rlperf bench").addoption(
        "--bench-quick", action="store_true", default=os.environ.get(QUICK_ENV, "0") not in ("", "0"),
        help=f"each microbenchmark's quick case set, as `rlperf bench --quick` (also {QUICK_ENV}=1)",
    )


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    """The card and the software stack join the JSON's machine_info, so that `pytest-benchmark
    compare` warns when two runs come from different cards or stacks (the commit is per benchmark,
    in ``extra_info``, and in pytest-benchmark's own ``commit_info``)."""
    from rlperf.bench.harness import environment

    env = environment()
    machine_info["rlperf"] = {k: env[k] for k in ("card", "sms", "memory_gib", "cuda", "torch", "triton") if k in env}
