from rlperf.cli import run

run()
