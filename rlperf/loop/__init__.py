"""rlperf.loop — the RL loop behind ``rlperf train`` (see :mod:`rlperf.loop.runner`).

* :func:`train` — run a training loop from ``rlperf train`` flags; returns the metrics lines;
* :func:`first_step` — one rollout + one train step as a :class:`FirstStepRecord` (the hook of the
  first-step gates, which import the record and this hook from here);
* :mod:`~rlperf.loop.record` — :class:`FirstStepRecord`, :class:`PhaseMemory`, :class:`EngineMemory`,
  :data:`PHASES`: what the first step hands to the gates;
* :mod:`~rlperf.loop.probe` — :func:`worst_case_probe`: forward + backward at the largest micro-batch;
* :mod:`~rlperf.loop.generation` — the default rollout function (``--rollout-function-path``'s
  contract), per-sample seeds, debug rollout data; samples are :class:`rlperf.train.Sample`;
* :mod:`~rlperf.loop.clients` — where rollouts are generated: the in-process engine or the servers
  behind a router, each with its weight sync (:mod:`rlperf.sync`);
* :mod:`~rlperf.loop.engines` — ``--rollout-num-gpus``: the run's own ``rlperf serve`` engines on their
  own GPUs behind the sglang-router (weights by broadcast, :mod:`rlperf.sync.distributed`);
* :mod:`~rlperf.loop.placement` — where the actor ranks run (``--actor-num-nodes``,
  ``--actor-num-gpus-per-node``, ``--placement``): layout checks, :class:`~rlperf.loop.placement.LocalPlacement`,
  torchrun's environment, the ranks' process group;
* :mod:`~rlperf.loop.data_parallel` — what changes on several ranks: sharded rollout, rank 0's samples,
  worst-rank memory peaks (the trainer side is :mod:`rlperf.train.fsdp`);
* :func:`parse_train_args` — flags -> a checked namespace (:class:`UsageError` before any step).

Phase times, memory peaks, the phase timeline and torch traces are the loop's telemetry
(:mod:`rlperf.telemetry`).
"""
from .args import UsageError, add_loop_arguments, parse_train_args, resolve_args
from .probe import probe_samples, worst_case_probe
from .record import PHASES, EngineMemory, FirstStepRecord, PhaseMemory
from .runner import METRICS_FILE, Run, first_step, summary_line, train

__all__ = ["UsageError", "add_loop_arguments", "parse_train_args", "resolve_args", "Run", "train", "first_step",
           "summary_line", "METRICS_FILE", "FirstStepRecord", "PhaseMemory", "EngineMemory", "PHASES", "worst_case_probe",
           "probe_samples"]
