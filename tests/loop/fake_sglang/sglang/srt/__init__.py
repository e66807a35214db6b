"""The stand-in's ``sglang.srt``: only what ``python -m rlperf.bench.sglang_anchor`` touches (the plugins)."""
