"""Reference of ``rlperf.kernels.matmul``: ``out = x @ w.T (+ bias)`` in float64.

Shapes (nn.Linear layout): ``x`` [M, K], ``w`` [N, K], ``bias`` [N] or None -> float64 [M, N].
The inputs are upcast to float64 before the product, so the result carries only the rounding of
float64 arithmetic (far below any bf16/fp16/fp32 kernel's error); callers cast it as they need.
"""
from __future__ import annotations

import torch


def matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M,K] @ w[N,K].T (+ bias[N])`` computed in float64, returned as float64 [M, N]."""
    out = x.double() @ w.double().T
    if bias is not None:
        out = out + bias.double()
    return out
