"""Expert parallel: the experts of an MoE layer split over the ranks of a process group, tokens sent to
the rank that owns their expert and back (all-to-all over torch.distributed: NCCL on CUDA, gloo on CPU).

With W ranks and E experts, rank r owns experts ``[r E/W, (r+1) E/W)`` (``E % W == 0``) and holds
only their weights (``w_gate_up`` [E/W, 2I, H], ``w_down`` [E/W, H, I]); the router is replicated.
Each rank routes its own T_r tokens, then :func:`expert_parallel_experts`:

1. sorts its (token, j) pairs by expert (:func:`rlperf.kernels.moe_plan`): the pairs bound for one
   rank are then contiguous, in expert order; the counts per rank are exchanged first;
2. dispatch: ``all_to_all`` of the pairs' token rows and expert ids;
3. each rank runs its experts over the rows it received (grouped GEMM, SwiGLU, grouped GEMM, the
   batch-invariant kernels; one row per (token, expert) pair);
4. combine: ``all_to_all`` back, then each token's k rows are summed in expert order
   (:func:`rlperf.kernels.moe_combine`).

Bits: every step computes a row from that row's inputs alone (the grouped GEMM's contract), and the
combine's order is the expert order, so a token's output is the bits of the one-rank block
(:func:`rlperf.kernels.moe_experts`). The expert-weight gradient of an expert sums its rows in the
order the rank received them, source rank by source rank and token order within: the order of the
one-rank run over the ranks' tokens concatenated, so that gradient is the same bits too.
Differentiable: the all-to-alls are ``torch.distributed.nn``'s, whose backward is the reverse exchange.

:class:`ExpertParallel` is what a model's MoE layer holds to run this way (``DecoderLayer.expert_parallel``,
set by :class:`rlperf.train.expert_parallel.ExpertParallelTrainer`): it picks the path of the kernel
policy's backend, the kernels above (CUDA, or the CPU interpreter) or the float64 reference
(:func:`expert_parallel_experts_ref`, the mirror of :func:`rlperf.kernels.reference.moe.moe_experts_ref`
that the one-process reference backend runs), and it can keep the expert-weight gradient of each
source rank's rows apart (:attr:`ExpertParallel.grad_taps`): a trainer then adds the ranks'
micro-batches' gradients in the order one process would (its micro-batch order), which is what makes
an expert-parallel step the bits of a one-process step.

The dispatcher is torch.distributed's ``all_to_all_single``. DeepEP was not tried: its ``sgl-deep-ep``
wheels are built against torch 2.13 and the GPU machines run torch 2.11 (one symbol missing at
import), and no GPU time was available; a DeepEP dispatcher would have to keep the contract above
(rows in expert order, token order within; per-source GEMMs under gradient taps).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from rlperf import kernels as K


def expert_range(num_experts: int, group=None) -> tuple[int, int]:
    """[first, last) expert of this rank in ``group`` (ValueError unless the ranks split E evenly)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise ValueError(f"--expert-model-parallel-size {world} does not divide num_experts={num_experts}")
    per = num_experts // world
    return rank * per, (rank + 1) * per


class _GradTap(torch.autograd.Function):
    """Identity on a weight in the forward; in the backward its gradient is filed under ``key`` in
    ``sink`` instead of reaching the weight (which then gets none from this use)."""

    @staticmethod
    def forward(ctx, w, sink, key):
        ctx.sink, ctx.key = sink, key
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        if ctx.key in ctx.sink:  # one use per (weight, source) and forward: a second is a caller's bug
            raise RuntimeError(f"expert parallel: gradient tap {ctx.key} filled twice")
        ctx.sink[ctx.key] = g
        return None, None, None


def _tapped(w: torch.Tensor, taps: dict | None, source: int) -> torch.Tensor:
    """``w`` for the rows of ``source``: itself, or through a tap filing its gradient under
    ``(id(w), source)`` in ``taps`` (grad mode on and ``w`` trainable only)."""
    if taps is None or not (torch.is_grad_enabled() and w.requires_grad):
        return w
    return _GradTap.apply(w, taps, (id(w), source))


def _check_shard(w_gate_up: torch.Tensor, w_down: torch.Tensor, per: int) -> None:
    if w_gate_up.shape[0] != per or w_down.shape[0] != per:
        raise ValueError(f"expert parallel: this rank owns {per} experts, got weights for {w_gate_up.shape[0]} "
                         f"and {w_down.shape[0]}")


def _source_chunks(recv: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of each source rank's rows among the received ones."""
    out, start = [], 0
    for n in recv:
        out.append((start, start + n))
        start += n
    return out


def expert_parallel_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor, num_experts: int, group=None, taps: dict | None = None
                            ) -> torch.Tensor:
    """The expert block with this rank's experts only (module docstring): x [T, H] (this rank's
    tokens), experts [T, k] (global ids, increasing per row), weights [T, k], w_gate_up
    [E/W, 2I, H] and w_down [E/W, H, I] (this rank's experts) -> [T, H] in x's dtype.

    ``taps`` (a dict, or None): each source rank's rows run their own grouped GEMMs (a row's bits are
    the same: the GEMM is row-invariant) on the weights through a tap, so the expert-weight gradient
    of source s's rows is filed as ``taps[(id(w), s)]`` (:class:`ExpertParallel`) and the weights
    themselves get none."""
    first, last = expert_range(num_experts, group)
    per = last - first
    _check_shard(w_gate_up, w_down, per)
    plan = K.moe_plan(experts, num_experts)
    bounds = plan.expert_offsets[::per]                                   # [W + 1]: where each rank's slots start
    send_counts = (bounds[1:] - bounds[:-1]).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    expert_of_slot = torch.repeat_interleave(torch.arange(num_experts, device=x.device),
                                             (plan.expert_offsets[1:] - plan.expert_offsets[:-1]).long(),
                                             output_size=plan.num_slots)
    rows = K.moe_slot_rows(x, plan)                                       # [S, H], slot order
    recv_rows = all_to_all_single(rows.new_empty(sum(recv), x.shape[1]), rows, recv, send, group=group)
    recv_experts = torch.empty(sum(recv), dtype=expert_of_slot.dtype, device=x.device)
    dist.all_to_all_single(recv_experts, expert_of_slot, recv, send, group=group)
    chunks = [(0, len(recv_experts))] if taps is None else _source_chunks(recv)
    parts = []
    for source, (lo, hi) in enumerate(chunks):
        if hi == lo and taps is not None:  # nothing from this source: no GEMM, no gradient filed
            parts.append(recv_rows.new_zeros(0, x.shape[1]))
            continue
        # one (row, local expert) pair per received row: top-1, weight 1
        local = K.moe_plan((recv_experts[lo:hi] - first).to(torch.int32)[:, None], per)
        h = K.grouped_matmul(recv_rows[lo:hi], _tapped(w_gate_up, taps, source), local, gather=True)
        y_slots = K.grouped_matmul(K.silu_mul(h), _tapped(w_down, taps, source), local)
        parts.append(y_slots[local.slot_of_pair.long()])                 # back to the received order
    y_rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    back = all_to_all_single(y_rows.new_empty(plan.num_slots, x.shape[1]), y_rows, send, recv, group=group)
    return K.moe_combine(back, plan, weights, x.dtype)


def expert_parallel_experts_ref(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                                w_gate_up: torch.Tensor, w_down: torch.Tensor, num_experts: int, group=None,
                                taps: dict | None = None) -> torch.Tensor:
    """:func:`expert_parallel_experts` in float64, step for step the one-process reference
    (:func:`rlperf.kernels.reference.moe.moe_experts_ref`): a token's k (token, expert) pairs in pair
    order ``t k + j``, grouped by the rank owning the expert (stable: pair order within), sent in
    float64; the owner multiplies each of its experts' rows (in the order received, per source rank
    with ``taps``) in float64; back, then ``sum_j weights[t, j] y[t k + j]`` in float64 -> [T, H] in
    x's dtype. An expert's rows are the same rows in the same order as in one process, so every
    float64 product and sum, and each gradient, has the one-process bits."""
    from rlperf.kernels.reference.moe import grouped_matmul_ref

    first, last = expert_range(num_experts, group)
    per, world = last - first, dist.get_world_size(group)
    _check_shard(w_gate_up, w_down, per)
    t, k = experts.shape
    flat = experts.reshape(-1).long()                                     # pair t k + j
    owner = torch.div(flat, per, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)                             # by owner rank, pair order within
    send_counts = torch.bincount(owner, minlength=world).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    xs = x.double().repeat_interleave(k, dim=0)                           # [T k, H], as the reference
    recv_rows = all_to_all_single(xs.new_empty(sum(recv), x.shape[1]), xs[order], recv, send, group=group)
    recv_experts = torch.empty(sum(recv), dtype=flat.dtype, device=x.device)
    dist.all_to_all_single(recv_experts, flat[order].contiguous(), recv, send, group=group)
    local = recv_experts - first
    chunks = [(0, len(local))] if taps is None else _source_chunks(recv)
    parts = []
    for source, (lo, hi) in enumerate(chunks):
        gu = grouped_matmul_ref(recv_rows[lo:hi], _tapped(w_gate_up, taps, source), local[lo:hi])
        inter = gu.shape[1] // 2
        g, u = gu[:, :inter], gu[:, inter:]
        parts.append(grouped_matmul_ref(g * torch.sigmoid(g) * u, _tapped(w_down, taps, source), local[lo:hi]))
    y_recv = parts[0] if len(parts) == 1 else torch.cat(parts)
    back = all_to_all_single(y_recv.new_empty(t * k, x.shape[1]), y_recv, send, recv, group=group)
    y = back[torch.argsort(order)]                                        # pair order again
    return (weights.double().reshape(t, k, 1) * y.reshape(t, k, -1)).sum(1).to(x.dtype)


class ExpertParallel:
    """What an MoE layer holds to run on this rank's share of its experts (module docstring).

    ``group``: the expert-parallel process group (None: the default group); rank r of its W ranks owns
    experts ``[r E/W, (r + 1) E/W)``. :attr:`grad_taps`: None, or a dict the next forwards file each
    source rank's expert-weight gradients in (``taps[(id(weight), source)]``); the trainer sets and
    empties it. Deep copies share it (a trainer's compute copy of the model keeps the same group).
    """

    def __init__(self, num_experts: int, group=None):
        self.num_experts, self.group = num_experts, group
        self.first, self.last = expert_range(num_experts, group)
        self.grad_taps: dict | None = None

    def __deepcopy__(self, memo):
        return self

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor) -> torch.Tensor:
        """The expert block (:func:`rlperf.kernels.moe_experts`'s contract) over the group: the float64
        reference where the kernel policy's backend is the reference, else the kernels (fast mode runs
        them too: there is no stock expert-parallel path)."""
        fn = (expert_parallel_experts_ref if K.current_policy().backend_for(x.device) == "reference"
              else expert_parallel_experts)
        return fn(x, experts, weights, w_gate_up, w_down, self.num_experts, self.group, self.grad_taps)
