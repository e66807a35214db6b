"""The RL loop on ``W > 1`` data-parallel actor ranks (``--actor-num-gpus-per-node``): what changes.

Each rank is one process of the default ``torch.distributed`` group (:mod:`rlperf.loop.placement`)
and runs the same loop (:class:`rlperf.loop.runner.Run`) in lockstep, colocated as slime's
``--colocate``: its trainer shard (:class:`rlperf.train.fsdp.FSDPTrainer`) and its own in-process
engine on the same device.

* **Rollout**: the rollout function runs on every rank; its ``data_source.client`` is a
  :class:`DataParallelEngineClient`, which generates prompts ``r, r + W, ...`` of each ``generate``
  call on rank ``r``'s engine and all-gathers the results, so every rank gets every generation, in
  order. A sample's seed is its index in the rollout (:func:`rlperf.loop.generation.sample_seed`) and
  the engine is batch invariant, so the tokens and rollout log-probs are those of the one-rank run.
  Rank 0's samples (rewards included) are then broadcast (:func:`broadcast_from_rank0`): every rank
  trains on exactly rank 0's rollout, whatever a custom rollout or reward function does.
* **Weight sync**: every rank's engine loads the full weights gathered from the FSDP shards bucket
  by bucket (:meth:`rlperf.train.fsdp.FSDPTrainer.iter_hf_weights`), in the compute dtype.
* **Disaggregated engines** (``--rollout-num-gpus N``, without ``--colocate``): the ranks have no
  engine of their own. Rank 0 alone talks to the engines (it starts them, on the GPUs after the actor
  ranks', or finds the router ``--placement ray`` started): it runs the rollout function through the
  router and broadcasts the samples (:func:`broadcast_from_rank0`); the other ranks wait for them
  (:class:`Rank0EnginesClient`). At each sync every rank walks the same gathering iterator, and
  rank 0 feeds the full tensors it yields to the :class:`rlperf.sync.distributed.WeightBroadcaster`
  (NCCL or gloo, a group of rank 0 and the engines only), which checks every engine's checksum; the
  other ranks only advance the iterator (the gathers are collectives). Only rank 0 speaks HTTP.
* **Metrics**: the trainer's sums are reduced over the ranks; ``memory/*`` peaks are the worst
  rank's (:func:`max_over_ranks`); times are rank 0's. Rank 0 alone writes ``metrics.jsonl``, the
  timeline, torch traces and checkpoints, and prints the step lines.
* **Errors**: an error on one rank cannot become a failed gate or a clean stop (the others would wait
  in a collective for ever): :class:`RankFailure` ends the process, and the launcher stops the others.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from rlperf.sync import SyncStats


class RankFailure(BaseException):
    """An error on one data-parallel rank: a ``BaseException`` so that no ``except Exception`` (the
    gates' crash report) swallows it; the process dies and the launcher stops the other ranks."""


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DataParallelEngineClient:
    """Rank ``r`` of ``W``: the rank's in-process engine (``engine_client``, an
    :class:`rlperf.loop.clients.EngineClient` over a full copy of the weights in the compute dtype)
    generates every ``W``-th prompt; the results are all-gathered (module docstring). A
    :class:`rlperf.loop.clients.RolloutClient`: every method is called on every rank at once."""

    runs_rollout = True

    def __init__(self, engine_client, rank: int, world_size: int):
        self.inner, self.rank, self.world_size = engine_client, rank, world_size
        self.kind = f"in-process engine on each of {world_size} ranks"

    @property
    def model(self):
        return self.inner.model

    @property
    def engine(self):
        return self.inner.engine

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    def generate(self, prompts: list[list[int]], params: list, **options) -> list:
        """Every rank calls it with the same prompts, params and ``options`` (``return_routed_experts``: a
        collective); returns all results in order."""
        mine = list(range(self.rank, len(prompts), self.world_size))
        outs = self.inner.generate([prompts[i] for i in mine], [params[i] for i in mine], **options) if mine else []
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, list(zip(mine, outs)))
        results: list = [None] * len(prompts)
        for part in gathered:
            for i, out in part:
                results[i] = out
        return results

    def load_weights(self, named_tensors, version: str) -> SyncStats:
        """Load ``(HF name, full tensor)`` pairs into this rank's engine (every rank: the iterator is a collective)."""
        return self.inner.load_weights(named_tensors, version)

    def weights_checksum(self) -> str | None:
        """Rank 0's engine's (every rank's engine holds the same bits); None on the others."""
        return self.inner.weights_checksum() if self.rank == 0 else None

    def close(self) -> None:
        self.inner.close()


class Rank0EnginesClient:
    """Disaggregated engines on several data-parallel ranks (module docstring): rank 0 alone talks to
    them through ``router_client`` (an :class:`rlperf.loop.clients.RouterClient` with distributed weight
    sync; None on the other ranks). Every rank calls :meth:`load_weights` with the same gathering
    iterator (a collective): rank 0 broadcasts what it yields to the engines, the others only advance
    it. The rollout function runs on rank 0 (:attr:`runs_rollout`); the loop hands its samples to the
    other ranks (:func:`broadcast_from_rank0`)."""

    def __init__(self, router_client, rank: int, world_size: int):
        if (router_client is None) != (rank != 0):
            raise ValueError("rank 0, and only rank 0, holds the engines' client")
        self.inner, self.rank, self.world_size = router_client, rank, world_size
        self.runs_rollout = rank == 0
        # the run's banner adds the rank count: "sglang-router, rank 0's engines, bf16, 2 data-parallel ranks"
        self.kind = (f"{router_client.kind}, " if router_client is not None else "") + "rank 0's engines"

    def generate(self, prompts: list[list[int]], params: list, **options) -> list:
        if self.inner is None:
            raise RuntimeError(f"rank {self.rank}: the disaggregated engines generate through rank 0 (the rollout "
                               f"reaches this rank by broadcast_from_rank0)")
        return self.inner.generate(prompts, params, **options)

    def load_weights(self, named_tensors, version: str) -> SyncStats:
        """Rank 0: broadcast the pairs to the engines as they come. The others: advance ``named_tensors``
        (the gathering iterator, a collective) to its end; nothing is kept."""
        if self.inner is not None:
            return self.inner.load_weights(named_tensors, version)
        nbytes = 0
        for _, t in named_tensors:
            nbytes += t.numel() * t.element_size()
        return SyncStats(buckets=0, bytes=nbytes)

    def weights_checksum(self) -> str | None:
        """The engines' (rank 0 asks them); None on the other ranks."""
        return self.inner.weights_checksum() if self.inner is not None else None

    def take_fault_events(self) -> list:
        """Rank 0's engine outages that ended (:meth:`rlperf.loop.clients.RouterClient.take_fault_events`);
        none on the other ranks."""
        return self.inner.take_fault_events() if self.inner is not None else []

    def engine_memory(self) -> list:
        """Every engine's memory as it reports it (:meth:`rlperf.loop.clients.RouterClient.engine_memory`),
        asked by rank 0 and sent to every rank (a collective)."""
        return broadcast_from_rank0(self.inner.engine_memory() if self.inner is not None else None)

    def close(self) -> None:
        """Rank 0 leaves the engines' weight-update group (it owns the group and, with ``--placement
        local``, the engines' processes)."""
        if self.inner is not None:
            self.inner.close()


@contextlib.contextmanager
def errors_end_the_ranks(what: str, keep: tuple = ()):
    """On several ranks an error in the block (other than ``keep``) becomes :class:`RankFailure` ("rank R:
    ``what``: the error"), which no gate can swallow while the other ranks wait in a collective; in one
    process it propagates as it is."""
    try:
        yield
    except keep:
        raise
    except Exception as exc:
        rank, world = rank_and_world()
        if world > 1:
            raise RankFailure(f"rank {rank}: {what}: {type(exc).__name__}: {exc}") from exc
        raise


def broadcast_from_rank0(obj):
    """Rank 0's ``obj`` on every rank (a pickled broadcast over the CPU group): a rollout's samples,
    the gates' exit code. One process: ``obj`` itself."""
    if rank_and_world()[1] == 1:
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_over_ranks(values: dict[str, int]) -> dict[str, int]:
    """Each value's maximum over the ranks (every rank has the same keys): the worst rank's memory peaks.
    One process: a copy of ``values``."""
    keys = sorted(values)
    if not keys or rank_and_world()[1] == 1:
        return dict(values)
    t = torch.tensor([int(values[k]) for k in keys], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, (int(v) for v in t.tolist())))
