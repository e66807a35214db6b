"""Where the actor (trainer) ranks run and how each finds the others: ``--placement`` with slime's
``--actor-num-nodes`` and ``--actor-num-gpus-per-node``.

One interface, :class:`Placement`, so the loop never knows where it runs:

* :meth:`Placement.check` — refuse a layout that cannot start (:class:`rlperf.loop.args.UsageError`,
  exit 2) before any process starts;
* :meth:`Placement.launch_actors` — start the ``W = actor_num_nodes x actor_num_gpus_per_node``
  rank processes, each running ``entry(ns)``, wait for them, return the exit code; a rank that dies
  takes the others down (they would wait for it in a collective for ever), with its error shown.

Engine processes (``--rollout-num-gpus``): under ``--placement local`` trainer rank 0 starts them
(:func:`rlperf.loop.engines.start_engine_fleet`); ``--placement ray`` starts them as actors on bundles of
their own and hands the ranks their router.

:class:`LocalPlacement` (``--placement local``) starts the ranks on this host with
``multiprocessing`` (spawn), one GPU each on CUDA (``LOCAL_RANK`` picks it); :class:`rlperf.loop.ray_placement.RayPlacement`
(``--placement ray``) implements the same two methods with Ray actors on the bundles of one placement
group, across nodes.

A rank learns its place from the environment, torchrun's contract (:class:`RankEnv`): ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. So a process
started by ``torchrun --nproc-per-node N -m rlperf train ...`` (the variables already set) is a rank
itself and nothing is launched; on several nodes, ``torchrun --nnodes M --node-rank i
--master-addr HOST ...`` on each node with ``--actor-num-nodes M``. :func:`actor_process_group` joins
the default process group (gloo on the CPU; on CUDA ``cpu:gloo,cuda:nccl``: NCCL for the model's
collectives, gloo for the small CPU objects the loop exchanges) and leaves it when the rank is done.
"""
from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Iterator

from rlperf.rollout.router import free_port

from .args import UsageError
from .device import run_device

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The environment variables that place a rank (torchrun's names)."""


@dataclasses.dataclass(frozen=True)
class ActorLayout:
    """How many actor ranks, where."""

    num_nodes: int = 1
    """``--actor-num-nodes``."""
    gpus_per_node: int = 1
    """``--actor-num-gpus-per-node``: ranks per node (one GPU each on CUDA)."""
    device_type: str = "cpu"
    """``cuda`` or ``cpu`` (``--device``)."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @classmethod
    def of(cls, ns: argparse.Namespace, device_type: str) -> ActorLayout:
        return cls(ns.actor_num_nodes, ns.actor_num_gpus_per_node, device_type)


@dataclasses.dataclass(frozen=True)
class RankEnv:
    """This process's place among the ranks (:data:`RANK_ENV`)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls, environ=None) -> RankEnv | None:
        """The place the environment gives (a rank started by a placement or by torchrun); None when
        ``WORLD_SIZE`` is not set (a plain process, which may launch ranks)."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return None
        try:
            return cls(int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))
        except ValueError:
            raise UsageError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers, got {env.get('RANK')!r}/"
                             f"{env.get('WORLD_SIZE')!r}/{env.get('LOCAL_RANK')!r}") from None


def check_actor_layout(ns: argparse.Namespace, device) -> ActorLayout:
    """The layout of ``ns`` on ``device``; :class:`UsageError` naming the flag for one that cannot run.

    Checked: positive counts; under torchrun, ``WORLD_SIZE`` equal to the layout's ranks; without it,
    one node (``--placement local`` starts processes on this host only); on CUDA no more ranks per
    node than visible GPUs (``--placement ray``: the cluster's, checked by the placement); with more than
    one rank, a global batch that splits over the ranks and what the data-parallel loop does not support
    yet (a running router, ``--async``, shared engine weights). Disaggregated engines
    (``--rollout-num-gpus``) take any number of ranks: rank 0 drives them (:mod:`rlperf.loop.data_parallel`).
    """
    layout = ActorLayout.of(ns, device.type)
    launched = RankEnv.from_environ()
    if launched is not None:
        if launched.world_size != layout.world_size:
            raise UsageError(f"WORLD_SIZE={launched.world_size} (torchrun or another launcher), but --actor-num-nodes "
                             f"{layout.num_nodes} x --actor-num-gpus-per-node {layout.gpus_per_node} = "
                             f"{layout.world_size} ranks: make them agree")
    elif layout.num_nodes > 1 and ns.placement != "ray":
        raise UsageError(f"--actor-num-nodes {layout.num_nodes}: --placement {ns.placement} starts "
                         f"ranks on this host only; for several nodes run torchrun on each node (torchrun --nnodes "
                         f"{layout.num_nodes} --nproc-per-node {layout.gpus_per_node} --node-rank I --master-addr HOST "
                         f"-m rlperf train --actor-num-nodes {layout.num_nodes} ...), or --placement ray")
    if device.type == "cuda":
        import torch

        visible = torch.cuda.device_count()
        if layout.gpus_per_node > visible and ns.placement != "ray":  # ray: the cluster's GPUs
            raise UsageError(f"--actor-num-gpus-per-node {layout.gpus_per_node}: only {visible} CUDA device(s) visible "
                             f"on this host (one GPU per rank)")
        if launched is not None and launched.local_rank >= visible:
            raise UsageError(f"LOCAL_RANK={launched.local_rank}: only {visible} CUDA device(s) visible")
    if layout.world_size > 1:
        _check_data_parallel(ns, layout)
    return layout


def _check_data_parallel(ns: argparse.Namespace, layout: ActorLayout) -> None:
    w = layout.world_size
    ranks = f"{w} actor ranks (--actor-num-nodes {layout.num_nodes} x --actor-num-gpus-per-node {layout.gpus_per_node})"
    if ns.global_batch_size % w:
        raise UsageError(f"--global-batch-size {ns.global_batch_size} does not split over {ranks}: each rank trains "
                         f"an equal share of every global batch; use a multiple of {w}")
    if ns.sglang_router_ip is not None:
        raise UsageError(f"--sglang-router-ip with {ranks}: a data-parallel run generates on its ranks' in-process "
                         f"engines (colocated) or on the engines it starts (--rollout-num-gpus); rollout through a running router needs "
                         f"one actor rank for now")
    if ns.async_mode:
        raise UsageError(f"--async with {ranks} is not supported yet (the rollout thread and the trainer would share "
                         f"the ranks' process group); use sync mode")
    if ns.engine_weights == "shared":
        raise UsageError(f"--engine-weights shared with {ranks}: a rank holds only a shard of the trainer's weights; "
                         f"its engine keeps a full copy (--engine-weights buckets, the default there)")


class Placement(abc.ABC):
    """Where actor ranks (and, later, engines) run (module docstring)."""

    name: str
    rank_said_why: bool = False
    """Set by :meth:`launch_actors` when the failing rank returned its code itself, having printed why (and
    how to resume): the launcher then adds no line of its own."""

    @abc.abstractmethod
    def check(self, layout: ActorLayout) -> None:
        """:class:`UsageError` if this placement cannot start ``layout`` (before any process starts)."""

    @abc.abstractmethod
    def launch_actors(self, entry: Callable[[argparse.Namespace], int], ns: argparse.Namespace,
                      layout: ActorLayout) -> int:
        """Start ``layout.world_size`` rank processes, each running ``entry(ns)`` with :data:`RANK_ENV` set
        (``entry`` must be importable by name: it travels to the new processes); wait for all; return 0
        when every rank returned 0, else the failing rank's code (its error shown on stderr)."""


def _rank_main(local_rank: int, entry, ns, env: dict) -> None:
    """One rank process of :class:`LocalPlacement`: place it, run ``entry(ns)``, exit with its code (an
    exception prints its traceback on the rank's stderr, which is the launcher's, and exits 1)."""
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    leave_process(int(entry(ns) or 0))


def leave_process(code: int) -> None:
    """End a rank process whose work is done with ``code``: flush Python's streams and exit without the
    interpreter's teardown. After a gloo process group, that teardown sometimes aborts in C++ static
    destructors (``terminate called without an active exception``, SIGABRT) although every collective
    has completed and the group is destroyed, which turned finished ranks into failed ones."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


STOP_GRACE_S = 3.0
"""Seconds the other ranks get to end on their own after one exits with an error (after a failed gate
every rank exits 1 together) before they are stopped: a rank left waiting in a collective never ends."""


class LocalPlacement(Placement):
    """Rank processes on this host (``multiprocessing`` spawn), rendezvous on 127.0.0.1 at a free port."""

    name = "local"

    def check(self, layout: ActorLayout) -> None:
        if layout.num_nodes > 1:
            raise UsageError(f"--actor-num-nodes {layout.num_nodes}: --placement local runs on this host only")

    def launch_actors(self, entry, ns, layout: ActorLayout) -> int:
        import multiprocessing
        import multiprocessing.connection

        self.check(layout)
        env = {"WORLD_SIZE": str(layout.world_size), "LOCAL_WORLD_SIZE": str(layout.gpus_per_node),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per rank: no forked CUDA or thread state
        procs = [ctx.Process(target=_rank_main, args=(r, entry, ns, env), name=f"rlperf-actor-rank-{r}")
                 for r in range(layout.world_size)]
        failed = False
        try:
            for p in procs:
                p.start()
            alive = list(procs)
            while alive:
                ready = multiprocessing.connection.wait([p.sentinel for p in alive], STOP_GRACE_S if failed else None)
                if not ready:  # the grace after a failure is over: stop the ranks still waiting
                    break
                for p in [p for p in alive if p.sentinel in ready]:
                    p.join()
                    alive.remove(p)
                    failed = failed or p.exitcode != 0
        finally:
            stopped = _stop([p for p in procs if p.is_alive()])
        codes = [p.exitcode for p in procs]
        if not any(codes):
            return 0
        ended = {r: c for r, c in enumerate(codes) if c and procs[r] not in stopped}
        if stopped or len(set(ended.values())) > 1 or any(c < 0 for c in ended.values()):
            # not every rank ended the same way on its own: say how each ended (a rank that lost its peer
            # in a collective fails too; the first in this list is not always the cause)
            parts = [f"rank {r} " + (f"was killed by {_signal_name(-c)}" if c < 0 else f"exited with code {c}")
                     for r, c in ended.items()] + [f"rank {procs.index(p)} was stopped" for p in stopped]
            print(f"rlperf: {layout.world_size} actor ranks: " + "; ".join(parts), file=sys.stderr)
        return 2 if 2 in ended.values() else 1


def _stop(procs) -> list:
    """SIGTERM, then SIGKILL after a few seconds, to each of ``procs``; returns them."""
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()
    return procs


def _signal_name(num: int) -> str:
    import signal

    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def needs_launch(ns: argparse.Namespace) -> bool:
    """True when this process must start the ranks: more than one (or any number with ``--placement ray``,
    which runs even one rank on its bundle), and it is not a rank itself."""
    return RankEnv.from_environ() is None and (ActorLayout.of(ns, "cpu").world_size > 1
                                               or ns.placement == "ray")


@contextlib.contextmanager
def actor_process_group(ns: argparse.Namespace) -> Iterator[RankEnv]:
    """Join the actor ranks' default process group for the block (nothing for a single process); yields
    this process's :class:`RankEnv`. On CUDA the rank's GPU is ``LOCAL_RANK`` (``ns.device`` becomes
    ``cuda:LOCAL_RANK``). The group is left after a barrier when the block ends normally; an error
    (or ``SystemExit``, how a rank reports a nonzero code) leaves at once, and the launcher stops the
    other ranks."""
    place = RankEnv.from_environ()
    if place is None or place.world_size == 1:
        yield place or RankEnv()
        return
    import torch
    import torch.distributed as dist

    device = run_device(ns)
    if device.type == "cuda":
        torch.cuda.set_device(place.local_rank)
        ns.device = f"cuda:{place.local_rank}"
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, rank=place.rank, world_size=place.world_size)
    yield place
    # a normal end only: after an error (SystemExit included) other ranks may be inside a collective, so
    # this rank leaves at once and the launcher stops them
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
