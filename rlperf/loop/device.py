"""What the host decides about a run: its device, kernel policy, compute dtype and GPU layout.

The probes of ``rlperf train`` / ``rlperf gate`` that need torch (CUDA present? how many GPUs? can
this kernel backend run here?), run once by :func:`rlperf.loop.resolve.resolve_args` after the flags'
own checks (:mod:`rlperf.loop.args`); each raises :class:`rlperf.loop.args.UsageError` naming the flag.
torch is imported inside the functions: importing this module stays light.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .args import PRECISIONS, UsageError


def compute_dtype(precision: str):
    """The ``torch.dtype`` of a resolved ``--precision`` (``bf16`` or ``fp32``)."""
    import torch

    return getattr(torch, PRECISIONS[precision])


def ray_driver(ns: argparse.Namespace) -> bool:
    """Whether this process is the driver of a ``--placement ray`` run: it starts the ranks and engines
    as Ray actors on the cluster's GPUs and computes on none itself (a rank has ``WORLD_SIZE`` set)."""
    return ns.placement == "ray" and "WORLD_SIZE" not in os.environ


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


def resolve_engine_layout(ns: argparse.Namespace, device, visible_gpus: int | None = None) -> None:
    """Check ``--rollout-num-gpus`` / ``--rollout-num-gpus-per-engine`` / ``--colocate`` before anything
    starts and set ``ns.disaggregated`` (rlperf starts its own engines: N > 0 without ``--colocate``) and
    ``ns.engine_gpus`` (each engine's ``CUDA_VISIBLE_DEVICES`` entry, the GPUs after the actor ranks'
    ``--actor-num-gpus-per-node``; None on CPU, where the engines are plain processes, and under
    ``--placement ray``, where each engine gets the GPU of its own bundle and the cluster's GPUs are
    counted by :meth:`rlperf.loop.ray_placement.RayPlacement.check`, not this host's).
    ``visible_gpus``: default ``torch.cuda.device_count()``. :class:`UsageError` naming the flag for a
    layout that cannot run."""
    n, per = ns.rollout_num_gpus, ns.rollout_num_gpus_per_engine
    ns.disaggregated, ns.engine_gpus = False, None
    if per != 1 and getattr(ns, "rollout_backend", "rlperf") != "sglang":  # SGLang engines take --tp-size GPUs
        raise UsageError(f"--rollout-num-gpus-per-engine {per}: only 1 is supported for now (one GPU per engine; "
                         "tensor-parallel engines are not built yet)")
    if n < 0:
        raise UsageError(f"--rollout-num-gpus must be >= 0, got {n}")
    if ns.colocate and per > 1 and device.type == "cuda":
        _check_colocated_tp_gpus(ns, device, per, visible_gpus)
    if n == 0 or ns.colocate:
        return  # the in-process engine, or engines that share the trainer's GPUs
    if ns.sglang_router_ip is not None:
        raise UsageError(f"--rollout-num-gpus {n} starts rlperf's own engines and router; --sglang-router-ip uses "
                         "running ones: give one of them")
    ns.disaggregated = True
    if device.type != "cuda" or ns.placement == "ray":
        return
    import torch

    actor = ns.actor_num_gpus_per_node  # the GPUs the trainer's ranks take on this host
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


def _check_colocated_tp_gpus(ns: argparse.Namespace, device, per: int, visible_gpus: int | None) -> None:
    """``--colocate --rollout-num-gpus-per-engine K`` (SGLang engines of K ranks): the engine's rank 0 shares
    the trainer's GPU and ranks 1..K-1 take the K - 1 visible GPUs after it, so the trainer's GPU index plus K
    must not pass the visible count. :class:`UsageError` naming the flags otherwise."""
    import torch

    visible = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    first = device.index or 0
    if first + per > visible:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UsageError(f"--colocate --rollout-num-gpus-per-engine {per}: the engine's {per} ranks take the trainer's "
                         f"GPU (cuda:{first}) and the {per - 1} after it, cuda:{first}..cuda:{first + per - 1}, but "
                         f"{visible} are visible" + (f" (CUDA_VISIBLE_DEVICES={listed})" if listed is not None else ""))


CPU_RUN_MODEL_COPIES = 6
"""float32 copies of the model's parameters a CPU run holds: the actor's weights, its gradients and AdamW's
two moments, the reference model (the first-step gates always build one) and the in-process engine's weights."""
LARGE_CPU_RUN_BYTES = 2 << 30
"""A CPU run estimated above this (before activations) is warned about before it allocates: the embedded
task's tiny model needs a few MiB; qwen3-0.6b needs ~13 GiB and minutes per step."""


def cpu_memory_warning(ns: argparse.Namespace) -> str | None:
    """For a run on the CPU whose model needs more than :data:`LARGE_CPU_RUN_BYTES`: one line with the
    estimated memory (:data:`CPU_RUN_MODEL_COPIES` x parameters x 4 bytes) and the machine's, said before
    anything is allocated; else None. Reads the flags and at most a ``config.json`` (before or after
    :func:`rlperf.loop.resolve.resolve_args`); what it cannot read is left to the checks that report it."""
    from rlperf.model.config import preset, read_hf_config
    from rlperf.telemetry.memory import system_memory_bytes

    from .args import TASK_DEFAULTS

    try:
        if run_device(ns).type != "cpu":
            return None
        if ns.load or ns.hf_checkpoint:
            from .checkpoint import model_dir

            cfg, name = read_hf_config(model_dir(ns.load) if ns.load else ns.hf_checkpoint)[0], "the model"
        else:
            model = ns.model or TASK_DEFAULTS["model"]
            cfg, name = preset(model), f"--model {model}"
    except (OSError, ValueError):  # UsageError too: resolve_args names the flag
        return None
    need = CPU_RUN_MODEL_COPIES * 4 * cfg.num_parameters
    if need <= LARGE_CPU_RUN_BYTES:
        return None
    have = system_memory_bytes() or 0  # the cgroup's limit when one is set
    machine = (f", more than this machine's {have / 2**30:.1f} GiB: expect it to run out of memory" if need > have > 0
               else f" of this machine's {have / 2**30:.1f} GiB" if have else "")
    return (f"{name} on the CPU: {cfg.num_parameters / 1e6:.0f}M parameters need about {need / 2**30:.1f} GiB "
            f"before activations ({CPU_RUN_MODEL_COPIES} float32 copies: weights, gradients, AdamW's two moments, "
            f"the reference and the engine's weights){machine}; each step takes minutes. The CPU path is made for "
            f"the tiny presets (--model tiny, qwen3-moe-tiny), larger models for --device cuda")


def start_kernel_precompile(precompile_kernels: str, record_kernels: str | None, device, policy, local_leader: bool):
    """A run's cold-start help (:mod:`rlperf.kernels.precompile`): ``(background, recorder)``, either None.

    ``background``: ``--precompile-kernels`` (``auto``: the manifest shipped for this GPU and Triton
    version; a file; ``off``) compiling in worker processes while the run builds itself, started by one
    process per host (``local_leader``) on CUDA with the Triton backend; None otherwise or when ``auto``
    finds no manifest. ``recorder``: an entered :class:`rlperf.kernels.precompile.ManifestRecorder` of
    ``--record-kernels`` (CUDA only: the interpreter compiles nothing), to be exited when the run closes."""
    from rlperf.kernels import precompile

    on_gpu = device.type == "cuda" and policy.backend_for(device) == "triton"
    recorder = precompile.ManifestRecorder(record_kernels).__enter__() if (record_kernels and on_gpu) else None
    background = None
    if on_gpu and local_leader and precompile_kernels != "off":
        manifest = precompile.shipped_manifest_path() if precompile_kernels == "auto" else Path(precompile_kernels)
        if manifest.is_file():
            background = precompile.BackgroundPrecompile(manifest)
        else:  # auto on a GPU generation or Triton version rlperf ships no manifest for (a FILE was checked)
            what = (f"no kernel manifest ships for this GPU and Triton ({manifest.name})" if precompile_kernels == "auto"
                    else f"--precompile-kernels {manifest}: no such file")
            print(f"rlperf: {what}: kernels compile on first use; --record-kernels FILE writes a manifest for "
                  f"--precompile-kernels FILE", file=sys.stderr, flush=True)
    return background, recorder
