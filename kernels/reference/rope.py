"""Torch reference of the fused q/k RMSNorm + rotary embedding.

Formula (x [T, heads, D], weight [D], positions [T], cos/sin [max_positions, D/2] float32)::

    y      = weight * x / sqrt(mean(x^2, -1) + eps)              # per (token, head) row, float64,
                                                                 # rounded to x's dtype
    c, s   = cos[positions], sin[positions]                      # [T, 1, D/2]
    out    = [y1 c - y2 s, y2 c + y1 s]                          # float32, rounded once to x's dtype

The norm is :func:`rlperf.kernels.reference.norm.rmsnorm`'s (float64, one rounding) and the rotation
is the float32 formula the kernel evaluates (y1 = y[..., :D/2], y2 = y[..., D/2:]), so this is the
composition RMSNorm-then-RoPE that HF runs and the reference backend ran before the two were fused:
its bits on the CPU are those of that composition, and the kernel differs from it only by its own
norm's reduction order and the GPU's fused multiply-add contraction.
"""
from __future__ import annotations

import torch

from .norm import rmsnorm


def rmsnorm_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of the last dim (float64, rounded to x's dtype), then the rotate-half rotary embedding in
    float32; result in x's dtype. Differentiable (autograd through the torch ops)."""
    y = rmsnorm(x, weight, eps).to(x.dtype)
    c = cos.float()[positions][:, None, :]
    s = sin.float()[positions][:, None, :]
    y1, y2 = y.float().chunk(2, dim=-1)
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1).to(x.dtype)
