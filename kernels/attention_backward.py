"""Backward of causal varlen attention (:func:`rlperf.kernels.varlen_attention`, the training
forward) in a fixed reduction order and without atomics, so the same inputs give the same gradient
bits on every run: what ``--deterministic-mode`` needs on the GPU. FlashAttention-2's algorithm,
with dQ in its own kernel instead of atomic adds.

Formula. Sequence ``b`` owns tokens ``cu_seqlens[b] .. cu_seqlens[b+1]`` (``L_b`` of them, query ``i``
at position ``i``); query head ``j`` reads KV head ``h = j // G`` (``G = Hq // Hkv``); ``scale`` is
``D**-0.5`` by default and ``c = scale * log2(e)``. The forward saved its output ``out`` and the
base-2 log-sum-exp of each (query head, token) row; with the upstream gradient ``dout``::

    lse[j, i]   = log2 sum_{p <= i} exp2(c * q[i, j] . k[p, h])           (saved by the forward)
    P[i, p]     = exp2(c * q[i, j] . k[p, h] - lse[j, i])    for p <= i, else 0
    delta[j, i] = sum_d dout[i, j, d] * out[i, j, d]                     (= sum_p P[i, p] dP[i, p])
    dP[i, p]    = dout[i, j] . v[p, h]
    dS[i, p]    = P[i, p] * (dP[i, p] - delta[j, i])
    dq[i, j]    = scale * sum_{p <= i} dS[i, p] k[p, h]
    dk[p, h]    = scale * sum_{j : j // G == h} sum_{i >= p} dS[i, p] q[i, j]
    dv[p, h]    =         sum_{j : j // G == h} sum_{i >= p} P[i, p] dout[i, j]

(``P``, ``dP``, ``dS`` per query head ``j``; every sum runs over the sequence's own tokens.)

Three kernels; every output element is written by exactly one program, and every sum runs in an
order fixed by the launch config alone:

1. ``delta``: one program per (``BLOCK_T`` tokens, query head), one float32 row sum over ``D``.
2. ``dk, dv``: one program per (``BLOCK_KV`` keys, KV head, sequence). It loops over the ``G``
   query heads of its group in order and, for each, over the ``STEP_Q``-query blocks that can see
   its keys, ascending (the diagonal blocks first), accumulating ``dk`` and ``dv`` in float32
   registers: one flat loop over the (head, block) pairs, every block through the causal mask
   (all true past the diagonal).
3. ``dq``: one program per (``BLOCK_Q`` queries, query head, sequence), looping over the
   ``STEP_KV``-key blocks from 0 upwards (full blocks, then the diagonal ones), accumulating in
   float32.

Tile products go through :mod:`rlperf.kernels.tile_dot`; ``P`` and ``dS`` are rounded to the input
dtype before their products with ``dout``, ``q``, ``k`` (as FlashAttention does), and float32 inputs
multiply in tf32 on the GPU, as in the forward. Gradients come back in the input dtype.

Determinism, and more: one config per (dtype, head_dim) (:func:`backward_config`), never a function
of the batch, and each sequence's blocks start at its first token, so a sequence's gradients do not
depend on which other sequences share the launch either (tested bit for bit). The tiles are
numbered as in the forward (``kernels/attention.py``): sequence ``b``'s tiles start at
``cu_seqlens[b] // BLOCK + b``, found by a binary search, without a host sync.

Tile rows past the end of their sequence load as zeros and add nothing: query rows with
``lse = +inf``, which makes their ``P`` exactly 0; key rows occur only in diagonal blocks, where the
causal mask removes them. Rows of tokens outside every sequence (past ``cu_seqlens[-1]``) are not
written, as in the forward.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .pipeline import grid_dependency_sync, launch_options, launch_with_fitting_stages
from .tile_dot import dot_acc, dot_fresh

__all__ = ["BackwardConfig", "attention_backward", "backward_config"]


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """The tiles of the two gradient kernels: one per (dtype, head_dim) (:func:`backward_config`)."""

    BLOCK_KV: int
    """dk/dv kernel: keys per program (its float32 dk and dv accumulators are [BLOCK_KV, D])."""
    STEP_Q: int
    """dk/dv kernel: queries per step of its loop."""
    BLOCK_Q: int
    """dq kernel: queries per program (its dq accumulator is [BLOCK_Q, D])."""
    STEP_KV: int
    """dq kernel: keys per step of its loop."""
    num_warps: int
    num_stages: int
    """Software pipeline depth; lowered where shared memory is short (``kernels/pipeline.py``: the
    loop order and the math stay, so the bits do not depend on it)."""


BLOCK_T = 64  # tokens per program of the delta kernel: a constant, so its row sums are fixed too


def backward_config(dtype: torch.dtype, head_dim: int) -> BackwardConfig:
    """The one launch config of ``dtype`` (bfloat16, float16, float32) and ``head_dim``.

    16-bit, D <= 128: 128-row program tiles and 64-row steps, with 8 warps from D=64 on (two
    warpgroups of 64 rows for Hopper's wgmma), so at D=128 each float32 accumulator takes 64
    registers per thread and a step's operands (2 x [64, 128] 16-bit) pipeline three deep in shared
    memory. float32 tiles are twice the bytes: half the rows, 4 warps. D=256 halves the rows again to
    keep the accumulators in registers. Not tuned on the device yet: ``python -m
    rlperf.bench.attention --sweep-backward`` times the candidates.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"attention backward: dtype {dtype}, expected bfloat16, float16 or float32")
    if dtype == torch.float32:
        if head_dim > 128:
            return BackwardConfig(BLOCK_KV=32, STEP_Q=32, BLOCK_Q=32, STEP_KV=32, num_warps=4, num_stages=2)
        return BackwardConfig(BLOCK_KV=64, STEP_Q=32, BLOCK_Q=64, STEP_KV=32, num_warps=4, num_stages=2)
    if head_dim > 128:
        return BackwardConfig(BLOCK_KV=64, STEP_Q=32, BLOCK_Q=64, STEP_KV=32, num_warps=8, num_stages=2)
    return BackwardConfig(BLOCK_KV=128, STEP_Q=64, BLOCK_Q=128, STEP_KV=64,
                          num_warps=8 if head_dim >= 64 else 4, num_stages=3)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _find_tile(CU, pid, num_seqs, search_steps, BLOCK: tl.constexpr):
    """(first token, length, tile index j within the sequence) of program ``pid``: sequence b's tiles
    start at f(b) = cu[b] // BLOCK + b (monotone, >= cdiv(L_b, BLOCK) slots each); surplus j >=
    cdiv(L_b, BLOCK) means "no tile", and the caller exits."""
    lo = pid * 0
    hi = lo + num_seqs
    for _ in range(search_steps):  # invariant: f(lo) <= pid < f(hi); extra steps are no-ops
        mid = (lo + hi) // 2
        take = tl.load(CU + mid) // BLOCK + mid <= pid
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    start = tl.load(CU + lo)
    length = tl.load(CU + lo + 1) - start
    return start, length, pid - (start // BLOCK + lo)


@triton.jit(do_not_specialize=["T"])
def _delta_kernel(O, DO, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh,
                  HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program (i, j): delta[j, t] = sum_d dout[t, j, d] * out[t, j, d] for BLOCK_T tokens t, float32."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_t < T
    rows = offs_t.to(tl.int64)
    o = tl.load(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + head.to(tl.int64) * T + rows, delta, mask=ok)


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, start, L, T, head, jm, n0,
               stride_qt, stride_qh, stride_dot, stride_doh, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr, STEP_Q: tl.constexpr):
    """Add query block ``jm`` of query head ``head`` to the program's dk, dv (transposed tiles:
    rows are keys ``n0 ..``), through the causal mask: all true once the block is past the
    diagonal, where ``where`` returns the scores unchanged. (Skipping it there with a run-time
    ``if`` changes the MMA layouts Triton picks at D = 256: bench/NOTES-attention.md.)"""
    offs_m = jm * STEP_Q + tl.arange(0, STEP_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ok = offs_m < L
    rows = (start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=q_ok[:, None],
                 other=0.0)
    # past the sequence: lse = +inf gives P = exp2(-inf) = 0 exactly (q and dout are 0 there too)
    stat = head.to(tl.int64) * T + rows
    lse = tl.load(LSE + stat, mask=q_ok, other=float("inf"))
    delta = tl.load(DELTA + stat, mask=q_ok, other=0.0)
    s_t = dot_fresh(k, tl.trans(q))                                   # scores transposed: [keys, queries]
    # key n0 + a <= query jm*STEP_Q + b, as offsets in the two blocks (the same booleans, no i32
    # overflow): comparing the positions themselves kept more values live (bench/NOTES-attention.md)
    s_t = tl.where((tl.arange(0, BLOCK_KV) + (n0 - jm * STEP_Q))[:, None] <= tl.arange(0, STEP_Q)[None, :],
                   s_t, float("-inf"))
    p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])
    dv = dot_acc(p_t.to(do.dtype), do, dv)
    dp_t = dot_fresh(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dot_acc(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit(do_not_specialize=["T", "num_seqs"])  # run-dependent integers: one kernel per shape
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    T, scale, qk_scale, num_seqs, search_steps,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr, STEP_Q: tl.constexpr,
):
    """Program (i, h): keys [n0, n0 + BLOCK_KV) of one sequence, KV head h -> dk, dv of those rows."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    kvh = tl.program_id(1)
    start, L, j = _find_tile(CU, tl.program_id(0), num_seqs, search_steps, BLOCK_KV)
    if j < (L + BLOCK_KV - 1) // BLOCK_KV:
        n0 = j * BLOCK_KV  # a sequence's first key blocks see the most queries: they start first
        offs_n = n0 + tl.arange(0, BLOCK_KV)
        offs_d = tl.arange(0, HEAD_DIM)
        key_ok = (offs_n < L)[:, None]
        rows = (start + offs_n).to(tl.int64)
        k = tl.load(K + rows[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=key_ok, other=0.0)
        v = tl.load(V + rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=key_ok, other=0.0)
        dk = tl.zeros([BLOCK_KV, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_KV, HEAD_DIM], tl.float32)
        m_lo = n0 // STEP_Q                                         # earlier queries see none of these keys
        m_end = (L + STEP_Q - 1) // STEP_Q
        # One loop over the (query head, query block) pairs in the order of the nested loops "for each
        # head: for jm in m_lo .. m_end", so the same sums in the same order. Nested loops (Triton
        # 3.6.0, SM 90) spilled: the software-pipelined inner loops' prologues (blocks m_lo, m_lo + 1;
        # m_full, m_full + 1) do not depend on the head, so LLVM hoisted their address vectors out of
        # the head loop and kept them on the stack across it (904 B at D = 128).
        head = kvh * G
        jm = m_lo
        for _ in range(0, G * (m_end - m_lo)):
            dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, start, L, T, head, jm, n0,
                                stride_qt, stride_qh, stride_dot, stride_doh, qk_scale,
                                HEAD_DIM, BLOCK_KV, STEP_Q)
            jm += 1
            head = tl.where(jm == m_end, head + 1, head)
            jm = tl.where(jm == m_end, m_lo, jm)
        # the stores' addresses and mask from the block start, not from rows and key_ok (which
        # stayed live, on the stack, across the loop)
        key0 = (start + n0).to(tl.int64)
        offs_j = tl.arange(0, BLOCK_KV).to(tl.int64)[:, None]
        out_ok = (tl.arange(0, BLOCK_KV) < L - n0)[:, None]
        tl.store(DK + key0 * stride_dkt + kvh * stride_dkh + (offs_j * stride_dkt + offs_d[None, :]),
                 (dk * scale).to(DK.dtype.element_ty), mask=out_ok)
        tl.store(DV + key0 * stride_dvt + kvh * stride_dvh + (offs_j * stride_dvt + offs_d[None, :]),
                 dv.to(DV.dtype.element_ty), mask=out_ok)


@triton.jit
def _dq_step(dq, q, do, lse, delta, K, V, start, L, kvh, jn, offs_m,
             stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
             HEAD_DIM: tl.constexpr, STEP_KV: tl.constexpr, MASKED: tl.constexpr):
    """Add key block ``jn`` to the program's dq. ``MASKED``: the block meets the diagonal (and may
    run past the sequence: those keys load as 0 and the causal mask removes them)."""
    offs_n = jn * STEP_KV + tl.arange(0, STEP_KV)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (start + offs_n).to(tl.int64)
    k_ptrs = K + rows[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
    v_ptrs = V + rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
    if MASKED:
        key_ok = (offs_n < L)[:, None]
        k = tl.load(k_ptrs, mask=key_ok, other=0.0)
        v = tl.load(v_ptrs, mask=key_ok, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = dot_fresh(q, tl.trans(k))                                     # [queries, keys]
    if MASKED:
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    p = tl.math.exp2(s * qk_scale - lse[:, None])
    dp = dot_fresh(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return dot_acc(ds.to(k.dtype), k, dq)


@triton.jit(do_not_specialize=["T", "num_seqs"])  # run-dependent integers: one kernel per shape
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    T, scale, qk_scale, num_seqs, search_steps,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, STEP_KV: tl.constexpr,
):
    """Program (i, j): queries [m0, m0 + BLOCK_Q) of one sequence, query head j -> dq of those rows."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    head = tl.program_id(1)
    kvh = head // G
    start, L, j = _find_tile(CU, tl.program_id(0), num_seqs, search_steps, BLOCK_Q)
    n_tiles = (L + BLOCK_Q - 1) // BLOCK_Q
    if j < n_tiles:
        m0 = (n_tiles - 1 - j) * BLOCK_Q  # a sequence's last query blocks see the most keys: they start first
        offs_m = m0 + tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ok = offs_m < L
        rows = (start + offs_m).to(tl.int64)
        q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_ok[:, None], other=0.0)
        do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=q_ok[:, None],
                     other=0.0)
        stat = head.to(tl.int64) * T + rows
        lse = tl.load(LSE + stat, mask=q_ok, other=float("inf"))
        delta = tl.load(DELTA + stat, mask=q_ok, other=0.0)
        dq = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
        n_full = (m0 + 1) // STEP_KV                                 # blocks wholly at or before every query
        n_end = (tl.minimum(m0 + BLOCK_Q, L) - 1 + STEP_KV) // STEP_KV  # cdiv(last query + 1, STEP_KV)
        for jn in range(0, n_full):
            dq = _dq_step(dq, q, do, lse, delta, K, V, start, L, kvh, jn, offs_m,
                          stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, HEAD_DIM, STEP_KV, False)
        for jn in range(n_full, n_end):
            dq = _dq_step(dq, q, do, lse, delta, K, V, start, L, kvh, jn, offs_m,
                          stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, HEAD_DIM, STEP_KV, True)
        tl.store(DQ + rows[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=q_ok[:, None])


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    *,
    need_dq: bool = True,
    need_dkdv: bool = True,
    config: BackwardConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch the gradient kernels (module docstring): no routing, no autograd, index tensors not
    checked. CUDA tensors run compiled, CPU tensors under the interpreter (``TRITON_INTERPRET=1``).

    Parameters
    ----------
    q : [T, Hq, D];  k, v : [T, Hkv, D], same dtype (bf16, fp16, fp32); any strides with a unit last one
    out : [T, Hq, D], the forward's output;  grad_out : [T, Hq, D], its upstream gradient
    lse : [Hq, T] float32 contiguous, the forward's base-2 log-sum-exp of the scaled scores
        (``attention_forward(..., return_lse=True)``), computed with this ``scale``
    cu_seqlens : [B+1] int32 offsets of the packed sequences
    need_dq, need_dkdv : skip the dq kernel, or the dk/dv kernel (its result is then None)
    config : another launch config, for tuning sweeps (``bench/attention.py``); the op never passes it

    Returns ``(dq [T, Hq, D], dk [T, Hkv, D], dv [T, Hkv, D])``, contiguous, in q's dtype.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    cfg = config or backward_config(q.dtype, D)
    q, k, v, out, grad_out = (_last_dim_contiguous(x) for x in (q, k, v, out, grad_out))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dq else None
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_dkdv else None
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if need_dkdv else None
    num_seqs = cu_seqlens.numel() - 1
    if T == 0 or num_seqs <= 0 or not (need_dq or need_dkdv):
        return dq, dk, dv
    scale = D ** -0.5 if scale is None else float(scale)
    qk_scale = scale * math.log2(math.e)  # the forward's expression: P matches the saved lse
    search_steps = math.ceil(math.log2(num_seqs)) if num_seqs > 1 else 0

    delta = torch.empty(Hq, T, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(T, BLOCK_T), Hq)](
        out, grad_out, delta, T, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1),
        HEAD_DIM=D, BLOCK_T=BLOCK_T, num_warps=4, **launch_options(out.device),
    )
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              grad_out.stride(0), grad_out.stride(1))
    key = (q.dtype, D, G, dataclasses.astuple(cfg))
    if need_dkdv:
        def launch_dkdv(stages):
            _dkdv_kernel[(T // cfg.BLOCK_KV + num_seqs, Hkv)](
                q, k, v, grad_out, lse, delta, dk, dv, cu_seqlens, *common,
                dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                T, scale, qk_scale, num_seqs, search_steps,
                G=G, HEAD_DIM=D, BLOCK_KV=cfg.BLOCK_KV, STEP_Q=cfg.STEP_Q,
                num_warps=cfg.num_warps, num_stages=stages, **launch_options(q.device),
            )

        launch_with_fitting_stages(launch_dkdv, ("attention_bwd_dkdv", *key), cfg.num_stages)
    if need_dq:
        def launch_dq(stages):
            _dq_kernel[(T // cfg.BLOCK_Q + num_seqs, Hq)](
                q, k, v, grad_out, lse, delta, dq, cu_seqlens, *common,
                dq.stride(0), dq.stride(1),
                T, scale, qk_scale, num_seqs, search_steps,
                G=G, HEAD_DIM=D, BLOCK_Q=cfg.BLOCK_Q, STEP_KV=cfg.STEP_KV,
                num_warps=cfg.num_warps, num_stages=stages, **launch_options(q.device),
            )

        launch_with_fitting_stages(launch_dq, ("attention_bwd_dq", *key), cfg.num_stages)
    return dq, dk, dv
