"""rlperf.rollout — the rollout side of the loop: engine, KV cache, tokenizer, HTTP server, router launcher.

``engine``: continuous batching over a paged KV cache with chunked prefill, preemption, seeded
sampling and per-token log-probs (:class:`Engine`, :class:`SamplingParams`). ``kv_cache``: page
pools and allocator. ``tokenizer``: a local HF tokenizer or the built-in byte tokenizer. ``loop``:
the engine thread. ``server``: the SGLang-compatible HTTP server (``rlperf serve``). ``router``:
N servers behind the real ``sglang-router``. ``weights``: receiving flattened weight buckets.
"""
from .engine import BadRequest, Engine, EngineConfig, Request, SamplingParams
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["BadRequest", "Engine", "EngineConfig", "Request", "SamplingParams", "ByteTokenizer", "load_tokenizer"]
