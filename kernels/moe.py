"""Mixture-of-experts kernels: top-k routing, token permutation, grouped GEMM, weighted combine.

Shapes: T tokens, H hidden, E experts, k experts per token (``top_k``), I expert intermediate
size, S = T k routed pairs. The expert block (Qwen3-MoE's sparse MLP) is::

    weights, experts = moe_route(x @ router.T, k, normalize)        # [T, k] float32, [T, k] int32
    out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),  e = experts[t, j]

run as :func:`moe_experts`: the (t, j) pairs are sorted by expert (:func:`moe_plan`), one grouped
GEMM computes every pair's ``[gate | up]`` row, :func:`rlperf.kernels.silu_mul` the activation, a
second grouped GEMM the ``down`` row, and :func:`moe_combine` sums each token's k rows.

Invariance contract (``invariant`` mode): the bits of a token's output depend only on that
token's input, its experts and weights, and the expert weights — never on how many tokens each
expert received, on which other tokens share the batch, or on the token's position in it:

* routing: one token per program; softmax max/sum and the top-k run over the token's E logits
  in one fixed order; ties go to the **lower expert index**; experts are listed in increasing
  index, so the output never depends on which of two equal scores a sort met first;
* permutation: a stable counting sort (one program per expert scans the pairs in order), so a
  token's slot is a function of the batch but the slot's contents are not;
* grouped GEMM: one tile config per (dtype, N, K) (:func:`grouped_matmul_config`), never a
  function of the expert loads; every tile runs the full K loop in increasing K into one float32
  accumulator (no split-K); a tile stores rows of one expert only, and the rows it computes past
  the expert's end (duplicates under pointer loads, the next expert's rows under TMA loads) are
  never stored. A row is computed by the same instructions whatever its position in its tile and
  whatever its neighbours hold (the dense matmul's contract, ``kernels/gemm.py``);
* combine: ``out[t] = sum_j weights[t, j] * y[slot(t, j)]`` in float32, j in increasing expert
  index (never in arrival order), rounded once.

Backward (deterministic, no atomics): ``d a = dy @ w_e`` is the same grouped GEMM on the
transposed weights (then the k rows of a token are summed in expert order, as the combine does);
``d w_e = sum_{s in expert e} dy[s]^T a[s]`` runs one program per (expert, N tile, K tile) that
walks the expert's rows in slot order; the combine's backward is two gathers and a row dot.
The routing weights' gradient is the torch formula (softmax, gather, normalise) recomputed in
float32. Fast mode (``--mode fast``) runs :func:`moe_experts` in stock torch
(``torch._grouped_mm`` on CUDA bf16, else a per-expert loop) and is not batch-invariant.

Under the CPU interpreter tile products go through :func:`rlperf.kernels.tile_dot.dot_acc`
(float64, row-position invariant on any x86 BLAS) and bf16 results are written as float32 and
rounded by torch (the interpreter's bf16 casts differ from torch's).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_mul
from .autograd import with_recompute_backward
from .dispatch import route
from .gemm import TensorDescriptor, launch_weight_grad, tma_ready, use_tma
from .reference.moe import moe_experts_ref, moe_route_ref, moe_route_weights_ref
from .tile_dot import dot_acc, kernel_store_dtype

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PERMUTE_BLOCK = 1024
_COMBINE_BLOCK_N = 256


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------


@triton.jit
def _route_kernel(logits, weights_out, experts_out, E, stride_l,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, REPLAY: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    z = tl.load(logits + t * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    ez = tl.where(valid, tl.exp(z - tl.max(z, 0)), 0.0)
    p = ez / tl.sum(ez, 0)
    selected = offs < 0
    if REPLAY:  # the experts are given (routing replay): only their weights are computed
        for j in tl.static_range(TOP_K):
            selected = selected | (offs == tl.load(experts_out + t * TOP_K + j))
    else:
        cand = tl.where(valid, p, -1.0)  # every real expert (p >= 0) ranks above the padding
        for j in tl.static_range(TOP_K):
            best = tl.max(cand, 0)
            pick = tl.min(tl.where(cand == best, offs, BLOCK_E), 0)  # a tie goes to the lower index
            selected = selected | (offs == pick)
            cand = tl.where(offs == pick, -2.0, cand)
    w = p
    if NORMALIZE:
        w = p / tl.sum(tl.where(selected, p, 0.0), 0)
    pos = tl.cumsum(selected.to(tl.int32), 0) - 1  # experts listed in increasing index
    if not REPLAY:
        tl.store(experts_out + t * TOP_K + pos, offs, mask=selected)
    tl.store(weights_out + t * TOP_K + pos, w, mask=selected)


def _launch_route(logits: torch.Tensor, top_k: int, normalize: bool,
                  experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    replay = experts is not None
    if not replay:
        experts = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, experts, e, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(e), NORMALIZE=normalize, REPLAY=replay)
    return weights, experts


def _torch_route_weights(logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    w = torch.softmax(logits.float(), dim=-1).gather(1, experts.long())
    return w / w.sum(-1, keepdim=True) if normalize else w


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"moe_route: logits must be [T, E], got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_route: top_k={top_k} must be in [1, E={logits.shape[1]}]")


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: logits [T, E] -> (weights [T, k] float32, experts [T, k] int32).

    ``p = softmax(logits)`` in float32; the k largest ``p`` (a tie goes to the lower expert index);
    experts listed in increasing index; ``weights = p[experts]``, divided by their sum when
    ``normalize`` (Qwen3-MoE's ``norm_topk_prob``). Differentiable in ``logits``.
    """
    _check_logits(logits, top_k)
    how = route("moe_route", logits.device, (logits,))
    if how == "reference":
        w, e = moe_route_ref(logits, top_k, normalize)
        return w.float(), e.to(torch.int32)
    weights, experts = _launch_route(logits.detach(), top_k, normalize)
    if how == "autograd":
        weights = with_recompute_backward(lambda _: weights, lambda l: _torch_route_weights(l, experts, normalize),
                                          logits)
    return weights, experts


def moe_route_weights(logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing replay: the weights of given ``experts`` [T, k] (any order, distinct per row, in
    [0, E)) under ``logits`` [T, E] -> (weights [T, k] float32, experts [T, k] int32), rows sorted
    by expert index, weights as :func:`moe_route` computes them. ValueError for experts out of
    range or repeated within a row."""
    _check_logits(logits, experts.shape[-1] if experts.dim() == 2 else 1)
    if experts.dim() != 2 or experts.shape[0] != logits.shape[0]:
        raise ValueError(f"moe_route_weights: experts must be [T, k] with T = {logits.shape[0]}, "
                         f"got shape {tuple(experts.shape)}")
    experts = torch.sort(experts.to(device=logits.device, dtype=torch.int32), dim=-1).values.contiguous()
    if experts.numel():
        e = logits.shape[1]
        if bool((experts[:, 0] < 0).any()) or bool((experts[:, -1] >= e).any()):
            raise ValueError(f"moe_route_weights: routed experts out of range [0, {e})")
        if bool((experts[:, 1:] == experts[:, :-1]).any()):
            raise ValueError("moe_route_weights: a token lists the same expert twice")
    how = route("moe_route", logits.device, (logits,))
    if how == "reference":
        return moe_route_weights_ref(logits, experts, normalize).float(), experts
    weights, _ = _launch_route(logits.detach(), experts.shape[1], normalize, experts)
    if how == "autograd":
        weights = with_recompute_backward(lambda _: weights, lambda l: _torch_route_weights(l, experts, normalize),
                                          logits)
    return weights, experts


# --------------------------------------------------------------------------------------------
# Permutation: a stable counting sort of the (token, j) pairs by expert
# --------------------------------------------------------------------------------------------


@triton.jit
def _count_kernel(experts, counts, S, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, S, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(experts + offs, mask=offs < S, other=-1)
        acc += (ids == e).to(tl.int32)
    tl.store(counts + e, tl.sum(acc, 0))


@triton.jit
def _place_kernel(experts, expert_offsets, slot_of_pair, pair_of_slot, S, BLOCK: tl.constexpr):
    # Program e walks the pairs in order and gives its hits consecutive slots from offsets[e]:
    # within an expert, slots follow pair order (a stable sort).
    e = tl.program_id(0)
    base = tl.load(expert_offsets + e)
    for start in range(0, S, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        hit = tl.load(experts + offs, mask=offs < S, other=-1) == e
        pos = base + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(slot_of_pair + offs, pos, mask=hit)
        tl.store(pair_of_slot + pos, offs, mask=hit)
        base += tl.sum(hit.to(tl.int32), 0)


@dataclasses.dataclass
class ExpertPlan:
    """Where each routed pair goes: the (token t, j) pair ``p = t k + j`` sits in slot
    ``slot_of_pair[p]`` of the expert-sorted order; slots ``expert_offsets[e] : expert_offsets[e+1]``
    belong to expert e, in pair order. All on the experts' device, built without a host sync."""

    num_experts: int
    top_k: int
    slot_of_pair: torch.Tensor    # [S] int32
    pair_of_slot: torch.Tensor    # [S] int32
    token_of_slot: torch.Tensor   # [S] int32 (pair_of_slot // k)
    expert_offsets: torch.Tensor  # [E + 1] int32
    _tiles: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def num_slots(self) -> int:
        return self.slot_of_pair.shape[0]

    def tile_offsets(self, block_m: int) -> torch.Tensor:
        """[E + 1] int32: expert e owns row tiles ``tile_offsets[e] : tile_offsets[e+1]`` of ``block_m`` rows."""
        if block_m not in self._tiles:
            counts = self.expert_offsets[1:] - self.expert_offsets[:-1]
            tiles = torch.zeros(self.num_experts + 1, dtype=torch.int32, device=counts.device)
            tiles[1:] = torch.cumsum((counts + block_m - 1) // block_m, 0)
            self._tiles[block_m] = tiles
        return self._tiles[block_m]

    def max_row_tiles(self, block_m: int) -> int:
        """An upper bound of the row tiles (a launch's grid), from shapes only: no host sync."""
        return triton.cdiv(self.num_slots, block_m) + min(self.num_experts, self.num_slots)


def _torch_plan(flat: torch.Tensor, num_experts: int, top_k: int) -> ExpertPlan:
    pair_of_slot = torch.sort(flat, stable=True).indices.to(torch.int32)
    slot_of_pair = torch.empty_like(pair_of_slot)
    slot_of_pair[pair_of_slot.long()] = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return ExpertPlan(num_experts, top_k, slot_of_pair, pair_of_slot, pair_of_slot // top_k, offsets)


def moe_plan(experts: torch.Tensor, num_experts: int) -> ExpertPlan:
    """The expert-sorted order of ``experts`` [T, k] (int, values in [0, E)): a stable counting sort."""
    if experts.dim() != 2:
        raise ValueError(f"moe_plan: experts must be [T, k], got shape {tuple(experts.shape)}")
    t, k = experts.shape
    flat = experts.reshape(-1).to(torch.int32).contiguous()
    s = flat.numel()
    dev = flat.device
    if dev.type != "cuda" and route("moe_experts", dev) == "reference":
        return _torch_plan(flat, num_experts, k)  # the same stable order, in torch
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    slot_of_pair = torch.empty(s, dtype=torch.int32, device=dev)
    pair_of_slot = torch.empty(s, dtype=torch.int32, device=dev)
    # a block that fits small batches (decode) saves the interpreter work; integer sums: exact anyway
    block = min(_PERMUTE_BLOCK, max(16, triton.next_power_of_2(s)))
    if s:
        _count_kernel[(num_experts,)](flat, counts, s, BLOCK=block)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    if s:
        _place_kernel[(num_experts,)](flat, offsets, slot_of_pair, pair_of_slot, s, BLOCK=block)
    return ExpertPlan(num_experts, k, slot_of_pair, pair_of_slot, pair_of_slot // k, offsets)


# --------------------------------------------------------------------------------------------
# Grouped GEMM
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tile shape and launch parameters of one (dtype, N, K), whatever the expert loads."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def grouped_matmul_config(dtype: torch.dtype, N: int, K: int) -> GroupedMatmulConfig:
    """The one tile config of a grouped GEMM with ``dtype`` expert weights [E, N, K]. BLOCK_M is 64 or
    128 (Hopper wgmmas of m64 per warpgroup: every output element is the same chain of k16 MMA steps).

    16-bit: 128 x 256 tiles, BLOCK_K 64, 8 warps, 4 stages, for every expert shape so far. Measured on an
    H200 by CUDA-graph replay (``python -m rlperf.bench.grouped_sweep``, 30B-A3B experts, 8192 tokens,
    bench/BENCHMARKS.md): geomean 0.95x ``torch._grouped_mm`` over gate_up and down with TMA loads, against
    0.67x for the 64 x 128 tile before, and the same bits as every other config swept."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"grouped_matmul: dtype {dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if dtype == torch.float32:
        return GroupedMatmulConfig(64, 64, 32, 4, 3)
    return GroupedMatmulConfig(128, 256, 64, 8, 4)


def expert_weight_grad_config(dtype: torch.dtype) -> GroupedMatmulConfig:
    """The expert weight gradient's tile (:func:`rlperf.kernels.gemm.launch_weight_grad` segmented by
    expert): BLOCK_M rows of the sum per step, a [BLOCK_N, BLOCK_K] output tile, warps, stages. A function
    of the dtype only, kept apart from :func:`grouped_matmul_config`, whose forward tiles a sweep tunes."""
    if dtype == torch.float32:
        return GroupedMatmulConfig(64, 64, 32, 4, 3)
    return GroupedMatmulConfig(64, 128, 64, 4, 4)


@triton.jit
def _expert_of_tile(tile_offsets, tile, num_experts, BLOCK_E: tl.constexpr):
    # tile_offsets[1:] is non-decreasing: the tile's expert is how many experts end at or before it
    offs = tl.arange(0, BLOCK_E)
    ends = tl.load(tile_offsets + 1 + offs, mask=offs < num_experts, other=2147483647)
    return tl.sum((ends <= tile).to(tl.int32), 0)


@triton.jit(do_not_specialize=["num_experts"])
def _grouped_matmul_kernel(
    a, w, out, rows_of_slot, expert_offsets, tile_offsets,
    N, K, num_experts,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    GATHER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    A_TMA: tl.constexpr = False, W_TMA: tl.constexpr = False, W_KN: tl.constexpr = False,
):
    # A_TMA: a is a TMA descriptor of the [S, K] slot rows ([BLOCK_M, BLOCK_K] blocks): rows past the
    # expert's end arrive as the next expert's rows (or zeros past S), computed and never stored.
    # W_TMA: w is a TMA descriptor of the expert weights as one 2-D tensor: [E N, K] with [BLOCK_N,
    # BLOCK_K] blocks, or with W_KN [E K, N] (the weights stored [E, K, N], e.g. the backward's w^T) with
    # [BLOCK_K, BLOCK_N] blocks. A block past the expert's N reads the next expert's rows into columns
    # that are never stored; with W_KN the launcher keeps K % BLOCK_K == 0, so no block crosses experts.
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = _expert_of_tile(tile_offsets, tile, num_experts, BLOCK_E)
    if e < num_experts:  # tiles past the last expert's are the grid's slack: no work
        row_start = tl.load(expert_offsets + e) + (tile - tl.load(tile_offsets + e)) * BLOCK_M
        row_end = tl.load(expert_offsets + e + 1)
        offs_m = row_start + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        if not A_TMA:
            # rows past the expert's end repeat its first row of the tile: computed, never stored
            safe_m = tl.where(offs_m < row_end, offs_m, row_start)
            if GATHER:  # the rows of `a` are tokens: slot s reads token pair_of_slot[s] // k
                src = tl.load(rows_of_slot + safe_m) // TOP_K
            else:
                src = safe_m
            a_ptrs = a + src.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
        if not W_TMA:
            safe_n = tl.where(offs_n < N, offs_n, 0)
            w_ptrs = (w + e.to(tl.int64) * stride_we + safe_n.to(tl.int64)[:, None] * stride_wn
                      + offs_k[None, :] * stride_wk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the full K loop, in order, into one accumulator (no split-K): fixed by BLOCK_K alone
        for ki in range(tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k[None, :] < K - ki * BLOCK_K  # zero tail: adds exact zeros
            if A_TMA:
                x_tile = a.load([row_start, ki * BLOCK_K])  # columns past K arrive as zeros
            else:
                x_tile = tl.load(a_ptrs, mask=k_mask, other=0.0)
                a_ptrs += BLOCK_K * stride_ak
            if W_TMA:
                if W_KN:
                    acc = dot_acc(x_tile, w.load([e * K + ki * BLOCK_K, pid_n * BLOCK_N]), acc, PRECISION)
                else:
                    acc = dot_acc(x_tile, w.load([e * N + pid_n * BLOCK_N, ki * BLOCK_K]).T, acc, PRECISION)
            else:
                w_tile = tl.load(w_ptrs, mask=k_mask, other=0.0)
                acc = dot_acc(x_tile, w_tile.T, acc, PRECISION)
                w_ptrs += BLOCK_K * stride_wk
        o_ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=(offs_m[:, None] < row_end) & (offs_n[None, :] < N))


def _precision(dtype: torch.dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _grouped_tma_operands(a: torch.Tensor, w: torch.Tensor, cfg: GroupedMatmulConfig, gather: bool):
    """(a_arg, w_arg, A_TMA, W_TMA, W_KN) of a grouped launch: TMA descriptors where the operand's rows
    are 16-byte aligned on a TMA-capable device (a function of the dtype, N, K, the config and whether a
    is gathered, never of the expert loads), else the tensors themselves (pointer loads)."""
    e, n, k = w.shape
    a_tma = not gather and use_tma(a.dtype, k, a.device)  # False where Triton has no TMA descriptors
    a_arg = TensorDescriptor.from_tensor(tma_ready(a), [cfg.BLOCK_M, cfg.BLOCK_K]) if a_tma else a
    w_arg, w_tma, w_kn = w, False, False
    if e * n * k:
        if w.stride(2) == 1 and use_tma(w.dtype, k, w.device):
            w_tma = True
            w_arg = TensorDescriptor.from_tensor(tma_ready(w.reshape(e * n, k)), [cfg.BLOCK_N, cfg.BLOCK_K])
        elif w.stride(1) == 1 and k % cfg.BLOCK_K == 0 and use_tma(w.dtype, n, w.device):
            # [E, N, K] viewed from [E, K, N] storage (w^T of the backward): its [BLOCK_K, BLOCK_N] blocks
            w_tma, w_kn = True, True
            w_arg = TensorDescriptor.from_tensor(tma_ready(w.transpose(1, 2).reshape(e * k, n)),
                                                 [cfg.BLOCK_K, cfg.BLOCK_N])
    return a_arg, w_arg, a_tma, w_tma, w_kn


def _launch_grouped(a: torch.Tensor, w: torch.Tensor, plan: ExpertPlan, gather: bool,
                    config: GroupedMatmulConfig | None = None, tma: bool | None = None) -> torch.Tensor:
    """``out[s] = a[row(s)] @ w[expert(s)].T``: a [R, K], w [E, N, K] (any strides) -> [S, N]; row(s)
    is the slot's token when ``gather`` (a holds tokens), else s (a holds slots). ``config`` and
    ``tma=False`` (pointer loads only) exist for tuning sweeps (``python -m rlperf.bench.grouped_sweep``)."""
    n, k = w.shape[1], w.shape[2]
    s = plan.num_slots
    cfg = config or grouped_matmul_config(w.dtype, n, k)
    out = torch.empty(s, n, dtype=kernel_store_dtype(a.dtype, a.device), device=a.device)
    if s and n:
        if tma is False:
            a_arg, w_arg, a_tma, w_tma, w_kn = a, w, False, False, False
        else:
            a_arg, w_arg, a_tma, w_tma, w_kn = _grouped_tma_operands(a, w, cfg, gather)
        grid = (plan.max_row_tiles(cfg.BLOCK_M), triton.cdiv(n, cfg.BLOCK_N))
        _grouped_matmul_kernel[grid](
            a_arg, w_arg, out, plan.pair_of_slot, plan.expert_offsets, plan.tile_offsets(cfg.BLOCK_M),
            n, k, plan.num_experts,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            GATHER=gather, TOP_K=plan.top_k, BLOCK_E=triton.next_power_of_2(plan.num_experts),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, PRECISION=_precision(w.dtype),
            A_TMA=a_tma, W_TMA=w_tma, W_KN=w_kn, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out.to(a.dtype)


def _launch_weight_grad(dy: torch.Tensor, a: torch.Tensor, plan: ExpertPlan, gather: bool,
                        w_dtype: torch.dtype) -> torch.Tensor:
    """d w [E, N, K] from dy [S, N] and a [R, K] (tokens when ``gather``): per expert, the sum over
    its slots in slot order (:func:`rlperf.kernels.gemm.launch_weight_grad`, segmented by expert)."""
    return launch_weight_grad(dy, a, w_dtype, segments=plan.num_experts, segment_offsets=plan.expert_offsets,
                              rows_of_slot=plan.pair_of_slot if gather else None, top_k=plan.top_k,
                              config=expert_weight_grad_config(w_dtype))


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, plan, gather):
        ctx.save_for_backward(a, w)
        ctx.plan, ctx.gather = plan, gather
        return _launch_grouped(a, w, plan, gather)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        plan, gather = ctx.plan, ctx.gather
        g = g.to(a.dtype).contiguous()
        da = dw = None
        if ctx.needs_input_grad[0]:
            da = _launch_grouped(g, w.transpose(1, 2), plan, gather=False)  # [S, K], slot order
            if gather:  # a token's k slot rows summed in expert order, as the combine sums
                da = _launch_combine(da, plan, None, a.dtype)
        if ctx.needs_input_grad[1]:
            dw = _launch_weight_grad(g, a, plan, gather, w.dtype)
        return da, dw, None, None


def _check_grouped(a: torch.Tensor, w: torch.Tensor, plan: ExpertPlan, gather: bool) -> None:
    if a.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_matmul: a must be [R, K] and w [E, N, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_matmul: a {tuple(a.shape)} and w {tuple(w.shape)} disagree on K")
    if w.shape[0] != plan.num_experts:
        raise ValueError(f"grouped_matmul: w has {w.shape[0]} experts, the plan {plan.num_experts}")
    rows = plan.num_slots // plan.top_k if gather else plan.num_slots
    if a.shape[0] != rows:
        raise ValueError(f"grouped_matmul: a has {a.shape[0]} rows, expected {rows} "
                         f"({'tokens' if gather else 'slots'})")
    if a.dtype not in SUPPORTED_DTYPES or w.dtype != a.dtype:
        raise TypeError(f"grouped_matmul: a {a.dtype} and w {w.dtype} must be one of {SUPPORTED_DTYPES}")


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, plan: ExpertPlan, gather: bool = False) -> torch.Tensor:
    """Batch-invariant grouped GEMM: ``out[s] = a[row(s)] @ w[expert(s)].T`` -> [S, N] in a's dtype.

    a [R, K]: R = T tokens when ``gather`` (slot s reads its token ``plan.token_of_slot[s]``), else
    R = S rows already in slot order; w [E, N, K]. Differentiable in a and w (module docstring).
    """
    _check_grouped(a, w, plan, gather)
    if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
        return _GroupedMatmul.apply(a, w, plan, gather)
    return _launch_grouped(a, w, plan, gather)


# --------------------------------------------------------------------------------------------
# Combine
# --------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(y, weights, slot_of_pair, out, N, stride_ym, stride_om,
                    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # j in increasing expert index (moe_route lists them so)
        s = tl.load(slot_of_pair + t * TOP_K + j).to(tl.int64)
        v = tl.load(y + s * stride_ym + offs_n, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            v = v * tl.load(weights + t * TOP_K + j)
        acc += v
    tl.store(out + t * stride_om + offs_n, acc.to(out.dtype.element_ty), mask=mask)


def _launch_combine(y: torch.Tensor, plan: ExpertPlan, weights: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[slot(t, j)]`` (weights 1 when None): y [S, N] -> [T, N]."""
    s, n = y.shape
    t = s // plan.top_k
    if y.stride(1) != 1:
        y = y.contiguous()
    out = torch.empty(t, n, dtype=kernel_store_dtype(out_dtype, y.device), device=y.device)
    if t and n:
        w = weights.float().contiguous() if weights is not None else y
        _combine_kernel[(t, triton.cdiv(n, _COMBINE_BLOCK_N))](
            y, w, plan.slot_of_pair, out, n, y.stride(0), out.stride(0),
            TOP_K=plan.top_k, HAS_WEIGHTS=weights is not None, BLOCK_N=_COMBINE_BLOCK_N)
    return out.to(out_dtype)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, plan, out_dtype):
        ctx.save_for_backward(y, weights)
        ctx.plan = plan
        return _launch_combine(y, plan, weights, out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        y, weights = ctx.saved_tensors
        plan = ctx.plan
        pair = plan.pair_of_slot.long()
        g_pairs = g.float().repeat_interleave(plan.top_k, dim=0)       # [S, N], pair order
        dy = dweights = None
        if ctx.needs_input_grad[0]:  # slot s gets weights[pair] * g[token]: a gather, no scatter
            dy = (weights.reshape(-1, 1)[pair] * g_pairs[pair]).to(y.dtype)
        if ctx.needs_input_grad[1]:
            dweights = (g_pairs * y[plan.slot_of_pair.long()].float()).sum(-1).reshape(weights.shape)
        return dy, dweights, None, None


def moe_combine(y: torch.Tensor, plan: ExpertPlan, weights: torch.Tensor, out_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
    """Weighted combine: y [S, N] (slot order), weights [T, k] -> [T, N] of ``out_dtype`` (y's):
    ``out[t] = sum_j weights[t, j] y[slot(t, j)]`` in float32, j increasing, rounded once."""
    if y.dim() != 2 or y.shape[0] != plan.num_slots:
        raise ValueError(f"moe_combine: y must be [S, N] with S = {plan.num_slots}, got {tuple(y.shape)}")
    if weights.shape != (plan.num_slots // plan.top_k, plan.top_k):
        raise ValueError(f"moe_combine: weights must be [T, k] = "
                         f"({plan.num_slots // plan.top_k}, {plan.top_k}), got {tuple(weights.shape)}")
    out_dtype = out_dtype or y.dtype
    if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad):
        return _Combine.apply(y, weights, plan, out_dtype)
    return _launch_combine(y, plan, weights, out_dtype)


class _SlotRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return x[plan.token_of_slot.long()]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        return _launch_combine(g.contiguous(), ctx.plan, None, g.dtype), None


def moe_slot_rows(x: torch.Tensor, plan: ExpertPlan) -> torch.Tensor:
    """x [T, H] -> [S, H]: row s is its token's row ``x[plan.token_of_slot[s]]``. Its gradient sums a
    token's k slot rows in expert order (the combine's order, no scatter-add), as the grouped GEMM's
    gathered input does: the expert-parallel dispatch sends these rows."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _SlotRows.apply(x, plan)
    return x[plan.token_of_slot.long()]


# --------------------------------------------------------------------------------------------
# The expert block
# --------------------------------------------------------------------------------------------


def _grouped_mm_takes(x) -> bool:
    """Whether fast mode's stock expert block runs as ``torch._grouped_mm`` (CUDA, bf16), which keeps the
    expert counts on the device. Elsewhere it loops over the experts with their counts read on the host: fine
    on the CPU, but no CUDA graph can hold it, so on CUDA fast mode runs the kernels then (:func:`moe_experts`)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _experts_route(x, grad_inputs: tuple) -> str:
    """How :func:`moe_experts` runs ``x`` (a dispatch route): fast mode's stock op where it stays on the device
    (:func:`_grouped_mm_takes`) or runs on the CPU, the kernels otherwise; a stock op with gradients is
    differentiated by torch ("stock" again)."""
    stock_ok = not x.is_cuda or _grouped_mm_takes(x)
    how = route("moe_experts", x.device, grad_inputs, stock_ok=stock_ok)
    if how == "autograd" and route("moe_experts", x.device, stock_ok=stock_ok) == "stock":
        how = "stock"
    return how


def _torch_experts(x, experts, weights, w_gate_up, w_down):
    """Fast mode: stock torch (``torch._grouped_mm`` on CUDA bf16, else one F.linear per expert)."""
    t, k = experts.shape
    flat = experts.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    token = order // k
    xs = x[token]
    inter = w_down.shape[2]
    if _grouped_mm_takes(x):
        counts = torch.zeros(w_gate_up.shape[0], dtype=torch.int32, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w_down.transpose(1, 2), offs=offs)
    else:
        counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
        parts, start = [], 0
        for e, c in enumerate(counts):
            if c:
                h = F.linear(xs[start:start + c], w_gate_up[e])
                parts.append(F.linear(F.silu(h[:, :inter]) * h[:, inter:], w_down[e]))
            start += c
        y = torch.cat(parts) if parts else xs.new_zeros(0, w_down.shape[1])
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, token, y)


def _check_experts(x, experts, weights, w_gate_up, w_down) -> None:
    if x.dim() != 2 or experts.dim() != 2 or experts.shape[0] != x.shape[0] or weights.shape != experts.shape:
        raise ValueError(f"moe_experts: x [T, H], experts [T, k] and weights [T, k] expected, got "
                         f"{tuple(x.shape)}, {tuple(experts.shape)}, {tuple(weights.shape)}")
    e, two_i, h = w_gate_up.shape
    if h != x.shape[1] or two_i % 2 or tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"moe_experts: w_gate_up must be [E, 2I, H] and w_down [E, H, I] for H = {x.shape[1]}, got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """The expert block: x [T, H], experts [T, k] (increasing per row, as :func:`moe_route` gives
    them), weights [T, k], w_gate_up [E, 2I, H] (rows: gate, then up), w_down [E, H, I] -> [T, H]
    in x's dtype: ``out[t] = sum_j weights[t, j] down_e(silu(gate_e x_t) * up_e x_t)``.

    Invariant mode: permutation, two grouped GEMMs, SwiGLU and combine (module docstring), each
    batch-invariant; differentiable in x, weights and the expert weights. Fast mode: stock torch, except on
    CUDA in a dtype ``torch._grouped_mm`` does not take (not bf16), where the kernels run (so a CUDA graph
    can hold the step: :func:`_grouped_mm_takes`).
    """
    _check_experts(x, experts, weights, w_gate_up, w_down)
    how = _experts_route(x, (x, weights, w_gate_up, w_down))
    if how == "stock":
        return _torch_experts(x, experts, weights, w_gate_up, w_down)
    if how == "reference":
        return moe_experts_ref(x, experts, weights, w_gate_up, w_down).to(x.dtype)
    plan = moe_plan(experts, w_gate_up.shape[0])
    h = grouped_matmul(x, w_gate_up, plan, gather=True)
    y = grouped_matmul(silu_mul(h), w_down, plan)
    return moe_combine(y, plan, weights, x.dtype)
