"""rlperf.loop — the RL loop behind ``rlperf train`` (see :mod:`rlperf.loop.runner`).

* :func:`train` — run a training loop from ``rlperf train`` flags; returns the metrics lines;
* :func:`first_step` — one rollout + one train step as a :class:`rlperf.gates.record.FirstStepRecord`
  (the hook of the first-step gates);
* :func:`parse_train_args` — flags -> a checked namespace (:class:`UsageError` before any step).
"""
from .args import UsageError, add_loop_arguments, parse_train_args, resolve_args
from .runner import METRICS_FILE, Run, first_step, summary_line, train

__all__ = ["UsageError", "add_loop_arguments", "parse_train_args", "resolve_args", "Run", "train", "first_step",
           "summary_line", "METRICS_FILE"]
