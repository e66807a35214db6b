"""Causal attention whose bits do not depend on how a sequence is batched or chunked: one Triton
kernel for varlen prefill (training), chunked prefill against a paged KV cache, and decode.

Formula. For sequence ``b`` with ``L_b`` tokens of K/V and ``n_b`` queries (the LAST ``n_b``
positions, so query ``i`` sits at position ``pos = L_b - n_b + i``), query head ``j`` and KV head
``h = j // G`` (``G = Hq // Hkv``)::

    out[i, j] = sum_{p <= pos} softmax_p(scale * q[i, j] . k[p, h]) * v[p, h]       scale = D**-0.5

Decode is ``n_b = 1``, chunked prefill ``n_b`` = a chunk, full prefill ``n_b = L_b``.

Invariance contract (docs/ARCHITECTURE.md, "Prefill ≡ decode"): the output row of (sequence, position, head)
has the same bits in every mode and every batch composition, because every mode runs

* the same kernel body with ONE launch config (``_CONFIG``: BLOCK_M, BLOCK_N, warps, stages; decode-only
  launches take ``_DECODE_CONFIG``, a 64-row tile of the same wgmma family, or, with more programs
  than SMs, the same update with the keys on the MMA's M side (below); both proven bit-identical) —
  on Hopper a row's wgmma result does not depend on which row of the tile it sits in, but a
  different tile shape or warp count may pick a different MMA instruction and change the bits
  (K/V arrive by TMA or, when strides forbid a descriptor, by pointers: the same values, tested
  bit-identical);
* the same KV blocks in the same order: block ``j`` holds positions ``[j*BLOCK_N, (j+1)*BLOCK_N)``,
  which is exactly page ``page_table[b, j]`` (``PAGE_SIZE == BLOCK_N``), from block 0 upwards, with
  no split-KV;
* the same online-softmax update per block (below). A tile covers several query positions, so it may run
  blocks that are entirely in some row's future; for that row the update is an exact no-op:
  scores are ``-inf``, the running max does not move (``alpha = exp2(0) = 1``), ``p = 0``, and
  ``acc*1 + 0 @ v == acc`` (``v`` past ``L_b`` is loaded as 0, never as stale cache bits or NaN).
  The one value ``+0`` cannot preserve is a ``-0.0`` accumulator, so the epilogue adds ``+0.0``.
* blocks wholly at or before every row of the tile skip the mask (fast path); the masked path
  differs only by a ``where`` applied to the raw scores before anything else, so a valid score
  takes the same arithmetic (and the same FMA contraction) on both paths.

The softmax sum. Per block, the same expressions in every launch::

    m' = max(m, scale * max_j s_j);  alpha = exp2(m - m');  p_j = exp2(scale * s_j - m')
    l' = l * alpha + key_sum(p)                     (one fixed order of additions: _key_sum)
    acc' = acc * alpha + p @ v   (p rounded to the K/V dtype);   at the end  out = acc / l + 0.0

``key_sum`` adds a row's ``BLOCK_N = 128`` values in an order defined by the key index alone
(:func:`_key_sum`: four interleaved chains, then a pairwise finish), not by ``tl.sum``, whose order
follows the register layout and so changes with the tile's orientation. The order is the one
``tl.sum`` takes on the row tiles (64 or 128 rows, wgmma; GPU test), so those launches have the bits
they had when they summed with ``tl.sum``. That lets a decode launch put the **keys on the MMA's M
side** (``KEYS_ON_M``, :func:`_attn_decode_keys_on_m_kernel`): the scores as ``k @ q^T`` of shape
``[BLOCK_N, QN]`` with the ``G`` query heads of one KV head as columns (padded to ``QN >= 16``), the
output as ``trans(p_t) @ v`` (``QN`` rows, ``mma.sync``). Every score is the same k16 chain over the head
dimension (the operands trade sides; the matrix products' swapped tiles rest on the same fact,
``kernels/gemm.py``), the output the same chain over the keys, and every elementwise step and the key
sum the same expressions, so the same bits (GPU tests, bf16 and fp16, G = 2, 4, 8). At decode the
64-row tile holds ``G`` real rows; the transposed score tile is a quarter of its size (registers, exp2s
and shared memory), which leaves room for a deeper pipeline at two programs per SM.

GQA: the ``G`` query heads of one KV head are packed into the M tile (row ``r`` = query
``r // G``, head ``r % G``), so each K/V block is read once per KV head, not once per query head;
that is what makes decode memory-efficient. Grid: (query tiles of all sequences, KV heads), no
split over KV: ``B * Hkv`` programs already fill the GPU in decode.

Training: with grad, :func:`varlen_attention` runs this kernel with ``STORE_LSE`` (each row's
base-2 log-sum-exp, stored after ``out`` without touching its bits) and differentiates through the
fixed-order Triton backward of ``kernels/attention_backward.py``.

Fast mode (``mode() == "fast"``) uses torch SDPA for prefill and chunks (flash / cuDNN / efficient; decode-only
batches keep this kernel, the fastest paged decode available), not
invariant; it exists to measure the price of invariance.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention_backward import attention_backward
from .autograd import with_recompute_backward
from .dispatch import mode, route
from .pipeline import grid_dependency_sync, launch_options, launch_with_fitting_stages, num_sms
from .tile_dot import dot_acc, dot_fresh
from .reference import attention as _ref

# One launch config for every mode (see the contract above). BLOCK_N is the KV block and the page
# size. Chosen by `python -m rlperf.bench.attention --sweep` on an H200 (bench/NOTES-attention.md):
# 128x128 tiles with 8 warps and TMA loads are the only tried config that is within reach of both
# the prefill (cuDNN) and the decode (SDPA flash) anchors. TMA falls back to pointer loads (same
# bits) when K/V strides do not allow a descriptor.
# GUESS_ONE_QUERY only acts in launches with as many queries as sequences (_attn_fwd_kernel's docstring).
_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True, "GUESS_ONE_QUERY": True}
PAGE_SIZE: int = _CONFIG["BLOCK_N"]
# Decode-only launches (one query per sequence) use half the M tile with one warpgroup: the same
# wgmma instruction family (m64 per warpgroup), the same KV blocks and online-softmax order, so the
# same bits as _CONFIG for every row; measured on an H100, bf16 and fp16, batches 1/7/64/256 of
# lengths 1..800, bit-identical to the full prefill, 5-25% faster than the 128-row tile (which is
# 127/128 padding at decode). BLOCK_M 16/32 with 4 warps (mma.sync) differed in a few rows: not used.
# tests/kernels/test_attention.py's GPU tests prove the equality for the shapes the model uses.
_DECODE_CONFIG = {**_CONFIG, "BLOCK_M": 64, "num_warps": 4}
# The software pipeline's depth (num_stages) moves no bit: the same loads, the same math in the same
# order, only how far ahead the loads are issued (launch_with_fitting_stages already lowers it where
# shared memory is short). A decode launch takes its depth from its grid: with at most one program per
# SM, a 2-deep pipeline hides the loads of each program's few KV blocks; with more programs than SMs,
# one stage (64 KiB of K/V tiles, 82 KiB of shared memory in all) lets two programs share an SM (ncu at
# B = 256; three would need <= 75 KiB and <= 168 registers), which hides them better. H200,
# Qwen3-0.6B heads, prompt 512, a graphed 28-layer stack (`python -m rlperf.bench.attention
# --sweep-decode`, fba5d7c): against 3 stages, 2 stages 1.02x / 1.04x at B = 1 / 16; 1 stage 1.24x /
# 1.30x at B = 64 / 256 and 1.10x at B = 64 KV 4096 (but 0.77x at B = 1); bits equal at every depth.
# Reading each block's page one block ahead (PREFETCH_PAGE) lets the 3-deep pipeline run ahead of the
# page table: 1.16x the 2-stage launch at B = 1 and 16 (12.8 / 17.3 against 14.8 / 20.0 us per layer,
# 8576cfe, same sweep); it changes nothing at one stage. With one stage a masked block (a decode step's
# last page, mostly empty at these lengths) loads by pointers (MASKED_PTR), so the empty rows of the
# page are not read.
# With more programs than SMs the launch puts the keys on the MMA's M side (KEYS_ON_M, module
# docstring): its 16-column score tile leaves room for a 2-deep pipeline at two programs per SM (106 KiB
# of shared memory against the 64-row tile's 82 KiB at one stage). In the engine's graphed decode step
# (`python -m rlperf.bench.fusion_ab`, H200, 5b2d08c, 3 rounds, the 64-row tiles then the default; today
# `--variants 'decode row tiles'` times that launch of before): 2.383 / 6.187 ms against 2.446 / 6.462 at
# B = 64 / 256 (0.97x / 0.96x); at one stage it lost (1.03x / 1.05x), and with few programs too (3 stages:
# 1.02x / 1.06x at B = 1 / 16), so that launch keeps the 64-row tile. Bits equal at every depth and warp
# count (the GPU tests).
_DECODE_FEW_PROGRAMS = {**_DECODE_CONFIG, "num_stages": 3, "PREFETCH_PAGE": True}
_DECODE_MANY_PROGRAMS = {**_DECODE_CONFIG, "num_stages": 2, "MASKED_PTR": True, "KEYS_ON_M": True}


def _decode_config(programs: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The launch config of a decode step of ``programs`` live programs (comment above). float32 keeps the
    64-row tile: the keys-on-M orientation is proven bit-identical on the GPU for 16-bit inputs only (its
    float32 dots run in TF32, which the GPU tests do not cover)."""
    if device.type != "cuda":
        return _DECODE_CONFIG  # the interpreter has no pipeline
    if programs <= num_sms(device):
        return _DECODE_FEW_PROGRAMS
    return _DECODE_MANY_PROGRAMS if dtype != torch.float32 else {**_DECODE_MANY_PROGRAMS, "KEYS_ON_M": False}

__all__ = ["PAGE_SIZE", "write_kv_cache", "paged_attention", "varlen_attention"]


# ----------------------------------------------------------------------------------------------
# attention kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_kv_block(
    K, V, K_PTR, V_PTR, b, kvh, jb, kv_start, kv_len, page,
    PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr, PREFETCH_PAGE: tl.constexpr, MASKED_PTR: tl.constexpr,
):
    """KV block ``jb`` of (sequence ``b``, KV head ``kvh``): ``k, v [BLOCK_N, HEAD_DIM]`` (every kernel's loads).

    ``MASKED``: rows past ``kv_len`` are absent: V's are zeroed (so ``0 * v`` stays 0 whatever stale
    bits the cache holds there); K's need no zeroing (their scores become ``-inf``).

    K/V arrive either through tensor descriptors (TMA on Hopper; K, V are descriptors over the
    2-D views ``[rows, Hkv*D]``) or through pointers; both paths load the same values.

    ``PREFETCH_PAGE`` (paged): ``page`` is block ``jb``'s page, read by the caller one block ahead, so the
    K/V loads do not wait on the page table's read; otherwise the block reads its page here.
    ``MASKED_PTR``: a masked block takes the pointer loads (``K_PTR``, ``V_PTR``: the tensors themselves)
    even when the others take TMA, so the rows past ``kv_len`` are never read (a decode step's last page
    is mostly empty: a TMA box would read all of it).
    """
    TMA_LOADS: tl.constexpr = USE_TMA and not (MASKED and MASKED_PTR)
    offs_j = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = jb * BLOCK_N + offs_j                      # key positions in the sequence
    # The masks compare the offset in the block with a per-row bound relative to the block start
    # (offs_j < kv_len - jb*BLOCK_N, not offs_n < kv_len): the same booleans (no i32 overflow at these
    # sizes), but comparing offs_n let LLVM widen the block index to 64 bits and keep a 64-bit key
    # position per column live across the masked loop; under Triton 3.6.0 for SM 90 that spilled the
    # one-stage decode launches (bench/NOTES-attention.md, "Decode loads").
    kv_left = kv_len - jb * BLOCK_N                     # rows of this block inside the sequence
    if TMA_LOADS:
        if PAGED:
            if PREFETCH_PAGE:
                row = page * BLOCK_N
            else:
                row = tl.load(PAGE_TABLE + b * stride_pt + jb) * BLOCK_N
        else:
            row = kv_start + jb * BLOCK_N
        k = K.load([row, kvh * HEAD_DIM])
        v = V.load([row, kvh * HEAD_DIM])
        if MASKED:
            v = tl.where((offs_j < kv_left)[:, None], v, 0.0)
    else:
        if PAGED:
            if not PREFETCH_PAGE:
                page = tl.load(PAGE_TABLE + b * stride_pt + jb)
            page = page.to(tl.int64)
            k_ptrs = K_PTR + page * stride_kp + kvh * stride_kh + offs_j[:, None] * stride_kt + offs_d[None, :]
            v_ptrs = V_PTR + page * stride_vp + kvh * stride_vh + offs_j[:, None] * stride_vt + offs_d[None, :]
        else:
            rows = (kv_start + offs_n).to(tl.int64)
            k_ptrs = K_PTR + kvh * stride_kh + rows[:, None] * stride_kt + offs_d[None, :]
            v_ptrs = V_PTR + kvh * stride_vh + rows[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            # Past L_b the cache holds stale bits (maybe NaN): load zeros so 0 * v stays 0.
            in_seq = (offs_j < kv_left)[:, None]
            k = tl.load(k_ptrs, mask=in_seq, other=0.0)
            v = tl.load(v_ptrs, mask=in_seq, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _key_sum(p):
    """``p [R, 128]`` -> ``[R]``: each row's sum over the keys of a block in one fixed order defined by the
    key index alone (module docstring, "The softmax sum"). With ``k = 8 i + 2 L + j`` (``i < 16``, ``L < 4``,
    ``j < 2``): four chains ``s_L = p[2L] + p[2L + 1] + p[8 + 2L] + p[9 + 2L] + ... + p[121 + 2L]``
    (ascending ``k``, left to right), then ``(s_0 + s_2) + (s_1 + s_3)``. Every step is one rounded
    ``a + b`` whatever the register layout. The order is the one ``tl.sum`` takes on a 64- or 128-row
    wgmma tile (each thread holds a row's 32 values of one ``L`` in that order and adds them up in
    register order; then butterfly shuffles over lane bits 1 and 0), so row tiles keep their bits."""
    R: tl.constexpr = p.shape[0]
    tl.static_assert(p.shape[1] == 128, "_key_sum: a block of 128 keys (BLOCK_N is the page size)")
    # [R, L, j, i0, i1, i2, i3]: i's bits reversed, so each split of the last axis halves the remaining
    # run of i in order (first half, second half) and the last split separates j.
    x = tl.permute(tl.reshape(p, [R, 2, 2, 2, 2, 4, 2]), (0, 5, 6, 4, 3, 2, 1))
    s = tl.zeros([R, 4], tl.float32)   # 0 + p[2L] is exact (p >= +0)
    by_i3 = tl.split(x)
    for a in tl.static_range(2):
        by_i2 = tl.split(by_i3[a])
        for b in tl.static_range(2):
            by_i1 = tl.split(by_i2[b])
            for c in tl.static_range(2):
                by_i0 = tl.split(by_i1[c])
                for d in tl.static_range(2):
                    by_j = tl.split(by_i0[d])   # i = 8 a + 4 b + 2 c + d
                    s = (s + by_j[0]) + by_j[1]
    s = tl.sum(tl.reshape(s, [R, 2, 2]), 1)   # L = 2 h + l: s_l + s_(2 + l)
    return tl.sum(s, 1)


@triton.jit
def _attn_block(
    acc, l_i, m_i, q, K, V, K_PTR, V_PTR, pos, b, kvh, jb, kv_start, kv_len, page,
    PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr, PREFETCH_PAGE: tl.constexpr, MASKED_PTR: tl.constexpr,
):
    """One online-softmax update with KV block ``jb`` (identical arithmetic in every mode).

    Rows are queries: ``q [BLOCK_M, D]``, ``acc [BLOCK_M, D]``, ``m_i, l_i [BLOCK_M]`` (module docstring,
    "The softmax sum"). ``MASKED``: apply the causal mask and treat positions past ``kv_len`` as absent;
    unmasked blocks lie at or before every row's position. :func:`_attn_block_keys_on_m` is the same
    update with the keys on the MMA's M side.
    """
    k, v = _load_kv_block(
        K, V, K_PTR, V_PTR, b, kvh, jb, kv_start, kv_len, page,
        PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        HEAD_DIM, BLOCK_N, PAGED, MASKED, USE_TMA, PREFETCH_PAGE, MASKED_PTR)
    qk = dot_fresh(q, tl.trans(k))
    # The mask is applied to the raw scores, before the scale, so valid entries see the same FMA
    # (qk * scale - m) whether or not their block was masked.
    if MASKED:
        offs_j = tl.arange(0, BLOCK_N)
        qk = tl.where(offs_j[None, :] <= (pos - jb * BLOCK_N)[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + _key_sum(p)
    acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _attn_block_keys_on_m(
    acc, l_i, m_i, q_t, K, V, K_PTR, V_PTR, pos, b, kvh, jb, kv_len, page,
    PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr, PREFETCH_PAGE: tl.constexpr, MASKED_PTR: tl.constexpr,
):
    """:func:`_attn_block` for one query position ``pos`` (a decode step) with the scores transposed: the
    keys on the MMA's M side. ``q_t [D, QN]`` (the queries as columns), ``m_i, l_i [QN]``; the scores
    ``s_t = k @ q_t`` ``[BLOCK_N, QN]`` (wgmma: M = BLOCK_N), ``p_t`` from them elementwise, then
    ``acc [QN, D] = acc * alpha + p_t^T @ v`` (QN rows: ``mma.sync``). Every element is the same chain of
    products in the same order as in :func:`_attn_block` (the score product's operands trade sides, each
    dot keeps its k16 chain), and every elementwise step and the key sum are the same expressions."""
    k, v = _load_kv_block(
        K, V, K_PTR, V_PTR, b, kvh, jb, 0, kv_len, page,
        PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        HEAD_DIM, BLOCK_N, True, MASKED, USE_TMA, PREFETCH_PAGE, MASKED_PTR)
    s_t = dot_fresh(k, q_t)
    if MASKED:
        offs_j = tl.arange(0, BLOCK_N)
        s_t = tl.where((offs_j <= pos - jb * BLOCK_N)[:, None], s_t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_t, 0) * qk_scale)
    p_t = tl.math.exp2(s_t * qk_scale - m_new[None, :])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + _key_sum(tl.trans(p_t))
    acc = dot_acc(tl.trans(p_t.to(v.dtype)), v, acc * alpha[:, None])
    return acc, l_i, m_new


# Integers whose divisibility by 16 follows the run rather than the shape (the batch's sequence count,
# the page table's row stride, which follows the KV cache's size, i.e. free memory) are not specialized
# on: one compiled kernel per shape serves every run, so a kernel manifest covers them.
@triton.jit(do_not_specialize=["num_seqs", "stride_pt", "stride_lse_h"])
def _attn_fwd_kernel(
    Q, K, V, K_PTR, V_PTR, O, LSE, CU_Q, KV_LENS, PAGE_TABLE,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lse_h,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_pt,
    qk_scale, num_seqs, search_steps,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, USE_TMA: tl.constexpr, STORE_LSE: tl.constexpr, PREFETCH_PAGE: tl.constexpr,
    MASKED_PTR: tl.constexpr, GUESS_ONE_QUERY: tl.constexpr = False,
):
    """Program (i, kvh): query tile i of the flattened tile list, KV head kvh.

    Tile numbering without host sync: sequence b's tiles start at f(b) = cu_q[b] // BLOCK_Q + b,
    which is monotone and leaves at least cdiv(n_b, BLOCK_Q) slots per sequence; the grid is
    f(B) = T // BLOCK_Q + B. A binary search over f finds b; surplus slots exit.

    ``GUESS_ONE_QUERY`` (a decode step's launch: T == B): first try the b that a batch of one query per
    sequence gives (cu_q[b] = b, so f(b) = b + b // BLOCK_Q and b = pid - (pid + 1) // (BLOCK_Q + 1),
    clamped to B - 1) and check it with the two loads f(b) <= pid < f(b + 1); only a failed check runs
    the search. Both find the same b, so the arithmetic and the bits are the search's; a decode program
    starts its K/V loads after two parallel loads instead of ceil(log2 B) dependent ones.

    ``STORE_LSE``: also store each row's base-2 log-sum-exp of the scaled scores,
    ``LSE[head, token] = m + log2(l)``, for the backward (``kernels/attention_backward.py``).
    """
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    lo = pid * 0
    hi = lo + num_seqs
    steps = search_steps
    if GUESS_ONE_QUERY:
        guess = tl.minimum(pid - (pid + 1) // (BLOCK_Q + 1), num_seqs - 1)
        found = ((tl.load(CU_Q + guess) // BLOCK_Q + guess <= pid)
                 & (pid < tl.load(CU_Q + guess + 1) // BLOCK_Q + guess + 1))
        lo = tl.where(found, guess, lo)
        hi = tl.where(found, guess + 1, hi)
        steps = tl.where(found, 0, search_steps)
    for _ in range(steps):  # invariant: f(lo) <= pid < f(hi); extra steps are no-ops
        mid = (lo + hi) // 2
        take = tl.load(CU_Q + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    b = lo
    q_start = tl.load(CU_Q + b)
    n_q = tl.load(CU_Q + b + 1) - q_start
    n_tiles = (n_q + BLOCK_Q - 1) // BLOCK_Q
    j = pid - (q_start // BLOCK_Q + b)
    if j < n_tiles:
        tile = n_tiles - 1 - j  # latest (longest) tiles of a sequence start first
        if PAGED:
            kv_len = tl.load(KV_LENS + b)
            kv_start = 0
        else:
            kv_len = n_q
            kv_start = q_start

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_idx = tile * BLOCK_Q + offs_m // G            # query index within the sequence
        head = kvh * G + offs_m % G
        row_ok = (offs_m < BLOCK_Q * G) & (q_idx < n_q)
        pos = kv_len - n_q + q_idx                      # key position of each row's query
        q_rows = (q_start + q_idx).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

        first_pos = kv_len - n_q + tile * BLOCK_Q
        last_pos = kv_len - n_q + tl.minimum(tile * BLOCK_Q + BLOCK_Q, n_q) - 1
        n_full = (first_pos + 1) // BLOCK_N                # blocks no row of the tile masks
        n_blocks = (last_pos + BLOCK_N) // BLOCK_N         # cdiv(last_pos + 1, BLOCK_N)
        pages = PAGE_TABLE + b * stride_pt
        if PREFETCH_PAGE:
            page = tl.load(pages, mask=n_blocks > 0, other=0)
        else:
            page = 0  # read inside _attn_block
        for jb in range(0, n_full):
            this_page = page
            if PREFETCH_PAGE:  # the next block's page, read while this block computes (same values)
                page = tl.load(pages + jb + 1, mask=jb + 1 < n_blocks, other=0)
            acc, l_i, m_i = _attn_block(
                acc, l_i, m_i, q, K, V, K_PTR, V_PTR, pos, b, kvh, jb, kv_start, kv_len, this_page,
                PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
                HEAD_DIM, BLOCK_N, PAGED, False, USE_TMA, PREFETCH_PAGE, MASKED_PTR)
        for jb in range(n_full, n_blocks):
            this_page = page
            if PREFETCH_PAGE:
                page = tl.load(pages + jb + 1, mask=jb + 1 < n_blocks, other=0)
            acc, l_i, m_i = _attn_block(
                acc, l_i, m_i, q, K, V, K_PTR, V_PTR, pos, b, kvh, jb, kv_start, kv_len, this_page,
                PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
                HEAD_DIM, BLOCK_N, PAGED, True, USE_TMA, PREFETCH_PAGE, MASKED_PTR)

        # + 0.0 turns a -0.0 (which an extra masked block would have turned into +0.0) into +0.0.
        out = acc / l_i[:, None] + 0.0
        tl.store(O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None])
        if STORE_LSE:
            # computed after the loop from the final m_i and l_i, changing neither: `out` keeps its bits
            # (the training forward must equal the engine's prefill and decode, which store no LSE)
            tl.store(LSE + head.to(tl.int64) * stride_lse_h + q_rows, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs", "stride_pt"])
def _attn_decode_keys_on_m_kernel(
    Q, K, V, K_PTR, V_PTR, O, CU_Q, KV_LENS, PAGE_TABLE,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_pt,
    qk_scale, num_seqs,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QN: tl.constexpr,
    USE_TMA: tl.constexpr, PREFETCH_PAGE: tl.constexpr, MASKED_PTR: tl.constexpr,
):
    """Program (b, kvh) of a paged launch with as many queries as sequences (a decode step): the
    queries of sequence ``b`` (one in a decode step; each in turn where a sequence has more), the
    ``G`` query heads of KV head ``kvh`` as the ``QN >= 16`` columns of the score tile and rows of the
    output tile (the padding ones computed on zero queries and not stored). The KV blocks, their order, masks and update
    are :func:`_attn_fwd_kernel`'s, through :func:`_attn_block_keys_on_m`; the epilogue is its."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(CU_Q + b)
    n_q = tl.load(CU_Q + b + 1) - q_start
    kv_len = tl.load(KV_LENS + b)
    offs_c = tl.arange(0, QN)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_c < G
    head = kvh * G + offs_c
    pages = PAGE_TABLE + b * stride_pt
    for i in range(0, n_q):
        pos = kv_len - n_q + i                              # this query's key position
        q_row = (q_start + i).to(tl.int64)
        q_t = tl.load(Q + q_row * stride_qt + head[None, :] * stride_qh + offs_d[:, None],
                      mask=col_ok[None, :], other=0.0)
        m_i = tl.full([QN], float("-inf"), tl.float32)
        l_i = tl.zeros([QN], tl.float32)
        acc = tl.zeros([QN, HEAD_DIM], tl.float32)
        n_full = (pos + 1) // BLOCK_N                       # blocks the query sees whole
        n_blocks = (pos + BLOCK_N) // BLOCK_N               # cdiv(pos + 1, BLOCK_N)
        if PREFETCH_PAGE:
            page = tl.load(pages, mask=n_blocks > 0, other=0)
        else:
            page = 0  # read inside _load_kv_block
        for jb in range(0, n_full):
            this_page = page
            if PREFETCH_PAGE:  # the next block's page, read while this block computes (same values)
                page = tl.load(pages + jb + 1, mask=jb + 1 < n_blocks, other=0)
            acc, l_i, m_i = _attn_block_keys_on_m(
                acc, l_i, m_i, q_t, K, V, K_PTR, V_PTR, pos, b, kvh, jb, kv_len, this_page,
                PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
                HEAD_DIM, BLOCK_N, False, USE_TMA, PREFETCH_PAGE, MASKED_PTR)
        for jb in range(n_full, n_blocks):
            this_page = page
            if PREFETCH_PAGE:
                page = tl.load(pages + jb + 1, mask=jb + 1 < n_blocks, other=0)
            acc, l_i, m_i = _attn_block_keys_on_m(
                acc, l_i, m_i, q_t, K, V, K_PTR, V_PTR, pos, b, kvh, jb, kv_len, this_page,
                PAGE_TABLE, stride_pt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
                HEAD_DIM, BLOCK_N, True, USE_TMA, PREFETCH_PAGE, MASKED_PTR)
        out = acc / l_i[:, None] + 0.0
        tl.store(O + q_row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=col_ok[:, None])


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int) -> int:
    if q.dim() != 3 or k.dim() < 3 or k.shape != v.shape:
        raise ValueError(f"expected q [T,Hq,D] and matching k/v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype {q.dtype}: expected bfloat16, float16 or float32")
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k.shape[-2]
    if k.shape[-1] != D:
        raise ValueError(f"head_dim of q ({D}) and k ({k.shape[-1]}) differ")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim {D}: expected a power of two >= 16 (64 and 128 are the tuned ones)")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    G = Hq // Hkv
    if G > block_m:
        raise ValueError(f"{G} query heads per KV head exceed BLOCK_M={block_m}")
    return G


def _tma_views_ok(k: torch.Tensor, v: torch.Tensor, paged: bool) -> bool:
    """Whether K/V can be described as 2-D ``[rows, Hkv*D]`` tensors for TMA: heads adjacent,
    16-byte aligned base and row stride, and row coordinates that fit int32."""
    for x in (k, v):
        D, H = x.shape[-1], x.shape[-2]
        row_stride = x.stride(1) if paged else x.stride(0)
        if x.stride(-1) != 1 or x.stride(-2) != D or (row_stride * x.element_size()) % 16 or x.data_ptr() % 16:
            return False
        if paged and x.stride(0) != x.shape[1] * row_stride:
            return False
        if x.shape[0] * (x.shape[1] if paged else 1) >= 2**31 or row_stride < H * D:
            return False
    return True


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    config: dict | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel directly: paged when ``page_table`` is given (k, v = the caches, with
    ``kv_lens``; :func:`paged_attention`'s layout), varlen otherwise (:func:`varlen_attention`'s).
    No routing and no autograd; index tensors are not checked (the ops do that). CUDA tensors run
    compiled, CPU tensors under the interpreter (``TRITON_INTERPRET=1``).

    ``return_lse``: return ``(out, lse)``, ``lse [Hq, T]`` float32 = the base-2 log-sum-exp of each
    row's scaled scores, ``log2 sum_p exp2(scale * log2(e) * q . k_p)`` (what
    :func:`rlperf.kernels.attention_backward.attention_backward` takes); ``out`` has the same bits
    either way.

    ``config`` (keys ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``, ``TMA`` and the optional
    ``PREFETCH_PAGE``, ``MASKED_PTR``, ``GUESS_ONE_QUERY``) replaces the
    one launch config for tuning sweeps (``bench/attention.py``); the ops never pass it, and another
    config may give other bits.
    """
    cfg = _CONFIG if config is None else config
    G = _check_qkv(q, k, v, cfg["BLOCK_M"])
    T, Hq, D = q.shape
    Hkv = k.shape[-2]
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    num_seqs = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q)
    lse = torch.empty(Hq, T, dtype=torch.float32, device=q.device) if return_lse else None
    if T == 0 or num_seqs <= 0:
        return (out, lse) if return_lse else out
    scale = D ** -0.5 if scale is None else float(scale)
    block_q = cfg["BLOCK_M"] // G
    paged = page_table is not None
    if paged:
        if k.shape[1] != cfg["BLOCK_N"]:
            raise ValueError(f"cache page size {k.shape[1]} != the kernel's KV block {cfg['BLOCK_N']} (PAGE_SIZE)")
        strides_k = (k.stride(0), k.stride(1), k.stride(2))
        strides_v = (v.stride(0), v.stride(1), v.stride(2))
        stride_pt = page_table.stride(0)
    else:
        strides_k = (0, k.stride(0), k.stride(1))
        strides_v = (0, v.stride(0), v.stride(1))
        stride_pt = 0
        kv_lens = cu_seqlens_q  # unused placeholders (PAGED=False never reads them)
        page_table = cu_seqlens_q
    use_tma = cfg["TMA"] and _tma_views_ok(k, v, paged)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # 2-D views [rows, Hkv*D]: a K/V block is the box [BLOCK_N, D] at (first row, kvh*D)
        # (K and V keep their own row strides: in the training forward V is often a strided view of
        # the fused qkv projection while K is a fresh contiguous tensor)
        def descriptor(x):
            rows = x.shape[0] * (x.shape[1] if paged else 1)
            row_stride = x.stride(1) if paged else x.stride(0)
            return TensorDescriptor(x, [rows, Hkv * D], [row_stride, 1], [cfg["BLOCK_N"], D])

        k_arg, v_arg = descriptor(k), descriptor(v)
    else:
        k_arg, v_arg = k, v
    if cfg.get("KEYS_ON_M", False) and paged and T == num_seqs:
        return _launch_decode_keys_on_m(q, k, v, k_arg, v_arg, out, cu_seqlens_q, kv_lens, page_table, stride_pt,
                                        strides_k, strides_v, scale, G, use_tma, cfg)
    grid = (T // block_q + num_seqs, Hkv)
    # float32 [128, 128] K and V blocks three stages deep need 448 KiB of shared memory (Hopper
    # has 227): fewer stages then (kernels/pipeline.py). The KV block order and the math stay, so
    # varlen and paged launches agree whatever depth each got.
    def launch(stages):
        _attn_fwd_kernel[grid](
            q, k_arg, v_arg, k, v, out, out if lse is None else lse, cu_seqlens_q, kv_lens, page_table,
            # the LSE stride only when storing: a constant elsewhere adds no compiled variant per T
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), T if return_lse else 0,
            *strides_k, *strides_v, stride_pt,
            scale * math.log2(math.e), num_seqs, math.ceil(math.log2(num_seqs)) if num_seqs > 1 else 0,
            G=G, HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], PAGED=paged, USE_TMA=use_tma,
            STORE_LSE=return_lse, PREFETCH_PAGE=paged and cfg.get("PREFETCH_PAGE", False),
            MASKED_PTR=use_tma and cfg.get("MASKED_PTR", False), GUESS_ONE_QUERY=cfg.get("GUESS_ONE_QUERY", False) and T == num_seqs,
            num_warps=cfg["num_warps"], num_stages=stages, **launch_options(q.device),
        )

    launch_with_fitting_stages(launch, ("attention", q.dtype, D, G, paged, use_tma, return_lse,
                                        tuple(sorted(cfg.items()))), cfg["num_stages"])
    return (out, lse) if return_lse else out


def _launch_decode_keys_on_m(q, k, v, k_arg, v_arg, out, cu_seqlens_q, kv_lens, page_table, stride_pt,
                             strides_k, strides_v, scale, G, use_tma, cfg) -> torch.Tensor:
    """:func:`attention_forward`'s launch of :func:`_attn_decode_keys_on_m_kernel`: grid (B, Hkv)."""
    num_seqs, Hkv, D = cu_seqlens_q.numel() - 1, k.shape[-2], q.shape[-1]
    qn = max(16, triton.next_power_of_2(G))

    def launch(stages):
        _attn_decode_keys_on_m_kernel[(num_seqs, Hkv)](
            q, k_arg, v_arg, k, v, out, cu_seqlens_q, kv_lens, page_table,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides_k, *strides_v, stride_pt,
            scale * math.log2(math.e), num_seqs,
            G=G, HEAD_DIM=D, BLOCK_N=cfg["BLOCK_N"], QN=qn, USE_TMA=use_tma,
            PREFETCH_PAGE=cfg.get("PREFETCH_PAGE", False), MASKED_PTR=use_tma and cfg.get("MASKED_PTR", False),
            num_warps=cfg["num_warps"], num_stages=stages, **launch_options(q.device),
        )

    launch_with_fitting_stages(launch, ("attention keys on m", q.dtype, D, G, use_tma, tuple(sorted(cfg.items()))),
                               cfg["num_stages"])
    return out


def _check_index(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, q on {device}")


# ----------------------------------------------------------------------------------------------
# fast mode: torch SDPA (not invariant)
# ----------------------------------------------------------------------------------------------


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal_offset: int | None):
    """q [n, Hq, D], k/v [L, Hkv, D] -> [n, Hq, D]; causal aligned to the end when causal_offset is set."""
    import torch.nn.functional as F

    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    n, L = q.shape[0], k.shape[0]
    if n == 1 or causal_offset is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    elif n == L:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _flash_varlen():
    """torch's flash varlen attention (``torch.nn.attention.varlen.varlen_attn``) and how it takes
    causality, or None where this torch has none. Its signature moved between releases."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def _varlen_fast(q, k, v, cu_seqlens, scale):
    flash = _flash_varlen() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
    if flash is not None and (flash[2] or q.shape[1] == k.shape[1]):
        fn, causal, has_gqa = flash
        # max_q = max_k = T: an upper bound known without reading cu_seqlens on the host, so the
        # call never synchronizes (and can be captured in a CUDA graph); extra blocks exit at once.
        T = q.shape[0]
        extra = {"enable_gqa": True} if has_gqa else {}
        return fn(q, k, v, cu_seqlens, cu_seqlens, T, T, scale=scale, **causal, **extra)
    cu = cu_seqlens.tolist()
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    if lens and all(n == lens[0] for n in lens) and lens[0] > 0:
        import torch.nn.functional as F

        B, L = len(lens), lens[0]
        qb = q[cu[0]:cu[-1]].view(B, L, *q.shape[1:]).transpose(1, 2)
        kb = k[cu[0]:cu[-1]].view(B, L, *k.shape[1:]).transpose(1, 2)
        vb = v[cu[0]:cu[-1]].view(B, L, *v.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        out = torch.empty_like(q)
        out[cu[0]:cu[-1]] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
        return out
    out = torch.empty_like(q)
    for b, n in enumerate(lens):
        if n:
            out[cu[b]:cu[b + 1]] = _sdpa(q[cu[b]:cu[b + 1]], k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]], scale, 0)
    return out


def _paged_fast(q, k_cache, v_cache, page_table, cu_seqlens_q, kv_lens, scale):
    """SDPA per sequence over its gathered pages on the CPU; None (= "use the kernel", correct for any
    layout) for decode-only batches and on CUDA (see below)."""
    if q.shape[0] == page_table.shape[0] or q.is_cuda:
        # As many queries as sequences: a decode step. torch has no paged-decode kernel (SDPA would
        # need the pages gathered into a dense copy and a length mask, which rules out its flash
        # backend), and rlperf's kernel beats SDPA flash on dense KV, so it is the fastest path
        # here too (checked without a host sync). On CUDA prefill and chunks take the kernel as well:
        # the loop below syncs the host twice a layer and gathers each sequence's pages, and the
        # engine's fast-mode 16x512 prefill step took 114-176 ms against invariant mode's 26-57 ms
        # (rlperf bench rollout, H200, 2026-11-29, same runs).
        return None
    cu = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    B = len(lens)
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        if cu[b + 1] == cu[b]:
            continue
        L = lens[b]
        pages = page_table[b, : -(-L // page)].long()
        kb = k_cache[pages].flatten(0, 1)[:L]
        vb = v_cache[pages].flatten(0, 1)[:L]
        out[cu[b]:cu[b + 1]] = _sdpa(q[cu[b]:cu[b + 1]], kb, vb, scale, 0)
    return out


# ----------------------------------------------------------------------------------------------
# autograd: the invariant forward, the fixed-order backward
# ----------------------------------------------------------------------------------------------


class _VarlenAttention(torch.autograd.Function):
    """:func:`varlen_attention` through the kernel, saving ``q, k, v``, the output and its base-2
    log-sum-exp; the backward is ``kernels/attention_backward.py``'s Triton kernels (fixed reduction
    order, no atomics: the same gradient bits on every run)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        out, lse = attention_forward(q, k, v, cu_seqlens, None, None, scale, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens, ctx.scale = cu_seqlens, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = attention_backward(q, k, v, out, lse, grad_out, ctx.cu_seqlens, ctx.scale,
                                        need_dq=need_q, need_dkdv=need_k or need_v)
        return dq, dk if need_k else None, dv if need_v else None, None, None


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal prefill over packed sequences without a cache (the training forward).

    Parameters
    ----------
    q : [T, Hq, D] bf16/fp16 (fp32 accepted; on the GPU its dots run in tf32)
    k, v : [T, Hkv, D], same dtype; ``Hq % Hkv == 0``
    cu_seqlens : [B+1] int32 offsets of the sequences in the packed token axis
    scale : softmax scale, default ``D**-0.5``

    Returns ``[T, Hq, D]`` in q's dtype. Bit-identical to :func:`paged_attention` on the same tokens.
    Differentiable in q, k, v: the Triton backward of ``kernels/attention_backward.py`` (fixed
    reduction order, no atomics: two runs give the same gradient bits), gradients in q's dtype. Fast
    mode recomputes its stock path (flash varlen or SDPA) and differentiates that; the reference
    backend's float64 code is differentiated by autograd as it is.
    """
    how = route("varlen_attention", q.device, (q, k, v))
    if how == "autograd" and mode() == "fast":
        return with_recompute_backward(lambda q, k, v: varlen_attention(q, k, v, cu_seqlens, scale),
                                       lambda q, k, v: _varlen_fast(q, k, v, cu_seqlens, scale), q, k, v, upcast=False)
    if how == "stock":
        return _varlen_fast(q, k, v, cu_seqlens, scale)
    _check_index("cu_seqlens", cu_seqlens, q.device)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens, q {q.shape[0]}")
    if how == "autograd":
        return _VarlenAttention.apply(q, k, v, cu_seqlens, scale)
    if how != "reference":
        return attention_forward(q, k, v, cu_seqlens, None, None, scale)
    return _ref.attention_ref(q, k, v, cu_seqlens, cu_seqlens, scale).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of new queries against a paged KV cache (decode, chunked or full prefill).

    Parameters
    ----------
    q : [T, Hq, D]; sequence b owns ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` (``n_b`` queries), which are
        the LAST ``n_b`` of its ``kv_lens[b]`` tokens (their K/V already written with :func:`write_kv_cache`)
    k_cache, v_cache : [num_pages, PAGE_SIZE, Hkv, D], q's dtype
    page_table : [B, max_pages] int32; token p of sequence b is in page ``page_table[b, p // PAGE_SIZE]``
    cu_seqlens_q : [B+1] int32;  kv_lens : [B] int32 with ``kv_lens[b] >= n_b``
    scale : softmax scale, default ``D**-0.5``

    Returns ``[T, Hq, D]`` in q's dtype; row (b, position, head) has the same bits whatever the mode
    (decode, chunk, full prefill) and whatever else is in the batch.
    """
    how = route("paged_attention", q.device)
    if how == "stock":
        out = _paged_fast(q, k_cache, v_cache, page_table, cu_seqlens_q, kv_lens, scale)
        if out is not None:
            return out
        how = route("paged_attention", q.device, stock_ok=False)
    for name, x in (("page_table", page_table), ("cu_seqlens_q", cu_seqlens_q), ("kv_lens", kv_lens)):
        _check_index(name, x, q.device)
    if k_cache.dim() != 4 or kv_lens.numel() != cu_seqlens_q.numel() - 1 or page_table.shape[0] != kv_lens.numel():
        raise ValueError(
            f"expected k_cache [pages, page, Hkv, D], page_table [B, max_pages], cu_seqlens_q [B+1], kv_lens [B]; got "
            f"{tuple(k_cache.shape)}, {tuple(page_table.shape)}, {tuple(cu_seqlens_q.shape)}, {tuple(kv_lens.shape)}"
        )
    if how != "reference":
        if page_table.stride(1) != 1:
            page_table = page_table.contiguous()
        # decode-only (T == B: every sequence has one query) takes the decode tile: same bits (above)
        decode = q.shape[0] == cu_seqlens_q.numel() - 1
        config = _decode_config(q.shape[0] * k_cache.shape[-2], q.device, q.dtype) if decode else None  # B x Hkv programs
        return attention_forward(q, k_cache, v_cache, cu_seqlens_q, kv_lens, page_table, scale, config=config)
    return _ref.paged_attention_ref(q, k_cache, v_cache, page_table, cu_seqlens_q, kv_lens, scale).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# KV cache write
# ----------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    K, V, KC, VC, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
):
    """Program t copies token t's K and V (all KV heads) into its cache slot; slot < 0 means skip."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    if slot >= 0:
        page = slot // PAGE
        off = slot % PAGE
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, HEAD_DIM)[None, :]
        mask = offs_h < H
        t64 = t.to(tl.int64)
        k = tl.load(K + t64 * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
        v = tl.load(V + t64 * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
        tl.store(KC + page * stride_kcp + off * stride_kct + offs_h * stride_kch + offs_d, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + page * stride_vcp + off * stride_vct + offs_h * stride_vch + offs_d, v.to(VC.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new tokens' K/V into the paged cache, in place.

    ``k, v [T, Hkv, D]``; ``k_cache, v_cache [num_pages, page_size, Hkv, D]``; ``slot_mapping [T]``
    int64 with ``slot = page_index * page_size + offset``; a negative slot skips its token (padding).
    """
    T = k.shape[0]
    if k.shape != v.shape or k_cache.shape != v_cache.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"shapes: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if slot_mapping.shape != (T,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [T] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if T == 0:
        return
    D = k.shape[2]
    if (route("write_kv_cache", k.device) in ("stock", "reference") or D & (D - 1)
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        # a copy has no bits to keep invariant; the torch path is exact too (but syncs the host for
        # the negative-slot filter, so on CUDA fast mode keeps the kernel)
        _ref.write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    H = k.shape[1]
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=H, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(H), PAGE=k_cache.shape[1],
        num_warps=4, **launch_options(k.device),
    )
