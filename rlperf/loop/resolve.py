"""Parsed ``rlperf train`` / ``rlperf gate`` flags -> a checked run, before anything starts.

:func:`resolve_args` runs four stages, each its own function, in this order:

1. :func:`rlperf.loop.args.fill_task_defaults` and :func:`rlperf.loop.args.check_flag_values`: the
   flags alone (defaults, ranges, relations);
2. :func:`probe_host`: what needs the host (``--device``, the GPUs the layout asks for, the kernel
   backend, ``--precision auto``, ``--engine-weights auto``, ``--cuda-graph-buckets auto``;
   :mod:`rlperf.loop.device`, :func:`rlperf.loop.placement.check_actor_layout`);
3. :func:`check_inputs`: the files the run reads (the API key file, ``--load`` / ``--ref-load`` /
   ``--hf-checkpoint``: directories, ``config.json``, complete safetensors, the checkpoint pointer);
4. :func:`check_outputs`: the directories it writes (``--save`` without checkpoints of another run
   unless ``--overwrite-save``; ``--save`` and ``--output-dir`` writable: created, a file written and
   removed).

Every failure is a :class:`rlperf.loop.args.UsageError` naming the flag. The result is the parsed
namespace completed (``embedded``, ``precision``, ``engine_weights``, ``cuda_graph_buckets``,
``disaggregated``, ``engine_gpus``, ``train_args``, the API key); the run reads it once, as
:class:`rlperf.loop.config.RunConfig`.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rlperf.flags import AUTO_BUCKETS
from rlperf.rollout.args import resolve_api_key
from rlperf.telemetry.loggers import logger_config_from
from rlperf.train.args import train_args_from

from .args import UsageError, add_loop_arguments, check_flag_values, check_moe_model, fill_task_defaults
from .device import kernel_policy, resolve_engine_layout, run_device
from .placement import check_actor_layout


def resolve_args(ns: argparse.Namespace) -> argparse.Namespace:
    """Fill the task's defaults and check everything that can be checked before a step (module
    docstring); returns ``ns``, completed."""
    fill_task_defaults(ns)
    check_flag_values(ns)
    probe_host(ns)
    try:
        ns.train_args = train_args_from(ns)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_inputs(ns)
    check_outputs(ns)
    return ns


def probe_host(ns: argparse.Namespace) -> None:
    """Stage 2: the device, the engines' GPUs (``ns.disaggregated``, ``ns.engine_gpus``), the kernel
    backend, the actor layout; ``--precision auto``, ``--engine-weights auto`` and ``--cuda-graph-buckets
    auto`` decided for this host."""
    if not ns.load and not ns.hf_checkpoint:  # the model is the preset
        from rlperf.model import preset

        try:
            cfg = preset(ns.model)
        except ValueError as exc:
            raise UsageError(f"--model {ns.model}: {exc}") from None
        # a checkpoint's model is checked when the run builds it (rlperf.loop.build.build_model)
        check_moe_model(cfg, ns.expert_model_parallel_size, ns.use_rollout_routing_replay)
    device = run_device(ns)
    resolve_engine_layout(ns, device)  # --rollout-num-gpus: ns.disaggregated, ns.engine_gpus
    if getattr(ns, "rollout_backend", "rlperf") == "sglang":  # its packages, before the model is built
        from .sglang_engines import check_sglang_installed, use_weight_sync_nccl_settings

        check_sglang_installed()
        use_weight_sync_nccl_settings()  # before any rank or NCCL communicator starts: they inherit it
    policy = kernel_policy(ns, device)  # checked now; the run applies it (rlperf.loop.runner.Run.kernels)
    actor_ranks = check_actor_layout(ns, device).world_size  # --actor-num-*: ranks, GPUs, batch split
    if ns.train_backend == "megatron":
        check_megatron_layout(ns, device, actor_ranks)
    if ns.precision in (None, "auto"):
        ns.precision = "bf16" if device.type == "cuda" else "fp32"
    if ns.precision == "bf16" and device.type == "cpu" and policy.backend_for(device) == "interpreter":
        raise UsageError("--precision bf16 on CPU needs the reference backend: the Triton interpreter's bf16 "
                         "tl.dot and casts are wrong (docs/ARCHITECTURE.md, Measured facts); use --kernel-backend "
                         "reference or fp32")
    resolve_cuda_graph_buckets(ns, device, actor_ranks)
    ew = ns.engine_weights
    if ew == "auto":
        ew = "shared" if (device.type == "cuda" and not ns.async_mode and ns.sglang_router_ip is None
                          and not ns.disaggregated and actor_ranks == 1
                          and ns.train_backend == "fsdp") else "buckets"
    if ew == "shared" and ns.train_backend == "megatron":
        raise UsageError("--engine-weights shared with --train-backend megatron: the engine runs rlperf's model on its "
                         "own full copy (megatron's layers hold shards); use --engine-weights buckets")
    if ew == "shared" and ns.async_mode:
        raise UsageError("--engine-weights shared needs sync mode: with --async the rollout would read weights "
                         "the trainer is updating")
    if ew == "shared" and ns.sglang_router_ip is not None:
        raise UsageError("--engine-weights applies to the in-process engine, not to servers behind --sglang-router-ip")
    if ew == "shared" and ns.disaggregated:
        raise UsageError("--engine-weights applies to the in-process engine, not to the engines of --rollout-num-gpus")
    ns.engine_weights = ew


def resolve_cuda_graph_buckets(ns: argparse.Namespace, device, actor_ranks: int) -> None:
    """``ns.cuda_graph_buckets`` made concrete (``ns.precision`` resolved first): an explicit list is
    checked (:func:`check_cuda_graph_buckets`, a :class:`UsageError` where graphs do not apply); ``auto``
    becomes :func:`rlperf.train.args.auto_cuda_graph_buckets` of ``--max-tokens-per-gpu`` where they do
    (a CUDA device, one actor process of the fsdp or the megatron backend, a dense model without routing
    replay, ``--use-dynamic-batch-size``), bounded by the device's memory, and ``()`` (eager) elsewhere,
    silently.
    A checkpoint's model is read from its ``config.json``; one that does not read stays eager (stage 3
    reports it)."""
    buckets = getattr(ns, "cuda_graph_buckets", ())
    if buckets != AUTO_BUCKETS:
        if buckets:
            check_cuda_graph_buckets(ns, device, actor_ranks)
        return
    ns.cuda_graph_buckets = ()
    cfg = run_model_config(ns)
    if (cfg is None or cuda_graph_refusal(ns, device, actor_ranks, cfg) is not None
            or not ns.use_dynamic_batch_size or not ns.max_tokens_per_gpu or ns.max_tokens_per_gpu < 1):
        return
    from rlperf.telemetry import memory
    from rlperf.train.args import auto_cuda_graph_buckets

    from .device import compute_dtype

    try:
        capacity = memory.capacity_bytes(device)
    except (AssertionError, RuntimeError):  # a --placement ray driver may see no GPU: the ranks' memory is unknown
        return
    ns.cuda_graph_buckets = auto_cuda_graph_buckets(
        ns.max_tokens_per_gpu, cfg.num_parameters * compute_dtype(ns.precision).itemsize, capacity)


def run_model_config(ns: argparse.Namespace):
    """The :class:`rlperf.model.ModelConfig` the run will train: the preset's, or the ``config.json`` of
    ``--load``'s latest checkpoint or of ``--hf-checkpoint``; None when it does not read (stage 3 names
    the flag)."""
    from rlperf.model.config import preset, read_hf_config

    try:
        if ns.load is None and ns.hf_checkpoint is None:
            return preset(ns.model)
        from .checkpoint import model_dir

        return read_hf_config(model_dir(ns.load) if ns.load else ns.hf_checkpoint)[0]
    except (OSError, ValueError):
        return None


def cuda_graph_refusal(ns: argparse.Namespace, device, actor_ranks: int, cfg) -> str | None:
    """Why graphed micro-steps (:mod:`rlperf.train.cuda_graph`) cannot run on this host, naming the flag,
    or None: they need a CUDA device, one actor process of the fsdp or the megatron backend (the
    data-parallel trainer runs its own micro-steps; with one process the megatron layout is TP = PP = 1)
    and a dense model without routing replay (the MoE layers' grouping is not captured). ``cfg``:
    :func:`run_model_config` (None: not read, not refused)."""
    if device.type != "cuda":
        return f"--cuda-graph-buckets replays CUDA graphs: it needs a CUDA device (--device {device.type})"
    if actor_ranks != 1:
        return (f"--cuda-graph-buckets needs one actor process (got --train-backend {ns.train_backend} with "
                f"{actor_ranks} actor rank(s))")
    if ns.use_rollout_routing_replay:
        return "--cuda-graph-buckets does not go with --use-rollout-routing-replay (MoE routing is not captured)"
    if cfg is not None and cfg.moe_layers:
        model = (f"--model {ns.model}" if ns.load is None and ns.hf_checkpoint is None
                 else f"--load {ns.load}" if ns.load else f"--hf-checkpoint {ns.hf_checkpoint}")
        return (f"--cuda-graph-buckets: {model} has MoE layers, whose expert grouping is not captured; "
                f"dense models only")
    return None


def check_cuda_graph_buckets(ns: argparse.Namespace, device, actor_ranks: int) -> None:
    """An explicit ``--cuda-graph-buckets`` list on this host: :class:`UsageError` with
    :func:`cuda_graph_refusal`'s reason (a checkpoint whose ``config.json`` does not read is stage 3's to report)."""
    why = cuda_graph_refusal(ns, device, actor_ranks, run_model_config(ns))
    if why is not None:
        raise UsageError(why)


def check_megatron_layout(ns: argparse.Namespace, device, actor_ranks: int) -> None:
    """``--train-backend megatron`` on this host: megatron-core importable, TP x PP dividing the actor
    ranks (data parallel over what is left), full recompute on CUDA only."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--train-backend megatron needs megatron-core ({exc}); pip install -e \".[megatron]\"") from None
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if actor_ranks % (tp * pp):
        raise UsageError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} does not "
                         f"divide the {actor_ranks} actor rank(s) (--actor-num-nodes {ns.actor_num_nodes} x "
                         f"--actor-num-gpus-per-node {ns.actor_num_gpus_per_node})")
    if not ns.load and not ns.hf_checkpoint:  # the preset's shape, known now (a checkpoint's: when built)
        from rlperf.model import preset

        check_megatron_split(preset(ns.model), tp, pp, f"--model {ns.model}")
    if ns.recompute_granularity == "full" and device.type != "cuda":
        raise UsageError("--recompute-granularity full needs CUDA (megatron's activation checkpointing saves and "
                         "restores CUDA RNG states)")
    if getattr(ns, "transformer_impl", "local") == "transformer_engine":
        check_transformer_engine(device)


def check_transformer_engine(device) -> None:
    """``--transformer-impl transformer_engine``: :class:`UsageError` naming what is missing — the
    ``transformer_engine.pytorch`` module (the message says why it did not import), CUDA, and (where
    both are there) the backend's Hugging Face name mapping for TE's fused layers, which rlperf does not
    have: its megatron layers are the local spec on rlperf's kernels."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or a library load failure (a missing cuBLAS symbol)
        raise UsageError(f"--transformer-impl transformer_engine needs Transformer Engine, which does not load here: "
                         f"{type(exc).__name__}: {exc} (install transformer-engine[pytorch] on a CUDA machine, or "
                         f"use --transformer-impl local)") from None
    if device.type != "cuda":
        raise UsageError(f"--transformer-impl transformer_engine needs CUDA (--device {device.type}); use "
                         f"--transformer-impl local")
    raise UsageError("--transformer-impl transformer_engine: Transformer Engine loads, but rlperf's megatron backend "
                     "has no Hugging Face weight mapping for TE's fused layers (layer norms inside linear_qkv / "
                     "linear_fc1, megatron's grouped q/k/v rows); use --transformer-impl local")


def check_megatron_split(cfg, tp: int, pp: int, what: str) -> None:
    """:class:`UsageError` when the model ``cfg`` (``what`` names it) does not split into ``tp`` x ``pp``:
    layers per pipeline stage, attention and key/value heads and the MLP's and vocabulary's rows per
    tensor-parallel rank."""
    layers = cfg.num_hidden_layers
    if layers % pp:
        raise UsageError(f"--pipeline-model-parallel-size {pp}: {what} has {layers} layers, which do not split "
                         f"evenly over {pp} stages")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        if getattr(cfg, field) % tp:
            raise UsageError(f"--tensor-model-parallel-size {tp}: {what}'s {field} {getattr(cfg, field)} does not "
                             f"split over {tp} ranks")


def check_inputs(ns: argparse.Namespace) -> None:
    """Stage 3: the API key (``--sglang-api-key-file`` read, else the environment) and the model and
    checkpoint directories the run will load."""
    try:
        ns.sglang_api_key = resolve_api_key(ns.sglang_api_key, ns.sglang_api_key_file, "--sglang-api-key")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for flag, path in (("--load", ns.load), ("--ref-load", ns.ref_load), ("--hf-checkpoint", ns.hf_checkpoint)):
        if path is not None and not Path(path).is_dir():
            raise UsageError(f"{flag} {path}: no such directory")
    from .checkpoint import LATEST

    if ns.load is not None and not (Path(ns.load) / LATEST).is_file():
        raise UsageError(f"--load {ns.load}: no {LATEST} (not a checkpoint directory written by --save)")
    # the model's config.json, read now: a missing or unsupported one (scaled RoPE, ...) is a usage error
    if ns.load is not None:
        check_model_dir(ns.load, "--load", trainer_state=True)
    elif ns.hf_checkpoint is not None:  # with --load it only names the tokenizer
        check_model_dir(ns.hf_checkpoint, "--hf-checkpoint", save_dir=False)
    if ns.ref_load is not None:
        check_model_dir(ns.ref_load, "--ref-load")
    check_response_len(ns)
    check_router_reachable(ns)
    if ns.load_debug_rollout_data:
        first = debug_rollout_path(ns.load_debug_rollout_data, "--load-debug-rollout-data", 0)
        if not ns.load and not first.is_file():  # a fresh run reads rollout 0's first
            raise UsageError(f"--load-debug-rollout-data {ns.load_debug_rollout_data}: {first}: no such file")
        if not first.parent.is_dir():
            raise UsageError(f"--load-debug-rollout-data {ns.load_debug_rollout_data}: {first.parent}: no such directory")


ROUTER_CONNECT_TIMEOUT_S = 5.0
"""Seconds ``--sglang-router-ip:--sglang-router-port`` may take to accept a connection before the run is refused."""


def check_router_reachable(ns: argparse.Namespace) -> None:
    """``--sglang-router-ip:--sglang-router-port`` accepts a TCP connection (a router that is not there
    is bad usage, found before the model is built)."""
    if ns.sglang_router_ip is None:
        return
    import socket

    try:
        socket.create_connection((ns.sglang_router_ip, ns.sglang_router_port), timeout=ROUTER_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise UsageError(f"--sglang-router-port {ns.sglang_router_port}: nothing accepts connections at "
                         f"{ns.sglang_router_ip}:{ns.sglang_router_port} ({exc.strerror or exc}); start the router "
                         f"first (rlperf serve --router N --router-port {ns.sglang_router_port})") from None


def model_context_length(ns: argparse.Namespace) -> int:
    """``max_position_embeddings`` of the model the run trains (``--load``'s, ``--hf-checkpoint``'s or the preset)."""
    if ns.load is None and ns.hf_checkpoint is None:
        from rlperf.model import preset

        return preset(ns.model).max_position_embeddings
    from rlperf.model.config import read_hf_config

    from .checkpoint import model_dir

    return read_hf_config(model_dir(ns.load) if ns.load else ns.hf_checkpoint)[0].max_position_embeddings


def check_response_len(ns: argparse.Namespace) -> None:
    """``--rollout-max-response-len`` within the model's context length: a larger one would size KV caches
    and buffers for positions the model has no rotary table for (99999999 asked for 1.6 TB)."""
    ctx = model_context_length(ns)
    if ns.rollout_max_response_len > ctx:
        raise UsageError(f"--rollout-max-response-len {ns.rollout_max_response_len}: longer than the model's context "
                         f"length, {ctx} tokens (max_position_embeddings); give at most {ctx}")


def debug_rollout_path(template: str, flag: str, rollout_id: int) -> Path:
    """``template`` formatted for ``rollout_id``; UsageError naming ``flag`` for a template that does not
    format with ``{rollout_id}`` alone."""
    try:
        path = Path(template.format(rollout_id=rollout_id))
    except (KeyError, IndexError, ValueError) as exc:
        raise UsageError(f"{flag} {template}: not a path template with {{rollout_id}} ({exc})") from None
    return path


def check_outputs(ns: argparse.Namespace) -> None:
    """Stage 4: ``--save`` (a fresh run into one holding checkpoints only with ``--overwrite-save``) and
    ``--output-dir``, created and proven writable."""
    if ns.save and not ns.debug_rollout_only:
        from .checkpoint import CheckpointError, check_save_dir

        try:
            check_save_dir(ns.save, ns.load, ns.overwrite_save)
        except CheckpointError as exc:
            raise UsageError(f"--save {ns.save}: {exc}") from None
    if ns.save:
        check_writable_dir(ns.save, "--save")
    if ns.save_debug_rollout_data:
        path = debug_rollout_path(ns.save_debug_rollout_data, "--save-debug-rollout-data", 0)
        check_writable_dir(path.parent, "--save-debug-rollout-data")
        if path.exists() and not path.is_file():
            raise UsageError(f"--save-debug-rollout-data {ns.save_debug_rollout_data}: {path} exists and is not a file")
    check_writable_dir(ns.output_dir, "--output-dir")
    ns.logger_config = logger_config_from(ns, error=UsageError)  # a missing package is bad usage, before a step


def check_earlier_metrics(ns: argparse.Namespace) -> None:
    """A run that does not resume (no ``--load``) refuses an ``--output-dir`` whose ``metrics.jsonl`` holds an
    earlier run's lines, unless ``--overwrite-output-dir``: it would start the file afresh and lose them
    (a run resuming with ``--load`` keeps the lines of the rollouts before its checkpoint). ``rlperf train``
    checks it once it holds the directory's lock (:mod:`rlperf.loop.run_lock`), so a live run is named
    by its lock first."""
    from rlperf.loop import METRICS_FILE

    path = Path(ns.output_dir) / METRICS_FILE
    if ns.load or getattr(ns, "overwrite_output_dir", False) or not path.is_file():
        return
    try:
        with open(path, "rb") as f:
            lines = sum(1 for line in f if line.strip())
    except OSError:
        return
    if lines:
        raise UsageError(f"--output-dir {ns.output_dir} holds the metrics of an earlier run ({path}, {lines} "
                         f"rollout(s)) and this run would replace them: choose another --output-dir, resume that run "
                         f"with --load, or add --overwrite-output-dir to replace them")


def check_writable_dir(path, flag: str) -> None:
    """Create ``path`` if needed and prove a file can be written there (removed again)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".rlperf-write-check-", dir=p)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: not writable ({exc.strerror or exc})") from None


def check_model_dir(path, flag: str, save_dir: bool = True, trainer_state: bool = False) -> Path:
    """The HF directory behind ``flag path`` (itself, or with ``save_dir`` the latest model of a directory
    written by --save) once its ``config.json`` reads as a supported model config and its safetensors
    files (and with ``trainer_state`` the checkpoint's ``trainer.pt``) are complete; :class:`UsageError`
    naming the flag otherwise."""
    from rlperf.model.config import read_hf_config

    from .checkpoint import LATEST, check_trainer_state, check_weights, model_dir

    p = Path(path)
    if not (p / "config.json").is_file() and not (save_dir and (p / LATEST).is_file()):
        raise UsageError(f"{flag} {path}: no config.json" + (
            f" and no {LATEST} (neither an HF checkpoint directory nor a directory written by --save)"
            if save_dir else " (not an HF checkpoint directory)"))
    try:
        directory = model_dir(p) if save_dir else p
        read_hf_config(directory)
        check_weights(directory)  # truncated or unreadable safetensors: refused now, not at load time
        if trainer_state:
            check_trainer_state(p)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: {exc}") from None
    return directory


def parse_train_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and resolve ``rlperf train`` flags (tests and :func:`rlperf.loop.first_step` callers)."""
    p = argparse.ArgumentParser(prog="rlperf train")
    add_loop_arguments(p)
    return resolve_args(p.parse_args(argv or []))
