"""rlperf.bench — kernel microbenchmarks. Each module has ``run(quick) -> list[BenchRow]``; the kernel
microbenchmarks also ``cases(quick) -> list[BenchCase]`` (``bench/test_microbench.py``); see ``run.py``."""
