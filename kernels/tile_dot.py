"""The one tile product every kernel uses: ``acc + a @ b`` with a float32 accumulator.

Shapes: ``a`` [BM, BK], ``b`` [BK, BN] (bfloat16, float16 or float32 tiles), ``acc`` [BM, BN]
float32 -> [BM, BN] float32.

On the GPU this is ``tl.dot(a, b, acc, input_precision=...)``: tensor-core MMAs whose bits for an
output row do not depend on the row's position in the tile (proven by the GPU tests).

Under Triton's CPU interpreter, ``tl.dot`` is ``np.matmul`` in the accumulator's dtype, and
numpy's float32 matmul is **not** row-position invariant on every x86 CPU: the BLAS micro-kernel
computes edge rows of a block differently from interior ones (fused vs. separate multiply-add), so
the same row changes bits with its position (34 of 64 rows of a [64, 32] x [32, 64] product on an
AVX2 CPU). In float64 the products of bf16/fp16/fp32 inputs are exact (24 + 24 significand bits fit
in 53), so a fused and an unfused multiply-add round alike and the sum over K runs in the same
order for every row: the interpreter therefore computes the tile product in float64 and rounds
``acc + a @ b`` to float32 once, here. That is the only place the interpreter's rounding differs
from a plain ``tl.dot``; ``tests/kernels/test_tile_dot.py`` runs the row-position experiment
through it.

Which path runs is fixed when this module is imported, exactly as Triton decides (at decoration
time, from ``TRITON_INTERPRET``) whether a ``@triton.jit`` function is interpreted.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    try:  # Triton >= 3.4 reads the variable through its knobs (the same parse as @triton.jit)
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # pragma: no cover - older Triton
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


#: True when this process's ``@triton.jit`` kernels run under the CPU interpreter.
INTERPRETED: tl.constexpr = tl.constexpr(_interpreting())


def kernel_store_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a kernel's output buffer gets so that the result rounds to ``dtype`` as torch rounds:
    ``dtype`` itself, except bfloat16 off the GPU, where the interpreter's bf16 casts round differently
    from torch's: there the kernel stores float32 and the caller rounds with torch (``.to(dtype)``)."""
    return torch.float32 if device.type != "cuda" and dtype == torch.bfloat16 else dtype


@triton.jit
def dot_acc(a, b, acc, INPUT_PRECISION: tl.constexpr = None):
    """``acc + a @ b`` in float32 (see the module docstring for the interpreter's float64 path)."""
    if INTERPRETED:
        # via float32: the interpreter's bfloat16 -> float32 cast is exact (its bf16 dot is not)
        a64 = a.to(tl.float32).to(tl.float64)
        b64 = b.to(tl.float32).to(tl.float64)
        exact = tl.dot(a64, b64, acc.to(tl.float64), input_precision="ieee")
        return exact.to(tl.float32)
    else:
        return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def dot_fresh(a, b, INPUT_PRECISION: tl.constexpr = None):
    """``a @ b`` in float32: :func:`dot_acc` into a zero accumulator (what ``tl.dot(a, b)`` does)."""
    zero = tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32)
    return dot_acc(a, b, zero, INPUT_PRECISION)
