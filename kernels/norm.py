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

Backward (:func:`rmsnorm_backward`, float32 math; the roundings of the forward count as identity,
as autograd of the float32 formula has them). With ``s`` the normalized input (x, or x + residual),
``rstd = 1 / sqrt(mean(s^2) + eps)`` (recomputed from ``s``: no per-row statistics are saved),
``xhat = s * rstd`` and ``g = dy * weight``::

    ds_norm = rstd * (g - xhat * mean(g * xhat))          # per row
    dweight = sum_rows(dy * xhat)
    add_rmsnorm: dx = dresidual = ds_norm + d(new_residual)

Deterministic: a program owns a fixed block of rows (:func:`_bwd_config`), accumulates its part of
``dweight`` in registers and stores it to its own row of a partial buffer; :func:`sum_partials` then
adds those rows in program order. No atomics, so two runs give the same bits. The block size does not
depend on the row count, so rows appended with dy = 0 (a micro-batch padded to a CUDA-graph bucket)
add only zero partials and ``dweight`` keeps its bits; other batch mixes do change it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import route
from .pipeline import grid_dependency_sync, launch_options
from .reference import norm as _ref

MAX_BLOCK = 8192  # rows up to this width are read once and kept in registers
BWD_ROWS_PER_PROGRAM = 32  # rows a backward program owns (rounded up to its tile): a constant, not a
                           # function of the row count, so the partial sums of dweight cover the same rows
                           # in any batch and rows appended with dy = 0 only add zero partials
BWD_TILE = 4096  # elements of the [rows, BLOCK] tile a backward program works on at once


def _config(H: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row of width H — a function of H alone (batch invariance)."""
    block = min(triton.next_power_of_2(H), MAX_BLOCK)
    num_warps = 4 if block <= 2048 else (8 if block <= 4096 else 16)
    return block, num_warps


@triton.jit(do_not_specialize=["rows_per_weight"])
def _rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr,
    H, stride_x, stride_r, stride_y, stride_s, eps, rows_per_weight,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    row = tl.program_id(0).to(tl.int64)
    w_ptr += (row // rows_per_weight) * H  # the weight row of this row's block (one weight: row 0)
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
    """The forward kernel over every row of x [..., H] with one weight [H], or with ``weight`` [B, H]:
    B equal blocks of consecutive rows, block b normalized with ``weight[b]``."""
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
        per = rows // weight.shape[0] if weight.dim() == 2 else rows
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight.contiguous(), y, s,
            H, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), float(eps), per,
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=num_warps, **launch_options(x.device),
        )
    y = y.reshape(x.shape)
    return (y, s.reshape(x.shape)) if residual is not None else y


# ---- backward -------------------------------------------------------------------------------


def _bwd_config(H: int) -> tuple[int, int, int, int]:
    """(BLOCK, ROWS, rows_per_program, num_warps) of the backward.

    A row of width H <= ``MAX_BLOCK`` is one chunk: ``ROWS`` rows go through the program together as
    a [ROWS, BLOCK] tile (more loads in flight than one row at a time). Wider rows take the chunked
    path, one row at a time. Every program owns ``rows_per_program`` consecutive rows
    (:data:`BWD_ROWS_PER_PROGRAM` rounded up to a multiple of ``ROWS``): one partial sum of
    ``dweight`` per program, added in program order (:func:`sum_partials`). The row count sets only
    how many programs run, never which rows a partial covers.
    """
    block = min(triton.next_power_of_2(max(H, 1)), MAX_BLOCK)
    tile_rows = max(1, min(BWD_TILE // block, 16)) if H <= block else 1
    per_program = triton.cdiv(BWD_ROWS_PER_PROGRAM, tile_rows) * tile_rows
    tile = block * tile_rows
    num_warps = 4 if tile <= 2048 else (8 if tile <= 4096 else 16)
    return block, tile_rows, per_program, num_warps


@triton.jit(do_not_specialize=["rows", "rows_per_program", "rows_per_block", "programs_per_block", "blocks"])
def _rmsnorm_bwd_kernel(
    dy_ptr, dr_ptr, s_ptr, w_ptr, dx_ptr, dwp_ptr,
    rows, H, rows_per_program, rows_per_block, programs_per_block, blocks,
    stride_dy, stride_dr, stride_s, stride_dx, eps,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, ONE_CHUNK: tl.constexpr, HAS_DRES: tl.constexpr,
):
    # program pid is program q of row block b (a launch over block b alone would number it q): it owns
    # the block's rows [q * rows_per_program, ...) and writes its partial of weight b's gradient to
    # row q * blocks + b of the [programs_per_block, blocks, H] partials (one block: pid's own row)
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    pid = tl.program_id(0)
    b = pid // programs_per_block
    q = pid - b * programs_per_block
    block_start = b * rows_per_block
    row_start = block_start + q * rows_per_program
    row_end = tl.minimum(tl.minimum(row_start + rows_per_program, block_start + rows_per_block), rows)
    w_ptr += b.to(tl.int64) * H
    dwp_ptr += (q * blocks + b).to(tl.int64) * H
    cols = tl.arange(0, BLOCK)
    tile_rows = tl.arange(0, ROWS)
    dx_ty = dx_ptr.dtype.element_ty
    if ONE_CHUNK:
        cm = cols < H
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for r0 in range(row_start, row_end, ROWS):
            r = (r0 + tile_rows).to(tl.int64)
            m = (r < row_end)[:, None] & cm[None, :]
            s = tl.load(s_ptr + r[:, None] * stride_s + cols[None, :], mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / H + eps)
            xhat = s * rstd[:, None]
            g = dy * w[None, :]
            c = tl.sum(g * xhat, axis=1) / H
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            if HAS_DRES:
                dx += tl.load(dr_ptr + r[:, None] * stride_dr + cols[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + r[:, None] * stride_dx + cols[None, :], dx.to(dx_ty), mask=m)
            dw += dy * xhat  # masked rows and columns add 0
        tl.store(dwp_ptr + cols, tl.sum(dw, axis=0), mask=cm)
    else:
        # rows wider than MAX_BLOCK: one row at a time, two passes over its chunks; this program's
        # row of the (zeroed) partial buffer accumulates dweight chunk by chunk (no other program
        # touches it, so no atomics)
        first = row_start.to(tl.int64)
        for i in range(0, row_end - row_start):
            row = first + i
            ss = tl.zeros([BLOCK], dtype=tl.float32)
            gs = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, H, BLOCK):
                c = start + cols
                m = c < H
                s = tl.load(s_ptr + row * stride_s + c, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * stride_dy + c, mask=m, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
                ss += s * s
                gs += dy * w * s
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / H + eps)
            c_row = tl.sum(gs, axis=0) * rstd / H  # mean(g * xhat)
            for start in range(0, H, BLOCK):
                c = start + cols
                m = c < H
                s = tl.load(s_ptr + row * stride_s + c, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * stride_dy + c, mask=m, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
                xhat = s * rstd
                dx = (dy * w - xhat * c_row) * rstd
                if HAS_DRES:
                    dx += tl.load(dr_ptr + row * stride_dr + c, mask=m, other=0.0).to(tl.float32)
                tl.store(dx_ptr + row * stride_dx + c, dx.to(dx_ty), mask=m)
                part = tl.load(dwp_ptr + c, mask=m, other=0.0)
                tl.store(dwp_ptr + c, part + dy * xhat, mask=m)


@triton.jit(do_not_specialize=["n"])
def _sum_partials_kernel(p_ptr, out_ptr, n, H, row_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # column block program_id(0) of group program_id(1) of the [n, G, H] float32 partials (row stride
    # G * H); rows added in a fixed order (tile by tile, elementwise, then one tl.sum over the tile's
    # rows). A group's columns sit in the tiles they have when the group is summed alone (G = 1).
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    g = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < H
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, n, BLOCK_R):
        r = (r0 + rr).to(tl.int64)
        acc += tl.load(p_ptr + r[:, None] * row_stride + g * H + cols[None, :], mask=(r < n)[:, None] & cm[None, :],
                       other=0.0)
    tl.store(out_ptr + g * H + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cm)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``partials.sum(0)`` of a contiguous [n, H] float32 buffer, in a fixed order, rounded once to ``dtype``;
    or of a contiguous [n, G, H] buffer, [G, H]: each group's sum with the bits of :func:`sum_partials` of
    that group's [n, H] slice alone (one launch for the G groups)."""
    n, H = partials.shape[0], partials.shape[-1]
    groups = partials.shape[1] if partials.dim() == 3 else 1
    out = torch.empty(partials.shape[1:], dtype=dtype, device=partials.device)
    if H and groups:
        if n == 0:
            return out.zero_()
        _sum_partials_kernel[(triton.cdiv(H, 64), groups)](partials, out, n, H, groups * H, BLOCK_R=64, BLOCK_C=64,
                                                            num_warps=4, **launch_options(partials.device))
    return out


def _rows2d(t: torch.Tensor, H: int) -> torch.Tensor:
    t2 = t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rmsnorm_grad_rows(H: int) -> int:
    """Rows of one partial sum of ``dweight`` in :func:`rmsnorm_backward` (the rows a backward program
    owns) for rows of width H: partial ``q`` covers rows ``[q R, (q + 1) R)``. A token range cut at
    multiples of R has the partials of the whole range, in order (what a sequence-parallel rank's
    share must be cut at, ``rlperf.kernels.tree_reduce.token_parallel_rmsnorm``)."""
    return _bwd_config(H)[2]


def rmsnorm_backward(dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, eps: float,
                     dresidual: torch.Tensor | None = None,
                     return_partials: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``y = rmsnorm(s, weight, eps)`` (module docstring), plus ``dresidual`` when given.

    Args:
        dy: [..., H] upstream gradient of y (any float dtype).
        s: [..., H] the normalized input (x; for add_rmsnorm the saved ``x + residual``).
        weight: [H]; or [B, H] (:func:`rmsnorm_blocks`): the rows are B equal blocks, block b was
            normalized with ``weight[b]``, and each block's programs and partial sums are those of a
            launch over that block alone.
        dresidual: [..., H] or None: the upstream gradient of add_rmsnorm's ``new_residual``, added
            to ``ds`` in float32 before the one rounding.

        return_partials: return the float32 partial sums [P, H] of ``dweight`` (weight [H] only; P =
            ceil(rows / :func:`rmsnorm_grad_rows`)) instead of their sum; ``sum_partials(partials,
            weight.dtype)`` is the ``dweight`` this call returns otherwise.

    Returns:
        ``(ds [..., H] in s's dtype, dweight [H] (or [B, H]) in weight's dtype)``.
    """
    H = s.shape[-1]
    s2, dy2 = _rows2d(s, H), _rows2d(dy, H)
    rows = s2.shape[0]
    blocks = weight.shape[0] if weight.dim() == 2 else 1
    per = rows // blocks
    dr2 = _rows2d(dresidual, H) if dresidual is not None else dy2
    dx = torch.empty((rows, H), dtype=s.dtype, device=s.device)
    block, tile_rows, per_program, num_warps = _bwd_config(H)
    per_block = triton.cdiv(per, per_program) if per else 0
    one_chunk = H <= block
    alloc = torch.empty if one_chunk else torch.zeros
    partials = alloc((per_block, blocks, H), dtype=torch.float32, device=s.device)
    if per_block and H:
        _rmsnorm_bwd_kernel[(per_block * blocks,)](
            dy2, dr2, s2, weight.contiguous(), dx, partials,
            rows, H, per_program, per, per_block, blocks,
            dy2.stride(0), dr2.stride(0), s2.stride(0), dx.stride(0), float(eps),
            BLOCK=block, ROWS=tile_rows, ONE_CHUNK=one_chunk, HAS_DRES=dresidual is not None, num_warps=num_warps,
            **launch_options(dy2.device),
        )
    if return_partials:
        if blocks > 1:
            raise ValueError("rmsnorm_backward: return_partials takes one weight [H], not blocks")
        return dx.reshape(s.shape), partials.view(per_block, H)
    dw = sum_partials(partials if blocks > 1 else partials.view(per_block, H), weight.dtype)
    return dx.reshape(s.shape), dw


class _RMSNorm(torch.autograd.Function):
    """:func:`rmsnorm` through the kernel; saves x and weight only (rstd is recomputed in the backward).
    A weight [B, H] is :func:`rmsnorm_blocks`' (``_launch`` and :func:`rmsnorm_backward` take both)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _launch(x, None, weight, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = rmsnorm_backward(dy, x, weight, ctx.eps)
        return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None


class _AddRMSNorm(torch.autograd.Function):
    """:func:`add_rmsnorm` through the kernel; saves its own output ``new_residual`` (which the next
    layer keeps alive anyway) and weight, not x and residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, s = _launch(x, residual, weight, eps)
        ctx.save_for_backward(s, weight)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dres):
        s, weight = ctx.saved_tensors
        if dy is None:  # only new_residual was used: it is x + residual
            dx, dw = (None if dres is None else dres.to(s.dtype)), None
        else:
            dx, dw = rmsnorm_backward(dy, s, weight, ctx.eps, dres)
        need_x, need_r, need_w = ctx.needs_input_grad[:3]
        return (dx if need_x else None), (dx if need_r else None), (dw if need_w else None), None


def rmsnorm_blocks(x: torch.Tensor, weights: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """:func:`rmsnorm` of each of B equal blocks of x [T, ..., H] along dim 0 (T divisible by B) with its
    own weight row: block b = ``x[b T/B:(b+1) T/B]`` normalized with ``weights[b]`` ([B, H], e.g. the
    replicas of :func:`rlperf.kernels.tree_reduce.block_replicas`). (The megatron tree mode's hidden-size
    norms used it until their gradient became ``tree_reduce.token_parallel_rmsnorm``'s.)

    Equal bit for bit to ``torch.cat([rmsnorm(x[b*per:(b+1)*per], weights[b]) for b])`` (blocks along
    dim 0) and to its gradients: the forward is row-invariant, and in the backward each block's
    programs cover the rows a launch over that block alone gives them, with ``dweights[b]`` that
    launch's partials added in its order (``sum_partials`` of a [programs, B, H] buffer, one group per
    block). On the Triton kernels one launch forward, two backward (instead of B and 2B plus the
    slices' zero-filled gradients and their adds); the reference backend and fast mode's stock op run
    the per-block calls themselves."""
    if weights.dim() != 2 or weights.shape[0] < 1 or weights.shape[1] != x.shape[-1]:
        raise ValueError(f"rmsnorm_blocks: weights [blocks, H] with H = {x.shape[-1]}, got {list(weights.shape)}")
    _check(x, weights[0], eps)
    blocks = weights.shape[0]
    if x.shape[0] % blocks:
        raise ValueError(f"rmsnorm_blocks: {x.shape[0]} rows (dim 0 of x) do not split into {blocks} equal blocks")
    how = route("rmsnorm", x.device, (x, weights))
    fused = how not in ("stock", "reference") and not (how == "autograd" and route("rmsnorm", x.device) == "stock")
    if not fused or blocks == 1:
        per = x.shape[0] // blocks
        outs = [rmsnorm(x[b * per:(b + 1) * per], weights[b], eps) for b in range(blocks)]
        return torch.cat(outs) if blocks > 1 else outs[0]
    if how == "autograd":
        return _RMSNorm.apply(x, weights, eps)
    return _launch(x, None, weights, eps)


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
        if route("rmsnorm", x.device) == "stock":  # fast mode's stock op: torch differentiates it
            return _torch_rmsnorm(x, weight, eps)
        return _RMSNorm.apply(x, weight, eps)
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

    Both ops are differentiable: the Triton backward of :func:`rmsnorm_backward` (float32 math,
    deterministic); the reference backend's float64 code and fast mode's stock torch code are
    differentiated by autograd as they are.
    """
    _check(x, weight, eps)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"add_rmsnorm: residual {list(residual.shape)} {residual.dtype} {residual.device} must match "
            f"x {list(x.shape)} {x.dtype} {x.device}"
        )
    how = route("add_rmsnorm", x.device, (x, residual, weight))
    if how == "autograd":
        if route("add_rmsnorm", x.device) == "stock":  # fast mode's stock op: torch differentiates it
            return _torch_add_rmsnorm(x, residual, weight, eps)
        return _AddRMSNorm.apply(x, residual, weight, eps)
    if how == "stock":
        return _torch_add_rmsnorm(x, residual, weight, eps)
    if how == "reference":
        return _ref.add_rmsnorm(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)
