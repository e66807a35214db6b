"""rlperf.rollout — the rollout side of the loop: engine, KV cache, tokenizer, HTTP server, router launcher.

``engine``: continuous batching over a paged KV cache with chunked prefill, preemption, seeded
sampling and per-token log-probs (:class:`Engine`, :class:`SamplingParams`, :class:`GenerationResult`).
``kv_cache``: page pools and allocator. ``tokenizer``: a local HF tokenizer or the built-in byte
tokenizer. ``engine_loop``: the engine thread (pause, resume, commands between steps). ``server``: the
SGLang-compatible HTTP server (``rlperf serve``; weight buckets arrive through :mod:`rlperf.sync`).
``router``: N servers behind the real ``sglang-router``.
"""
from rlperf.lazy_exports import lazy_exports

_EXPORTS = {
    'BadRequest': '.engine',
    'Engine': '.engine',
    'EngineConfig': '.engine',
    'GenerationResult': '.engine',
    'Request': '.engine',
    'SamplingParams': '.engine',
    'ByteTokenizer': '.tokenizer',
    'load_tokenizer': '.tokenizer',
}
"""Each exported name -> the submodule that defines it (imported when the name is first used)."""
__all__ = ["BadRequest", "Engine", "EngineConfig", "GenerationResult", "Request", "SamplingParams", "ByteTokenizer",
           "load_tokenizer"]


__getattr__ = lazy_exports(__name__, _EXPORTS)
