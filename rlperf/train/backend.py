"""The seam on the trainer side: the loop talks to every training backend through :class:`TrainerBackend`.

A backend is built once per run from the typed configuration (:class:`TrainerSetup`, whose ``config``
is the run's :class:`rlperf.train.config.TrainConfig`) and then asked only the protocol's verbs:

* ``describe()`` — the layout in words, for the run's first line ("" for one process);
* ``prepare(samples)`` — log-probs of the samples (old actor, reference), then their advantages;
* ``train_step(samples)`` — one optimizer step over a global batch; its metrics (slime's names);
* ``train(samples)`` — one rollout: ``prepare``, then one ``train_step`` per global batch;
* ``train_routed_experts(samples)`` — MoE models: the actor's own routing (the gates' record);
* ``compute_weights(bucket_bytes)`` — ``(HF name, tensor)`` pairs of the compute weights: what weight
  sync sends, bucket by bucket;
* ``checkpoint_state()`` / ``load_state_dict(state)`` — checkpoint state out (the whole float32
  masters and the trainer state, :class:`CheckpointState`) and in (the weights were loaded already);
* ``probe_step(mb, loss_of)`` — one forward and backward of a micro-batch (the gates' memory probe);
* ``close()`` — release what building it set up (process groups);

plus four attributes: ``args`` (:class:`rlperf.train.TrainArgs`), ``model`` (the model forward and
backward run on), ``device`` and ``engine_model`` (the rlperf model an in-process engine of this process
runs: the compute weights themselves, or a full copy loaded from ``compute_weights`` at every sync).

Every layout answers the same verbs on every rank with the same arguments: ``compute_weights`` and
``checkpoint_state`` are collectives where the weights are sharded (every rank walks them), and
``checkpoint_state`` is None on the ranks that write nothing. Which rank gathers, broadcasts or writes is
the backend's business, never the loop's.

The registry maps ``--train-backend`` and the layout flags to one implementation (:func:`backend_name`),
each registered by name with :func:`register_trainer_backend` beside its class:

* ``one-process`` — ``--train-backend fsdp`` on one actor rank: :class:`rlperf.train.Trainer`;
* ``fsdp`` — ``--train-backend fsdp`` on several actor ranks: :class:`rlperf.train.fsdp.FSDPTrainer`;
* ``expert-parallel`` — ``--expert-model-parallel-size`` > 1:
  :class:`rlperf.train.expert_parallel.ExpertParallelTrainer`;
* ``megatron`` — ``--train-backend megatron``: :class:`rlperf.train.megatron.backend.MegatronBackend`.

:func:`build_trainer` imports the chosen backend's module (so megatron-core loads only when asked for)
and calls its factory. docs/ARCHITECTURE.md ("The seams") shows how to add a backend.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .args import TrainArgs
    from .config import TrainConfig
    from .sample import Sample


@dataclasses.dataclass
class TrainerSetup:
    """What a backend is built from: the typed configuration and this process's starting point."""

    config: TrainConfig
    """The run's trainer section (``--train-backend``, layout flags, :class:`rlperf.train.TrainArgs`, precision)."""
    model: nn.Module
    """The actor, whole, in float32: the master weights. On several ranks every rank passes its own and the
    backend starts every rank from rank 0's (it broadcasts them before it shards)."""
    ref_model: nn.Module | None
    """The frozen reference model (a KL term needs one), whole, float32; None without."""
    device: torch.device
    compute_dtype: torch.dtype
    """The dtype forward and backward run in (bf16 on CUDA): :class:`rlperf.train.Trainer`'s mixed precision."""
    seed: int
    """The run's seed (megatron's model-parallel random generators)."""
    engine_copy: bool = True
    """Whether this process runs an in-process engine: the distributed backends then keep a full copy of the
    weights in ``compute_dtype`` for it (:attr:`TrainerBackend.engine_model`); engines elsewhere need none."""
    world_size: int = 1
    """Actor ranks in the default process group (1: one process)."""


class LayoutError(ValueError):
    """The model does not split into the layout the flags ask for (its message names them): bad usage, which
    the loop reports as such."""


@dataclasses.dataclass
class CheckpointState:
    """What one checkpoint writes: the whole actor with float32 master weights (its ``save_pretrained`` writes
    the HF files) and the trainer state (:meth:`rlperf.train.Trainer.state_dict`: optimizer, step count)."""

    model: nn.Module
    trainer_state: dict


@runtime_checkable
class TrainerBackend(Protocol):
    """What the loop asks of its trainer, on every layout (module docstring)."""

    args: TrainArgs
    model: nn.Module
    """The model forward and backward run on (this rank's shard or stage where the weights are split)."""

    @property
    def device(self) -> torch.device:
        """Where this rank computes."""

    @property
    def engine_model(self) -> nn.Module:
        """The rlperf model an in-process engine of this process runs: the compute weights (one process), or
        a full copy in the compute dtype that ``compute_weights`` loads at every sync; where the engines run
        elsewhere, a model of the same configuration (their client reads its ``cfg``)."""

    def describe(self) -> str:
        """The layout in words for the run's first line (``"2 data-parallel ranks"``); "" for one process."""

    def prepare(self, samples: Sequence[Sample]) -> None:
        """Fill every sample's ``log_probs`` (old actor), ``ref_log_probs`` (when the loss needs them) and
        ``advantages``; every rank gets every sample's."""

    def train_step(self, samples: Sequence[Sample], micro_step_hook=None) -> dict[str, float]:
        """One optimizer step over the prepared global batch ``samples``; the step's metrics."""

    def train(self, samples: Sequence[Sample], *, on_first_micro_step=None, phase=None) -> list[dict[str, float]]:
        """One rollout: :meth:`prepare` (inside ``phase("log_prob")``), then one :meth:`train_step` per global
        batch (inside ``phase("train")``); each step's metrics."""

    def train_routed_experts(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """MoE models: the actor's own routing of every sample (its routers, never a replay)."""

    def compute_weights(self, bucket_bytes: int) -> Iterable[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)`` pairs of the compute weights, whole, in ``hf_state_dict`` order (gathered
        ``bucket_bytes`` at a time where sharded: a collective every rank walks to its end)."""

    def checkpoint_state(self) -> CheckpointState | None:
        """What a checkpoint writes; None on the ranks that write nothing (a collective where sharded)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's trainer state (every rank, the whole state; each keeps its share)."""

    def probe_step(self, mb, loss_of) -> None:
        """One forward with grad and one backward of the micro-batch ``mb`` under ``loss_of(log_probs,
        entropy)``, gradients left in ``.grad``: the first-step gates' worst-case memory probe."""

    def close(self) -> None:
        """Release what building the backend set up (process groups); the loop calls it once."""


BackendFactory = Callable[[TrainerSetup], TrainerBackend]

BACKEND_MODULES = {
    "one-process": "rlperf.train.trainer",
    "fsdp": "rlperf.train.fsdp",
    "expert-parallel": "rlperf.train.expert_parallel",
    "megatron": "rlperf.train.megatron.backend",
}
"""Each built-in backend's module, imported when the backend is asked for (its registration runs then)."""

_REGISTRY: dict[str, BackendFactory] = {}


def register_trainer_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: register ``factory(setup) -> TrainerBackend`` under ``name`` (a class whose constructor
    takes a :class:`TrainerSetup`, or its ``build`` classmethod)."""
    def register(factory: BackendFactory) -> BackendFactory:
        _REGISTRY[name] = factory
        return factory
    return register


def backend_name(config: TrainConfig, world_size: int) -> str:
    """The registered backend of ``--train-backend`` (``config.backend``) and the layout flags: any name but
    ``fsdp`` is the backend itself (``megatron``, or one registered); ``fsdp`` is expert parallel when
    ``--expert-model-parallel-size`` > 1, FSDP2 on several actor ranks and the one-process trainer on one."""
    if config.backend != "fsdp":
        return config.backend
    if config.moe.expert_model_parallel_size > 1:
        return "expert-parallel"
    return "fsdp" if world_size > 1 else "one-process"


def trainer_backend(name: str) -> BackendFactory:
    """The factory registered as ``name`` (its built-in module imported first); KeyError naming the known ones."""
    if name not in _REGISTRY and name in BACKEND_MODULES:
        importlib.import_module(BACKEND_MODULES[name])
    if name not in _REGISTRY:
        raise KeyError(f"no trainer backend {name!r}: registered {sorted(set(_REGISTRY) | set(BACKEND_MODULES))}")
    return _REGISTRY[name]


def build_trainer(setup: TrainerSetup) -> TrainerBackend:
    """The backend :func:`backend_name` picks for ``setup``, built."""
    return trainer_backend(backend_name(setup.config, setup.world_size))(setup)


def start_from_rank0(setup: TrainerSetup) -> None:
    """On several ranks, every rank's actor and reference overwritten with rank 0's, whatever each built,
    loaded or warmed up (a broadcast per parameter): what the distributed backends shard. One rank: nothing."""
    if setup.world_size <= 1:
        return
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for model in (setup.model, setup.ref_model):
            for p in model.parameters() if model is not None else ():
                dist.broadcast(p.data, 0)


def describe_ranks(world_size: int) -> str:
    """``"N data-parallel ranks"`` on several ranks, "" on one (the one-process and FSDP layouts' words)."""
    return f"{world_size} data-parallel ranks" if world_size > 1 else ""


def full_engine_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """An empty full copy of ``model``'s architecture in ``dtype``, frozen, on its device: a distributed
    backend's engine copy (:attr:`TrainerBackend.engine_model`, loaded from ``compute_weights`` at every sync)."""
    engine = type(model)(model.cfg, dtype, model.head_weight.device)
    engine.requires_grad_(False)
    return engine


def shard_from_rank0(setup: TrainerSetup, shard: Callable[[], TrainerBackend]) -> TrainerBackend:
    """The FSDP and expert-parallel backends' start: every rank starts from rank 0's weights
    (:func:`start_from_rank0`), an engine copy is made while the model is whole (with ``setup.engine_copy``),
    then ``shard()`` builds the trainer, which splits the model in place. Its ``engine_model`` is the engine
    copy, or (engines elsewhere) the sharded master model, whose ``cfg`` their client reads."""
    start_from_rank0(setup)
    engine = full_engine_copy(setup.model, setup.compute_dtype) if setup.engine_copy else None
    trainer = shard()
    trainer.engine_model = engine if engine is not None else trainer.master_model
    return trainer

