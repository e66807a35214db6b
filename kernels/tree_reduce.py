"""Reductions whose order is fixed in advance, so that tensor parallelism never moves a bit.

Tensor parallelism splits the reduced dimension of three computations across ranks: the K of a
row-parallel matmul (``o_proj``, ``down_proj``), the N of a column-parallel matmul's input gradient
(``dx = g @ w``), and the vocabulary of the log-softmax. Summing rank partials with an all-reduce
changes the order of the float32 additions with the number of ranks (and the kernel of one GPU
sums K in yet another order), so a TP=2 trainer and a 1-GPU engine would disagree. Here the
reduced dimension is cut into a fixed number of **leaves** ``S`` (:data:`TREE_LEAVES`, a power of
two and a multiple of every supported TP size), each leaf's partial is computed alone, in float32,
by the batch-invariant kernel, and the partials are added in one fixed balanced binary tree::

    S = 4:   (p0 + p1) + (p2 + p3)          S = 8:   ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))

With ``t`` ranks (``t`` divides ``S``), rank ``r`` holds the contiguous leaves
``[r S/t, (r + 1) S/t)``: their tree is exactly one node of the full tree, so each rank reduces its
own node, the ``t`` nodes are all-gathered (float32) and every rank adds them in the tree's top
levels. TP=1 (all leaves on one rank), TP=2, TP=4 and TP=8 perform the same float32 additions on
the same operands: the bits are the same. The leaf partial itself is a function of the leaf only
(the matmul tile config is pinned to the full layer's shape, :func:`leaf_product`). On the Triton
backends a rank's node of a split-K product is one launch (:func:`_tree_node`: each leaf's K chain
into its own float32 accumulator and the tree's additions in registers), with the bits of a launch
per leaf and :func:`tree_sum` (``FUSED_LEAF_PRODUCTS``).

Ops (``group``: the tensor-parallel process group, None for one rank):

* :func:`tree_sum` — ``parts`` [S, ...] float32 -> [...] in the fixed tree; :func:`tree_sum_to` the same
  tree over float32 values of any dtype, rounded once to a given dtype, in one launch;
* :func:`row_parallel_linear` — ``y = x @ w.T`` with K split into leaves (forward tree; backward:
  ``dx``, ``dw`` have no reduction across the split);
* :func:`column_parallel_linear` — ``y = x @ w.T`` with N split (no reduction in the forward; the
  backward's ``dx = g @ w`` is the tree over N's leaves);
* :func:`column_shard_matmul` — a rank's columns of a product, in the whole product's tile config;
* :func:`tree_logprob` — the vocabulary-parallel log-prob and entropy: per leaf ``(max, sum-exp,
  entropy sum, target logit)``, combined in the tree; the backward's ``d hidden`` is the tree too.

Sequence parallelism (``sequence_parallel=True`` on the linear layers): outside the tensor-parallel
layers every rank holds a contiguous ``T / TP`` slice of the tokens. A column-parallel layer
all-gathers its input's tokens (a concatenation: exact); a row-parallel layer's output, and a
column-parallel layer's input gradient, are a **tree reduce-scatter**: each rank sends every other
rank that rank's tokens of its tree node (one all-to-all) and adds the ``TP`` nodes it receives in
the tree's top levels — per token the same additions on the same operands as the all-gather of
nodes, so the bits of a token are those of TP=1. :func:`token_parallel_rmsnorm` gives the RMSNorm
weights, applied per token, the gradient one rank holding every token computes: the norm kernel's
partial sums over fixed row blocks, all-gathered across the ranks in rank order and added once.

The rollout engine computes the same trees at TP=1 (``rlperf.model``'s ``reduction_leaves``), so
trainer and engine log-probs stay equal bit for bit whatever the trainer's tensor-parallel size.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import norm
from .dispatch import route
from .pipeline import grid_dependency_sync, launch_options
from .tile_dot import dot_acc, kernel_store_dtype

TREE_LEAVES = 8
"""Default leaf count S: the tree serves tensor-parallel sizes 1, 2, 4 and 8."""


# --------------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------------


def _check_leaves(leaves: int) -> None:
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"tree leaves must be a power of two >= 1, got {leaves}")


def tree_sum(parts) -> torch.Tensor:
    """Sum ``parts`` (a sequence or a leading dim of power-of-two length S) in the fixed balanced
    tree: adjacent pairs first, ``((p0 + p1) + (p2 + p3)) + ...``. A tensor's leading dim is added a
    level at a time (one element-wise add per level, log2(S) launches): the same pairs, the same bits."""
    if isinstance(parts, torch.Tensor):
        _check_leaves(parts.shape[0])
        while parts.shape[0] > 1:
            parts = parts[0::2] + parts[1::2]
        return parts[0]
    parts = list(parts)
    _check_leaves(len(parts))
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


@triton.jit
def _tree_sum_kernel(parts, out, N, stride_s, LEAVES: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = tree_sum(parts[:, i]) in float32 (adjacent pairs first), stored in out's dtype (one rounding)
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < N
    p = parts + offs
    v0 = tl.load(p, mask=keep, other=0.0).to(tl.float32)
    if LEAVES == 1:
        node = v0
    else:
        v1 = tl.load(p + stride_s, mask=keep, other=0.0).to(tl.float32)
        node = v0 + v1
        if LEAVES >= 4:
            v2 = tl.load(p + 2 * stride_s, mask=keep, other=0.0).to(tl.float32)
            v3 = tl.load(p + 3 * stride_s, mask=keep, other=0.0).to(tl.float32)
            node = node + (v2 + v3)
        if LEAVES == 8:
            v4 = tl.load(p + 4 * stride_s, mask=keep, other=0.0).to(tl.float32)
            v5 = tl.load(p + 5 * stride_s, mask=keep, other=0.0).to(tl.float32)
            v6 = tl.load(p + 6 * stride_s, mask=keep, other=0.0).to(tl.float32)
            v7 = tl.load(p + 7 * stride_s, mask=keep, other=0.0).to(tl.float32)
            node = node + ((v4 + v5) + (v6 + v7))
    tl.store(out + offs, node, mask=keep)


_TREE_SUM_BLOCK = 1024


def tree_sum_to(parts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``tree_sum(parts.float()).to(out_dtype)`` for ``parts`` [S, ...] (S in 1, 2, 4, 8): the same float32
    additions in the same tree and one rounding, as one launch where the policy runs Triton kernels
    (instead of a cast, log2(S) adds and a cast); bf16 off the GPU is rounded by torch
    (``kernel_store_dtype``)."""
    _check_leaves(parts.shape[0])
    how = route("matmul", parts.device)
    if how not in ("triton", "interpreter") or parts.shape[0] not in _FUSED_TREE_SIZES:
        return tree_sum(parts.float()).to(out_dtype)
    flat = parts.reshape(parts.shape[0], -1)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = torch.empty(parts.shape[1:], dtype=kernel_store_dtype(out_dtype, parts.device), device=parts.device)
    n = out.numel()
    if n:
        _tree_sum_kernel[(triton.cdiv(n, _TREE_SUM_BLOCK),)](flat, out, n, flat.stride(0), LEAVES=parts.shape[0],
                                                             BLOCK=_TREE_SUM_BLOCK, **launch_options(parts.device))
    return out.to(out_dtype)


class _TreeStack:
    """Adds leaves as they arrive, in the order of :func:`tree_sum` (a binary counter: two partial
    sums of the same height are added as soon as both exist), keeping at most log2(S) + 1 partials
    alive instead of S."""

    def __init__(self, combine=torch.add):
        self.stack: list[tuple[int, object]] = []
        self.combine = combine

    def push(self, value) -> None:
        height = 0
        while self.stack and self.stack[-1][0] == height:
            _, left = self.stack.pop()
            value = self.combine(left, value)
            height += 1
        self.stack.append((height, value))

    def result(self):
        if len(self.stack) != 1:
            raise ValueError("tree: the number of leaves pushed is not a power of two")
        return self.stack[0][1]


def group_size_rank(group) -> tuple[int, int]:
    """``(size, rank)`` of a tensor-parallel process group; ``(1, 0)`` for None (one rank)."""
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)



def all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``x`` (the same shape on each), in rank order: a copy, no arithmetic."""
    size, _ = group_size_rank(group)
    if size == 1:
        return [x]
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return parts


def _local_leaves(leaves: int, group, what: str) -> int:
    _check_leaves(leaves)
    size, _ = group_size_rank(group)
    if leaves % size:
        raise ValueError(f"{what}: {leaves} tree leaves cannot be split over {size} tensor-parallel ranks "
                         f"(the leaf count must be a multiple of the TP size)")
    return leaves // size


def _gather_nodes(node, group, combine=None):
    """All ranks' tree nodes (this rank's included), added in the top levels of the tree."""
    size, _ = group_size_rank(group)
    if size == 1:
        return node
    import torch.distributed as dist

    if isinstance(node, tuple):  # several tensors per node: gather them stacked
        stacked = torch.stack(node).contiguous()
        got = [torch.empty_like(stacked) for _ in range(size)]
        dist.all_gather(got, stacked, group=group)
        nodes = [tuple(g.unbind(0)) for g in got]
    else:
        node = node.contiguous()
        nodes = [torch.empty_like(node) for _ in range(size)]
        dist.all_gather(nodes, node, group=group)
    acc = _TreeStack(combine or torch.add)
    for n in nodes:
        acc.push(n)
    return acc.result()


def _scatter_nodes(node: torch.Tensor, group) -> torch.Tensor:
    """The tree reduce-scatter over tokens: ``node`` [T, ...] is this rank's tree node for every token;
    returns [T / TP, ...], this rank's contiguous token slice of the full tree sum (the ranks' nodes
    added in the tree's top levels, as :func:`_gather_nodes` adds them: the same bits per token)."""
    size, _ = group_size_rank(group)
    if size == 1:
        return node
    import torch.distributed as dist

    if node.shape[0] % size:
        raise ValueError(f"sequence parallel: {node.shape[0]} tokens do not split over {size} ranks")
    send = [c.contiguous() for c in node.chunk(size, dim=0)]
    got = [torch.empty_like(send[0]) for _ in range(size)]
    dist.all_to_all(got, send, group=group)
    acc = _TreeStack()
    for n in got:
        acc.push(n)
    return acc.result()


def _all_gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[T / TP, ...] per rank -> [T, ...]: the ranks' token slices concatenated in rank order."""
    parts = all_gather(x, group)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _own_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice [T / TP, ...] of the tokens [T, ...]."""
    size, rank = group_size_rank(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence parallel: {x.shape[0]} tokens do not split over {size} ranks")
    n = x.shape[0] // size
    return x[rank * n:(rank + 1) * n]


class _ScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_tokens(x, group).clone()

    @staticmethod
    def backward(ctx, g):
        return _all_gather_tokens(g, ctx.group), None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_tokens(x, group)

    @staticmethod
    def backward(ctx, g):
        return _own_tokens(g, ctx.group).contiguous(), None


def scatter_tokens(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter the sequence-parallel region: ``x`` [T, ...] (the same on every rank) -> this rank's
    token slice [T / TP, ...]. Backward: the slices' gradients all-gathered (no sum)."""
    return _ScatterTokens.apply(x, group)


def gather_tokens(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave the sequence-parallel region: this rank's tokens [T / TP, ...] -> all tokens [T, ...].
    Backward: this rank's slice of the gradient, which must be the whole gradient on every rank (as
    :func:`tree_logprob`'s ``d hidden`` is: the ranks' vocabulary nodes added in the tree)."""
    return _GatherTokens.apply(x, group)


class _TokenParallelRMSNorm(torch.autograd.Function):
    """:func:`token_parallel_rmsnorm` over ``group`` of two or more ranks (one rank: ``rmsnorm`` itself)."""

    @staticmethod
    def forward(ctx, x, weight, eps, group, kernels):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.group, ctx.kernels = eps, group, kernels
        with torch.no_grad():
            return norm.rmsnorm(x, weight, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if ctx.kernels:  # this rank's partials are the whole range's partials [r P/TP, (r+1) P/TP): gather, sum once
            dx, partials = norm.rmsnorm_backward(dy, x, weight, ctx.eps, return_partials=True)
            return dx, norm.sum_partials(_all_gather_tokens(partials, ctx.group), weight.dtype), None, None, None
        # the reference (and fast mode's stock op): every token on every rank, the one-rank gradients, own rows
        xs = _all_gather_tokens(x.detach(), ctx.group).requires_grad_()
        w = weight.detach().requires_grad_()
        with torch.enable_grad():
            y = norm.rmsnorm(xs, w, ctx.eps)
        dx, dw = torch.autograd.grad(y, (xs, w), _all_gather_tokens(dy.contiguous(), ctx.group))
        return _own_tokens(dx, ctx.group).contiguous(), dw, None, None, None


def token_parallel_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, group=None) -> torch.Tensor:
    """``rmsnorm(x, weight, eps)`` of x [T_local, ..., H], this rank's contiguous share of the tokens under
    sequence parallelism over ``group`` (None: every token here), whose weight gradient is the one a single
    rank holding every token computes, bit for bit, at any group size.

    The forward is row-invariant. The weight's gradient is a sum over tokens: on the kernels it is
    :func:`rlperf.kernels.norm.rmsnorm_backward`'s partial sums over fixed blocks of
    :func:`~rlperf.kernels.norm.rmsnorm_grad_rows` consecutive rows, added once in a fixed order; a rank
    whose share starts at a multiple of that block computes exactly its blocks' partials, so the ranks'
    partials all-gathered in rank order are the whole range's, and one ``sum_partials`` gives the one-rank
    bits (T_local must be a multiple of the block under a group). Rows appended with a zero gradient
    (a micro-batch padded further) add zero partials: the bits stay. The reference backend and fast
    mode's stock op gather every token and run the one-rank gradient."""
    size, _ = group_size_rank(group)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if size == 1 or not needs_grad:
        return norm.rmsnorm(x, weight, eps)
    kernels = route("rmsnorm", x.device, (x, weight)) == "autograd" and route("rmsnorm", x.device) != "stock"
    rows = norm.rmsnorm_grad_rows(x.shape[-1])
    if kernels and (x.numel() // x.shape[-1]) % rows:
        raise ValueError(f"token_parallel_rmsnorm: this rank's {x.numel() // x.shape[-1]} tokens are not a multiple "
                         f"of the norm gradient's {rows}-row blocks (pad the micro-batch to a multiple of {rows} x "
                         f"{size} tokens)")
    return _TokenParallelRMSNorm.apply(x, weight, eps, group, kernels)


# --------------------------------------------------------------------------------------------
# Leaf products
# --------------------------------------------------------------------------------------------


def leaf_product(a: torch.Tensor, b: torch.Tensor, config_n: int | None = None) -> torch.Tensor:
    """``a [M, K] @ b[N, K].T`` -> [M, N] float32, by the batch-invariant path of the current policy.

    ``config_n``: the N whose tile config the Triton kernel uses (default N): a column-parallel shard
    passes the full layer's N, so a column's bits do not depend on how many columns this rank holds.
    The reference backend multiplies in float64 (exact products, row- and column-position invariant)
    and rounds once; fast mode uses stock torch (not invariant).
    """
    how = route("matmul", a.device)
    if how in ("triton", "interpreter"):
        from . import gemm

        cfg = gemm.matmul_config(a.dtype, config_n or b.shape[0], a.shape[1], a.shape[0])
        return gemm.launch(a, b, None, torch.float32, config=cfg)
    if how == "reference":
        return (a.double() @ b.double().T).float()
    return F.linear(a.float(), b.float())


# One launch per tree node: every leaf's partial product and the tree over them, in registers.
FUSED_LEAF_PRODUCTS = True
"""Compute a rank's tree node of a split-K product (:func:`tree_matmul`, ``column_parallel_linear``'s
``dx``) in one launch of :func:`_tree_node_kernel` instead of a launch per leaf plus the tree's adds
(2 S - 1 launches). The bits are the same either way (each leaf's BLOCK_K chain and the tree's float32
additions are those of :func:`leaf_product` and :func:`tree_sum`); False keeps the per-leaf launches,
for A/B timing and tests."""
_FUSED_TREE_SIZES = (1, 2, 4, 8)  # the node sizes the kernel unrolls (TREE_LEAVES / TP for TP 1..8)


@triton.jit
def _leaf_partial(x, w, leaf, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # x[rows, leaf's K] @ w[cols, leaf's K].T into a fresh float32 accumulator, BLOCK_K at a time in
    # increasing K: the chain gemm's kernel runs on the leaf's slice (its tail zero-masked in both).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = leaf * LEAF_K
    for ki in range(tl.cdiv(LEAF_K, BLOCK_K)):
        k = ki * BLOCK_K + offs_k
        inside = k < LEAF_K
        a = tl.load(x + rows.to(tl.int64)[:, None] * stride_xm + (k0 + k)[None, :] * stride_xk,
                    mask=inside[None, :], other=0.0)
        b = tl.load(w + cols.to(tl.int64)[:, None] * stride_wn + (k0 + k)[None, :] * stride_wk,
                    mask=inside[None, :], other=0.0)
        acc = dot_acc(a, b.T, acc, PRECISION)
    return acc


@triton.jit
def _leaf_pair(x, w, first, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # leaves first, first + 1 added: a height-1 node of the tree
    a = _leaf_partial(x, w, first, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                      BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    b = _leaf_partial(x, w, first + 1, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                      BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    return a + b


@triton.jit
def _leaf_quad(x, w, first, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # leaves first .. first + 3: (p0 + p1) + (p2 + p3), a height-2 node
    left = _leaf_pair(x, w, first, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                      BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    right = _leaf_pair(x, w, first + 2, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    return left + right


@triton.jit(do_not_specialize=["M"])
def _tree_node_kernel(x, w, out, M, N, LEAF_K, stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                      LEAVES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr):
    # out[m, n] = the balanced tree over LEAVES leaf partials (tree_sum's order: adjacent pairs first),
    # in float32. Rows past M / columns past N read row / column 0 and are never stored.
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0)
    cols = tl.where(offs_n < N, offs_n, 0)
    # explicit calls (no *args): the leaf index is the only argument that changes
    if LEAVES == 1:
        node = _leaf_partial(x, w, 0, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                             BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    elif LEAVES == 2:
        node = _leaf_pair(x, w, 0, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                          BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    elif LEAVES == 4:
        node = _leaf_quad(x, w, 0, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                          BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    else:  # 8
        left = _leaf_quad(x, w, 0, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                          BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        right = _leaf_quad(x, w, 4, LEAF_K, rows, cols, stride_xm, stride_xk, stride_wn, stride_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        node = left + right
    o_ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, node, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


TREE_NODE_TILES = {
    "m64n64w4s3": (64, 64, 4, 3),
    "m128n64w8s3": (128, 64, 8, 3),
    "m64n128w8s3": (64, 128, 8, 3),
}
"""Launch choices of :func:`_tree_node_kernel`: ``name: (BLOCK_M, BLOCK_N, num_warps, num_stages)``. The
bits do not depend on the choice (each leaf's BLOCK_K chain is the leaf product's). Measured on an H200
(``python -m rlperf.bench.tree_node_sweep``, bench/BENCHMARKS.md): all three within 2% of each other, at
0.29-0.30x cuBLAS over the 0.6b shapes; larger tiles hold more live accumulators (up to log2(S) + 2)
than the registers do well."""
TREE_NODE_TILE = "m64n64w4s3"
"""The :data:`TREE_NODE_TILES` entry :func:`_tree_node` launches."""


def _tree_node(a: torch.Tensor, b: torch.Tensor, leaves: int, config_n: int | None = None,
               tile: str | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's tree node of ``a [M, K_local] @ b[N, K_local].T`` -> [M, N] in float32, rounded once to
    ``out_dtype`` (a node that is the whole tree: one rank): ``leaves`` equal
    K slices, each :func:`leaf_product` (tile config of ``config_n``, default N), added in the tree.
    One launch (``tile``, default :data:`TREE_NODE_TILE`, from :data:`TREE_NODE_TILES`) where the
    policy runs Triton kernels and ``leaves`` is one of the kernel's sizes (``b`` read through its
    strides); else a launch per leaf and the tree's adds (the same bits)."""
    width = a.shape[1] // leaves
    how = route("matmul", a.device)
    if FUSED_LEAF_PRODUCTS and how in ("triton", "interpreter") and leaves in _FUSED_TREE_SIZES and a.shape[0] > 0:
        from . import gemm

        block_m, block_n, warps, stages = TREE_NODE_TILES[tile or TREE_NODE_TILE]
        M, N = a.shape[0], b.shape[0]
        block_k = gemm.matmul_config(a.dtype, config_n or N, width, M).BLOCK_K  # the leaf products' K steps
        # the kernel's store rounds to out's dtype (kernel_store_dtype: float32 for bf16 off the GPU)
        out = torch.empty((M, N), dtype=kernel_store_dtype(out_dtype, a.device), device=a.device)
        grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
        _tree_node_kernel[grid](a, b, out, M, N, width, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                out.stride(0), out.stride(1), LEAVES=leaves, BLOCK_M=block_m, BLOCK_N=block_n,
                                BLOCK_K=block_k, PRECISION="tf32x3" if a.dtype == torch.float32 else "tf32",
                                num_warps=warps, num_stages=stages, **launch_options(a.device))
        return out.to(out_dtype)
    acc = _TreeStack()
    for c in range(leaves):
        acc.push(leaf_product(a[:, c * width:(c + 1) * width], b[:, c * width:(c + 1) * width], config_n))
    return acc.result().to(out_dtype)


def _matmul_out(a, b, out_dtype, config_n=None):
    """``a @ b.T`` in ``out_dtype``: rounded once from float32 (the kernel's cast on the GPU)."""
    how = route("matmul", a.device)
    if how in ("triton", "interpreter"):
        from . import gemm

        cfg = gemm.matmul_config(a.dtype, config_n or b.shape[0], a.shape[1], a.shape[0])
        return gemm.launch(a, b, None, out_dtype, config=cfg)
    return leaf_product(a, b, config_n).to(out_dtype)


def _input_grad_out(g: torch.Tensor, w: torch.Tensor, out_dtype, config_n: int) -> torch.Tensor:
    """``dx = g [M, N] @ w [N, K]`` -> [M, K] in ``out_dtype``, in the tile config of a ``[*, config_n]``
    product (the whole layer's K: a rank's columns keep their bits). On the kernels ``w`` is read in
    place (``gemm.launch(..., w_kn=True)``); elsewhere it is :func:`_matmul_out` on ``w.T``."""
    if route("matmul", g.device) in ("triton", "interpreter"):
        from . import gemm

        cfg = gemm.matmul_config(g.dtype, config_n, w.shape[0], g.shape[0], swapped_ok=False)
        return gemm.launch(g, w, None, out_dtype, config=cfg, w_kn=True)
    return _matmul_out(g, w.T.contiguous(), out_dtype, config_n=config_n)


def _weight_grad_out(g: torch.Tensor, x: torch.Tensor, out_dtype, config_n: int | None = None) -> torch.Tensor:
    """``dw = g [M, N].T @ x [M, K]`` -> [N, K] in ``out_dtype``: a sum over the M tokens. On the kernels
    it is ``gemm.launch_weight_grad`` (g and x read in place; every element's sum runs over the tokens in
    fixed blocks of rows whatever N and K are, so a rank's rows or columns of dw keep their bits at any
    TP); elsewhere :func:`_matmul_out` on the transposes (``config_n`` pins its tile config)."""
    if route("matmul", g.device) in ("triton", "interpreter"):
        from . import gemm

        return gemm.launch_weight_grad(g, x, out_dtype)[0]
    return _matmul_out(g.T.contiguous(), x.T.contiguous(), out_dtype, config_n=config_n)


def column_shard_matmul(x: torch.Tensor, w: torch.Tensor, n_total: int, out_dtype: torch.dtype | None = None):
    """``x [M, K] @ w[N_local, K].T`` -> [M, N_local] in ``out_dtype`` (default x's), in the tile config of
    the whole ``[n_total, K]`` product: each column the bits it has in the unsplit product (e.g. a rank's
    vocabulary slice of the LM-head logits, a rank's q/k/v or gate/up rows in plain tensor parallelism).
    Off the kernels (reference backend, fast mode's stock op) it is :func:`rlperf.kernels.gemm.matmul` on the
    shard, which the reference computes per element in float64 (column-position invariant) and rounds once.
    No autograd (an engine's forward)."""
    if route("matmul", x.device) in ("triton", "interpreter"):
        return _matmul_out(x, w, out_dtype or x.dtype, config_n=n_total)
    from . import gemm

    return gemm.matmul(x, w, None, out_dtype or x.dtype)


def tree_matmul(x: torch.Tensor, w: torch.Tensor, leaves: int = TREE_LEAVES, group=None) -> torch.Tensor:
    """``x [M, K_local] @ w[N, K_local].T`` -> [M, N] float32, K reduced in the fixed tree.

    ``K_local`` is this rank's share of K (all of it without ``group``); it holds ``leaves / TP``
    leaves of equal width. Every rank returns the full sum."""
    return _gather_nodes(_local_tree_matmul(x, w, leaves, group), group)


def _local_tree_matmul(x: torch.Tensor, w: torch.Tensor, leaves: int, group,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's tree node of :func:`tree_matmul` (its K leaves added in the tree): [M, N] float32,
    or rounded once to ``out_dtype``."""
    local = _local_leaves(leaves, group, "tree_matmul")
    if x.shape[1] % local:
        raise ValueError(f"tree_matmul: K = {x.shape[1]} on this rank does not split into {local} equal leaves")
    return _tree_node(x, w, local, config_n=w.shape[0], out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# Row- and column-parallel linear layers (autograd)
# --------------------------------------------------------------------------------------------


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, leaves, group, k_total, sequence_parallel):
        ctx.save_for_backward(x, w)
        ctx.k_total, ctx.group, ctx.sequence_parallel = k_total, group, sequence_parallel
        if sequence_parallel:
            return _scatter_nodes(_local_tree_matmul(x, w, leaves, group), group).to(x.dtype)
        if group_size_rank(group)[0] == 1:  # the node is the whole tree: rounded by the kernel's store
            return _local_tree_matmul(x, w, leaves, group, out_dtype=x.dtype)
        return tree_matmul(x, w, leaves, group).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        if ctx.sequence_parallel:  # this rank's tokens' gradient -> every token's (a concatenation)
            g = _all_gather_tokens(g, ctx.group)
        gx = gw = None
        # dx [M, K_local] = g @ w: a reduction over N, which every rank holds whole
        if ctx.needs_input_grad[0]:
            gx = _input_grad_out(g, w, x.dtype, config_n=ctx.k_total)
        # dw [N, K_local] = g.T @ x: a reduction over the tokens
        if ctx.needs_input_grad[1]:
            gw = _weight_grad_out(g, x, w.dtype, config_n=ctx.k_total)
        return gx, gw, None, None, None, None


def row_parallel_linear(x: torch.Tensor, w: torch.Tensor, leaves: int = TREE_LEAVES, group=None,
                        sequence_parallel: bool = False) -> torch.Tensor:
    """``x [..., K_local] @ w[N, K_local].T`` -> [..., N] in x's dtype: K (split over ``group``) reduced
    in the fixed tree (:func:`tree_matmul`), rounded once. Gradients: ``dx = g @ w`` (tile config
    pinned to the full K) and ``dw = g.T @ x`` (a sum over the tokens): no cross-rank sum in either.

    ``sequence_parallel``: x [T, K_local] holds every token, the result [T / TP, N] this rank's tokens
    (the tree reduce-scatter, module docstring); the backward all-gathers the tokens' gradient."""
    size, _ = group_size_rank(group)
    lead = x.shape[:-1]
    y = _RowParallel.apply(x.reshape(-1, x.shape[-1]), w, leaves, group, w.shape[1] * size, sequence_parallel)
    if sequence_parallel:
        return y.reshape(-1, *lead[1:], w.shape[0])
    return y.reshape(*lead, w.shape[0])


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, leaves, group, n_total, sequence_parallel):
        if sequence_parallel:  # this rank's tokens -> every token (a concatenation: exact)
            x = _all_gather_tokens(x, group)
        ctx.save_for_backward(x, w)
        ctx.leaves, ctx.group, ctx.n_total, ctx.sequence_parallel = leaves, group, n_total, sequence_parallel
        return _matmul_out(x, w, x.dtype, config_n=n_total)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            # dx [M, K] = g [M, N_local] @ w [N_local, K]: N is split over the ranks -> the tree
            local = _local_leaves(ctx.leaves, ctx.group, "column_parallel_linear")
            # w.T [K, N_local] as a copy: the tree node kernel read through the transposed view's strides
            # took 4x as long on an H200 (128.5 against 31 ms per 0.6b step, bench/BENCHMARKS.md)
            one_rank = group_size_rank(ctx.group)[0] == 1 and not ctx.sequence_parallel
            node = _tree_node(g, w.T.contiguous(), local, out_dtype=x.dtype if one_rank else torch.float32)
            if one_rank:  # the node is the whole tree, rounded by the kernel's store
                gx = node
            elif ctx.sequence_parallel:
                gx = _scatter_nodes(node, ctx.group).to(x.dtype)
            else:
                gx = _gather_nodes(node, ctx.group).to(x.dtype)
        if ctx.needs_input_grad[1]:
            # dw [N_local, K] = g.T @ x: rows of dw are rows of the product (batch invariance)
            gw = _weight_grad_out(g, x, w.dtype)
        return gx, gw, None, None, None, None


def column_parallel_linear(x: torch.Tensor, w: torch.Tensor, leaves: int = TREE_LEAVES, group=None,
                           sequence_parallel: bool = False) -> torch.Tensor:
    """``x [..., K] @ w[N_local, K].T`` -> [..., N_local] in x's dtype: the forward is the plain
    batch-invariant matmul with its tile config pinned to the full N (a column's bits do not depend
    on the split); the backward's ``dx`` sums N's leaves in the fixed tree.

    ``w``'s rows must be in leaf order: leaf ``c`` is rows ``[c N_local / (S/TP), ...)`` on every
    rank, so a fused weight (q/k/v, gate/up) is stored leaf-blocked (each leaf holds its slice of
    every part), not part after part.

    ``sequence_parallel``: x [T / TP, K] holds this rank's tokens; they are all-gathered first (the
    result is [T, N_local]) and ``dx`` is the tree reduce-scatter back to this rank's tokens."""
    size, _ = group_size_rank(group)
    local = _local_leaves(leaves, group, "column_parallel_linear")
    if w.shape[0] % local:
        raise ValueError(f"column_parallel_linear: N = {w.shape[0]} on this rank does not split into {local} leaves")
    lead = x.shape[:-1]
    y = _ColumnParallel.apply(x.reshape(-1, x.shape[-1]), w, leaves, group, w.shape[0] * size, sequence_parallel)
    if sequence_parallel:
        return y.reshape(-1, *lead[1:], w.shape[0])
    return y.reshape(*lead, w.shape[0])


# --------------------------------------------------------------------------------------------
# Vocabulary-parallel log-prob and entropy
# --------------------------------------------------------------------------------------------
#
# Per leaf (a contiguous slice of the vocabulary), in raw logit units x = hidden . weight[j]:
#   m  = max_j x_j,   s = sum_j exp((x_j - m) / T),   e = sum_j exp((x_j - m) / T) (x_j - m),
#   tz = x_target if the target is in the leaf else 0.
# Two nodes combine as (r = max(m1, m2); a_i = exp((m_i - r) / T); d_i = m_i - r, 0 when m_i = -inf):
#   s = a1 s1 + a2 s2,   e = a1 (e1 + d1 s1) + a2 (e2 + d2 s2),   tz = tz1 + tz2,   m = r.
# At the root: lse = m / T + log s,  logp = (tz - m) / T - log s,  entropy = log s - e / (s T).


def _combine_stats(left, right, inv_t: float):
    m1, s1, e1, z1 = left
    m2, s2, e2, z2 = right
    m = torch.maximum(m1, m2)
    r = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    a1, a2 = torch.exp((m1 - r) * inv_t), torch.exp((m2 - r) * inv_t)
    d1 = torch.where(torch.isneginf(m1), torch.zeros_like(m1), m1 - r)
    d2 = torch.where(torch.isneginf(m2), torch.zeros_like(m2), m2 - r)
    return m, a1 * s1 + a2 * s2, a1 * (e1 + d1 * s1) + a2 * (e2 + d2 * s2), z1 + z2


def _combine_levels(leaves: list[tuple], combine):
    """The fixed tree of :func:`_combine_stats` over ``leaves`` (a power of two of (m, s, e, tz) tuples of
    [N] tensors) a level at a time: the leaves' statistics stacked [S, N], each level one ``combine`` of
    the even rows with the odd rows — the tree's pairs, so per element the same operations on the same
    operands as the pairwise :class:`_TreeStack`, in log2(S) combines instead of S - 1 (each 29
    element-wise launches; at S = 8 91 launches with the stacks instead of 203). CUDA only: there an element-wise op rounds an element the same wherever it
    sits; torch's CPU ``exp`` may round an element in a vector body and in a loop's tail differently, so
    the CPU keeps the pairwise order of operand shapes."""
    level = tuple(torch.stack(parts) for parts in zip(*leaves))
    while level[0].shape[0] > 1:
        level = combine(tuple(t[0::2] for t in level), tuple(t[1::2] for t in level))
    return tuple(t[0] for t in level)


def _leaf_stats(hidden, weight, targets, inv_t: float, v_offset: int, v_total: int):
    """(m, s, e, tz) [N] float32 of one vocabulary leaf ``weight`` [Vl, H] starting at ``v_offset``."""
    how = route("fused_logprob", hidden.device)
    if how in ("triton", "interpreter"):
        from .fused_lm_head import _local_stats

        m, s, t, tz = _local_stats(hidden, weight, targets, inv_t, v_offset, v_total, True, False)
        # the kernel's running sums use exp2((x - m) c) with c = log2(e) / T: the same exp((x - m) / T)
        # up to its rounding; t is sum exp(...) (x - m), e here
        return m, s, t, tz
    x = hidden.double() @ weight.double().T  # [N, Vl], exact products, one rounding below
    x = x.float().double()
    m = x.max(dim=1).values
    p = torch.exp((x - m[:, None]) * inv_t)
    local = targets - v_offset
    inside = (local >= 0) & (local < weight.shape[0])
    tz = torch.where(inside, x.gather(1, local.clamp(0, weight.shape[0] - 1)[:, None]).squeeze(1),
                     torch.zeros_like(m))
    return m.float(), p.sum(1).float(), (p * (x - m[:, None])).sum(1).float(), tz.float()


def _forward_stats(hidden, weight, targets, inv_t, leaves, group):
    size, rank = group_size_rank(group)
    local = _local_leaves(leaves, group, "tree_logprob")
    v_local = weight.shape[0]
    if v_local % local:
        raise ValueError(f"tree_logprob: this rank's vocabulary slice ({v_local}) does not split into {local} leaves")
    width = v_local // local
    v_total = v_local * size
    combine = functools.partial(_combine_stats, inv_t=inv_t)
    stats = (_leaf_stats(hidden, weight[c * width:(c + 1) * width], targets, inv_t, rank * v_local + c * width, v_total)
             for c in range(local))
    if hidden.device.type == "cuda" and local > 1:
        node = _combine_levels(list(stats), combine)
    else:
        acc = _TreeStack(combine)
        for leaf in stats:
            acc.push(leaf)
        node = acc.result()
    m, s, e, tz = _gather_nodes(node, group, combine)
    log_s = torch.log(s)
    valid = (targets >= 0) & (targets < v_total)
    # <= 0, as fused_logprob reports it (rounding can put a near-certain token a few ulps above 0)
    logp = torch.where(valid, (tz - m) * inv_t - log_s, torch.full_like(log_s, math.nan)).clamp_(max=0.0)
    entropy = log_s - (e / s) * inv_t
    lse = m * inv_t + log_s
    return logp, entropy, lse


def _leaf_backward(hidden, weight, targets, lse, ent, g_lp, g_ent, inv_t, v_offset, grad_h, grad_w):
    """Add one vocabulary leaf's d hidden into ``grad_h`` ([N, H] float32, zeros) and write its d weight
    into ``grad_w`` ([Vl, H], the leaf's rows of the weight gradient)."""
    how = route("fused_logprob", hidden.device)
    if how in ("triton", "interpreter"):
        from .fused_lm_head import _backward

        _backward(hidden, weight, targets, lse, ent, g_lp, g_ent, inv_t, v_offset, True, True, True,
                  grad_h=grad_h, grad_w=grad_w)
        return
    x = (hidden.double() @ weight.double().T).float().double()
    z = x * inv_t
    p = torch.exp(z - lse.double()[:, None])
    local = targets - v_offset
    onehot = torch.zeros_like(p)
    inside = (local >= 0) & (local < weight.shape[0])
    onehot[inside, local[inside]] = 1.0
    dz = g_lp.double()[:, None] * (onehot - p) - g_ent.double()[:, None] * p * (z - lse.double()[:, None]
                                                                                + ent.double()[:, None])
    dx = dz * inv_t
    grad_h.copy_((dx @ weight.double()).float())
    grad_w.copy_(dx.T @ hidden.double())


class _TreeLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, leaves, group):
        logp, ent, lse = _forward_stats(hidden, weight, targets, inv_t, leaves, group)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_t, ctx.leaves, ctx.group = inv_t, leaves, group
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.contiguous().float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.contiguous().float()
        size, rank = group_size_rank(ctx.group)
        local = ctx.leaves // size
        width = weight.shape[0] // local
        # each leaf writes its rows of d weight in place and its d hidden into its own float32 slot; the slots
        # are added in the fixed tree (tree_sum_to: the tree's pairs, one launch on the kernels)
        grad_w = torch.empty_like(weight)
        leaf_h = torch.zeros((local, *hidden.shape), dtype=torch.float32, device=hidden.device)
        for c in range(local):
            off = rank * weight.shape[0] + c * width
            _leaf_backward(hidden, weight[c * width:(c + 1) * width], targets, lse, ent, g_lp, g_ent, ctx.inv_t, off,
                           leaf_h[c], grad_w[c * width:(c + 1) * width])
        grad_h = _gather_nodes(tree_sum_to(leaf_h, torch.float32), ctx.group)
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None


def tree_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 return_entropy: bool = False, leaves: int = TREE_LEAVES, group=None):
    """Log-prob (and entropy) of ``targets`` under ``softmax(hidden @ weight_full.T / T)``, the
    vocabulary reduced in the fixed tree of ``leaves`` slices (module docstring).

    hidden [N, H]; weight [V_local, H] (this rank's contiguous V/TP slice under ``group``, rank order);
    targets [N] ids in [0, V) (NaN log-prob otherwise). Returns logp [N] float32 (and entropy [N]);
    differentiable in hidden and weight. Never holds more than one leaf's [N, V/S] logits (and on the
    GPU only the fused kernel's tiles of it)."""
    if not temperature > 0:
        raise ValueError(f"tree_logprob: temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"tree_logprob: hidden [N, H] {list(hidden.shape)} and weight [V, H] {list(weight.shape)}")
    hidden = hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    logp, ent = _TreeLogprob.apply(hidden, weight, targets.to(torch.int64).contiguous(), 1.0 / float(temperature),
                                   leaves, group)
    return (logp, ent) if return_entropy else logp


def head_blocks(num_heads: int, num_kv_heads: int, leaves: int) -> int:
    """How many blocks the heads are cut into for the q/k norm: ``min(leaves, num_kv_heads)`` (a
    power of two dividing both head counts), so that a TP rank's heads are whole blocks."""
    blocks = min(leaves, num_kv_heads)
    if blocks & (blocks - 1) or num_kv_heads % blocks or num_heads % blocks:
        raise ValueError(f"{num_heads} query / {num_kv_heads} key-value heads do not split into {blocks} blocks "
                         f"(a power of two dividing both)")
    return blocks


# --------------------------------------------------------------------------------------------
# A replicated weight used on each block of a split dimension
# --------------------------------------------------------------------------------------------


class _BlockReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, blocks, leaves, group):
        ctx.leaves, ctx.group = leaves, group
        return weight.detach()[None].expand(blocks, *weight.shape).clone()

    @staticmethod
    def backward(ctx, grad):
        size, _ = group_size_rank(ctx.group)
        if size == 1:  # the whole tree on this rank: one launch, rounded once to the gradient's dtype
            return tree_sum_to(grad, grad.dtype), None, None, None
        return _gather_nodes(tree_sum_to(grad, torch.float32), ctx.group).to(grad.dtype), None, None, None


def block_replicas(weight: torch.Tensor, leaves: int, group=None) -> torch.Tensor:
    """``leaves / TP`` copies [blocks, *weight.shape] of a replicated ``weight`` (e.g. the q/k RMSNorm
    weight), one per block of a dimension split over ``group`` (e.g. attention heads); the caller
    applies copy ``b`` to block ``b``. Backward: the blocks' weight gradients are added in the fixed
    tree (the ranks' nodes gathered), so the weight's gradient is the same at every TP size and on
    every rank, instead of a per-rank partial that an all-reduce would add in a TP-dependent order."""
    blocks = _local_leaves(leaves, group, "block_replicas")
    return _BlockReplicas.apply(weight, blocks, leaves, group)
