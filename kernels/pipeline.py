"""Launch a Triton kernel at the deepest software pipeline that fits in shared memory.

``num_stages`` only sets how far tile loads run ahead of the math: the loop order, the tile
shapes and the MMA instructions stay the same, so a result's bits do not depend on it. Where a
tuned depth does not fit (float32 tiles are twice the bytes; a float32 epilogue needs a larger
buffer), dropping stages keeps the contract; the depth that fit is remembered per key so later
launches go straight to it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import torch
from triton.runtime.errors import OutOfResources

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
