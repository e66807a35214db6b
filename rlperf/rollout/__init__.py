"""rlperf.rollout — the rollout side of the loop: engine, KV cache, tokenizer, HTTP server, router launcher.

``engine``: continuous batching over a paged KV cache with chunked prefill, preemption, seeded
sampling and per-token log-probs (:class:`Engine`, :class:`SamplingParams`, :class:`GenerationResult`).
``kv_cache``: page pools and allocator. ``tokenizer``: a local HF tokenizer or the built-in byte
tokenizer. ``engine_loop``: the engine thread (pause, resume, commands between steps). ``server``: the
SGLang-compatible HTTP server (``rlperf serve``; weight buckets arrive through :mod:`rlperf.sync`).
``router``: N servers behind the real ``sglang-router``.
"""
from .engine import BadRequest, Engine, EngineConfig, GenerationResult, Request, SamplingParams
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["BadRequest", "Engine", "EngineConfig", "GenerationResult", "Request", "SamplingParams", "ByteTokenizer",
           "load_tokenizer"]
