"""pytest-benchmark entry to the kernel microbenchmarks (GPU).

    pytest bench/test_microbench.py --benchmark-json results/pytest-bench.json

Each case runs a benchmark module's quick set once under pytest-benchmark (wall time of the whole
set) and stores every row — kernel and anchor medians from CUDA events, ratio, rates — in the
benchmark's ``extra_info``, so the JSON carries the same numbers as ``rlperf bench``. Full tables
come from ``rlperf bench``.
"""
import importlib

import pytest
import torch

from rlperf.bench.harness import environment
from rlperf.bench.run import BENCHES

if not torch.cuda.is_available():
    pytest.skip("benchmarks need CUDA (CPU timings are not performance results)", allow_module_level=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BENCHES))
def test_microbench(name, benchmark):
    module = importlib.import_module(BENCHES[name])
    rows = benchmark.pedantic(module.run, kwargs={"quick": True}, rounds=1, iterations=1)
    assert rows, f"benchmark {name} returned no rows"
    for r in rows:
        assert r.kernel_ms > 0 and r.anchor_ms > 0, r
    benchmark.extra_info["environment"] = environment()
    benchmark.extra_info["summary"] = module.summarize(rows)
    benchmark.extra_info["rows"] = [r.to_dict() for r in rows]
