"""Which implementation an op runs: the backend (where and how) and the mode (invariant or fast).

Backend, chosen per call from the input's device:

* ``"triton"``       — CUDA tensors: the Triton kernels, compiled for the GPU.
* ``"interpreter"``  — CPU tensors with ``TRITON_INTERPRET=1`` in the environment: the same Triton
  kernels, run by Triton's interpreter on the CPU (how CI tests every kernel).
* ``"reference"``    — CPU tensors otherwise: the torch references of ``rlperf.kernels.reference``
  (float64 math, result cast to the input dtype).

``RLPERF_BACKEND`` (or :func:`use_backend`) overrides the choice; asking for ``"triton"`` on CPU
tensors or ``"interpreter"`` without ``TRITON_INTERPRET=1`` is an error, never a silent fallback.
Triton reads ``TRITON_INTERPRET`` when a kernel module is imported, so it has to be set before
the first op runs.

Mode, global:

* ``"invariant"`` (default) — batch-invariant kernels: a row's bits never depend on the batch.
* ``"fast"``               — the fastest path, invariance not required, so the price of
  invariance can be measured: cuBLAS (``F.linear``) for matmul and SDPA (flash/cuDNN) for
  prefill attention. On CUDA, ops whose rlperf kernel beats the stock torch code (RMSNorm,
  SwiGLU, log-softmax; paged decode, which torch lacks) keep the kernel in fast mode too: there
  invariance costs nothing. On CPU fast mode runs the stock torch ops (see :func:`use_stock_op`).
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

BACKENDS = ("triton", "interpreter", "reference")
MODES = ("invariant", "fast")

_state = threading.local()


_env: dict | None = None


def refresh_environment() -> None:
    """Re-read ``TRITON_INTERPRET`` and ``RLPERF_BACKEND`` (they are read once, on the first op).

    Reading them once keeps the per-op dispatch cost to a few attribute lookups (it sits on the
    decode hot path), and matches Triton, which reads ``TRITON_INTERPRET`` when a kernel module
    is imported: changing it later does not change how already-imported kernels run.
    """
    global _env
    forced = os.environ.get("RLPERF_BACKEND") or None
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"RLPERF_BACKEND={forced!r}: expected one of {BACKENDS}")
    _env = {"interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), "forced": forced}


def backend(device: torch.device | str | None = None) -> str:
    """The backend an op on ``device`` runs now: ``"triton"``, ``"interpreter"`` or ``"reference"``."""
    if _env is None:
        refresh_environment()
    forced = getattr(_state, "backend", None) or _env["forced"]
    if isinstance(device, torch.device):
        is_cuda = device.type == "cuda"
    else:
        is_cuda = device is not None and str(device).startswith("cuda")
    if forced is None:
        if is_cuda:
            return "triton"
        return "interpreter" if _env["interpret"] else "reference"
    if forced == "triton" and not is_cuda:
        raise RuntimeError(f"backend 'triton' needs CUDA tensors, got a tensor on {device or 'cpu'}")
    if forced == "interpreter":
        if is_cuda:
            raise RuntimeError("backend 'interpreter' runs on CPU tensors only")
        if not _env["interpret"]:
            raise RuntimeError("backend 'interpreter' needs TRITON_INTERPRET=1 set before rlperf.kernels runs an op")
    return forced


@contextlib.contextmanager
def use_backend(name: str | None):
    """Force a backend inside the block (``None`` restores automatic choice)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend {name!r}: expected one of {BACKENDS}")
    previous = getattr(_state, "backend", None)
    _state.backend = name
    try:
        yield
    finally:
        _state.backend = previous


_mode = os.environ.get("RLPERF_MODE", "invariant")
if _mode not in MODES:
    raise ValueError(f"RLPERF_MODE={_mode!r}: expected one of {MODES}")


def mode() -> str:
    """``"invariant"`` (batch-invariant kernels) or ``"fast"`` (cuBLAS/SDPA/torch)."""
    return _mode


def set_mode(name: str) -> None:
    """Switch every op between ``"invariant"`` and ``"fast"``."""
    global _mode
    if name not in MODES:
        raise ValueError(f"mode {name!r}: expected one of {MODES}")
    _mode = name


@contextlib.contextmanager
def use_mode(name: str):
    """Run the block in mode ``name``, then restore the previous mode."""
    previous = mode()
    set_mode(name)
    try:
        yield
    finally:
        set_mode(previous)


def use_stock_op(device: torch.device | str, stock_wins_on_cuda: bool) -> bool:
    """Whether an op runs its stock torch implementation: only in fast mode; there always on CPU,
    and on CUDA only where the stock op is faster than rlperf's kernel (``stock_wins_on_cuda``;
    measured in bench/BENCHMARKS.md: True for matmul and prefill attention, False for the row ops)."""
    if _mode != "fast":
        return False
    is_cuda = device.type == "cuda" if isinstance(device, torch.device) else str(device).startswith("cuda")
    return stock_wins_on_cuda or not is_cuda


def use_triton(device: torch.device | str) -> bool:
    """True when an invariant-mode op on ``device`` should launch its Triton kernel (GPU or interpreter)."""
    return backend(device) in ("triton", "interpreter")
