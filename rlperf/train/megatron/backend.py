"""``--train-backend megatron`` as a :class:`rlperf.train.backend.TrainerBackend`: megatron's tensor /
pipeline / data-parallel groups over the actor ranks, this rank's stage and shards of a ``GPTModel`` (and
of the reference) loaded from rank 0's whole HF weights, a :class:`MegatronTrainer` on them, and the
rank's engine copy.

One process with no default process group gets a one-rank group of its own (an in-memory store: no TCP
port another process could take first); :meth:`MegatronBackend.close` leaves megatron's groups and
that group. The engine copy (``engine_model``) is rlperf's model in the compute dtype, in the tree mode
(``reduction_leaves``) whose bits are the trainer's at any TP / PP (true on-policy), loaded from the
gathered shards at every sync.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlperf.kernels.tree_reduce import TREE_LEAVES

from ..backend import LayoutError, TrainerSetup, register_trainer_backend, start_from_rank0
from .model import RecomputeConfig, build_gpt_model
from .runtime import ParallelLayout, destroy_model_parallel, initialize_model_parallel
from .trainer import MegatronTrainer


class MegatronBackend(MegatronTrainer):
    """A :class:`MegatronTrainer` that owns its process groups (module docstring)."""

    own_group = False
    """Whether building made the default process group (one process), which :meth:`close` destroys."""
    groups = False
    """Whether megatron's model-parallel groups are up (:meth:`close` destroys them once)."""

    def describe(self) -> str:
        world = dist.get_world_size()
        tp, pp = self.tp.size, self.pp_size
        return f"megatron backend on {world} rank(s): TP {tp} x PP {pp} x DP {world // (tp * pp)}"

    def close(self) -> None:
        if self.groups:
            destroy_model_parallel()
            self.groups = False
        if self.own_group:
            dist.destroy_process_group()
            self.own_group = False


@register_trainer_backend("megatron")
def build_megatron_trainer(setup: TrainerSetup) -> MegatronBackend:
    """The megatron backend (module docstring); :class:`rlperf.train.backend.LayoutError` naming the layout
    flags when the model does not split into it."""
    from rlperf.model.qwen3 import Qwen3ForCausalLM

    mc, device = setup.config.megatron, setup.device
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl",
                                store=dist.HashStore(), rank=0, world_size=1)
    start_from_rank0(setup)
    flags = (f"--tensor-model-parallel-size {mc.tensor_model_parallel_size} --pipeline-model-parallel-size "
             f"{mc.pipeline_model_parallel_size}" + (" --sequence-parallel" if mc.sequence_parallel else ""))
    groups = False
    try:
        initialize_model_parallel(ParallelLayout(mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size,
                                                 sequence_parallel=mc.sequence_parallel), seed=setup.seed)
        groups = True
        recompute = RecomputeConfig(mc.recompute_granularity, mc.recompute_method, mc.recompute_num_layers)

        def shards(model):
            gpt = build_gpt_model(model.cfg, torch.float32, TREE_LEAVES, recompute, device=device,
                                  sequence_parallel=mc.sequence_parallel)
            gpt.load_hf_tensors(model.hf_state_dict())
            return gpt

        actor, ref = shards(setup.model), (shards(setup.ref_model) if setup.ref_model is not None else None)
    except BaseException as exc:
        if groups:
            destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()
        if isinstance(exc, (ValueError, AssertionError)):  # the model does not split into this layout
            raise LayoutError(f"--train-backend megatron {flags}: {exc}") from None
        raise
    trainer = MegatronBackend(actor, setup.config.args, ref, compute_dtype=setup.compute_dtype,
                              distributed_optimizer=mc.use_distributed_optimizer)
    trainer.own_group, trainer.groups = own_group, True
    engine = Qwen3ForCausalLM(setup.model.cfg, setup.compute_dtype, device, reduction_leaves=TREE_LEAVES)
    engine.requires_grad_(False)
    trainer.engine_model = engine
    return trainer
