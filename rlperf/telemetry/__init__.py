"""rlperf.telemetry — the training loop's own instrumentation (what every ``rlperf train`` run records).

* :mod:`~rlperf.telemetry.meter` — :class:`PhaseMeter`: wall time and peak memory (CUDA allocator or
  host resident set) of each phase; the loop's ``perf/*`` and ``memory/*`` metrics and the first-step
  gates' per-phase peaks both come from it;
* :mod:`~rlperf.telemetry.memory` — the memory samplers the meter, the timeline and the rollout
  server's ``/get_server_info`` read (RSS, peak RSS, CUDA allocator counters, capacity);
* :mod:`~rlperf.telemetry.timeline` — :class:`PhaseTimeline`: the phase slices and memory counters of a
  run, as a Perfetto trace;
* :mod:`~rlperf.telemetry.trainer_trace` — :class:`TrainerTrace`: torch.profiler traces of a window of
  steps (``--profile-step-start/-end``, ``--profile-target``);
* :mod:`~rlperf.telemetry.loggers` — each metrics line also to TensorBoard (``--use-tensorboard``),
  Weights & Biases (``--use-wandb``) and the run's redrawn picture (``--plot``), rank 0 only.

The profile harness for rollout servers (``rlperf profile``) is a tool on top, :mod:`rlperf.profiles`.
"""
from .memory import (capacity_bytes, memory_counters, memory_kind, peak_rss_bytes, process_memory, reset_peak_rss,
                     rss_bytes, system_memory_bytes)
from .meter import PhaseMeter, PhaseSample
from .timeline import PhaseTimeline, default_path, perfetto_available
from .trainer_trace import TrainerTrace, add_profile_arguments, check_profile_args

__all__ = ["PhaseMeter", "PhaseSample", "PhaseTimeline", "TrainerTrace", "default_path", "perfetto_available",
           "add_profile_arguments", "check_profile_args", "memory_counters", "rss_bytes", "peak_rss_bytes",
           "reset_peak_rss", "memory_kind", "capacity_bytes", "process_memory", "system_memory_bytes"]
