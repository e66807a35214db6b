"""RMSNorm and fused add+RMSNorm, batch-invariant (one row per program, fixed reduction order).

Formula (x [..., H], weight [H], HF ``Qwen3RMSNorm`` order)::

    xf    = x.float()
    xn    = xf * 1 / sqrt(mean(xf^2) + eps)        # statistics in float32
    y     = weight * xn.to(x.dtype)                # normalized value rounded to the input dtype,
                                                   # then the product in promote(x, weight) dtype

``add_rmsnorm(x, residual, weight)`` first forms ``s = (x + residual)`` rounded to the input dtype
(HF: ``hidden = residual + hidden``), returns ``(rmsnorm(s), s)``.

Invariance contract: a row's sum of squares is accumulated by one program, over H in chunks of a
fixed ``BLOCK`` (elementwise into a [BLOCK] float32 vector, chunk after chunk), then reduced once
by ``tl.sum``. ``BLOCK`` and ``num_warps`` depend only on H (:func:`_config`), never on the number of
rows, so a row's bits are the same alone or inside any batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .autograd import with_recompute_backward
from .dispatch import route
from .reference import norm as _ref

MAX_BLOCK = 8192  # rows up to this width are read once and kept in registers


def _config(H: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row of width H — a function of H alone (batch invariance)."""
    block = min(triton.next_power_of_2(H), MAX_BLOCK)
    num_warps = 4 if block <= 2048 else (8 if block <= 4096 else 16)
    return block, num_warps


@triton.jit
def _rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr,
    H, stride_x, stride_r, stride_y, stride_s, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    in_ty = x_ptr.dtype.element_ty
    out_ty = y_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    # pass 1: sum of squares, chunk by chunk in column order (the invariant reduction order)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        c = start + cols
        m = c < H
        v = tl.load(x_row + c, mask=m, other=0.0)
        if HAS_RESIDUAL:
            # the sum rounded to the input dtype, as torch adds two bf16/fp16 tensors
            v = (v.to(tl.float32) + tl.load(r_row + c, mask=m, other=0.0).to(tl.float32)).to(in_ty)
            tl.store(s_ptr + row * stride_s + c, v, mask=m)
        vf = v.to(tl.float32)
        acc += vf * vf
    inv_rms = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    # pass 2: normalize (re-reads the row; when H <= BLOCK it is one chunk and mostly in L1/L2)
    for start in range(0, H, BLOCK):
        c = start + cols
        m = c < H
        v = tl.load(x_row + c, mask=m, other=0.0)
        if HAS_RESIDUAL:
            v = (v.to(tl.float32) + tl.load(r_row + c, mask=m, other=0.0).to(tl.float32)).to(in_ty)
        xn = (v.to(tl.float32) * inv_rms).to(in_ty)
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        y = w.to(tl.float32) * xn.to(tl.float32)
        tl.store(y_ptr + row * stride_y + c, y.to(out_ty), mask=m)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if not x.is_floating_point():
        raise TypeError(f"rmsnorm: x must be a floating tensor, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("rmsnorm: x needs at least one dimension (the normalized one)")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rmsnorm: weight must have shape [{x.shape[-1]}], got {list(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"rmsnorm: weight on {weight.device}, x on {x.device}")
    if not eps > 0:
        raise ValueError(f"rmsnorm: eps must be > 0, got {eps}")


def _launch(x, residual, weight, eps):
    H = x.shape[-1]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, H), dtype=out_dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, H)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        s = torch.empty((rows, H), dtype=x.dtype, device=x.device)
    else:
        r2, s = x2, y  # unused (HAS_RESIDUAL=False)
    if rows > 0 and H > 0:
        block, num_warps = _config(H)
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight.contiguous(), y, s,
            H, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), float(eps),
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
        )
    y = y.reshape(x.shape)
    return (y, s.reshape(x.shape)) if residual is not None else y


def _torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF Qwen3RMSNorm, line for line (the fast mode)
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(var + eps)
    return weight * xf.to(x.dtype)


def _torch_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    new_residual = residual + x
    return _torch_rmsnorm(new_residual, weight, eps), new_residual


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension.

    Args:
        x: [..., H] float16/bfloat16/float32.
        weight: [H].
        eps: added to the mean square (> 0).

    Returns:
        [..., H] in ``promote_types(x.dtype, weight.dtype)`` (x's dtype when they agree):
        ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.
    """
    _check(x, weight, eps)
    how = route("rmsnorm", x.device, (x, weight))
    if how == "autograd":
        return with_recompute_backward(lambda x, w: rmsnorm(x, w, eps), lambda x, w: _torch_rmsnorm(x, w, eps),
                                       x, weight)
    if how == "stock":
        return _torch_rmsnorm(x, weight, eps)
    if how == "reference":
        return _ref.rmsnorm(x, weight, eps)
    return _launch(x, None, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, in one pass.

    Args:
        x, residual: [..., H], same shape, dtype and device.
        weight: [H].

    Returns:
        ``(normed, new_residual)`` with ``new_residual = (x + residual)`` in the input dtype and
        ``normed = rmsnorm(new_residual, weight, eps)``.

    Both ops are differentiable: the backward recomputes the HF formula in float32
    (:func:`rlperf.kernels.autograd.with_recompute_backward`).
    """
    _check(x, weight, eps)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"add_rmsnorm: residual {list(residual.shape)} {residual.dtype} {residual.device} must match "
            f"x {list(x.shape)} {x.dtype} {x.device}"
        )
    how = route("add_rmsnorm", x.device, (x, residual, weight))
    if how == "autograd":
        return with_recompute_backward(lambda x, r, w: add_rmsnorm(x, r, w, eps),
                                       lambda x, r, w: _torch_add_rmsnorm(x, r, w, eps), x, residual, weight)
    if how == "stock":
        return _torch_add_rmsnorm(x, residual, weight, eps)
    if how == "reference":
        return _ref.add_rmsnorm(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)
