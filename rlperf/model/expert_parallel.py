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


def expert_parallel_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor, num_experts: int, group=None) -> torch.Tensor:
    """The expert block with this rank's experts only (module docstring): x [T, H] (this rank's
    tokens), experts [T, k] (global ids, increasing per row), weights [T, k], w_gate_up
    [E/W, 2I, H] and w_down [E/W, H, I] (this rank's experts) -> [T, H] in x's dtype."""
    first, last = expert_range(num_experts, group)
    per = last - first
    if w_gate_up.shape[0] != per or w_down.shape[0] != per:
        raise ValueError(f"expert parallel: this rank owns {per} experts, got weights for {w_gate_up.shape[0]} "
                         f"and {w_down.shape[0]}")
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
    # one (row, local expert) pair per received row: top-1, weight 1
    local = K.moe_plan((recv_experts - first).to(torch.int32)[:, None], per)
    h = K.grouped_matmul(recv_rows, w_gate_up, local, gather=True)
    y_slots = K.grouped_matmul(K.silu_mul(h), w_down, local)
    y_rows = y_slots[local.slot_of_pair.long()]                          # back to the received order
    back = all_to_all_single(y_rows.new_empty(plan.num_slots, x.shape[1]), y_rows, send, recv, group=group)
    return K.moe_combine(back, plan, weights, x.dtype)
