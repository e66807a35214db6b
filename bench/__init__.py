"""rlperf.bench — kernel microbenchmarks. Each module has ``run(quick) -> list[BenchRow]``; see ``run.py``."""
