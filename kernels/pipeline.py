"""How rlperf launches its Triton kernels: at the deepest software pipeline that fits in shared memory,
and, where switched on, with programmatic dependent launch.

``num_stages`` only sets how far tile loads run ahead of the math: the loop order, the tile
shapes and the MMA instructions stay the same, so a result's bits do not depend on it. Where a
tuned depth does not fit (float32 tiles are twice the bytes; a float32 epilogue needs a larger
buffer), dropping stages keeps the contract; the depth that fit is remembered per key so later
launches go straight to it.

Programmatic dependent launch (Hopper and later; on by default, ``RLPERF_PDL=0`` or
:func:`use_programmatic_launch` turns it off). A decode step is a chain of small kernels, each of which
waits for the one before it to finish and for its own blocks to be scheduled; with PDL a kernel's blocks
may be launched while its predecessor's last blocks still run. Every kernel that a launch marks this way
(the decode step's: RMSNorm, matmul, the q/k norm + RoPE + K/V store, attention, SwiGLU, the K/V write,
the sampler, the fused lm-head log-prob; and the dense train step's backward kernels: attention's, the
norms', SwiGLU's, the weight gradient, the log-prob's; the tensor-parallel tree's node product and tree
sum) starts with :func:`grid_dependency_sync`: it waits until the previous grid has finished and its
memory writes are visible (``griddepcontrol.wait``) before it reads or writes anything, then lets the
next launch start (``griddepcontrol.launch_dependents``). No load, store or arithmetic moves, so the
bits are those of the plain launch; only the gap between kernels shrinks. Both instructions do nothing
in a grid launched without the attribute, so one compiled body serves both launches (the attribute is a
compile option, ``launch_pdl``, and CUDA graphs capture it). Under the CPU interpreter neither is
emitted.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Hashable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

try:  # Triton >= 3.3 (the device has 3.6, CI 3.9)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: no programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None

PDL_ENV = "RLPERF_PDL"
"""``1`` or unset: Triton kernels that support it are launched with programmatic dependent launch on
SM 90+ GPUs (measured faster at every decode batch and in the graphed train loop: docs/kernels.md);
``0``: plain launches (module docstring)."""

# the grid-dependency instructions exist in compiled kernels only: Triton's interpreter runs the
# kernels as Python on the CPU (it reads TRITON_INTERPRET when a kernel is defined, as here)
_GRID_DEPENDENCY = tl.constexpr(gdc_wait is not None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


@triton.jit
def grid_dependency_sync():
    """Called first in a kernel that may be launched with PDL: wait for the previous grid (its writes
    visible), then let the next grid launch. A no-op in a grid launched without PDL."""
    if _GRID_DEPENDENCY:
        gdc_wait()
        gdc_launch_dependents()


def _pdl_from_environment() -> bool:
    value = os.environ.get(PDL_ENV, "1")
    if value not in ("0", "1", ""):
        raise ValueError(f"{PDL_ENV}={value!r}: expected 1 (programmatic dependent launch, the default) or 0")
    return value != "0"


_pdl_on: bool | None = None  # None: not read yet (RLPERF_PDL, on the first launch)


def set_programmatic_launch(on: bool | None) -> None:
    """Turn programmatic dependent launch on or off for the whole process (None: back to ``RLPERF_PDL``).
    It applies to the launches made from then on; a CUDA graph keeps the launches it captured."""
    global _pdl_on
    _pdl_on = None if on is None else bool(on)


@contextlib.contextmanager
def use_programmatic_launch(on: bool):
    """:func:`set_programmatic_launch` for a block (process-wide, not per thread), restored after it."""
    global _pdl_on
    saved = _pdl_on
    set_programmatic_launch(on)
    try:
        yield
    finally:
        _pdl_on = saved


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9


def programmatic_launch_switched_on() -> bool:
    """The switch alone (``RLPERF_PDL``, read on first use, or :func:`set_programmatic_launch`), whatever
    the device: on by default."""
    global _pdl_on
    if _pdl_on is None:
        _pdl_on = _pdl_from_environment()
    return _pdl_on


def programmatic_launch(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: switched on, a CUDA device of SM 90 or later."""
    if not programmatic_launch_switched_on() or device.type != "cuda":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


_PDL_OPTIONS = {"launch_pdl": True}
_NO_OPTIONS: dict = {}


def launch_options(device: torch.device) -> dict:
    """The extra launch keywords of a kernel that calls :func:`grid_dependency_sync`: ``launch_pdl``
    where :func:`programmatic_launch` holds, else none (the plain launch)."""
    return _PDL_OPTIONS if programmatic_launch(device) else _NO_OPTIONS


_STAGES_THAT_FIT: dict = {}


def launch_with_fitting_stages(launch: Callable[[int], object], key: Hashable, num_stages: int) -> int:
    """Call ``launch(stages)`` from the remembered (else ``num_stages``) depth down to 1 until it
    fits; re-raise ``OutOfResources`` at depth 1. Returns the depth used. ``key`` must identify
    the kernel and everything that sizes its shared memory (config, dtypes)."""
    stages = _STAGES_THAT_FIT.get(key, num_stages)
    while True:
        try:
            launch(stages)
            break
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
    _STAGES_THAT_FIT[key] = stages
    return stages


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device`` (its index, else the current device), cached: what
    a launch sizes a persistent grid or a pipeline depth by."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
