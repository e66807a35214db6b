"""rlperf.profiles — the profile harness behind `rlperf profile` (discover workers through the router,
start/stop traces, drive load, collect, merge into one Perfetto trace, summarize).

The harness lands with issue #6; until then `rlperf profile` says so and exits 2.
"""
