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
* :mod:`~rlperf.telemetry.notice` — :func:`slow_phase_notice`: a phase still running after a few seconds
  says what it is doing (a large model on the CPU), rank 0 only.

The profile harness for rollout servers (``rlperf profile``) is a tool on top, :mod:`rlperf.profiles`.
"""
from rlperf.lazy_exports import lazy_exports

_EXPORTS = {
    'capacity_bytes': '.memory',
    'memory_counters': '.memory',
    'memory_kind': '.memory',
    'peak_rss_bytes': '.memory',
    'process_memory': '.memory',
    'reset_peak_rss': '.memory',
    'rss_bytes': '.memory',
    'system_memory_bytes': '.memory',
    'PhaseMeter': '.meter',
    'PhaseSample': '.meter',
    'PhaseTimeline': '.timeline',
    'default_path': '.timeline',
    'perfetto_available': '.timeline',
    'slow_phase_notice': '.notice',
    'TrainerTrace': '.trainer_trace',
    'add_trace_window_arguments': '.trainer_trace',
    'check_profile_args': '.trainer_trace',
}
"""Each exported name -> the submodule that defines it (imported when the name is first used)."""
__all__ = ["PhaseMeter", "PhaseSample", "PhaseTimeline", "TrainerTrace", "default_path", "perfetto_available",
           "add_trace_window_arguments", "check_profile_args", "slow_phase_notice", "memory_counters", "rss_bytes", "peak_rss_bytes",
           "reset_peak_rss", "memory_kind", "capacity_bytes", "process_memory", "system_memory_bytes"]


__getattr__ = lazy_exports(__name__, _EXPORTS)
