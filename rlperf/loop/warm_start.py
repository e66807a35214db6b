"""The embedded run's warmed weights, kept for the next run in the same process.

``rlperf train`` runs the first-step gates on a run of their own, then the training run
(``rlperf.cli``): both build the same preset model from the same seed and give it the same format
warm-up (:func:`rlperf.data.embedded.format_warmup`, 60 Adam steps). The second run takes the
first's result instead: a host copy of the float32 master weights after the warm-up and its last
loss, kept under a key of everything that result depends on (:func:`rlperf.loop.build.warm_start_key`:
the model config, seed, device, compute dtype, kernel mode and backend, CPU
threads, deterministic algorithms, the task and the warm-up function). The run that finds it skips
the random init and the warm-up and loads these weights: the bits a fresh warm-up would give.

On two CPU cores that is ~4 s of the tiny model's ``rlperf train``. Only models of at most
:data:`MAX_BYTES` are kept (the copy lives in host memory beside the run; larger presets run on GPUs,
where the warm-up replays a CUDA graph in about a second). One entry: a new key replaces it.
"""
from __future__ import annotations

import dataclasses

import torch

MAX_BYTES = 1 << 30
"""The largest warmed model (float32 parameter bytes) kept for the next run."""


@dataclasses.dataclass(frozen=True)
class WarmedWeights:
    key: tuple
    state: dict[str, torch.Tensor]
    """Parameter name -> host (CPU) copy of the float32 master weight after the warm-up."""
    loss: float
    """The warm-up's last loss."""

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy the kept weights into ``model``'s parameters (same names, shapes and dtype)."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.state[name])


_kept: WarmedWeights | None = None


def lookup(key: tuple) -> WarmedWeights | None:
    """The kept warmed weights if they were kept under ``key``, else None."""
    return _kept if _kept is not None and _kept.key == key else None


def keep(key: tuple, model: torch.nn.Module, loss: float) -> bool:
    """Keep a host copy of ``model``'s parameters after its warm-up under ``key`` (replacing what was
    kept); False, keeping nothing, when the model is larger than :data:`MAX_BYTES`."""
    global _kept
    params = dict(model.named_parameters())
    if sum(p.numel() * p.element_size() for p in params.values()) > MAX_BYTES:
        return False
    _kept = WarmedWeights(key, {n: p.detach().to("cpu", copy=True) for n, p in params.items()}, loss)
    return True


def clear() -> None:
    """Forget the kept weights (tests; a caller that wants every run to warm up afresh)."""
    global _kept
    _kept = None
