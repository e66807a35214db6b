"""SwiGLU activation: ``silu_mul(gate_up) = silu(g) * u`` with ``gate_up = [g | u]`` (fused gate/up output).

Shapes: ``gate_up`` [..., 2I] -> [..., I], same dtype. Math in fp32 per element:
``y = round(silu(g) * u)`` with ``silu(g) = g / (1 + exp(-g))``.

Invariance: purely elementwise, every element runs the same instruction sequence, so a token's
bits never depend on its batch. On CPU the reference computes in float64 and rounds once: torch's
CPU kernels use vectorized math for the bulk of a buffer and scalar math for its tail, which can
differ in the last bit of a float32 result, so a float32 torch silu would depend on where a token
sits in the batch; in float64 those differences vanish in the final rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .autograd import with_recompute_backward
from .dispatch import route
from .reference.activation import silu_mul_ref

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, inter, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``gate_up = [g | u]`` on the last dim: [..., 2I] -> [..., I].

    Differentiable: the backward recomputes the torch formula in float32.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: last dim of gate_up must be even (gate and up halves), got {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    how = route("silu_mul", gate_up.device, (gate_up,))
    if how == "autograd":
        return with_recompute_backward(silu_mul, _torch_silu_mul, gate_up)
    if how == "stock":
        return _torch_silu_mul(gate_up)
    if how == "reference":
        return silu_mul_ref(gate_up).to(gate_up.dtype)
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] and inter:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(inter, BLOCK))](x, y, inter, x.stride(0), y.stride(0), BLOCK=BLOCK)
    return y.reshape(*gate_up.shape[:-1], inter)
