"""``--use-distributed-optimizer``: AdamW whose moments are sharded over the data-parallel group.

Every data-parallel replica holds the same float32 master parameters and, after the trainer's
fixed-order sum, the same full gradients. AdamW is elementwise, so each replica only needs the moments
(``exp_avg``, ``exp_avg_sq``) of the elements it updates: parameter ``p`` (``n`` elements, flattened)
is cut into ``DP`` chunks of ``ceil(n / DP)`` elements (the last ones shorter or empty), replica ``d``
keeps the moments of chunk ``d`` and updates only it; one all-gather over the data-parallel group then
puts every replica's updated chunks back into every replica's parameters. An element's update is the
same arithmetic on the same operands as ``torch.optim.AdamW`` on the whole tensor, so a run with the
sharded optimizer is the bits of a run without it (``tests/train/test_megatron_parallel.py``).

Memory per rank: the moments are ``2 x 4 x n / DP`` bytes instead of ``2 x 4 x n``; the float32
masters and the gradients stay whole on every replica (the gradient norm's fixed order needs every
parameter's whole gradient).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..adamw import adamw, step_state


def _chunk(n: int, size: int) -> int:
    return -(-n // size) if n else 0


class DistributedAdamW:
    """``torch.optim.AdamW`` over this data-parallel rank's chunks of ``groups``' parameters.

    ``groups``: AdamW's parameter groups (``params``, ``weight_decay``); ``group``: the data-parallel
    process group (None: one replica, every chunk is the whole tensor). Offers what the trainer uses
    of an optimizer: :meth:`step`, :attr:`param_groups` (the learning rate) and the moments of a
    parameter, whole (:meth:`full_moment`, a collective) or set from a whole tensor (:meth:`set_state`).
    """

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float, group=None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.params: list[torch.Tensor] = []
        self.shard_of: dict[int, torch.nn.Parameter] = {}
        inner_groups = []
        for g in groups:
            shards = []
            for p in g["params"]:
                lo, hi = self._bounds(p)
                shard = torch.nn.Parameter(p.detach().reshape(-1)[lo:hi].clone())
                self.params.append(p)
                self.shard_of[id(p)] = shard
                shards.append(shard)
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": shards})
        self.inner = adamw(inner_groups, lr, betas, eps)

    def _bounds(self, p: torch.Tensor) -> tuple[int, int]:
        c = _chunk(p.numel(), self.size)
        lo = min(self.rank * c, p.numel())
        return lo, min(lo + c, p.numel())

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def defaults(self) -> dict:
        """The inner AdamW's defaults (its implementation: :mod:`rlperf.train.adamw`)."""
        return self.inner.defaults

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's chunks (their values and gradients read from the whole parameters),
        then every rank's updated chunks all-gathered into every rank's parameters."""
        for p in self.params:
            lo, hi = self._bounds(p)
            shard = self.shard_of[id(p)]
            shard.copy_(p.detach().reshape(-1)[lo:hi])
            shard.grad = p.grad.detach().reshape(-1)[lo:hi].to(shard.dtype) if p.grad is not None else None
        self.inner.step()
        for p in self.params:
            self.shard_of[id(p)].grad = None
        if self.size == 1:
            for p in self.params:
                p.detach().reshape(-1).copy_(self.shard_of[id(p)])
            return
        chunks = [_chunk(p.numel(), self.size) for p in self.params]
        local = torch.zeros(sum(chunks), dtype=torch.float32, device=self.params[0].device)
        off = 0
        for p, c in zip(self.params, chunks):
            s = self.shard_of[id(p)]
            local[off:off + s.numel()] = s
            off += c
        every = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(every, local, group=self.group)
        off = 0
        for p, c in zip(self.params, chunks):
            whole = torch.cat([e[off:off + c] for e in every])[:p.numel()]
            p.detach().reshape(-1).copy_(whole.to(p.dtype))
            off += c

    def step_count(self) -> float | None:
        """AdamW's step count (the same for every parameter), None before the first step."""
        for st in self.inner.state.values():
            if "step" in st:
                return float(st["step"])
        return None

    @torch.no_grad()
    def full_moment(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """The whole moment ``key`` (``exp_avg`` / ``exp_avg_sq``) of parameter ``p``, float32, its shape
        (zeros before the first step): the ranks' chunks all-gathered. A collective over the group."""
        shard = self.shard_of[id(p)]
        st = self.inner.state.get(shard, {})
        mine = st[key] if key in st else torch.zeros_like(shard, dtype=torch.float32)
        c = _chunk(p.numel(), self.size)
        if self.size == 1:
            return mine.reshape(p.shape).clone()
        padded = torch.zeros(c, dtype=torch.float32, device=mine.device)
        padded[:mine.numel()] = mine
        every = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(every, padded, group=self.group)
        return torch.cat(every)[:p.numel()].reshape(p.shape)

    @torch.no_grad()
    def set_state(self, p: torch.Tensor, step: float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Restore parameter ``p``'s moments from whole tensors (this rank keeps its chunk)."""
        lo, hi = self._bounds(p)
        shard = self.shard_of[id(p)]
        self.inner.state[shard] = {
            "step": step_state(self.inner, step, shard),
            "exp_avg": exp_avg.reshape(-1)[lo:hi].to(dtype=torch.float32, device=shard.device).clone(),
            "exp_avg_sq": exp_avg_sq.reshape(-1)[lo:hi].to(dtype=torch.float32, device=shard.device).clone()}
