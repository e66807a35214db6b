"""rlperf.loop — the RL loop behind ``rlperf train`` (see :mod:`rlperf.loop.runner`).

* :func:`train` — run a training loop from ``rlperf train`` flags; returns the metrics lines;
* :func:`first_step` — one rollout + one train step as a :class:`FirstStepRecord` (the hook of the
  first-step gates), defined in :mod:`~rlperf.loop.first_step`: import it from there, since once that
  submodule is imported anywhere the package attribute ``first_step`` is the module, not the function;
* :mod:`~rlperf.loop.build` — the parts built before the trainer: model, tokenizer, data, warm-up, reference;
* :mod:`~rlperf.loop.metrics` — what each rollout's ``metrics.jsonl`` line holds, the file, the step line;
* :mod:`~rlperf.loop.record` — :class:`FirstStepRecord`, :class:`PhaseMemory`, :class:`EngineMemory`,
  :data:`PHASES`: what the first step hands to the gates;
* :mod:`~rlperf.loop.probe` — :func:`worst_case_probe`: forward + backward at the largest micro-batch;
* :mod:`~rlperf.loop.generation` — the default rollout function (``--rollout-function-path``'s
  contract), per-sample seeds, debug rollout data; samples are :class:`rlperf.train.Sample`;
* :mod:`~rlperf.loop.args`, :mod:`~rlperf.loop.device`, :mod:`~rlperf.loop.resolve`,
  :mod:`~rlperf.loop.config` — the flags (the parser module), what the host decides, the checks that run
  before anything starts, and the typed configuration the run reads (:class:`RunConfig`);
* :mod:`~rlperf.loop.clients` — the seam to the engines: :class:`RolloutClient` (generate,
  load_weights, weights_checksum, close) and :func:`client_for`, which picks the in-process engine,
  the servers behind a router or the run's own engines from the configuration;
* :mod:`~rlperf.loop.engines` — ``--rollout-num-gpus``: the run's own ``rlperf serve`` engines on their
  own GPUs behind the sglang-router (weights by broadcast, :mod:`rlperf.sync.distributed`);
* :mod:`~rlperf.loop.launch` — :func:`~rlperf.loop.launch.placement_for`, the placement ``--placement`` names;
* :mod:`~rlperf.loop.placement` — where the actor ranks run (``--actor-num-nodes``,
  ``--actor-num-gpus-per-node``, ``--placement``): layout checks, :class:`~rlperf.loop.placement.LocalPlacement`,
  torchrun's environment, the ranks' process group;
* :mod:`~rlperf.loop.data_parallel` — what changes on several ranks: sharded rollout, rank 0's samples,
  worst-rank memory peaks (the trainer side is the backends', :mod:`rlperf.train.backend`);
* :func:`parse_train_args` — flags -> a checked namespace (:class:`UsageError` before any step).

Phase times, memory peaks, the phase timeline and torch traces are the loop's telemetry
(:mod:`rlperf.telemetry`).
"""
from rlperf.lazy_exports import lazy_exports

_EXPORTS = {
    'UsageError': '.args',
    'add_loop_arguments': '.args',
    'parse_train_args': '.resolve',
    'resolve_args': '.resolve',
    'RunConfig': '.config',
    'RolloutClient': '.clients',
    'client_for': '.clients',
    'probe_samples': '.probe',
    'worst_case_probe': '.probe',
    'PHASES': '.record',
    'EngineMemory': '.record',
    'FirstStepRecord': '.record',
    'PhaseMemory': '.record',
    'METRICS_FILE': '.metrics',
    'summary_line': '.metrics',
    'Run': '.runner',
    'train': '.runner',
    'first_step': '.first_step',
}
"""Each exported name -> the submodule that defines it (imported when the name is first used)."""
__all__ = ["RunConfig", "RolloutClient", "client_for", "UsageError", "add_loop_arguments", "parse_train_args", "resolve_args", "Run", "train", "first_step",
           "summary_line", "METRICS_FILE", "FirstStepRecord", "PhaseMemory", "EngineMemory", "PHASES", "worst_case_probe",
           "probe_samples"]


__getattr__ = lazy_exports(__name__, _EXPORTS)
