"""Fused q/k RMSNorm + rotary embedding (Qwen3's ``q_norm``/``k_norm`` then RoPE), batch-invariant.

Formula (x [T, heads, D] — q or k, typically a strided view of the qkv projection — weight [D],
positions [T] int, cos/sin [max_positions, D/2] float32 tables, D even, ``D/2`` = HALF)::

    xf      = x.float()                                        # one (token, head) row of D values
    rstd    = 1 / sqrt(sum(xf^2) / D + eps)                    # float32
    y       = (weight * (xf * rstd).to(x.dtype)).to(x.dtype)   # rmsnorm's roundings (norm.py), in x's dtype
    c, s    = cos[positions[t]], sin[positions[t]]             # float32 table rows, looked up per token
    out     = [y1 c - y2 s, y2 c + y1 s]  (float32)            # y1 = y[:HALF], y2 = y[HALF:] (HF rotate_half)
    return out.to(x.dtype)                                     # [T, heads, D], contiguous, rounded once

What the kernel computes exactly: every product and sum above is one IEEE float32 operation, except
that on the GPU the compiler may contract ``a*b - c*d`` (and the sum of squares' ``x1^2 + x2^2``)
into a fused multiply-add, and that the sum of squares is reduced by ``tl.sum`` over a [BLOCK_H,
HALF] tile (the pairs ``x1[j]^2 + x2[j]^2`` first, then one tree over j). So a value may differ in
the last float32 bit from the torch formula (``RopeTable.apply`` after ``rmsnorm``), and ``rstd``
from the rmsnorm kernel's tree; it is still one fixed function of the row's inputs, and every caller
(the engine's prefill and decode, the trainer's packed forward) runs this kernel, so they agree bit
for bit.

Invariance contract: one program per (token, block of ``BLOCK_H`` heads); it reduces each of its
rows in the fixed order above. ``BLOCK_H``, the tile width and ``num_warps`` depend only on (heads,
D) (:func:`_config`), never on T, and the angle comes from the table row of the token's own
position (no sin/cos evaluated per batch), so a token's bits are the same alone, in a decode batch
or in a packed prefill of any length. No host synchronization: CUDA-graph capturable; positions are
validated where requests enter, not here.

The engine's paged step normalizes and rotates Q and K in one launch, :func:`rmsnorm_rope_store_kv`:
the programs and tile shapes of the two ``rmsnorm_rope`` launches and the same row formula, with K's
rotated rows written straight into the token's KV-cache slot (and V beside them) instead of an
output tensor, so Q and the cache hold the bits ``rmsnorm_rope`` gives the trainer.

Backward (:func:`rmsnorm_rope_backward`, float32 math, the roundings of the forward as identity, as
autograd of the float32 formula has them), with ``xhat = xf * rstd`` (rstd recomputed from x: the
forward saves only its inputs)::

    dy1 = do1 c + do2 s;   dy2 = do2 c - do1 s                  # the rotation's transpose
    dx  = rstd * (dy * weight - xhat * mean(dy * weight * xhat))  per row
    dweight = sum over tokens and heads of dy * xhat

Deterministic: a program owns a fixed block of :data:`BWD_TOKENS_PER_PROGRAM` tokens, keeps its part
of ``dweight`` in registers and stores it to its own row of a partial buffer, which
:func:`rlperf.kernels.norm.sum_partials` adds in program order. No atomics. The block size is a
constant, so a partial covers the same tokens in any batch and tokens appended with dout = 0 (a
micro-batch's padding) add zero partials: the gradients keep their bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import route
from .norm import _torch_rmsnorm, sum_partials
from .pipeline import grid_dependency_sync, launch_options
from .reference import rope as _ref

BWD_TOKENS_PER_PROGRAM = 16  # tokens a backward program owns (one partial sum of dweight each)
MAX_HALF_TILE = 1024  # elements of one [BLOCK_H, HALF] half-row tile a program holds


def _config(heads: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_HALF, num_warps) — a function of (heads, D) alone (batch invariance)."""
    block_half = triton.next_power_of_2(max(D // 2, 1))
    block_h = min(triton.next_power_of_2(max(heads, 1)), max(1, MAX_HALF_TILE // block_half))
    num_warps = 4 if block_h * block_half <= 1024 else 8
    return block_h, block_half, num_warps


@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, t, h, c, cm, m, heads, stride_xt, stride_xh,
                    stride_cs, eps, HALF: tl.constexpr):
    """The module docstring's formula for rows (token t, heads h) of one program: the two rotated
    halves [BLOCK_H, BLOCK_HALF], rounded to x's dtype. Every kernel that writes rmsnorm_rope's values
    computes them here, so they are the same bits."""
    in_ty = x_ptr.dtype.element_ty
    x_off = t * stride_xt + h[:, None] * stride_xh + c[None, :]
    x1 = tl.load(x_ptr + x_off, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + HALF, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + c, mask=cm, other=0.0).to(tl.float32)
    # rmsnorm's two roundings: the normalized value to x's dtype, then its product with weight
    y1 = (w1[None, :] * (x1 * rstd[:, None]).to(in_ty).to(tl.float32)).to(in_ty).to(tl.float32)
    y2 = (w2[None, :] * (x2 * rstd[:, None]).to(in_ty).to(tl.float32)).to(in_ty).to(tl.float32)
    # the angle of this token's own position, from the table (no per-batch sin/cos)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cs + c, mask=cm, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + c, mask=cm, other=0.0)[None, :]
    return (y1 * cos - y2 * sin).to(in_ty), (y2 * cos + y1 * sin).to(in_ty)


@triton.jit
def _rmsnorm_rope_kernel(
    x_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr,
    per, subs, stride_w, stride_xt, stride_xh, stride_yt, stride_yh, stride_cs, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # program (t, b * subs + j): token t's heads j * BLOCK_H ... of head block b (``per`` heads, its own
    # weight row b): the program of a launch over that block alone (one block: every head, subs tiles)
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) // subs
    hl = (tl.program_id(1) % subs) * BLOCK_H + tl.arange(0, BLOCK_H)
    h = b * per + hl
    c = tl.arange(0, BLOCK_HALF)
    cm = c < HALF
    m = (hl < per)[:, None] & cm[None, :]
    o1, o2 = _norm_rope_rows(x_ptr, w_ptr + b * stride_w, pos_ptr, cos_ptr, sin_ptr, t, h, c, cm, m, per, stride_xt,
                             stride_xh, stride_cs, eps, HALF)
    y_off = t * stride_yt + h[:, None] * stride_yh + c[None, :]
    tl.store(y_ptr + y_off, o1, mask=m)
    tl.store(y_ptr + y_off + HALF, o2, mask=m)


@triton.jit
def _qk_norm_rope_store_kv_kernel(
    q_ptr, qw_ptr, k_ptr, kw_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    q_heads, k_heads, q_blocks,
    stride_qt, stride_qh, stride_yt, stride_yh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, eps,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PAGE: tl.constexpr,
):
    # Programs (t, b < q_blocks): rmsnorm_rope of token t's Q rows into y, the tile [BLOCK_HQ, HALF] of
    # _rmsnorm_rope_kernel launched for Q; programs (t, b >= q_blocks): its K rows, the tile of the
    # launch for K, stored straight into the token's cache slot with its V rows (slot < 0: padding,
    # nothing stored). Each branch runs the same row function on the same tile shape as the plain
    # launch (the same num_warps: _config gives 4 for every D up to 2048), so the same bits.
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    c = tl.arange(0, BLOCK_HALF)
    cm = c < HALF
    if b < q_blocks:
        h = b * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        m = (h < q_heads)[:, None] & cm[None, :]
        o1, o2 = _norm_rope_rows(q_ptr, qw_ptr, pos_ptr, cos_ptr, sin_ptr, t, h, c, cm, m, q_heads, stride_qt,
                                 stride_qh, stride_cs, eps, HALF)
        y_off = t * stride_yt + h[:, None] * stride_yh + c[None, :]
        tl.store(y_ptr + y_off, o1, mask=m)
        tl.store(y_ptr + y_off + HALF, o2, mask=m)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            h = (b - q_blocks) * BLOCK_HK + tl.arange(0, BLOCK_HK)
            m = (h < k_heads)[:, None] & cm[None, :]
            o1, o2 = _norm_rope_rows(k_ptr, kw_ptr, pos_ptr, cos_ptr, sin_ptr, t, h, c, cm, m, k_heads, stride_kt,
                                     stride_kh, stride_cs, eps, HALF)
            page = slot // PAGE
            off = slot % PAGE
            kc_off = page * stride_kcp + off * stride_kcs + h[:, None] * stride_kch + c[None, :]
            kc_ty = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + kc_off, o1.to(kc_ty), mask=m)
            tl.store(kc_ptr + kc_off + HALF, o2.to(kc_ty), mask=m)
            v_off = t * stride_vt + h[:, None] * stride_vh + c[None, :]
            vc_off = page * stride_vcp + off * stride_vcs + h[:, None] * stride_vch + c[None, :]
            vc_ty = vc_ptr.dtype.element_ty
            tl.store(vc_ptr + vc_off, tl.load(v_ptr + v_off, mask=m).to(vc_ty), mask=m)
            tl.store(vc_ptr + vc_off + HALF, tl.load(v_ptr + v_off + HALF, mask=m).to(vc_ty), mask=m)


@triton.jit(do_not_specialize=["T", "tokens_per_program"])
def _rmsnorm_rope_bwd_kernel(
    x_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, do_ptr, dx_ptr, dwp_ptr,
    T, per, tokens_per_program, stride_w,
    stride_xt, stride_xh, stride_dot, stride_doh, stride_dxt, stride_dxh, stride_cs, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # program (p, b): tokens p * tokens_per_program ... of head block b (``per`` heads, weight row b),
    # the program p of a launch over that block alone; its dweight partial is row (p, b) of the
    # [programs, blocks, D] buffer
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    pid = tl.program_id(0)
    b = tl.program_id(1)
    blocks = tl.num_programs(1)
    t_start = pid * tokens_per_program
    t_end = tl.minimum(t_start + tokens_per_program, T)
    c = tl.arange(0, BLOCK_HALF)
    cm = c < HALF
    hh = tl.arange(0, BLOCK_H)
    w_ptr += b * stride_w
    w1 = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    dw1 = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
    dx_ty = dx_ptr.dtype.element_ty
    first = t_start.to(tl.int64)
    for i in range(0, t_end - t_start):
        t = first + i
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cs + c, mask=cm, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cs + c, mask=cm, other=0.0)[None, :]
        for h0 in range(0, per, BLOCK_H):
            h = b * per + h0 + hh
            m = (h0 + hh < per)[:, None] & cm[None, :]
            x_off = t * stride_xt + h[:, None] * stride_xh + c[None, :]
            do_off = t * stride_dot + h[:, None] * stride_doh + c[None, :]
            x1 = tl.load(x_ptr + x_off, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + x_off + HALF, mask=m, other=0.0).to(tl.float32)
            do1 = tl.load(do_ptr + do_off, mask=m, other=0.0).to(tl.float32)
            do2 = tl.load(do_ptr + do_off + HALF, mask=m, other=0.0).to(tl.float32)
            rstd = (1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps))[:, None]
            xh1 = x1 * rstd
            xh2 = x2 * rstd
            dy1 = do1 * cos + do2 * sin
            dy2 = do2 * cos - do1 * sin
            g1 = dy1 * w1
            g2 = dy2 * w2
            mean_gx = (tl.sum(g1 * xh1 + g2 * xh2, axis=1) / (2 * HALF))[:, None]
            dx_off = t * stride_dxt + h[:, None] * stride_dxh + c[None, :]
            tl.store(dx_ptr + dx_off, ((g1 - xh1 * mean_gx) * rstd).to(dx_ty), mask=m)
            tl.store(dx_ptr + dx_off + HALF, ((g2 - xh2 * mean_gx) * rstd).to(dx_ty), mask=m)
            dw1 += dy1 * xh1  # masked heads and columns add 0
            dw2 += dy2 * xh2
    row = (pid * blocks + b) * (2 * HALF)
    tl.store(dwp_ptr + row + c, tl.sum(dw1, axis=0), mask=cm)
    tl.store(dwp_ptr + row + HALF + c, tl.sum(dw2, axis=0), mask=cm)


def _check(x, weight, positions, cos, sin, eps) -> None:
    if not x.is_floating_point() or x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"rmsnorm_rope: x must be a floating [T, heads, D] tensor with D even, got "
                         f"{x.dtype} {list(x.shape)}")
    T, _, D = x.shape
    if weight.dim() != 1 or weight.shape[0] != D:
        raise ValueError(f"rmsnorm_rope: weight must have shape [{D}], got {list(weight.shape)}")
    if positions.dim() != 1 or positions.shape[0] != T or positions.is_floating_point():
        raise ValueError(f"rmsnorm_rope: positions must be [{T}] integers, got {positions.dtype} "
                         f"{list(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != D // 2 or table.dtype != torch.float32:
            raise ValueError(f"rmsnorm_rope: {name} must be a float32 [max_positions, {D // 2}] table, got "
                             f"{table.dtype} {list(table.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"rmsnorm_rope: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    for name, t in (("weight", weight), ("positions", positions), ("cos", cos), ("sin", sin)):
        if t.device != x.device:
            raise ValueError(f"rmsnorm_rope: {name} on {t.device}, x on {x.device}")
    if not eps > 0:
        raise ValueError(f"rmsnorm_rope: eps must be > 0, got {eps}")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _blocked_weight(weight: torch.Tensor, heads: int) -> tuple[torch.Tensor, int, int]:
    """([blocks, D] weight rows, blocks, heads per block) of a [D] weight (one block of every head) or a
    [blocks, D] one (head block b = heads b * per ... (b + 1) * per - 1 takes row b; any row stride,
    0 included: one weight expanded over the blocks is read in place)."""
    if weight.dim() == 1:
        return weight.contiguous()[None], 1, heads
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return w, w.shape[0], heads // w.shape[0]


def rmsnorm_rope_forward(x, weight, positions, cos, sin, eps) -> torch.Tensor:
    """Launch the forward kernel (module docstring): [T, heads, D] -> contiguous [T, heads, D] in x's dtype.
    ``weight`` [D], or [blocks, D]: head block b normalized with row b, each block by the programs of
    a launch over that block alone (:func:`rmsnorm_rope_blocks`)."""
    T, heads, D = x.shape
    x = _last_dim_contiguous(x)
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    w, blocks, per = _blocked_weight(weight, heads)
    if T and heads and D:
        block_h, block_half, num_warps = _config(per, D)
        subs = triton.cdiv(per, block_h)
        _rmsnorm_rope_kernel[(T, blocks * subs)](
            x, w, positions.contiguous(), cos, sin, y,
            per, subs, w.stride(0), x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0), float(eps),
            HALF=D // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=num_warps, **launch_options(x.device),
        )
    return y


def rmsnorm_rope_backward(dout, x, weight, positions, cos, sin, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (module docstring): ``(dx [T, heads, D] in x's dtype, dweight in weight's dtype and shape)``;
    with a [blocks, D] weight, row b of dweight is block b's sum alone (the bits of this backward over
    that block's heads with its own [D] weight)."""
    T, heads, D = x.shape
    x, dout = _last_dim_contiguous(x), _last_dim_contiguous(dout)
    cos, sin = cos.contiguous(), sin.contiguous()
    dx = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    w, blocks, per = _blocked_weight(weight, heads)
    per_program = BWD_TOKENS_PER_PROGRAM
    programs = triton.cdiv(T, per_program) if heads and D else 0
    partials = torch.empty((programs, blocks, D), dtype=torch.float32, device=x.device)
    if programs:
        block_h, block_half, num_warps = _config(per, D)
        _rmsnorm_rope_bwd_kernel[(programs, blocks)](
            x, w, positions.contiguous(), cos, sin, dout, dx, partials,
            T, per, per_program, w.stride(0), x.stride(0), x.stride(1), dout.stride(0), dout.stride(1),
            dx.stride(0), dx.stride(1), cos.stride(0), float(eps),
            HALF=D // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=num_warps, **launch_options(x.device),
        )
    dw = sum_partials(partials if weight.dim() == 2 else partials.view(programs, D), weight.dtype)
    return dx, dw


class _RMSNormRope(torch.autograd.Function):
    """:func:`rmsnorm_rope` through the kernel; saves its inputs only (x is a view of the qkv
    projection, which attention keeps alive anyway); the backward is :func:`rmsnorm_rope_backward`."""

    @staticmethod
    def forward(ctx, x, weight, positions, cos, sin, eps):
        ctx.save_for_backward(x, weight, positions, cos, sin)
        ctx.eps = eps
        return rmsnorm_rope_forward(x, weight, positions, cos, sin, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        x, weight, positions, cos, sin = ctx.saved_tensors
        dx, dw = rmsnorm_rope_backward(dout, x, weight, positions, cos, sin, ctx.eps)
        need_x, need_w = ctx.needs_input_grad[:2]
        return (dx if need_x else None), (dw if need_w else None), None, None, None, None


def rmsnorm_rope_store_kv(q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor, k_weight: torch.Tensor,
                          positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                          v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """The engine's Q/K/V step: returns :func:`rmsnorm_rope` of ``q`` [T, Hq, D] and stores
    ``rmsnorm_rope`` of ``k`` [T, Hkv, D] with ``v`` [T, Hkv, D] into the paged cache, in place —
    what ``rmsnorm_rope(q)``, ``rmsnorm_rope(k)`` then :func:`rlperf.kernels.write_kv_cache` give,
    with the same bits.

    ``k_cache, v_cache [num_pages, page_size, Hkv, D]``; ``slot_mapping [T]`` int64, ``slot = page *
    page_size + offset``, negative to skip a token's K/V (padding). On the Triton kernels (no
    gradient wanted) it is one launch: Q's programs and K's programs are those of the two
    ``rmsnorm_rope`` launches (their tile shapes, the one row function ``_norm_rope_rows``), K's
    writing into the cache instead of an output; elsewhere it is the three calls.
    """
    _check(q, q_weight, positions, cos, sin, eps)
    _check(k, k_weight, positions, cos, sin, eps)
    T, q_heads, D = q.shape
    k_heads = k.shape[1]
    kernels = ("triton", "interpreter")  # the Triton kernels, compiled or on the CPU's interpreter
    fused = (route("rmsnorm_rope", q.device, (q, q_weight, k, k_weight)) in kernels
             and route("write_kv_cache", k.device) in kernels and not D & (D - 1) and q.dtype == k.dtype
             and v.shape == k.shape and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:]
             and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
             and slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64)
    if fused:
        block_hq, block_half, warps_q = _config(q_heads, D)
        block_hk, _, warps_k = _config(k_heads, D)
        fused = warps_q == warps_k  # true for every D up to 2048 (MAX_HALF_TILE): one launch, Q's num_warps
    if not fused:  # other backends, or shapes the one launch declines: the three calls (they check)
        from .attention import write_kv_cache

        write_kv_cache(rmsnorm_rope(k, k_weight, positions, cos, sin, eps), v, k_cache, v_cache, slot_mapping)
        return rmsnorm_rope(q, q_weight, positions, cos, sin, eps)
    y = torch.empty((T, q_heads, D), dtype=q.dtype, device=q.device)
    if T == 0 or D == 0:
        return y
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    cos, sin = cos.contiguous(), sin.contiguous()
    q_blocks = triton.cdiv(q_heads, block_hq) if q_heads else 0
    k_blocks = triton.cdiv(k_heads, block_hk) if k_heads else 0
    _qk_norm_rope_store_kv_kernel[(T, q_blocks + k_blocks)](
        q, q_weight.contiguous(), k, k_weight.contiguous(), positions.contiguous(), cos, sin, y, v,
        k_cache, v_cache, slot_mapping,
        q_heads, k_heads, q_blocks,
        q.stride(0), q.stride(1), y.stride(0), y.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), float(eps),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        HALF=D // 2, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, PAGE=k_cache.shape[1],
        num_warps=warps_q, **launch_options(q.device),
    )
    return y


def _torch_rmsnorm_rope(x, weight, positions, cos, sin, eps):
    # the unfused formula (fast mode on CPU): HF's rmsnorm, then rotate-half RoPE in float32
    y = _torch_rmsnorm(x, weight, eps).to(x.dtype)
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    y1, y2 = y.float().chunk(2, dim=-1)
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1).to(x.dtype)


def rmsnorm_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of each head's row, then the rotary embedding of its token's position (module docstring).

    Parameters
    ----------
    x : [T, heads, D] float16/bfloat16/float32, D even; any strides with the last dim contiguous
        (the model passes a view of the qkv projection)
    weight : [D] the norm weight (``q_norm`` / ``k_norm``)
    positions : [T] int64 (or int32) position of each token in its sequence, < max_positions (not
        checked here: that would synchronize the host)
    cos, sin : [max_positions, D/2] float32 tables (:class:`rlperf.model.layer.RopeTable`)
    eps : added to the mean square (> 0)

    Returns ``[T, heads, D]`` in x's dtype, contiguous. Differentiable in x and weight: the Triton
    backward of :func:`rmsnorm_rope_backward` (deterministic); the reference backend's float64 code
    and fast mode's stock torch code are differentiated by autograd as they are.
    """
    _check(x, weight, positions, cos, sin, eps)
    how = route("rmsnorm_rope", x.device, (x, weight))
    if how == "autograd":
        if route("rmsnorm_rope", x.device) == "stock":  # fast mode's stock op: torch differentiates it
            return _torch_rmsnorm_rope(x, weight, positions, cos, sin, eps)
        return _RMSNormRope.apply(x, weight, positions, cos, sin, eps)
    if how == "stock":
        return _torch_rmsnorm_rope(x, weight, positions, cos, sin, eps)
    if how == "reference":
        return _ref.rmsnorm_rope(x, weight, positions, cos, sin, eps)
    return rmsnorm_rope_forward(x, weight, positions, cos, sin, eps)


def rmsnorm_rope_blocks(x: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """:func:`rmsnorm_rope` of each head block with its own weight row, in one launch: x [T, heads, D] cut
    into ``blocks`` blocks of ``per = heads / blocks`` consecutive heads, block b normalized with
    ``weights[b]`` ([blocks, D], e.g. the replicas of :func:`rlperf.kernels.tree_reduce.block_replicas`).

    Equal bit for bit to ``torch.cat([rmsnorm_rope(x[:, b*per:(b+1)*per], weights[b], ...) for b], 1)``
    and to its gradients: each block runs the programs and tile shapes (``_config(per, D)``) of a launch
    over that block alone, and the backward's ``dweights[b]`` adds that launch's partials in its order
    (``sum_partials`` of a [programs, blocks, D] buffer, one group per block). Forward one launch,
    backward two (instead of ``blocks`` and ``2 * blocks`` plus the slices' gradient adds). The
    reference backend and fast mode's stock op run the per-block calls themselves."""
    if weights.dim() != 2 or x.dim() != 3 or weights.shape[0] < 1 or x.shape[1] % weights.shape[0]:
        raise ValueError(f"rmsnorm_rope_blocks: weights [blocks, D] with blocks dividing x's heads, got x "
                         f"{list(x.shape)} and weights {list(weights.shape)}")
    _check(x, weights[0], positions, cos, sin, eps)
    blocks, per = weights.shape[0], x.shape[1] // weights.shape[0]
    how = route("rmsnorm_rope", x.device, (x, weights))
    fused = how not in ("stock", "reference") and not (how == "autograd" and route("rmsnorm_rope", x.device) == "stock")
    if not fused:
        outs = [rmsnorm_rope(x[:, b * per:(b + 1) * per], weights[b], positions, cos, sin, eps) for b in range(blocks)]
        return torch.cat(outs, dim=1) if blocks > 1 else outs[0]
    if how == "autograd":
        return _RMSNormRope.apply(x, weights, positions, cos, sin, eps)
    return rmsnorm_rope_forward(x, weights, positions, cos, sin, eps)
