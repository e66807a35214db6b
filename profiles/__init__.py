"""rlperf.profiles — the profile harness behind ``rlperf profile`` (issue #6).

``control``: discover workers through the router (``GET /workers``) and start/stop their profilers
(slime's ``tools/profile_rollout.py``). ``load``: the load generator and its request log.
``traces``: read Chrome traces (SGLang's ``*.trace.json.gz`` too), put them on one clock, merge them
into one Perfetto-loadable trace. ``summary``: top kernels, prefill vs decode, throughput and latency.
``harness``: ``rlperf profile run`` end to end, collecting traces locally or over HTTP.
``cli``: the ``rlperf profile`` arguments. The training loop's own phase timeline and torch traces
are not here: they are the loop's telemetry (:mod:`rlperf.telemetry`), which this harness may read.
"""
