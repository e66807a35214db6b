"""A stand-in for the ``sglang`` package in the SGLang backend's tests: only ``python -m sglang.launch_server``
(:mod:`sglang.launch_server`, a small HTTP server that answers like SGLang and records every request)."""
