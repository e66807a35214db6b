"""SwiGLU activation: ``silu_mul(gate_up) = silu(g) * u`` with ``gate_up = [g | u]`` (fused gate/up output).

Shapes: ``gate_up`` [..., 2I] -> [..., I], same dtype. Math in fp32 per element:
``y = round(silu(g) * u)`` with ``silu(g) = g / (1 + exp(-g))``.

Invariance: purely elementwise, every element runs the same instruction sequence, so a token's
bits never depend on its batch. On CPU the reference computes in float64 and rounds once: torch's
CPU kernels use vectorized math for the bulk of a buffer and scalar math for its tail, which can
differ in the last bit of a float32 result, so a float32 torch silu would depend on where a token
sits in the batch; in float64 those differences vanish in the final rounding.

Backward (:func:`silu_mul_backward`, fp32 per element, rounded once to gate_up's dtype), with
``sig = 1 / (1 + exp(-g))``::

    dg = dy * u * sig * (1 + g * (1 - sig))
    du = dy * g * sig

Elementwise, so deterministic; it needs only the input ``gate_up`` (saved, no float32 copy).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import route
from .pipeline import grid_dependency_sync, launch_options
from .reference.activation import silu_mul_ref

BLOCK = 1024


@triton.jit
def silu_mul_f32(g, u):
    """``silu(g) * u`` in float32 of two tiles of any float dtype: the one formula of every SwiGLU kernel
    (this module's and the matmul kernel's SwiGLU epilogue), so each gives this one's bits."""
    g = g.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u.to(tl.float32)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, inter, stride_x, stride_y, BLOCK: tl.constexpr):
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    y = silu_mul_f32(g, u)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(x_ptr, dy_ptr, dx_ptr, inter, stride_x, stride_dy, stride_dx, BLOCK: tl.constexpr):
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * (g * sig)
    out_ty = dx_ptr.dtype.element_ty
    tl.store(dx_ptr + row * stride_dx + cols, dg.to(out_ty), mask=mask)
    tl.store(dx_ptr + row * stride_dx + inter + cols, du.to(out_ty), mask=mask)


def _launch(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] and inter:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(inter, BLOCK))](x, y, inter, x.stride(0), y.stride(0), BLOCK=BLOCK,
                                                                   **launch_options(x.device))
    return y.reshape(*gate_up.shape[:-1], inter)


def silu_mul_backward(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`silu_mul`: dy [..., I] (any float dtype), gate_up [..., 2I] -> d gate_up
    [..., 2I] in gate_up's dtype (module docstring)."""
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    g = dy.reshape(-1, inter)
    if g.stride(-1) != 1:
        g = g.contiguous()
    dx = torch.empty(x.shape[0], 2 * inter, dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] and inter:
        _silu_mul_bwd_kernel[(x.shape[0], triton.cdiv(inter, BLOCK))](
            x, g, dx, inter, x.stride(0), g.stride(0), dx.stride(0), BLOCK=BLOCK, **launch_options(x.device))
    return dx.reshape(gate_up.shape)


class _SiLUMul(torch.autograd.Function):
    """:func:`silu_mul` through the kernel; saves gate_up (its input) for :func:`silu_mul_backward`."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _launch(gate_up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        return silu_mul_backward(dy, gate_up)


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``gate_up = [g | u]`` on the last dim: [..., 2I] -> [..., I].

    Differentiable: the Triton backward of :func:`silu_mul_backward`; the reference backend's
    float64 code and fast mode's stock torch code are differentiated by autograd as they are.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: last dim of gate_up must be even (gate and up halves), got {tuple(gate_up.shape)}")
    how = route("silu_mul", gate_up.device, (gate_up,))
    if how == "autograd":
        if route("silu_mul", gate_up.device) == "stock":  # fast mode's stock op: torch differentiates it
            return _torch_silu_mul(gate_up)
        return _SiLUMul.apply(gate_up)
    if how == "stock":
        return _torch_silu_mul(gate_up)
    if how == "reference":
        return silu_mul_ref(gate_up).to(gate_up.dtype)
    return _launch(gate_up)
