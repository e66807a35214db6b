"""megatron-core's process groups on rlperf's ranks, and the CPU paths it lacks.

megatron-core is written for CUDA: its layers place tensors on ``torch.cuda.current_device()`` and
draw dropout / initialisation randomness inside ``get_cuda_rng_tracker().fork()``, which swaps CUDA
generator states. On a CPU-only rank (gloo; the CI) both would fail. This module supplies the CPU
paths without changing the package:

* :func:`cpu_device_queries` — while active (and only where CUDA is absent), ``torch.cuda.current_device()``
  answers ``"cpu"`` and ``Tensor.cuda()`` returns the tensor itself, so megatron's
  ``torch.empty(..., device=torch.cuda.current_device())`` allocates on the CPU and the tied
  embedding's first-to-last-stage copy (``weight.data.cuda()``, then an all-reduce) stays there;
* :class:`CPURNGStatesTracker` — megatron's RNG tracker with named CPU generator states:
  ``fork(name)`` swaps the process's CPU RNG state in and out, as the CUDA tracker does with the
  CUDA state. :func:`install_rng_tracker` makes it the tracker megatron's ``get_cuda_rng_tracker()``
  returns, seeded as ``model_parallel_cuda_manual_seed`` seeds its states.

:func:`initialize_model_parallel` builds megatron's tensor / pipeline / data-parallel groups on the
default process group (NCCL on CUDA, gloo on CPU) and installs both.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How the ranks of the default process group split the model (slime's flag names).

    ``world = tensor_model_parallel_size x pipeline_model_parallel_size x data-parallel size``.
    """

    tensor_model_parallel_size: int = 1
    """``--tensor-model-parallel-size``: ranks that split each layer's weights."""
    pipeline_model_parallel_size: int = 1
    """``--pipeline-model-parallel-size``: stages that split the layers."""
    context_parallel_size: int = 1
    """``--context-parallel-size``: only 1 is implemented (refused otherwise)."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: the activations between the tensor-parallel layers split over the tokens
    (rlperf's layers do it: :func:`rlperf.train.megatron.model.build_gpt_model`); a no-op at TP=1."""

    def check(self, world_size: int) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.context_parallel_size != 1:
            raise ValueError(f"--context-parallel-size {self.context_parallel_size}: context parallelism is not "
                             f"implemented by the megatron backend (use 1)")
        model = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % model:
            raise ValueError(f"{world_size} ranks do not split into --tensor-model-parallel-size "
                             f"{self.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                             f"{self.pipeline_model_parallel_size}")

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@contextlib.contextmanager
def cpu_device_queries():
    """``torch.cuda.current_device()`` answers ``"cpu"`` and ``Tensor.cuda()`` is the identity inside
    the block when CUDA is unavailable (megatron allocates on the device it names); with CUDA nothing
    changes."""
    if torch.cuda.is_available():
        yield
        return
    original, original_cuda = torch.cuda.current_device, torch.Tensor.cuda
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda = original, original_cuda


def _tracker_base():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


class CPURNGStatesTracker(_tracker_base()):
    """megatron's RNG tracker over the CPU generator: ``add(name, seed)`` records a CPU state seeded
    with ``seed``; ``fork(name)`` runs its block on that state and keeps what the block advanced it to."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name=None):
        from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

        name = name or _MODEL_PARALLEL_RNG_TRACKER_NAME
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_rng_tracker(seed: int) -> None:
    """Seed megatron's model-parallel RNG states (``model_parallel_cuda_manual_seed``'s offsets: the
    tensor-parallel state differs per TP rank, the data-parallel one does not); on CPU through
    :class:`CPURNGStatesTracker`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        mrandom.model_parallel_cuda_manual_seed(seed)
        return
    tracker = CPURNGStatesTracker()
    tp_rank = ps.get_tensor_model_parallel_rank()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)


def initialize_model_parallel(layout: ParallelLayout, seed: int = 0) -> None:
    """megatron's process groups for ``layout`` over the default process group (which must exist),
    and its RNG tracker (:func:`install_rng_tracker`). Call :func:`destroy_model_parallel` before the
    default group is destroyed."""
    if not dist.is_initialized():
        raise RuntimeError("the megatron backend needs an initialised torch.distributed process group")
    layout.check(dist.get_world_size())
    from megatron.core import parallel_state as ps

    with cpu_device_queries():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
            context_parallel_size=layout.context_parallel_size,
            create_gloo_process_groups=False,
        )
    install_rng_tracker(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    ps.destroy_model_parallel()
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
