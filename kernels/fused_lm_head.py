"""Fused lm-head + log-prob (+ entropy) from hidden states, without [N, V] float32 logits: the op
``rlperf.kernels.fused_logprob``, and its launchers for tuning (:func:`fused_logprob_forward`,
:func:`fused_logprob_backward`).

Formula (hidden [N, H], weight [V, H] = the lm head, targets [N], temperature T > 0)::

    z[i, j]   = (hidden[i] . weight[j]) * float32(1 / T)      # float32 accumulate
    lse[i]    = log sum_j exp(z[i, j])
    logp[i]   = z[i, targets[i]] - lse[i]
    entropy[i]= lse[i] - sum_j p[i, j] z[i, j],   p = exp(z - lse)

Backward (autograd, also through the entropy), with upstream grads ``g`` (of logp) and ``q`` (of
entropy) per row::

    dz[i, j]  = g[i] * (1[j == targets[i]] - p[i, j]) - q[i] * p[i, j] * (z[i, j] - lse[i] + entropy[i])
    d hidden  = (dz / T) @ weight          d weight = (dz / T)^T @ hidden

Forward kernel: the vocabulary is cut into fixed splits of ``SPLIT_TILES * BLOCK_N`` columns; one
program owns ``BLOCK_M`` tokens x one split. For each ``BLOCK_N`` vocabulary tile of its split, in
increasing order, it computes the logit tile with a full K loop over H (``tl.dot``, float32
accumulator; never stored) and folds it into running (max, sum-exp, entropy-sum) per token, in raw
logit units, with :func:`rlperf.kernels.logprob.online_lse_update` — the same update, chunk by
chunk, that ``token_logprobs`` documents (one FMA + ex2 per logit). A second small kernel merges the
splits of a token in split order. Memory: [n_splits, N] float32 partials, nothing of size [N, V].

Batch invariance: the tile config (``BLOCK_M/N/K``, warps, stages, split width) is one constant
per dtype, never a function of N; a token's logits depend only on its own hidden row (rows of a
tile never mix; rows past N are clamped duplicates, never stored); the tile order and the split
merge order are fixed. So a token's log-prob bits are the same alone, in any batch, in any row.
N (and what derives from it) is never specialized either (``do_not_specialize``): one compiled
kernel serves every batch, so a training run whose micro-batches have new token counts compiles
nothing after its first step.

Train/rollout log-probs: this function is the one log-prob path of both sides. The trainer calls it
on the hidden rows that predict response tokens (``rlperf/train/batching.py``); the rollout engine
calls it on the final hidden row of each sampled token, one call per temperature group, and draws
the token itself from the logits (``rlperf/rollout/engine.py``). Same kernel, same config, same
tile and split order, and a row's bits do not depend on the other rows of the launch: a token's
rollout and training log-probs are equal bit for bit whenever its hidden rows are
(``--true-on-policy-mode``), and neither side materialises [N, V] float32 logits for them.

Backward: the vocabulary is walked in chunks of ``BWD_CHUNK_COLUMNS`` columns (a constant, never a
function of N); per chunk a Triton kernel recomputes the logit tiles (same config as the forward)
and writes ``dz / T`` in the input dtype, then two batch-invariant Triton matmuls give that chunk's
rows of d weight (:func:`rlperf.kernels.gemm.weight_grad`: the sum over the N rows in a fixed
order) and add its term to a float32 d hidden (:func:`rlperf.kernels.gemm.input_grad`: a row
depends on its own dz row only). Deterministic run to run (fixed chunk order, no atomics), and
rows appended with zero upstream gradient (a micro-batch padded to a CUDA-graph bucket) change no
bit of either gradient.

Tensor parallel (``tp_group``): each rank holds a contiguous V/tp slice of the vocabulary (rank r's
slice follows ranks 0..r-1; sizes may differ) and the same hidden and (global) targets. The local
(max, sum-exp, entropy-sum, target logit) are combined with all-reduces (MAX, then SUM of the
rescaled terms); every rank returns the full-vocabulary logp / entropy. Backward returns each
rank's d weight slice and the full d hidden (all-reduced over the group).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import route
from .gemm import input_grad, weight_grad
from .logprob import LOG2E, _check_temperature, online_lse_update
from .pipeline import grid_dependency_sync, launch_options
from .sampling import row_keys, uniform
from .reference import fused_logprob as _ref
from .tile_dot import INTERPRETED, dot_acc

BWD_CHUNK_COLUMNS = 16384  # vocabulary columns of dlogits per backward chunk: [N, 16384] in the input dtype


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """One tile config per dtype (batch invariance: never a function of N)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_TILES: int  # vocabulary tiles per forward split
    num_warps: int
    num_stages: int
    flatten: bool = False  # software-pipeline across the vocabulary tiles of a split (tl.range flatten)
    tma: bool = False      # TMA tensor descriptors for the tiles (when rows are 16-byte aligned)


# Why this tile (bf16/fp16; NVIDIA H200, Triton 3.6, N=8192 H=2560 V=151936, sweeps in bench/logprob.py):
# * 128x256 tiles with 8 warps (two wgmma warpgroups) reuse each loaded tile most: 128x128 ran
#   13.9 ms, 128x256 10.9 ms; TMA descriptors took it to 9.96 ms and the flattened vocab-tile loop
#   (next tile's loads overlap this tile's online-softmax epilogue) to 9.83-10.0 ms, against 9.24 ms
#   for the cuBLAS lm-head matmul alone (1.06-1.08x). BLOCK_K 128 (2 stages) fell to 13.6 ms; 16
#   warps to ~11-12 ms. Split width (8/16/32 tiles) moved the time by under 1%.
# * Split width 5 tiles (1,280 columns), for decode: the rollout engine calls this kernel on one
#   token tile per step, where the split count alone sets how many programs stream the lm head. The
#   151,936-word vocabulary in splits of 16 tiles made 38 programs (29% of an H200's 132 SMs); 5 tiles
#   make 119, one wave. Engine decode step, qwen3-0.6b shape, CUDA graphs (H200, `fusion_ab` variants
#   `logprob split 5/8` against 16, one call): B = 1 / 16 / 64 / 256 took 0.95x / 0.95x / 0.97x / 0.99x
#   the time with 5 tiles, 0.96x / 0.96x / 0.97x / 1.00x with 8.
# * Bits: a token's log-prob depends on (BLOCK_N, split width, warps) — they set the online
#   reduction's chunking and tl.max/tl.sum trees; stages, flatten and TMA did not change them.
#   Whatever the config, it is one constant per dtype, never a function of N.
_CONFIGS = {
    torch.bfloat16: FusedConfig(128, 256, 64, 5, 8, 3, flatten=True, tma=True),
    torch.float16: FusedConfig(128, 256, 64, 5, 8, 3, flatten=True, tma=True),
    torch.float32: FusedConfig(64, 64, 32, 32, 4, 2),
}

try:  # host-side TMA descriptors: Triton >= 3.4 (the device has 3.6, CI 3.9)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


def fused_config(dtype: torch.dtype) -> FusedConfig:
    if dtype not in _CONFIGS:
        raise TypeError(f"fused_logprob: dtype {dtype} not supported; expected one of {list(_CONFIGS)}")
    return _CONFIGS[dtype]


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _logits_tile(h_src, w_src, off_m, off_n, rows, cols, H, stride_h, stride_w,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32 = hidden[off_m:] @ weight[off_n:]^T, K loop over H in order.

    Pointer path: ``rows`` / ``cols`` are clamped in range (duplicates past the end are never
    stored), so only the K tail needs a mask. TMA path (``h_src``/``w_src`` are descriptors):
    out-of-range rows, columns and K arrive as zeros.
    """
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if USE_TMA:
        for k in range(0, H, BLOCK_K):
            a = h_src.load([off_m, k])
            b = w_src.load([off_n, k])
            acc = dot_acc(a, b.T, acc, PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = h_src + rows.to(tl.int64)[:, None] * stride_h + offs_k[None, :]
        w_ptrs = w_src + cols.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
        for k in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(h_ptrs)
                b = tl.load(w_ptrs)
            else:
                a = tl.load(h_ptrs, mask=(k + offs_k)[None, :] < H, other=0.0)
                b = tl.load(w_ptrs, mask=(k + offs_k)[:, None] < H, other=0.0)
            acc = dot_acc(a, b, acc, PRECISION)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    return acc


@triton.jit
def _raw_logits(h_src, w_src, off_m, n0, rows, V, H, stride_h, stride_w,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """(x [BLOCK_M, BLOCK_N] float32, offs_n [BLOCK_N]): the raw logits of vocabulary tile ``n0``
    (:func:`_logits_tile`), columns past V at -inf (one add per element: cheaper than a select), and the
    tile's column indices. The one tile the forward kernels fold."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    cols = tl.minimum(offs_n, V - 1)
    acc = _logits_tile(h_src, w_src, off_m, n0, rows, cols, H, stride_h, stride_w,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, USE_TMA)
    return acc + tl.where(offs_n < V, 0.0, float("-inf"))[None, :], offs_n


@triton.jit
def _split_program(N, V, num_m_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr):
    """This program's (token tile, vocabulary split) of a partials launch: ``(pid_m, pid_s, offs_m, rows,
    v_begin, v_end)``, rows clamped to N - 1 (the rows past N are computed, never stored) and the split's
    columns [v_begin, v_end) of the V. Token tiles run fastest: the programs of a wave share a vocabulary
    split, so its weight tiles are read from HBM about once per wave and served to the other token tiles
    from L2."""
    pid = tl.program_id(0)
    pid_m = pid % num_m_tiles
    pid_s = pid // num_m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, N - 1)
    v_begin = pid_s * (SPLIT_TILES * BLOCK_N)
    v_end = tl.minimum(v_begin + SPLIT_TILES * BLOCK_N, V)
    return pid_m, pid_s, offs_m, rows, v_begin, v_end


@triton.jit
def _fresh_stats(BLOCK_M: tl.constexpr):
    """Each row's running (max, sum-exp, entropy-sum, target logit) before its first tile: (-inf, 0, 0, 0)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    t = tl.zeros([BLOCK_M], tl.float32)
    tz = tl.zeros([BLOCK_M], tl.float32)
    return m, s, t, tz


@triton.jit
def _fold_tile(m, s, t, tz, x, offs_n, tgt, c, WITH_ENTROPY: tl.constexpr):
    """Fold logit tile ``x`` [BLOCK_M, BLOCK_N] (columns ``offs_n``, past V at -inf) into the running (max,
    sum-exp, entropy-sum) and target logit of each row: the online update, and the target's column."""
    # at most one column of one tile matches: a sum of zeros and that logit, exact
    tz += tl.sum(tl.where(offs_n[None, :] == tgt[:, None], x, 0.0), axis=1)
    m, s, t = online_lse_update(m, s, t, x, c, WITH_ENTROPY)
    return m, s, t, tz


@triton.jit
def _store_partials(pm_ptr, ps_ptr, pt_ptr, pz_ptr, m, s, t, tz, pid_s, offs_m, N):
    """A program's split partials, [n_splits, N] each, at (split, token); rows past N are not stored."""
    out = pid_s * N + offs_m
    keep = offs_m < N
    tl.store(pm_ptr + out, m, mask=keep)
    tl.store(ps_ptr + out, s, mask=keep)
    tl.store(pt_ptr + out, t, mask=keep)
    tl.store(pz_ptr + out, tz, mask=keep)


@triton.jit(do_not_specialize=["N", "num_m_tiles"])
def _fwd_partials_kernel(
    h_src, w_src, tgt_ptr, pm_ptr, ps_ptr, pt_ptr, pz_ptr,
    N, V, H, stride_h, stride_w, v_offset, c, num_m_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_TILES: tl.constexpr,
    EVEN_K: tl.constexpr, WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, FLATTEN: tl.constexpr,
):
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    pid_m, pid_s, offs_m, rows, v_begin, v_end = _split_program(N, V, num_m_tiles, BLOCK_M, BLOCK_N, SPLIT_TILES)
    tgt = tl.load(tgt_ptr + rows) - v_offset  # local vocabulary index
    tgt = tl.where((tgt >= 0) & (tgt < V), tgt, -1)  # not in this slice: matches no column
    m, s, t, tz = _fresh_stats(BLOCK_M)
    for n0 in tl.range(v_begin, v_end, BLOCK_N, flatten=FLATTEN):
        x, offs_n = _raw_logits(h_src, w_src, pid_m * BLOCK_M, n0, rows, V, H, stride_h, stride_w,
                                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, USE_TMA)
        m, s, t, tz = _fold_tile(m, s, t, tz, x, offs_n, tgt, c, WITH_ENTROPY)
    _store_partials(pm_ptr, ps_ptr, pt_ptr, pz_ptr, m, s, t, tz, pid_s, offs_m, N)


@triton.jit(do_not_specialize=["N", "num_m_tiles"])
def _fwd_partials_of_logits_kernel(
    logits, logits_ptr, pm_ptr, ps_ptr, pt_ptr,
    N, V, stride_l, c, zero, num_m_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr, OPERAND: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """:func:`_fwd_partials_kernel`'s splits, tiles and online update (no entropy) over logits already in
    memory (``logits_ptr`` [N, V] float32, the lm-head product's): each tile is loaded instead of computed.

    * **Layout.** A loaded tile passes through a tensor-core product of zeros into it as the accumulator
      (``x + 0 @ 0``, exact: it changes no value but a -0.0 into +0.0, which the -inf mask's ``+ 0.0``
      does to every column anyway). The result sits in the partials kernel's accumulator layout: the same
      BLOCK_N-wide wgmma instruction, warps stacked along the rows only. So the max and sum over a row run
      over the same registers and lanes in the same order: the same bits. Which rows share a program
      (BLOCK_M) moves no bit, since rows never meet in a reduction; ``zero`` is a run-time 0.0, so the
      compiler cannot drop the product.
    * **Loads.** ``USE_TMA``: ``logits`` is a tensor descriptor of [BLOCK_M, BLOCK_N] boxes, which lands a
      tile in shared memory and from there straight in the accumulator layout (rows past N and columns past
      V arrive as zeros). Otherwise ``logits`` is ``logits_ptr`` and the tile loads by masked pointers.
    * **No target.** The partials kernel also sums ``where(column == target, x, 0)`` over each tile: zeros
      and, in the target's split, its logit, i.e. exactly that logit ``+ 0.0``. Here the split merge reads
      that logit from the logits instead (``_fwd_combine_kernel``'s GATHER_TARGET), so these partials do not
      depend on the targets and can be computed before the tokens are drawn.

    Rows past N are never stored."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    pid_m, pid_s, offs_m, rows, v_begin, v_end = _split_program(N, V, num_m_tiles, BLOCK_M, BLOCK_N, SPLIT_TILES)
    m, s, t, _ = _fresh_stats(BLOCK_M)
    za = (tl.zeros([BLOCK_M, 16], tl.float32) + zero).to(OPERAND)
    zb = (tl.zeros([16, BLOCK_N], tl.float32) + zero).to(OPERAND)
    row_ptrs = logits_ptr + rows.to(tl.int64) * stride_l
    for n0 in tl.range(v_begin, v_end, BLOCK_N, num_stages=2):
        if USE_TMA:
            x = logits.load([pid_m * BLOCK_M, n0])
        else:
            offs_n = n0 + tl.arange(0, BLOCK_N)
            x = tl.load(row_ptrs[:, None] + offs_n[None, :], mask=(offs_m < N)[:, None] & (offs_n < V)[None, :],
                        other=0.0)
        x = dot_acc(za, zb, x)
        if n0 + BLOCK_N > V:  # only the vocabulary's last tile has columns past V: _raw_logits' mask
            x = x + tl.where(n0 + tl.arange(0, BLOCK_N) < V, 0.0, float("-inf"))[None, :]
        m, s, t = online_lse_update(m, s, t, x, c, False)
    out = pid_s * N + offs_m
    keep = offs_m < N
    tl.store(pm_ptr + out, m, mask=keep)
    tl.store(ps_ptr + out, s, mask=keep)
    tl.store(pt_ptr + out, t, mask=keep)


@triton.jit
def _merge_split(m, s, t, pm_ptr, ps_ptr, pt_ptr, at, keep, c, WITH_ENTROPY: tl.constexpr):
    """Fold one split's (max, sum-exp, entropy-sum) partials at offsets ``at`` into the running (m, s, t)
    of each token (raw units, as the online update); lanes not ``keep`` read a harmless (m, s) = (0, 1)
    and are never stored."""
    pm = tl.load(pm_ptr + at, mask=keep, other=0.0)
    ps = tl.load(ps_ptr + at, mask=keep, other=1.0)
    m_new = tl.maximum(m, pm)
    r = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2((m - r) * c)
    b = tl.exp2((pm - r) * c)
    if WITH_ENTROPY:
        pt = tl.load(pt_ptr + at, mask=keep, other=0.0)
        da = tl.where(m == float("-inf"), 0.0, m - r)
        db = tl.where(pm == float("-inf"), 0.0, pm - r)
        t = a * (t + da * s) + b * (pt + db * ps)
    s = a * s + b * ps
    return m_new, s, t


@triton.jit(do_not_specialize=["N"])
def _fwd_combine_kernel(
    pm_ptr, ps_ptr, pt_ptr, pz_ptr, tgt_ptr, logits_ptr, o0_ptr, o1_ptr, o2_ptr, o3_ptr,
    N, num_splits, v_total, stride_l, inv_t, c,
    BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr, FINAL: tl.constexpr, GATHER_TARGET: tl.constexpr = False,
):
    """Merge the splits of each token in split order (raw units, as the online update).

    FINAL: (logp, entropy, lse) into o0..o2 (lse in temperature-scaled units, for backward).
    Else the local raw (m, s, t, target logit) into o0..o3, for the tensor-parallel all-reduce.
    GATHER_TARGET (FINAL only): the target logit is read from ``logits_ptr`` [N, V] (row stride ``stride_l``)
    instead of summed from the splits' ``pz``. The same value: the splits hold +0.0 but the target's, which
    holds its logit + 0.0, so their sum in split order is that logit + 0.0.
    """
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < N
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    tz = tl.zeros([BLOCK], tl.float32)
    for sp in tl.range(0, num_splits, num_stages=_COMBINE_STAGES):
        m, s, t = _merge_split(m, s, t, pm_ptr, ps_ptr, pt_ptr, sp * N + offs, keep, c, WITH_ENTROPY)
        if not GATHER_TARGET:
            tz += tl.load(pz_ptr + sp * N + offs, mask=keep, other=0.0)
    if FINAL:
        tgt = tl.load(tgt_ptr + offs, mask=keep, other=0)
        log_s = tl.log(s)
        valid = (tgt >= 0) & (tgt < v_total)
        if GATHER_TARGET:
            row = offs.to(tl.int64) * stride_l
            tz = tl.where(valid, tl.load(logits_ptr + row + tgt, mask=keep & valid, other=0.0) + 0.0, 0.0)
        tl.store(o0_ptr + offs, tl.where(valid, (tz - m) * inv_t - log_s, float("nan")), mask=keep)
        if WITH_ENTROPY:
            tl.store(o1_ptr + offs, log_s - (t / s) * inv_t, mask=keep)
        tl.store(o2_ptr + offs, m * inv_t + log_s, mask=keep)
    else:
        tl.store(o0_ptr + offs, m, mask=keep)
        tl.store(o1_ptr + offs, s, mask=keep)
        tl.store(o2_ptr + offs, t, mask=keep)
        tl.store(o3_ptr + offs, tz, mask=keep)


_NO_COLUMN = tl.constexpr(2147483647)  # int32 max: "no column yet" in the sampling partials (every key -inf)


@triton.jit
def _better_draw(key_a, col_a, x_a, key_b, col_b, x_b):
    """The draw of two candidates (key, column, logit): the larger key, the lower column on equal keys
    (:func:`rlperf.kernels.sample`'s rule), with its logit."""
    b = (key_b > key_a) | ((key_b == key_a) & (col_b < col_a))
    return tl.where(b, key_b, key_a), tl.where(b, col_b, col_a), tl.where(b, x_b, x_a)


@triton.jit
def _tile_draw(k, cols, x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(key, column, logit) of each row's draw in a [BLOCK_M, BLOCK_N] tile of keys ``k`` over columns ``cols``
    [BLOCK_N] (increasing) with logits ``x``: :func:`_better_draw` over the row. On the GPU one ``tl.reduce``
    with it. Triton's interpreter runs a reduction with a combine function one element at a time in Python
    (seconds a tile), so there the same draw comes from built-in reductions, as its reduction gives it, left
    to right: the largest non-NaN key and its lowest column, or the first column when its key is NaN (no key
    beats a NaN accumulator). Without NaN keys the draw is unique, whatever order the GPU's tree takes."""
    if INTERPRETED:
        first = cols[None, :] == tl.min(cols, 0)
        first_key = tl.sum(tl.where(first, k, 0.0), 1)
        first_nan = first_key != first_key
        clean = tl.where(k != k, float("-inf"), k)
        kmax = tl.max(clean, 1)
        kcol = tl.min(tl.where(clean == kmax[:, None], cols[None, :], _NO_COLUMN), 1)
        kx = tl.sum(tl.where(cols[None, :] == kcol[:, None], x, 0.0), 1)
        kmax = tl.where(first_nan, first_key, kmax)
        kcol = tl.where(first_nan, tl.min(cols, 0), kcol)
        kx = tl.where(first_nan, tl.sum(tl.where(first, x, 0.0), 1), kx)
    else:
        kmax, kcol, kx = tl.reduce((k, tl.broadcast_to(cols[None, :], (BLOCK_M, BLOCK_N)), x), 1, _better_draw)
    return kmax, kcol, kx


@triton.jit(do_not_specialize=["N", "num_m_tiles"])
def _sample_partials_kernel(
    h_src, w_src, temp_ptr, seed_ptr, pos_ptr, pm_ptr, ps_ptr, pk_ptr, pi_ptr, px_ptr,
    N, V, H, stride_h, stride_w, c, num_m_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_TILES: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, FLATTEN: tl.constexpr,
):
    """:func:`_fwd_partials_kernel`'s programs (the same tiles, splits and online update, so the same
    (max, sum-exp) partials) without a target: in each logit tile a token's Gumbel-max draw
    (:func:`rlperf.kernels.sample`'s keys: ``x`` when its temperature is 0, else ``x / T + g(seed,
    position, column)``) is kept as (best key, its lowest column, that column's raw logit) per split."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    pid_m, pid_s, offs_m, rows, v_begin, v_end = _split_program(N, V, num_m_tiles, BLOCK_M, BLOCK_N, SPLIT_TILES)
    temp = tl.load(temp_ptr + rows)
    greedy = temp == 0.0
    inv_temp = 1.0 / tl.where(greedy, 1.0, temp)
    key, key2 = row_keys(tl.load(seed_ptr + rows), tl.load(pos_ptr + rows))
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    t = tl.zeros([BLOCK_M], tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_M], _NO_COLUMN, tl.int32)
    best_x = tl.zeros([BLOCK_M], tl.float32)
    for n0 in tl.range(v_begin, v_end, BLOCK_N, flatten=FLATTEN):
        x, offs_n = _raw_logits(h_src, w_src, pid_m * BLOCK_M, n0, rows, V, H, stride_h, stride_w,
                                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, USE_TMA)
        m, s, t = online_lse_update(m, s, t, x, c, False)
        g = -tl.log(-tl.log(uniform(offs_n[None, :], key[:, None], key2[:, None])))
        k = tl.where(greedy[:, None], x, x * inv_temp[:, None] + g)
        k = tl.where((offs_n < V)[None, :], k, float("-inf"))
        # one reduction over (key, column, logit): a max of the keys, then a min over the columns holding
        # it, would keep the key tile live for a second pass (register spills)
        kmax, kcol, kx = _tile_draw(k, offs_n, x, BLOCK_M, BLOCK_N)
        better = (kmax > best) | ((kmax == best) & (best_i == _NO_COLUMN))  # strict: earlier tiles win ties
        best = tl.where(better, kmax, best)
        best_i = tl.where(better, kcol, best_i)
        best_x = tl.where(better, kx, best_x)
    out = pid_s * N + offs_m
    keep = offs_m < N
    tl.store(pm_ptr + out, m, mask=keep)
    tl.store(ps_ptr + out, s, mask=keep)
    tl.store(pk_ptr + out, best, mask=keep)
    tl.store(pi_ptr + out, best_i, mask=keep)
    tl.store(px_ptr + out, best_x, mask=keep)


@triton.jit(do_not_specialize=["N"])
def _sample_combine_kernel(pm_ptr, ps_ptr, pk_ptr, pi_ptr, px_ptr, tok_ptr, lp_ptr, N, num_splits, inv_t, c,
                           BLOCK: tl.constexpr):
    """Per token, in split order: (max, sum-exp) merged as :func:`_fwd_combine_kernel` merges them, and the
    draw = the split with the largest key (the earliest on ties: splits hold increasing columns, so the
    lowest column wins, as :func:`rlperf.kernels.sample`'s combine); its log-prob is
    ``(logit - m) * inv_t - log(s)``, :func:`_fwd_combine_kernel`'s formula with the drawn column's logit
    as the target's."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < N
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    tok = tl.full([BLOCK], _NO_COLUMN, tl.int32)
    tz = tl.zeros([BLOCK], tl.float32)
    for sp in range(0, num_splits):
        m, s, t = _merge_split(m, s, t, pm_ptr, ps_ptr, ps_ptr, sp * N + offs, keep, c, False)
        pk = tl.load(pk_ptr + sp * N + offs, mask=keep, other=float("-inf"))
        better = (pk > best) | ((pk == best) & (tok == _NO_COLUMN))
        best = tl.where(better, pk, best)
        tok = tl.where(better, tl.load(pi_ptr + sp * N + offs, mask=keep, other=_NO_COLUMN), tok)
        tz = tl.where(better, tl.load(px_ptr + sp * N + offs, mask=keep, other=0.0), tz)
    # every key -inf (only a row of NaN or -inf logits): the lowest column, as one chunked pass would give
    tok = tl.where(tok == _NO_COLUMN, 0, tok)
    tl.store(tok_ptr + offs, tok.to(tl.int64), mask=keep)
    tl.store(lp_ptr + offs, (tz - m) * inv_t - tl.log(s), mask=keep)


@triton.jit(do_not_specialize=["N", "v_begin", "v_end", "num_m_tiles"])
def _bwd_dlogits_kernel(
    h_src, w_src, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dl_ptr,
    N, V, H, stride_h, stride_w, stride_dl, v_begin, v_end, v_offset, inv_t, c, num_m_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dlogits[:, v_begin:v_end] = dz / T (module docstring), in the input dtype."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    pid = tl.program_id(0)
    pid_m = pid % num_m_tiles
    pid_n = pid // num_m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = v_begin + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, N - 1)
    cols = tl.minimum(offs_n, V - 1)
    acc = _logits_tile(h_src, w_src, pid_m * BLOCK_M, v_begin + pid_n * BLOCK_N, rows, cols, H, stride_h, stride_w,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, USE_TMA)
    lse = tl.load(lse_ptr + rows)
    g = tl.load(glp_ptr + rows)
    tgt = tl.load(tgt_ptr + rows) - v_offset
    p = tl.exp2(acc * c - (lse * 1.4426950408889634)[:, None])  # exp(z - lse), one FMA + ex2
    coef = g[:, None]
    if WITH_ENTROPY:
        q = tl.load(gent_ptr + rows)
        ent = tl.load(ent_ptr + rows)
        coef = coef + q[:, None] * (acc * inv_t + (ent - lse)[:, None])
    dz = tl.where(offs_n[None, :] == tgt[:, None], g[:, None], 0.0) - p * coef
    dst = dl_ptr + offs_m.to(tl.int64)[:, None] * stride_dl + (offs_n - v_begin)[None, :]
    keep = (offs_m[:, None] < N) & (offs_n[None, :] < v_end)
    tl.store(dst, (dz * inv_t).to(dl_ptr.dtype.element_ty), mask=keep)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

_COMBINE_BLOCK = 128
# Splits whose partials load ahead of the sequential merge (cp.async stages of its loop). The merge is a chain
# of dependent updates per token; without the stages each split's loads waited for the update before it
# (about 28 us for the 119 splits of Qwen3's vocabulary at decode batches, H200).
_COMBINE_STAGES = tl.constexpr(16)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is unused for 16-bit inputs


def _sources(hidden, weight, cfg):
    """(h_src, w_src, use_tma): TMA descriptors when the config asks and rows are 16-byte aligned
    (a function of dtype and H only, never of N), else the tensors themselves."""
    es = hidden.element_size()
    use_tma = (cfg.tma and TensorDescriptor is not None and (hidden.shape[1] * es) % 16 == 0
               and (not hidden.is_cuda or torch.cuda.get_device_capability(hidden.device)[0] >= 9))
    if not use_tma:
        return hidden, weight, False

    def ready(t):
        if (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0:
            return t
        return t.clone(memory_format=torch.contiguous_format)

    return (TensorDescriptor.from_tensor(ready(hidden), [cfg.BLOCK_M, cfg.BLOCK_K]),
            TensorDescriptor.from_tensor(ready(weight), [cfg.BLOCK_N, cfg.BLOCK_K]), True)


def _local_stats(hidden, weight, targets, inv_t, v_offset, v_total, with_entropy, final, cfg=None):
    """Run the forward kernels. final: (logp, entropy, lse); else local (m, s, t, tz)."""
    cfg = cfg or fused_config(hidden.dtype)
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    num_m = triton.cdiv(N, cfg.BLOCK_M)
    num_splits = triton.cdiv(V, cfg.SPLIT_TILES * cfg.BLOCK_N)
    parts = torch.empty((4, num_splits, N), dtype=torch.float32, device=dev)
    h_src, w_src, use_tma = _sources(hidden, weight, cfg)
    _fwd_partials_kernel[(num_m * num_splits,)](
        h_src, w_src, targets, parts[0], parts[1], parts[2], parts[3],
        N, V, H, hidden.stride(0), weight.stride(0), v_offset, inv_t * LOG2E, num_m,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_TILES=cfg.SPLIT_TILES,
        EVEN_K=H % cfg.BLOCK_K == 0, WITH_ENTROPY=with_entropy, PRECISION=_precision(hidden.dtype),
        USE_TMA=use_tma, FLATTEN=cfg.flatten, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(dev),
    )
    outs = _merge_splits(parts, targets, v_total, inv_t, with_entropy, final)
    return outs[0], outs[1], outs[2], outs[3]


def _merge_splits(parts: torch.Tensor, targets: torch.Tensor, v_total: int, inv_t: float, with_entropy: bool,
                  final: bool, logits: torch.Tensor | None = None) -> torch.Tensor:
    """The split partials ``parts`` [4, n_splits, N] (max, sum-exp, entropy-sum, target logit) merged per
    token in split order (:func:`_fwd_combine_kernel`): [4, N] float32, rows (logp, entropy, lse, -) when
    ``final``, else the local (m, s, t, tz). ``logits`` [N, V] (``final`` only): the target logits are read
    from them, not from ``parts[3]`` (the same values: the kernel's GATHER_TARGET)."""
    _, num_splits, N = parts.shape
    outs = torch.empty((4, N), dtype=torch.float32, device=parts.device)
    _fwd_combine_kernel[(triton.cdiv(N, _COMBINE_BLOCK),)](
        parts[0], parts[1], parts[2], parts[3], targets, parts[3] if logits is None else logits,
        outs[0], outs[1], outs[2], outs[3],
        N, num_splits, v_total, 0 if logits is None else logits.stride(0), inv_t, inv_t * LOG2E,
        BLOCK=_COMBINE_BLOCK, WITH_ENTROPY=with_entropy, FINAL=final, GATHER_TARGET=logits is not None,
        num_warps=4, **launch_options(parts.device),
    )
    return outs


_OPERAND = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Rows per program of the folding kernel: one warp per 16 rows, as in the partials kernel's accumulator
# layout (wgmma rows per warp), so its row reductions are that kernel's. 64 rows, not the partials kernel's
# 128: half the tile in registers and shared memory, and decode batches fill it.
_OF_LOGITS_BLOCK_M = 64


def logits_give_fused_logprob(weight: torch.Tensor) -> bool:
    """Whether ``fused_logprob_of_logits(linear(hidden, weight, out_dtype=torch.float32), targets, T,
    weight.dtype)`` is ``fused_logprob(hidden, weight, targets, T)`` bit for bit, for any hidden rows: a
    16-bit lm head in invariant mode on the Triton kernels. On the GPU every product is one k16 tensor-core
    chain over H, whatever the tile; under the interpreter a tile product is exact per BLOCK_K tile, so
    there the lm-head product's BLOCK_K must also be this kernel's (it is for vocabularies of 16384 words
    and more: :func:`rlperf.kernels.matmul_config`)."""
    from .dispatch import mode
    from .gemm import matmul_config

    if weight.dim() != 2 or weight.dtype not in _OPERAND or mode() != "invariant":
        return False
    how = route("fused_logprob", weight.device, stock_ok=False)
    if how == "interpreter":
        V, H = weight.shape
        return matmul_config(weight.dtype, V, H, 1).BLOCK_K == fused_config(weight.dtype).BLOCK_K
    return how == "triton"


@dataclasses.dataclass(frozen=True)
class LogitsFold:
    """The target-free half of :func:`fused_logprob_of_logits`: each row's split partials (max, sum-exp) of
    ``logits`` at ``inv_t`` = 1 / T, [4, n_splits, N] float32 in ``parts`` (rows 2 and 3 unused), for
    :func:`logprob_of_fold` to merge once the targets are known."""

    parts: torch.Tensor
    logits: torch.Tensor
    inv_t: float


def _check_logits(logits: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype not in _OPERAND:
        raise TypeError(f"{what}: dtype {dtype} must be a 16-bit lm-head dtype (bfloat16, float16)")
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"{what}: logits must be [N, V] float32, got {list(logits.shape)} {logits.dtype}")
    if route("fused_logprob", logits.device, stock_ok=False) not in ("triton", "interpreter"):
        raise RuntimeError(f"{what}: needs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on CPU)")


def _check_targets(targets: torch.Tensor, N: int, device: torch.device, what: str) -> None:
    if targets.shape != (N,) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"{what}: targets must be [{N}] integer ids, got {list(targets.shape)} {targets.dtype}")
    if targets.device != device:
        raise ValueError(f"{what}: logits on {device}, targets on {targets.device}")


def fold_logits(logits: torch.Tensor, temperature: float, dtype: torch.dtype) -> LogitsFold:
    """The first half of :func:`fused_logprob_of_logits`, which needs no targets: every split's partials of
    ``logits`` [N, V] float32 (the lm-head product of a 16-bit ``dtype`` head) at ``temperature``, one
    launch of :func:`_fwd_partials_of_logits_kernel`. A step can run it before (or beside) drawing its tokens;
    :func:`logprob_of_fold` then gives the log-probs of the drawn tokens."""
    T = _check_temperature(temperature)
    _check_logits(logits, dtype, "fold_logits")
    return _fold(logits, T, dtype)


def _fold(logits: torch.Tensor, T: float, dtype: torch.dtype) -> LogitsFold:
    """:func:`fold_logits` on checked arguments."""
    N, V = logits.shape
    cfg = fused_config(dtype)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    inv_t = 1.0 / T
    num_m = triton.cdiv(N, _OF_LOGITS_BLOCK_M)
    num_splits = triton.cdiv(V, cfg.SPLIT_TILES * cfg.BLOCK_N)
    parts = torch.empty((4, num_splits, N), dtype=torch.float32, device=x.device)
    if N == 0:
        return LogitsFold(parts, x, inv_t)
    # TMA when the rows are 16-byte aligned (V % 4 == 0, e.g. every Qwen3 vocabulary): a function of V only
    use_tma = (TensorDescriptor is not None and (x.stride(0) * 4) % 16 == 0 and x.data_ptr() % 16 == 0
               and (not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] >= 9))
    src = TensorDescriptor.from_tensor(x, [_OF_LOGITS_BLOCK_M, cfg.BLOCK_N]) if use_tma else x
    _fwd_partials_of_logits_kernel[(num_m * num_splits,)](
        src, x, parts[0], parts[1], parts[2], N, V, x.stride(0), inv_t * LOG2E, 0.0, num_m,
        BLOCK_M=_OF_LOGITS_BLOCK_M, BLOCK_N=cfg.BLOCK_N, SPLIT_TILES=cfg.SPLIT_TILES, OPERAND=_OPERAND[dtype],
        USE_TMA=use_tma, num_warps=_OF_LOGITS_BLOCK_M // 16, **launch_options(x.device),
    )
    return LogitsFold(parts, x, inv_t)


def logprob_of_fold(fold: LogitsFold, targets: torch.Tensor) -> torch.Tensor:
    """The second half of :func:`fused_logprob_of_logits`: the log-probs [N] float32 of ``targets`` [N]
    (integer ids; NaN outside [0, V)) from ``fold`` (:func:`fold_logits`), its splits merged in order and each
    target's logit read from the folded logits: one launch of :func:`_fwd_combine_kernel`."""
    _check_targets(targets, fold.logits.shape[0], fold.logits.device, "logprob_of_fold")
    return _merge_fold(fold, targets)


def _merge_fold(fold: LogitsFold, targets: torch.Tensor) -> torch.Tensor:
    """:func:`logprob_of_fold` on checked arguments."""
    N, V = fold.logits.shape
    if N == 0:
        return fold.logits.new_zeros(0)
    tgt = targets.to(torch.int64).contiguous()
    return _merge_splits(fold.parts, tgt, V, fold.inv_t, False, True, logits=fold.logits)[0].clamp_(max=0.0)


def fused_logprob_of_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                            dtype: torch.dtype) -> torch.Tensor:
    """:func:`fused_logprob`'s log-probs [N] float32 (no entropy, no autograd) from the logits the lm-head
    product already wrote, instead of a second pass over the lm head: :func:`fold_logits` then
    :func:`logprob_of_fold` (its clamp to <= 0 included, as ``fused_logprob``'s).

    ``logits`` [N, V] float32 must be ``rlperf.kernels.linear(hidden, weight, out_dtype=torch.float32)`` of a
    16-bit ``weight`` of ``dtype`` on the Triton kernels (CUDA, or the interpreter); ``targets`` [N] integer
    ids (NaN outside [0, V)). Then the result is ``fused_logprob(hidden, weight, targets, temperature)`` bit
    for bit: the matmul's logits are the partials kernel's logit tiles (one k16 chain over H, the same
    BLOCK_K), and :func:`_fwd_partials_of_logits_kernel` folds them with that kernel's config, tiles,
    splits, update and reduction layout, then the same combine. What it reads is the [N, V] logits, where
    the fused pass reads the [V, H] lm head: at decode batches (N <= a few hundred) far fewer bytes.
    """
    T = _check_temperature(temperature)
    _check_logits(logits, dtype, "fused_logprob_of_logits")
    _check_targets(targets, logits.shape[0], logits.device, "fused_logprob_of_logits")
    return _merge_fold(_fold(logits, T, dtype), targets)


def _tp_layout(weight: torch.Tensor, group) -> tuple[int, int]:
    """(this rank's first vocabulary index, total V) from every rank's slice size."""
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.int64, device=weight.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([weight.shape[0]], dtype=torch.int64, device=weight.device), group=group)
    sizes = [int(x) for x in sizes]
    rank = dist.get_rank(group)
    return sum(sizes[:rank]), sum(sizes)


def _tp_finalize(m, s, t, tz, targets, inv_t, v_total, group):
    """Combine the ranks' local raw statistics: global max, then sums of the rescaled terms."""
    import torch.distributed as dist

    gm = m.clone()
    dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=group)
    r = torch.where(torch.isneginf(gm), torch.zeros_like(gm), gm)
    a = torch.exp((m - r) * inv_t)
    packed = torch.stack([a * s, a * (t + torch.where(torch.isneginf(m), torch.zeros_like(m), m - r) * s), tz])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)  # tz: only the owning rank's is non-zero
    S, T_, TZ = packed
    log_s = torch.log(S)
    valid = (targets >= 0) & (targets < v_total)
    logp = torch.where(valid, (TZ - gm) * inv_t - log_s, torch.full_like(log_s, math.nan))
    ent = log_s - (T_ / S) * inv_t
    return logp, ent, gm * inv_t + log_s


def _backward(hidden, weight, targets, lse, ent, g_lp, g_ent, inv_t, v_offset, with_entropy,
              need_h, need_w, cfg=None, grad_h=None, grad_w=None):
    """(d hidden [N, H] float32, d weight [V, H]) of the log-probs' (and entropy's) upstream gradients;
    ``grad_h`` (zeros, [N, H] float32) and ``grad_w`` ([V, H], weight's dtype, e.g. a slice of a larger
    buffer) are written in place when given: the same bits as fresh buffers."""
    cfg = cfg or fused_config(hidden.dtype)
    N, H = hidden.shape
    V = weight.shape[0]
    if need_h and grad_h is None:
        grad_h = torch.zeros((N, H), dtype=torch.float32, device=hidden.device)
    if need_w and grad_w is None:
        grad_w = torch.empty_like(weight)
    num_m = triton.cdiv(N, cfg.BLOCK_M)
    chunk = backward_chunk(V, cfg)
    dl = torch.empty((N, chunk), dtype=hidden.dtype, device=hidden.device)
    h_src, w_src, use_tma = _sources(hidden, weight, cfg)
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        _bwd_dlogits_kernel[(num_m * triton.cdiv(v1 - v0, cfg.BLOCK_N),)](
            h_src, w_src, targets, lse, ent, g_lp, g_ent, dl,
            N, V, H, hidden.stride(0), weight.stride(0), dl.stride(0), v0, v1, v_offset, inv_t, inv_t * LOG2E, num_m,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
            EVEN_K=H % cfg.BLOCK_K == 0, WITH_ENTROPY=with_entropy, PRECISION=_precision(hidden.dtype),
            USE_TMA=use_tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch_options(hidden.device),
        )
        d = dl[:, : v1 - v0]
        if need_w:
            grad_w[v0:v1] = weight_grad(d, hidden, weight.dtype)
        if need_h:
            grad_h += input_grad(d, weight[v0:v1], torch.float32)
    return grad_h, grad_w


def backward_chunk(V: int, cfg: FusedConfig) -> int:
    """Vocabulary columns per backward chunk: :data:`BWD_CHUNK_COLUMNS` rounded down to a multiple of
    ``BLOCK_N`` (at least one tile), at most V rounded up. Never a function of the token count: the
    chunks fix the order in which d hidden's float32 terms are added."""
    chunk = max(cfg.BLOCK_N, BWD_CHUNK_COLUMNS // cfg.BLOCK_N * cfg.BLOCK_N)
    return min(chunk, triton.cdiv(V, cfg.BLOCK_N) * cfg.BLOCK_N)


def fused_logprob_forward(hidden, weight, targets, inv_t: float, with_entropy: bool = False, *,
                          config: FusedConfig | None = None):
    """Launch the forward kernels over the whole vocabulary of ``weight``: no routing, no autograd,
    no input checks (:func:`fused_logprob` does those).

    ``hidden`` [N, H] and ``weight`` [V, H] with unit inner stride, ``targets`` [N] int64 contiguous,
    ``inv_t`` = 1 / temperature. Returns ``(logp, entropy, lse)``, each [N] float32 (entropy
    unwritten unless ``with_entropy``); ``lse`` is what :func:`fused_logprob_backward` takes.
    ``config`` (default :func:`fused_config`'s, the one the op uses) exists for tuning sweeps
    (``bench/logprob.py``); another config may give other bits.
    """
    logp, ent, lse, _ = _local_stats(hidden, weight, targets, inv_t, 0, weight.shape[0], with_entropy, True, config)
    return logp, ent, lse


def fused_logprob_backward(hidden, weight, targets, lse, entropy, grad_logp, grad_entropy, inv_t: float,
                           with_entropy: bool = False, *, need_hidden: bool = True, need_weight: bool = True,
                           config: FusedConfig | None = None):
    """The backward of :func:`fused_logprob_forward`'s outputs: ``(d hidden [N, H] float32 or None,
    d weight [V, H] in weight's dtype or None)`` for upstream grads ``grad_logp`` and ``grad_entropy``
    ([N] float32 contiguous; ``grad_entropy`` is read only with ``with_entropy``). Same launch
    contract as the forward; ``config`` for tuning sweeps."""
    return _backward(hidden, weight, targets, lse, entropy, grad_logp, grad_entropy, inv_t, 0, with_entropy,
                     need_hidden, need_weight, config)


class _FusedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, with_entropy, tp_group):
        if tp_group is None:
            v_offset, v_total = 0, weight.shape[0]
            logp, ent, lse, _ = _local_stats(hidden, weight, targets, inv_t, 0, v_total, with_entropy, True)
        else:
            v_offset, v_total = _tp_layout(weight, tp_group)
            m, s, t, tz = _local_stats(hidden, weight, targets, inv_t, v_offset, v_total, with_entropy, False)
            logp, ent, lse = _tp_finalize(m, s, t, tz, targets, inv_t, v_total, tp_group)
        # a log-prob is <= 0; for a near-certain token, rounding of lse = m + log(sum) can land a few ulps
        # below its logit (+7.7e-07 seen in bf16): report 0 there. The backward reads lse, not logp.
        logp = logp.clamp_(max=0.0)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_t, ctx.with_entropy, ctx.tp_group, ctx.v_offset = inv_t, with_entropy, tp_group, v_offset
        ctx.mark_non_differentiable(lse)
        return logp, ent, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_lse):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None, None
        g_lp = g_lp.contiguous().float()
        g_ent = g_ent.contiguous().float() if ctx.with_entropy else g_lp
        grad_h, grad_w = _backward(hidden, weight, targets, lse, ent, g_lp, g_ent, ctx.inv_t, ctx.v_offset,
                                   ctx.with_entropy, need_h, need_w)
        if need_h and ctx.tp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.tp_group)
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, None, None, None, None


def _sample_logprob_kernels(hidden, weight, temperatures, seeds, positions, inv_t: float):
    """Launch the sampling forward (:func:`_sample_partials_kernel`, :func:`_sample_combine_kernel`) in the
    fused log-prob's tile config: (tokens [N] int64, logp [N] float32, not clamped)."""
    cfg = fused_config(hidden.dtype)
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    num_m = triton.cdiv(N, cfg.BLOCK_M)
    num_splits = triton.cdiv(V, cfg.SPLIT_TILES * cfg.BLOCK_N)
    parts = torch.empty((4, num_splits, N), dtype=torch.float32, device=dev)  # m, s, best key, its logit
    cols = torch.empty((num_splits, N), dtype=torch.int32, device=dev)
    h_src, w_src, use_tma = _sources(hidden, weight, cfg)
    c = inv_t * LOG2E
    _sample_partials_kernel[(num_m * num_splits,)](
        h_src, w_src, temperatures, seeds, positions, parts[0], parts[1], parts[2], cols, parts[3],
        N, V, H, hidden.stride(0), weight.stride(0), c, num_m,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_TILES=cfg.SPLIT_TILES,
        EVEN_K=H % cfg.BLOCK_K == 0, PRECISION=_precision(hidden.dtype), USE_TMA=use_tma, FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(dev),
    )
    tokens = torch.empty(N, dtype=torch.int64, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    _sample_combine_kernel[(triton.cdiv(N, _COMBINE_BLOCK),)](
        parts[0], parts[1], parts[2], cols, parts[3], tokens, logp, N, num_splits, inv_t, c,
        BLOCK=_COMBINE_BLOCK, num_warps=4, **launch_options(dev),
    )
    return tokens, logp


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def _check(hidden, weight, targets):
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"fused_logprob: hidden must be [N, H] and weight [V, H], got "
                         f"{list(hidden.shape)} and {list(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_logprob: hidden [N, H] = {list(hidden.shape)} and weight [V, H] = "
                         f"{list(weight.shape)} disagree on H")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"fused_logprob: hidden {hidden.dtype} and weight {weight.dtype} differ")
    fused_config(hidden.dtype)
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"fused_logprob: targets must have shape [{hidden.shape[0]}], got {list(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"fused_logprob: targets must be integer token ids, got {targets.dtype}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"fused_logprob: hidden, weight, targets on {hidden.device}, {weight.device}, {targets.device}")
    if weight.shape[0] == 0 or hidden.shape[1] == 0:
        raise ValueError("fused_logprob: V and H must be > 0")


def fused_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    tp_group=None,
):
    """Per-token log-prob (and entropy) of ``softmax(hidden @ weight.T / temperature)``.

    Args:
        hidden: [N, H] bfloat16/float16/float32 final hidden states.
        weight: [V, H] lm-head weight, same dtype (this rank's vocabulary slice under ``tp_group``).
        targets: [N] integer token ids in [0, V_total) (NaN log-prob otherwise).
        temperature: Python float > 0.
        return_entropy: also return the entropy of each token's distribution.
        tp_group: a ``torch.distributed`` process group over which the vocabulary is split, or None.

    Returns:
        logp [N] float32, <= 0 (a value rounding put above 0 is reported as 0), and entropy [N] float32.
        Differentiable w.r.t. hidden and weight.
    """
    T = _check_temperature(temperature)
    _check(hidden, weight, targets)
    how = route("fused_logprob", hidden.device, stock_ok=tp_group is None)
    if how == "stock":
        # stock torch: cuBLAS logits, then float32 log-softmax (materializes [N, V] float32)
        logp_all = torch.log_softmax(F.linear(hidden, weight).float() / T, dim=-1)
        logp = logp_all.gather(-1, targets.long().clamp(0, weight.shape[0] - 1)[:, None]).squeeze(-1)
        logp = torch.where((targets >= 0) & (targets < weight.shape[0]), logp, torch.full_like(logp, math.nan))
        if not return_entropy:
            return logp
        return logp, -(logp_all.exp() * logp_all).nan_to_num(0.0).sum(-1)
    if how == "reference":
        if tp_group is not None:
            raise RuntimeError("fused_logprob: tp_group needs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on CPU)")
        return _ref.fused_logprob(hidden, weight, targets, T, return_entropy)
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + 0.0 * hidden.sum() + 0.0 * weight.sum()
        return (empty, empty.clone()) if return_entropy else empty
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    tgt = targets.to(torch.int64).contiguous()
    logp, ent, _lse = _FusedLogprob.apply(hidden, weight, tgt, 1.0 / T, bool(return_entropy), tp_group)
    return (logp, ent) if return_entropy else logp


def fused_sample_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    logprob_temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw a token per row and its log-prob, reading the lm head once: what the rollout engine did with
    ``logits = linear(hidden, weight)`` (float32), ``sample(logits, temperatures, 1.0, 0, seeds, positions)``
    and ``fused_logprob(hidden, weight, tokens, logprob_temperature)``, for a batch without top-p / top-k.

    Args:
        hidden: [N, H] bfloat16/float16/float32 final hidden rows; weight: [V, H] lm head, same dtype.
        temperatures: [N] float32 draw temperatures, >= 0 (0: greedy); checked by the caller, as
            :func:`rlperf.kernels.sample` with ``check_values=False``.
        seeds, positions: [N] int64, the draw's seed and counter (:func:`rlperf.kernels.sample`).
        logprob_temperature: Python float > 0, the temperature of the log-probs.

    Returns:
        (tokens [N] int64, logp [N] float32 <= 0).

    The kernels are :func:`fused_logprob`'s forward programs (its tile config, vocabulary splits and
    online log-sum-exp, merged in split order by the same code), each also keeping its split's Gumbel-max
    draw with :func:`rlperf.kernels.sample`'s keys, ties to the lowest column. So ``logp`` has the bits of
    ``fused_logprob(hidden, weight, tokens, logprob_temperature)`` (the drawn column's logit is the
    target's), and a token is the argmax of the sampler's keys over the logits of that tile config, which
    are the lm-head product's in every config sharing its ``BLOCK_K`` (``rlperf.kernels.gemm``): the
    sampler's token. Off the kernels (the reference backend, fast mode's stock log-prob) it is those three
    calls.
    """
    T = _check_temperature(logprob_temperature)
    if hidden.dim() != 2:
        raise ValueError(f"fused_sample_logprob: hidden must be [N, H], got {list(hidden.shape)}")
    N = hidden.shape[0]
    for name, t, dtype in (("temperatures", temperatures, torch.float32), ("seeds", seeds, torch.int64),
                           ("positions", positions, torch.int64)):
        if not isinstance(t, torch.Tensor) or t.shape != (N,) or t.dtype != dtype or t.device != hidden.device:
            raise ValueError(f"fused_sample_logprob: {name} must be a [{N}] {dtype} tensor on {hidden.device}, got "
                             f"{list(getattr(t, 'shape', []))} {getattr(t, 'dtype', type(t).__name__)} on "
                             f"{getattr(t, 'device', '-')}")
    _check(hidden, weight, seeds)
    if route("fused_logprob", hidden.device) not in ("triton", "interpreter"):
        from .gemm import linear
        from .sampling import sample

        logits = linear(hidden, weight, out_dtype=torch.float32)
        tokens = sample(logits, temperatures, 1.0, 0, seeds, positions, check_values=False, filtered=False)
        return tokens, fused_logprob(hidden, weight, tokens, T)
    if N == 0:
        return (torch.empty(0, dtype=torch.int64, device=hidden.device),
                torch.empty(0, dtype=torch.float32, device=hidden.device))
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    tokens, logp = _sample_logprob_kernels(hidden, weight, temperatures.contiguous(), seeds.contiguous(),
                                           positions.contiguous(), 1.0 / T)
    return tokens, logp.clamp_(max=0.0)
