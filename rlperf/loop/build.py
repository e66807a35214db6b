"""The parts of a run built before its trainer: the model and tokenizer, the data, the format warm-up and
the reference model. Every bad input (a checkpoint that cannot be loaded, a bad prompt file or python
path) is a :class:`rlperf.loop.args.UsageError` naming its flag.

The actor comes from ``--load`` > ``--hf-checkpoint`` > the ``--model`` preset at random init, or is
warmed already when an earlier run of this process kept its warm-up's result for the same key
(:mod:`rlperf.loop.warm_start`: the gates' run before the training run). A preset model on the embedded
task gets the task's format warm-up on rank 0 only: the other ranks take rank 0's weights when the
trainer backend starts (:func:`rlperf.train.backend.start_from_rank0`), and the warm-up draws no random
numbers, so the ranks' generators stay alike.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from . import checkpoint as ckpt
from . import warm_start
from .args import UsageError, check_moe_model
from .config import RunConfig


@contextlib.contextmanager
def usage_errors(flag: str, path):
    """A checkpoint that cannot be loaded (missing files, an unsupported config.json, mismatched
    tensors) is bad input: :class:`UsageError` naming the flag (the CLI exits 2 with it)."""
    try:
        yield
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: {exc}") from None


@dataclasses.dataclass
class ModelParts:
    model: torch.nn.Module
    """The actor, float32 (the master weights)."""
    tokenizer: object
    warm_key: tuple | None
    """What the format warm-up's result depends on (:func:`warm_start_key`), where this process warms up."""
    warm_started: object | None
    """The warmed weights of an earlier run of this process, when they apply (:mod:`rlperf.loop.warm_start`)."""


@dataclasses.dataclass
class DataParts:
    dataset: object
    """The prompts (:class:`rlperf.data.jsonl.PromptDataset`)."""
    reward_fn: object
    rollout_fn: object
    """``--rollout-function-path``, else :func:`rlperf.loop.generation.generate_rollout`."""
    custom_generate: object | None


def build_model(config: RunConfig, device: torch.device, key_of, rank: int) -> ModelParts:
    """The actor and tokenizer (module docstring). ``key_of(model_cfg)``: the warm-start key of a preset
    model (:func:`warm_start_key`), asked only where this process warms the model up."""
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.rollout.tokenizer import load_tokenizer

    m = config.model
    init_path = ckpt.model_dir(m.load) if m.load else m.hf_checkpoint
    warms_up = config.data.embedded and not m.init_path and rank == 0
    warm_key = key_of(preset(m.preset)) if warms_up else None
    warm_started = None
    if init_path:
        with usage_errors("--load" if m.load else "--hf-checkpoint", m.load or init_path):
            model = Qwen3ForCausalLM.from_pretrained(init_path, dtype=torch.float32, device=device)
    elif warm_key is not None and (kept := warm_start.lookup(warm_key)):
        warm_started = kept  # no random init, no warm-up
        model = Qwen3ForCausalLM(preset(m.preset), torch.float32, device)
        kept.load_into(model)
    else:
        model = Qwen3ForCausalLM.random(preset(m.preset), seed=config.runtime.seed, device=device)
    tokenizer = load_tokenizer(m.hf_checkpoint, model.cfg.vocab_size)
    moe = config.train.moe
    check_moe_model(model.cfg, moe.expert_model_parallel_size, moe.routing_replay)
    return ModelParts(model, tokenizer, warm_key, warm_started)


def warm_start_key(cfg, seed: int, device: torch.device, dtype: torch.dtype, policy) -> tuple:
    """Everything the warm-up's result depends on (:mod:`rlperf.loop.warm_start`): the preset model ``cfg``
    and the seed it is drawn from, the device, the compute dtype, the kernels (mode and the backend they
    resolve to here), the CPU threads, deterministic algorithms, the task and the warm-up function itself."""
    from rlperf.data.embedded import EMBEDDED_TASK, format_warmup

    return (cfg, seed, str(device), dtype, policy.mode, policy.backend_for(device), torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(), EMBEDDED_TASK, format_warmup)


def warm_up(parts: ModelParts, dtype: torch.dtype) -> float | None:
    """The embedded task's format warm-up of ``parts.model`` where this process runs it (kept for later runs
    of the process), or the kept result's; its last loss, else None (a ``--prompt-data`` run, a loaded
    model, a rank other than 0)."""
    from rlperf.data.embedded import EMBEDDED_TASK, format_warmup

    if parts.warm_started is not None:
        return parts.warm_started.loss
    if parts.warm_key is None:
        return None
    loss = format_warmup(parts.model, EMBEDDED_TASK, parts.tokenizer, compute_dtype=dtype)
    warm_start.keep(parts.warm_key, parts.model, loss)
    return loss


def reference_model(config: RunConfig, model: torch.nn.Module, device: torch.device) -> torch.nn.Module | None:
    """``--ref-load``, else a frozen copy of the actor as it starts when a KL term needs one (slime asks for
    ``--ref-load``), else None."""
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.train import frozen_copy

    m, a = config.model, config.train.args
    if m.ref_load:
        with usage_errors("--ref-load", m.ref_load):
            return Qwen3ForCausalLM.from_pretrained(ckpt.model_dir(m.ref_load), dtype=torch.float32, device=device)
    if a.use_kl_loss or a.kl_coef:
        return frozen_copy(model)
    return None


def build_data(config: RunConfig, tokenizer) -> DataParts:
    """The prompts, the reward, the rollout function and the custom generate function."""
    from rlperf.data.embedded import EMBEDDED_TASK
    from rlperf.data.jsonl import DataError, PromptDataset, load_prompt_data
    from rlperf.data.rewards import load_python_path, reward_fn_for

    from .generation import generate_rollout

    d, r, seed = config.data, config.rollout, config.runtime.seed
    try:
        if d.embedded:
            dataset = PromptDataset(EMBEDDED_TASK.records(), seed)
        else:
            dataset = PromptDataset(load_prompt_data(
                d.prompt_data, d.input_key, d.label_key, d.metadata_key, d.apply_chat_template, tokenizer), seed)
        return DataParts(
            dataset, reward_fn_for(d.rm_type, d.custom_rm_path),
            load_python_path(r.rollout_function_path, "--rollout-function-path") if r.rollout_function_path
            else generate_rollout,
            load_python_path(r.custom_generate_function_path, "--custom-generate-function-path")
            if r.custom_generate_function_path else None)
    except (DataError, ValueError) as exc:
        raise UsageError(str(exc)) from None
