"""Torch references of RMSNorm and add+RMSNorm (float64 math).

Formulas (x [..., H], weight [H]):

    rmsnorm(x)            = weight * x / sqrt(mean(x^2, -1) + eps)
    add_rmsnorm(x, r)     = (rmsnorm(x + r), x + r)      # x + r rounded to the input dtype first

The reference keeps the normalized value in float64 (no intermediate rounding); the kernels follow
HF Qwen3RMSNorm's order (float32 statistics, the normalized value cast to the input dtype, then the
product with weight), so the two differ by at most a couple of roundings of the output dtype.
"""
from __future__ import annotations

import torch


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of the last dim in float64; result in ``promote_types(x.dtype, weight.dtype)``."""
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    xd = x.double()
    inv_rms = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.double() * (xd * inv_rms)).to(out_dtype)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual), x + residual)``; the sum is rounded to the input dtype (as HF does)."""
    new_residual = (x.double() + residual.double()).to(x.dtype)
    return rmsnorm(new_residual, weight, eps), new_residual
