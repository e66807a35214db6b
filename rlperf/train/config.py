"""The trainer's typed configuration: what a trainer backend is built from (:mod:`rlperf.train.backend`).

:class:`TrainConfig` holds the training core's :class:`rlperf.train.TrainArgs`, the precision, the steps
per rollout, ``--train-backend`` with the megatron layout (:class:`MegatronConfig`) and mixture-of-experts
training (:class:`MoEConfig`). The loop builds it once from the resolved flags, as a section of its
``RunConfig`` (``rlperf/loop/config.py``). Light to import: no torch.
"""
from __future__ import annotations

import dataclasses

from .args import TrainArgs


@dataclasses.dataclass(frozen=True)
class MegatronConfig:
    """The megatron backend's parallel layout and recompute (slime's flags; ``world = TP x PP x DP``)."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    recompute_granularity: str | None
    """``full`` (CUDA) or None; selective and context parallel are refused by
    :func:`rlperf.loop.args.check_megatron_flags`."""
    recompute_method: str | None
    recompute_num_layers: int | None
    sequence_parallel: bool = False
    """``--sequence-parallel``: activations between the tensor-parallel layers split over the tokens."""
    use_distributed_optimizer: bool = False
    """``--use-distributed-optimizer``: AdamW's moments sharded over the data-parallel replicas."""
    transformer_impl: str = "local"
    """``--transformer-impl``: only ``local`` runs (``transformer_engine`` is refused at resolve time)."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts training (MoE models only; :func:`rlperf.loop.args.check_moe_model`)."""

    routing_replay: bool = False
    """``--use-rollout-routing-replay``: the rollout returns every token's routed experts and the
    trainer's forwards route as the rollout did (:func:`rlperf.train.batching.replayed_routing`)."""
    expert_model_parallel_size: int = 1
    """``--expert-model-parallel-size``: actor ranks each MoE layer's experts are split over
    (:class:`rlperf.train.expert_parallel.ExpertParallelTrainer`); 1: every rank holds every expert."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The trainer: its core options, precision and steps per rollout, ``--train-backend`` and the layout
    flags. Which implementation trains is :func:`rlperf.train.backend.backend_name`'s answer for this
    section and the number of actor ranks: one process, FSDP2 over the ranks, expert parallel, or
    megatron laid out by :attr:`megatron`."""

    args: TrainArgs
    """The training core's options (losses, advantages, batching, optimizer)."""
    precision: str
    """``bf16`` (float32 masters, bf16 compute weights) or ``fp32`` (resolved from ``auto``)."""
    num_steps_per_rollout: int
    backend: str = "fsdp"
    """``--train-backend``: ``fsdp`` (rlperf's model; FSDP2 on several ranks) or ``megatron``."""
    megatron: MegatronConfig | None = None
    """The megatron backend's layout (``backend == "megatron"`` only)."""
    moe: MoEConfig = MoEConfig()
    """Routing replay and expert parallel (MoE models)."""
