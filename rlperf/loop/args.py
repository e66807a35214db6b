"""Flags of ``rlperf train`` (slime's names) and the checks that run before anything starts.

:func:`add_loop_arguments` adds the loop's flags plus the training core's
(:func:`rlperf.train.add_train_arguments`); :func:`resolve_args` fills the defaults (the embedded
task's when ``--prompt-data`` is absent, see :data:`rlperf.data.embedded.EMBEDDED_DEFAULTS`) and
raises :class:`UsageError` for anything that would fail later: the batch relation
``rollout_batch_size * n_samples_per_prompt == global_batch_size * num_steps_per_rollout``, an
unknown estimator, conflicting modes, a ``--kernel-backend`` that cannot run on ``--device``, an
unwritable ``--save``, a bad ``--profile-step-*`` window
(:mod:`rlperf.telemetry.trainer_trace`), a model directory whose ``config.json`` is missing or
describes a model rlperf does not implement (:func:`rlperf.model.config.read_hf_config`), sampling
values the kernels cannot take (:func:`rlperf.rollout.sampling_params.check_sampling_values`, the
server's check too), an unknown ``--model`` preset, ``--device cuda`` without a GPU (on this host; a
``--placement ray`` driver leaves that to the cluster check, :func:`run_device`), a ``--load`` /
``--ref-load`` whose pointer or files are broken (:mod:`rlperf.loop.checkpoint`), a fresh run into a
``--save`` that holds checkpoints (without ``--overwrite-save``), an engine layout that cannot run
(:func:`resolve_engine_layout`: ``--rollout-num-gpus-per-engine`` other than 1, more GPUs than are
visible with ``--placement local``, ``--rollout-num-gpus`` with ``--sglang-router-ip``). Every message
names the flag.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rlperf.data.embedded import EMBEDDED_DEFAULTS
from rlperf.rollout.args import API_KEY_ENV, add_kernel_arguments, resolve_api_key
from rlperf.rollout.sampling_params import check_sampling_values
from rlperf.telemetry.loggers import add_logger_arguments, logger_config_from
from rlperf.telemetry.trainer_trace import add_profile_arguments, check_profile_args
from rlperf.train.args import TrainArgs, add_train_arguments, train_args_from


class UsageError(ValueError):
    """Bad flags or inputs, found before any step (the CLI exits 2 with the message)."""


# loop flags whose default depends on the task (None on the parser; resolve_args fills them)
_TASK_DEFAULTS = dict(
    rollout_batch_size=32, n_samples_per_prompt=8, global_batch_size=None, num_steps_per_rollout=1, num_rollout=100,
    rollout_max_response_len=1024, rollout_temperature=1.0, lr=TrainArgs.lr, rm_type="boxed_math", model="tiny",
)


def add_loop_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", default=None, help="jsonl prompts (default: the embedded task)")
    g.add_argument("--input-key", default="input")
    g.add_argument("--label-key", default="label")
    g.add_argument("--metadata-key", default="metadata")
    g.add_argument("--apply-chat-template", action="store_true", help="the input field is a list of chat messages")
    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-batch-size", type=int, default=None, help="prompts per rollout")
    g.add_argument("--num-steps-per-rollout", type=int, default=None)
    g.add_argument("--num-rollout", type=int, default=None, help="rollouts (steps) to run")
    g.add_argument("--rollout-max-response-len", type=int, default=None)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-function-path", default=None,
                   help="python path of fn(args, rollout_id, data_source, evaluation=False) -> samples")
    g.add_argument("--custom-generate-function-path", default=None,
                   help="python path of fn(args, sample, sampling_params) -> sample (one generation)")
    g.add_argument("--custom-rm-path", default=None, help="python path of fn(args, sample) -> float")
    g.add_argument("--rm-type", default=None, choices=["exact", "boxed_math"], help="built-in rule reward")
    g.add_argument("--sglang-router-ip", default=None,
                   help="rollout through this sglang-router (default: an in-process engine)")
    g.add_argument("--sglang-router-port", type=int, default=None)
    g.add_argument("--sglang-api-key", default=None, metavar="KEY",
                   help="API key of the router and its rlperf serve workers (their --api-key), sent as 'Authorization: "
                        f"Bearer KEY' on every request. On the command line it shows in ps: prefer --sglang-api-key-file "
                        f"or the {API_KEY_ENV} environment variable (default: {API_KEY_ENV}, else no key)")
    g.add_argument("--sglang-api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (surrounding whitespace stripped)")
    g.add_argument("--colocate", action="store_true", help="trainer and engines share the GPU (weights by CUDA IPC)")
    g.add_argument("--rollout-num-gpus", type=int, default=0, metavar="N",
                   help="disaggregated engines (without --colocate): start N rlperf serve engines, one per GPU after the "
                        "actor's, behind the sglang-router, and sync the weights to them by NCCL broadcast from the "
                        "trainer; with --device cpu, N engine processes and gloo (default 0: one in-process engine)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, metavar="K",
                   help="GPUs per engine (only 1 for now: no tensor-parallel engines)")
    g.add_argument("--sglang-cuda-graph-max-bs", type=int, default=None,
                   help="in-process engine: replay decode steps of up to this many sequences from CUDA graphs, as "
                        "rlperf serve --cuda-graph-max-bs (default: serve's, 256 on CUDA; 0: eager decode, the "
                        "debuggable path; CPU is always eager)")
    g.add_argument("--engine-weights", default="auto", choices=["auto", "buckets", "shared"],
                   help="in-process engine's weights: its own copy loaded from flattened buckets at each sync, or "
                        "shared: it runs on the trainer's compute weights (no copy; sync mode only); auto: shared on "
                        "CUDA in sync mode, buckets otherwise")
    g.add_argument("--sglang-mem-fraction-static", type=float, default=None,
                   help="in-process engine on CUDA: the fraction of device memory that everything allocated "
                        "before it plus its KV cache may fill (default: no fraction; the KV cache holds one "
                        "rollout, rollout-batch-size x n-samples-per-prompt sequences of the longest prompt plus "
                        "--rollout-max-response-len, and the rest of the device is the trainer's); engines on "
                        "GPUs of their own (--rollout-num-gpus): the fraction of their GPU for weights + KV cache "
                        "(default 0.8, under the first-step gate's headroom); servers behind a router you started "
                        "take rlperf serve --mem-fraction-static")
    g = p.add_argument_group("model and checkpoints")
    g.add_argument("--model", default=None, help="preset when no --hf-checkpoint/--load (default tiny)")
    g.add_argument("--hf-checkpoint", default=None, help="initial weights (HF safetensors directory)")
    g.add_argument("--load", default=None, help="resume from this --save directory")
    g.add_argument("--ref-load", default=None, help="reference model (HF directory or a --save directory)")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int, default=None, help="save every N rollouts (and after the last)")
    g.add_argument("--overwrite-save", action="store_true",
                   help="let a run that does not resume from --save write into it although it holds checkpoints "
                        "(its pointer moves to this run's checkpoints)")
    g.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda")
    g = p.add_argument_group("precision")
    g.add_argument("--precision", default="auto", choices=list(PRECISIONS),
                   help="compute dtype of the trainer's forward/backward and of the in-process engine: bf16 (float32 "
                        "master weights, gradient accumulation and AdamW state, as Megatron) or fp32; auto: bf16 on "
                        "CUDA, fp32 on CPU (bf16 on CPU runs the torch reference in bf16: a test path)")
    g.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="--precision bf16 (slime's name)")
    g.add_argument("--fp32", dest="precision", action="store_const", const="fp32", help="--precision fp32")
    add_kernel_arguments(p.add_argument_group("kernels"), auto_cpu="the torch reference (the trainer's CPU path)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--output-dir", default="rlperf-train", help="metrics.jsonl and the timeline go here")
    g.add_argument("--async", dest="async_mode", action="store_true",
                   help="overlap rollout k+1 with training k (one step off-policy)")
    g.add_argument("--deterministic-mode", action="store_true")
    g.add_argument("--true-on-policy-mode", action="store_true",
                   help="train on the rollout's own policy: needs sync mode and --num-steps-per-rollout 1; the "
                        "logprob_abs_diff gate then requires train_rollout_logprob_abs_diff exactly 0 (engine and "
                        "trainer compute log-probs with the same fused kernel)")
    g.add_argument("--debug-rollout-only", action="store_true")
    g.add_argument("--debug-train-only", action="store_true")
    g.add_argument("--save-debug-rollout-data", default=None, help="path template with {rollout_id}")
    g.add_argument("--load-debug-rollout-data", default=None, help="path template with {rollout_id}")
    g.add_argument("--num-threads", type=int, default=1, help="CPU intra-op threads (1 is fastest on shared cores)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (summary lines still print; there is none when stderr is not a terminal)")
    add_profile_arguments(p)
    add_logger_arguments(p)
    add_train_arguments(p)
    from .placement import add_placement_arguments  # placement imports this module's UsageError

    add_placement_arguments(p)
    p.set_defaults(lr=None, n_samples_per_prompt=None, rollout_temperature=None)


PRECISIONS = {"auto": None, "bf16": "bfloat16", "fp32": "float32"}
"""``--precision`` values and their compute dtypes (:func:`compute_dtype`)."""


def compute_dtype(ns: argparse.Namespace, precision: str | None = None):
    """The run's compute dtype: ``precision`` (bf16 or fp32), else ``ns.precision`` (resolved)."""
    import torch

    return getattr(torch, PRECISIONS[precision or ns.precision])


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


def ray_driver(ns: argparse.Namespace) -> bool:
    """Whether this process is the driver of a ``--placement ray`` run: it starts the ranks and engines
    as Ray actors on the cluster's GPUs and computes on none itself (a rank has ``WORLD_SIZE`` set)."""
    return getattr(ns, "placement", "local") == "ray" and "WORLD_SIZE" not in os.environ


def run_device(ns: argparse.Namespace):
    """``--device`` as a ``torch.device`` (``auto``: cuda when present); :class:`UsageError` if unreadable,
    or naming a CUDA device this host does not have. The driver of a ``--placement ray`` run
    (:func:`ray_driver`) computes nothing: its ``--device cuda`` is the cluster's GPUs, which
    :meth:`rlperf.loop.ray_placement.RayPlacement.check` counts, so this host may have none."""
    import torch

    try:
        device = torch.device(ns.device if ns.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {ns.device}: {exc}") from None
    if device.type == "cuda" and not ray_driver(ns):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {ns.device}: no CUDA device is available (torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {ns.device}: only {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return device


def kernel_policy(ns: argparse.Namespace, device):
    """The run's :class:`rlperf.kernels.KernelPolicy` from ``--mode`` and ``--kernel-backend`` on
    ``device``; :class:`UsageError` naming the flag when that backend cannot run there.

    ``auto`` on CPU is the torch reference, not the Triton interpreter even under
    ``TRITON_INTERPRET=1``: the references are differentiable as they are, and a training step under
    the interpreter takes minutes (``--kernel-backend interpreter`` asks for it).
    """
    import rlperf.kernels as K

    backend = ns.kernel_backend
    if backend == "auto":
        backend = None if device.type == "cuda" else "reference"
    policy = K.KernelPolicy(mode=ns.mode, backend=backend)
    try:
        policy.backend_for(device)
    except RuntimeError as exc:
        raise UsageError(f"--kernel-backend {ns.kernel_backend} on {device}: {exc}") from None
    return policy


def actor_gpus_on_this_host(ns: argparse.Namespace) -> int:
    """GPUs the trainer's ranks take on this host (``--actor-num-gpus-per-node``; 1 without it)."""
    return int(getattr(ns, "actor_num_gpus_per_node", None) or 1)


def resolve_engine_layout(ns: argparse.Namespace, device, visible_gpus: int | None = None) -> None:
    """Check ``--rollout-num-gpus`` / ``--rollout-num-gpus-per-engine`` / ``--colocate`` before anything
    starts and set ``ns.disaggregated`` (rlperf starts its own engines: N > 0 without ``--colocate``) and
    ``ns.engine_gpus`` (each engine's ``CUDA_VISIBLE_DEVICES`` entry, the GPUs after the actor ranks'
    ``--actor-num-gpus-per-node``; None on CPU, where the engines are plain processes, and under
    ``--placement ray``, where each engine gets the GPU of its own bundle and the cluster's GPUs are
    counted by :meth:`rlperf.loop.ray_placement.RayPlacement.check`, not this host's).
    ``visible_gpus``: default ``torch.cuda.device_count()``. :class:`UsageError` naming the flag for a
    layout that cannot run."""
    n, per = getattr(ns, "rollout_num_gpus", 0) or 0, getattr(ns, "rollout_num_gpus_per_engine", 1)
    ns.disaggregated, ns.engine_gpus = False, None
    if per != 1:
        raise UsageError(f"--rollout-num-gpus-per-engine {per}: only 1 is supported for now (one GPU per engine; "
                         "tensor-parallel engines are not built yet)")
    if n < 0:
        raise UsageError(f"--rollout-num-gpus must be >= 0, got {n}")
    if n == 0 or ns.colocate:
        return  # the in-process engine, or engines that share the trainer's GPUs
    if ns.sglang_router_ip is not None:
        raise UsageError(f"--rollout-num-gpus {n} starts rlperf's own engines and router; --sglang-router-ip uses "
                         "running ones: give one of them")
    ns.disaggregated = True
    if device.type != "cuda" or getattr(ns, "placement", "local") == "ray":
        return
    import torch

    actor = actor_gpus_on_this_host(ns)
    visible = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    if device.index is not None and device.index >= actor:
        raise UsageError(f"--device {ns.device}: with --rollout-num-gpus the actor runs on the first {actor} GPU(s) "
                         f"(cuda:0..cuda:{actor - 1}) and the engines on the next ones; use --device cuda")
    if actor + n * per > visible:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UsageError(f"--rollout-num-gpus {n}: the actor takes {actor} GPU(s) and the engines {n * per} more, "
                         f"{actor + n * per} in all, but {visible} are visible"
                         + (f" (CUDA_VISIBLE_DEVICES={listed})" if listed is not None else ""))
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in listed.split(",")] if listed else [str(i) for i in range(visible)]
    ns.engine_gpus = ids[actor:actor + n * per]


def resolve_args(ns: argparse.Namespace) -> argparse.Namespace:
    """Fill task defaults, check every relation; returns ``ns`` with ``train_args`` and ``embedded`` set."""
    ns.embedded = ns.prompt_data is None
    defaults = EMBEDDED_DEFAULTS if ns.embedded else _TASK_DEFAULTS
    for k, v in defaults.items():
        if getattr(ns, k, None) is None:
            setattr(ns, k, v)
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.rollout_batch_size * ns.n_samples_per_prompt // ns.num_steps_per_rollout
    for flag in ("rollout_batch_size", "num_steps_per_rollout", "num_rollout", "rollout_max_response_len"):
        if getattr(ns, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.num_threads is not None and ns.num_threads < 0:
        raise UsageError(f"--num-threads must be >= 1 (or 0: torch's default), got {ns.num_threads}")
    if not ns.load and not ns.hf_checkpoint:  # the model is the preset
        from rlperf.model import preset

        try:
            preset(ns.model)
        except ValueError as exc:
            raise UsageError(f"--model {ns.model}: {exc}") from None
    # the sampling kernel's types; the rollout server checks its sampling_params with the same function
    check_sampling_values(ns.rollout_temperature, ns.rollout_top_p, ns.rollout_top_k, positive_temperature=True,
                          error=UsageError, names={"temperature": "--rollout-temperature",
                                                   "top_p": "--rollout-top-p", "top_k": "--rollout-top-k"})
    if ns.rollout_batch_size * ns.n_samples_per_prompt != ns.global_batch_size * ns.num_steps_per_rollout:
        raise UsageError(
            f"batch relation broken: --rollout-batch-size {ns.rollout_batch_size} x --n-samples-per-prompt "
            f"{ns.n_samples_per_prompt} = {ns.rollout_batch_size * ns.n_samples_per_prompt} samples per rollout, but "
            f"--global-batch-size {ns.global_batch_size} x --num-steps-per-rollout {ns.num_steps_per_rollout} = "
            f"{ns.global_batch_size * ns.num_steps_per_rollout}")
    if ns.true_on_policy_mode and ns.async_mode:
        raise UsageError("--true-on-policy-mode needs sync mode: --async trains one step off-policy")
    if ns.true_on_policy_mode and ns.num_steps_per_rollout != 1:
        raise UsageError("--true-on-policy-mode needs --num-steps-per-rollout 1 (later steps train an updated actor)")
    if ns.debug_rollout_only and ns.debug_train_only:
        raise UsageError("--debug-rollout-only and --debug-train-only exclude each other")
    if ns.debug_train_only and not ns.load_debug_rollout_data:
        raise UsageError("--debug-train-only needs --load-debug-rollout-data")
    if (ns.sglang_router_ip is None) != (ns.sglang_router_port is None):
        raise UsageError("give both --sglang-router-ip and --sglang-router-port (or neither: in-process engine)")
    try:
        ns.sglang_api_key = resolve_api_key(getattr(ns, "sglang_api_key", None), getattr(ns, "sglang_api_key_file", None),
                                            "--sglang-api-key")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    frac = ns.sglang_mem_fraction_static
    if frac is not None and not 0 < frac < 1:
        raise UsageError(f"--sglang-mem-fraction-static must be in (0, 1), got {frac}")
    if ns.save_interval is not None and ns.save_interval < 1:
        raise UsageError(f"--save-interval must be >= 1, got {ns.save_interval}")
    if ns.save_interval is not None and not ns.save:
        raise UsageError("--save-interval needs --save")
    check_profile_args(ns, error=UsageError)
    device = run_device(ns)
    resolve_engine_layout(ns, device)  # --rollout-num-gpus: ns.disaggregated, ns.engine_gpus
    policy = kernel_policy(ns, device)  # checked now; the run applies it (rlperf.loop.runner.Run.kernels)
    from .placement import check_actor_layout

    actor_ranks = check_actor_layout(ns, device).world_size  # --actor-num-*: ranks, GPUs, batch split
    if getattr(ns, "precision", None) in (None, "auto"):
        ns.precision = "bf16" if device.type == "cuda" else "fp32"
    if ns.precision == "bf16" and device.type == "cpu" and policy.backend_for(device) == "interpreter":
        raise UsageError("--precision bf16 on CPU needs the reference backend: the Triton interpreter's bf16 "
                         "tl.dot and casts are wrong (DESIGN, Measured facts); use --kernel-backend reference or fp32")
    if getattr(ns, "sglang_cuda_graph_max_bs", None) is not None and ns.sglang_cuda_graph_max_bs < 0:
        raise UsageError(f"--sglang-cuda-graph-max-bs must be >= 0, got {ns.sglang_cuda_graph_max_bs}")
    ew = getattr(ns, "engine_weights", "auto")
    if ew == "auto":
        ew = "shared" if (device.type == "cuda" and not ns.async_mode and ns.sglang_router_ip is None
                          and not ns.disaggregated and actor_ranks == 1) else "buckets"
    if ew == "shared" and ns.async_mode:
        raise UsageError("--engine-weights shared needs sync mode: with --async the rollout would read weights "
                         "the trainer is updating")
    if ew == "shared" and ns.sglang_router_ip is not None:
        raise UsageError("--engine-weights applies to the in-process engine, not to servers behind --sglang-router-ip")
    if ew == "shared" and ns.disaggregated:
        raise UsageError("--engine-weights applies to the in-process engine, not to the engines of --rollout-num-gpus")
    ns.engine_weights = ew
    try:
        ns.train_args = train_args_from(ns)
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
    if ns.save and not ns.debug_rollout_only:  # a fresh run into a --save holding checkpoints: only when told
        from .checkpoint import CheckpointError, check_save_dir

        try:
            check_save_dir(ns.save, ns.load, getattr(ns, "overwrite_save", False))
        except CheckpointError as exc:
            raise UsageError(f"--save {ns.save}: {exc}") from None
    if ns.save:
        check_writable_dir(ns.save, "--save")
    check_writable_dir(ns.output_dir, "--output-dir")
    ns.logger_config = logger_config_from(ns, error=UsageError)  # --use-tensorboard, --use-wandb, --plot
    return ns


def parse_train_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and resolve ``rlperf train`` flags (tests and :func:`rlperf.loop.first_step` callers)."""
    p = argparse.ArgumentParser(prog="rlperf train")
    add_loop_arguments(p)
    return resolve_args(p.parse_args(argv or []))
