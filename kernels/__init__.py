"""rlperf.kernels — batch-invariant kernels for train/rollout bit-identity, with torch references.

Every op has a Triton kernel and a torch reference (``rlperf.kernels.reference``). Which one runs
is explicit: :func:`backend` (triton on CUDA; reference, or the Triton interpreter when
``TRITON_INTERPRET=1``, on CPU) and :func:`mode` (``"invariant"`` or ``"fast"``). See
``rlperf.kernels.dispatch``.

Ops are imported lazily, so ``import rlperf.kernels`` does not import Triton.
"""
from __future__ import annotations

import importlib

from .dispatch import BACKENDS, MODES, backend, mode, set_mode, use_backend, use_mode

# public name -> submodule that defines it
_OPS = {
    "matmul": "matmul",
    "linear": "matmul",
    "matmul_config": "matmul",
    "rmsnorm": "norm",
    "add_rmsnorm": "norm",
    "PAGE_SIZE": "attention",
    "write_kv_cache": "attention",
    "paged_attention": "attention",
    "varlen_attention": "attention",
    "log_softmax": "logprob",
    "token_logprobs": "logprob",
    "sample": "sampling",
    "fused_logprob": "fused_logprob",
    "silu_mul": "activation",
}

__all__ = ["BACKENDS", "MODES", "backend", "mode", "set_mode", "use_backend", "use_mode", *_OPS]


def __getattr__(name: str):
    if name in _OPS:
        value = getattr(importlib.import_module(f".{_OPS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlperf.kernels' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_OPS))
