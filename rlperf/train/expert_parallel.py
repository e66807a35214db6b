"""Expert-parallel training (``--expert-model-parallel-size EP``): each MoE layer's experts split over
EP ranks, every other weight replicated, the ranks data parallel; one step is the bits of one process's.

Layout. W actor ranks (torch.distributed's default group) form W / EP expert-parallel groups of EP
consecutive ranks; rank r holds expert share ``r % EP`` (experts ``[(r % EP) E / EP, (r % EP + 1) E / EP)``
of every MoE layer: :func:`shard_experts`) and a full copy of every other weight. The ranks holding the
same share (one per group) are its replicas. Tokens reach their experts by all-to-all inside the group
(:class:`rlperf.model.expert_parallel.ExpertParallel`).

Work. A global batch is packed into micro-batches exactly as one process packs it
(:func:`rlperf.train.batching.pack_micro_batches`); micro-batch m runs on rank ``m % W`` in round
``m // W``, all ranks in lockstep (a forward or backward is a collective: a rank with no micro-batch
left in the last round runs micro-batch 0 again and its results are dropped). Old and reference
log-probs, and the trainer's own routing for the gates, are all-gathered.

Bits (the contract: log-probs, loss, gradients and update equal one process's, bit for bit).
- A token's forward does not depend on its micro-batch's rank: the kernels are batch-invariant and the
  expert block over a group gives the one-process rows (:mod:`rlperf.model.expert_parallel`).
- One process accumulates each gradient over its micro-batches in order, ``((g0 + g1) + g2) + ...``.
  Here each round's per-micro-batch gradients are kept apart and added in that same order: every
  replicated weight's gradient of the round is all-gathered over all ranks; an expert share's gradient
  is kept per source rank by gradient taps (the rows of each source run their own grouped GEMMs) and
  all-gathered over the share's replicas. The metric sums are added in micro-batch order alike.
- The grad norm is the one-process norm: the expert shares' gradients are gathered into whole tensors
  for it (the same tensors, in the same order); clipping and AdamW are elementwise, so a share updates
  as its rows of the whole tensor would.
Exactness costs memory: a round holds W copies of the replicated gradients (the all-gather) and EP
copies of the local expert gradients (one per source). That is this trainer's trade: a lab for exact
expert parallel, not a memory-lean one (it is not combined with FSDP).

Weight sync and checkpoints see whole tensors: :meth:`ExpertParallelTrainer.compute_weights` and
:meth:`ExpertParallelTrainer.gather_model` all-gather the shares (collectives: every rank walks them),
and the optimizer state is saved whole and sliced again on load, so a checkpoint resumes at any layout.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from rlperf.model.expert_parallel import ExpertParallel
from rlperf.model.moe import RoutingTrace

from .backend import TrainerSetup, describe_ranks, register_trainer_backend, shard_from_rank0
from .batching import HostCopies, MicroBatch, micro_batch_log_probs, pack_micro_batches
from .sample import Sample
from .trainer import Trainer

EXPERT_FIELDS = ("experts_gate_up", "experts_down")
"""A sparse layer's parameters that expert parallel splits (dim 0: the expert)."""


class ExpertGroups:
    """The process groups of one layout: :attr:`expert` (this rank's EP consecutive ranks) and
    :attr:`replicas` (the ranks holding this rank's expert share). Every rank must build it (collective)."""

    def __init__(self, expert_parallel_size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        ep = expert_parallel_size
        if ep < 1 or world % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {world} actor ranks")
        self.size, self.world, self.rank = ep, world, rank
        self.share = rank % ep
        self.expert = self.replicas = None
        for g in range(world // ep):  # every rank creates every group, in the same order
            grp = dist.new_group(list(range(g * ep, (g + 1) * ep)))
            if rank // ep == g:
                self.expert = grp
        for s in range(ep):
            grp = dist.new_group(list(range(s, world, ep)))
            if s == self.share:
                self.replicas = grp


def shard_experts(model: nn.Module, groups: ExpertGroups) -> None:
    """Keep this rank's share of every MoE layer's experts (in place: the parameters become
    ``[E / EP, ...]`` slices, at the same place in ``named_parameters``) and give each sparse layer its
    :class:`ExpertParallel`. Every rank must start from the same full weights."""
    cfg = model.cfg
    per = cfg.num_experts // groups.size
    for layer in model.layers:
        if not layer.is_moe:
            continue
        for f in EXPERT_FIELDS:
            full = getattr(layer, f)
            setattr(layer, f, nn.Parameter(full.detach()[groups.share * per:(groups.share + 1) * per].clone(),
                                           requires_grad=full.requires_grad))
        layer.expert_parallel = ExpertParallel(cfg.num_experts, groups.expert)


def _is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_FIELDS


def _gather_share(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's share ``t`` [E / EP, ...] -> the whole tensor [E, ...] (concatenated in rank order)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


class ExpertParallelTrainer(Trainer):
    """:class:`rlperf.train.Trainer` over expert-parallel data-parallel ranks (module docstring).

    ``model`` / ``ref_model``: full models with the same weights on every rank (the caller broadcasts
    them); both are sharded here (:func:`shard_experts`). ``compute_dtype`` and ``routing_replay`` as
    in :class:`rlperf.train.Trainer`.
    """

    def __init__(self, model: nn.Module, args, ref_model: nn.Module | None = None,
                 compute_dtype: torch.dtype | None = None, routing_replay: bool = False,
                 expert_parallel_size: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelTrainer needs an initialised torch.distributed process group")
        cfg = model.cfg
        if not cfg.moe_layers:
            raise ValueError("--expert-model-parallel-size: the model is dense (num_experts is 0)")
        if cfg.num_experts % expert_parallel_size:
            raise ValueError(f"--expert-model-parallel-size {expert_parallel_size} does not divide the model's "
                             f"num_experts={cfg.num_experts}")
        self.groups = ExpertGroups(expert_parallel_size)
        self.rank, self.world_size = self.groups.rank, self.groups.world
        shard_experts(model, self.groups)
        if ref_model is not None:
            shard_experts(ref_model, self.groups)
        super().__init__(model, args, ref_model, compute_dtype=compute_dtype, routing_replay=routing_replay)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.expert_index = [i for i, n in enumerate(names) if _is_expert(n)]
        self.dense_index = [i for i, n in enumerate(names) if not _is_expert(n)]
        self.eps = [layer.expert_parallel for layer in self.model.layers if layer.is_moe]

    # ---- rounds of micro-batches ----------------------------------------------------------------
    def _global_micro_batches(self, samples: Sequence[Sample], replay: bool | None = None) -> list[MicroBatch]:
        packing = self._packing()
        if replay is False:
            packing.pop("replay_routing", None)
        return pack_micro_batches(samples, device=self.device, **packing)

    def _rounds(self, count: int):
        """(round, this rank's micro-batch index, whether it is a real one) for every round."""
        for j in range(-(-count // self.world_size)):
            m = j * self.world_size + self.rank
            yield j, (m if m < count else 0), m < count

    def _gather_by_index(self, mine: list, n: int) -> list:
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        out: list = [None] * n
        for part in gathered:
            for i, value in part:
                out[i] = value
        return out

    @torch.no_grad()
    def sample_log_probs(self, model: nn.Module, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Every sample's log-probs (all-gathered), the micro-batches spread over the ranks by rounds."""
        mbs = self._global_micro_batches(samples)
        mine = HostCopies()
        for _, m, real in self._rounds(len(mbs)):
            lp = micro_batch_log_probs(model, mbs[m], self.args.rollout_temperature)
            if real:
                mine.add(mbs[m].indices, mbs[m].response_lengths, lp)
        return self._gather_by_index(mine.per_sample(), len(samples))

    @torch.no_grad()
    def train_routed_experts(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """The actor's own routing of every sample (never replayed), all-gathered."""
        mbs = self._global_micro_batches(samples, replay=False)
        mine = []
        for _, m, real in self._rounds(len(mbs)):
            mb, trace = mbs[m], RoutingTrace()
            micro_batch_log_probs(self.model, mb, self.args.rollout_temperature, routing=trace)
            if real:
                experts, cu = trace.experts().cpu(), mb.cu_seqlens.tolist()
                mine += [(i, experts[cu[j]:cu[j + 1] - 1]) for j, i in enumerate(mb.indices)]
        return self._gather_by_index(mine, len(samples))

    def micro_batches(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """This rank's micro-batches of the global batch (every ``W``-th of one process's packing)."""
        mbs = self._global_micro_batches(samples)
        return mbs[self.rank::self.world_size]

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self, samples: Sequence[Sample], micro_step_hook=None) -> dict[str, float]:
        """:meth:`rlperf.train.Trainer.train_step` over the ranks (module docstring): the same metrics,
        gradients and update as one process."""
        with_rollout = self._check_prepared(samples)
        denom = self._loss_denominator(samples)
        self._zero_grads()
        for p in self.master_params:
            p.grad = None
        mbs = self._global_micro_batches(samples)
        totals: dict[str, torch.Tensor] = {}
        taps: dict = {}
        self._acc: dict[int, torch.Tensor] = {}  # master parameter index -> its gradient so far
        try:
            for ep in self.eps:
                ep.grad_taps = taps
            for j, m, real in self._rounds(len(mbs)):
                taps.clear()
                for p in self.params:
                    p.grad = None
                metrics, count = self._micro_step(samples, mbs[m], denom, with_rollout)
                # every rank's micro-batch metrics of this round, in micro-batch order
                rows = [None] * self.world_size
                dist.all_gather_object(rows, (real, {k: v.detach().cpu() for k, v in metrics.items()}, count))
                for r, (is_real, ms, cnt) in enumerate(rows):
                    if not is_real:
                        continue
                    if micro_step_hook is not None and j == 0 and r == 0:
                        micro_step_hook({f"train/{k}": float(v) / max(cnt, 1.0) for k, v in ms.items()})
                    for k, v in ms.items():
                        totals[k] = totals.get(k, 0.0) + v.to(self.device) / denom
                self._fold_round(j, taps, len(mbs))
        finally:
            for ep in self.eps:
                ep.grad_taps = None
            taps.clear()
        for p in self.params:
            p.grad = None
        for i, m in enumerate(self.master_params):
            m.grad = self._acc.get(i)
        self._acc = {}
        return self._finish_step(totals)

    def _fold_round(self, j: int, taps: dict, count: int) -> None:
        """Add round ``j``'s per-micro-batch gradients into the master gradients in micro-batch order."""
        W, EP = self.world_size, self.groups.size
        dense = [self.params[i] for i in self.dense_index]
        buf = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in dense])
        parts = [torch.empty_like(buf) for _ in range(W)]
        dist.all_gather(parts, buf)
        for r in range(W):
            if j * W + r < count:
                self._add_flat(parts[r], self.dense_index)
        experts = [self.params[i] for i in self.expert_index]
        if not experts:
            return
        # this rank's expert share: one gradient per source rank of its group, from the taps
        buf = torch.cat([(taps.get((id(p), s)) if taps.get((id(p), s)) is not None else torch.zeros_like(p)).reshape(-1)
                         for s in range(EP) for p in experts])
        replicas = W // EP
        parts = [buf] if replicas == 1 else [torch.empty_like(buf) for _ in range(replicas)]
        if replicas > 1:
            dist.all_gather(parts, buf, group=self.groups.replicas)
        chunk = sum(p.numel() for p in experts)
        for g in range(replicas):  # group g's source s ran micro-batch j W + g EP + s
            for s in range(EP):
                if j * W + g * EP + s < count:
                    self._add_flat(parts[g][s * chunk:(s + 1) * chunk], self.expert_index)

    @torch.no_grad()
    def _add_flat(self, flat: torch.Tensor, indices: list[int]) -> None:
        """Master parameter ``indices[i]``'s gradient ``+=`` ``flat``'s piece i (the first piece sets it),
        in the master's dtype (one process adds a bf16 micro-batch gradient into its float32 master
        gradient the same way: :meth:`rlperf.train.Trainer._accumulate_master_grads`)."""
        start = 0
        for i in indices:
            m = self.master_params[i]
            piece = flat[start:start + m.numel()].view(m.shape)
            start += m.numel()
            if i not in self._acc:
                self._acc[i] = piece.to(m.dtype).clone()
            else:
                self._acc[i].add_(piece)

    def clip_grad_norm(self, max_norm: float) -> float:
        """One process's grad norm (its tensors, its order: the expert shares' gradients gathered whole),
        then every local gradient clipped by it."""
        experts = set(self.expert_index)
        grads = [_gather_share(p.grad, self.groups.expert) if i in experts else p.grad
                 for i, p in enumerate(self.master_params)]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        torch.nn.utils.clip_grads_with_norm_(self.master_params, max_norm, total)
        return float(total)

    # ---- whole tensors: weight sync, checkpoints ------------------------------------------------------
    def _whole(self, model: nn.Module):
        """``(name, whole tensor)`` of ``model``'s parameters in ``named_parameters`` order, the expert
        shares all-gathered (a collective)."""
        for name, p in model.named_parameters():
            yield name, (_gather_share(p.detach(), self.groups.expert) if _is_expert(name) else p.detach())

    def compute_weights(self, bucket_bytes: int = 512 << 20):
        """``(HF name, tensor)`` of the whole compute weights in :meth:`hf_state_dict` order (a collective)."""
        from rlperf.model.qwen3 import hf_views

        whole = dict(self._whole(self.model))
        for name in self.model.hf_param_order():
            yield from hf_views(self.model.cfg, name, whole[name])

    def gather_model(self, bucket_bytes: int = 512 << 20) -> nn.Module | None:
        """A collective: on rank 0 a CPU copy of the actor with the whole float32 master weights, else None."""
        copy = type(self.master_model)(self.master_model.cfg, torch.float32, "cpu") if self.rank == 0 else None
        params = dict(copy.named_parameters()) if copy is not None else {}
        for name, t in self._whole(self.master_model):
            if copy is not None:
                params[name].data.copy_(t)
        return copy

    def state_dict(self) -> dict:
        """The base state (optimizer keyed by name), the expert shares' AdamW moments gathered whole
        (a collective; every rank returns it)."""
        state = super().state_dict()  # rank 0 only holds it (the others: empty)
        saved = state["optimizer"].get("state", {}) if state["optimizer"] else {}
        names = [n for n, p in self.master_model.named_parameters() if p.requires_grad]
        for i in self.expert_index:  # every rank gathers (collectives), in parameter order
            live = self.optimizer.state.get(self.master_params[i], {})
            for k in sorted(k for k, v in live.items() if torch.is_tensor(v) and v.dim() > 0):
                whole = _gather_share(live[k], self.groups.expert).cpu()
                if names[i] in saved:
                    saved[names[i]][k] = whole
        return state

    def load_state_dict(self, state: dict) -> None:
        """:meth:`state_dict`'s whole state (or one process's), each expert moment sliced to this rank's share."""
        import copy

        state = copy.copy(state)
        optim = self._optimizer_state_by_name(state["optimizer"])
        optim = {**optim, "state": {n: dict(st) for n, st in optim.get("state", {}).items()}}
        per = self.master_model.cfg.num_experts // self.groups.size
        lo = self.groups.share * per
        for name, st in optim["state"].items():
            if _is_expert(name):
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] != per:
                        st[k] = v[lo:lo + per].clone()
        state["optimizer"] = optim
        super().load_state_dict(state)

    def describe(self) -> str:
        return f"{describe_ranks(self.world_size)}, experts split over {self.groups.size} ranks (expert parallel)"


@register_trainer_backend("expert-parallel")
def build_expert_parallel_trainer(setup: TrainerSetup) -> ExpertParallelTrainer:
    """``--expert-model-parallel-size EP > 1``: every rank starts from rank 0's weights and keeps its share of
    the experts (:class:`ExpertParallelTrainer`); its ``engine_model`` is a full engine copy in the compute
    dtype, loaded from the gathered weights at every sync (engines elsewhere: the sharded master model)."""
    moe = setup.config.moe
    return shard_from_rank0(setup, lambda: ExpertParallelTrainer(
        setup.model, setup.config.args, setup.ref_model, compute_dtype=setup.compute_dtype,
        routing_replay=moe.routing_replay, expert_parallel_size=moe.expert_model_parallel_size))
