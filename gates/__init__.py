"""rlperf.gates — the first-step gates (kl_zero, logprob_abs_diff, oom_headroom, sanity) behind `rlperf gate`.

* :mod:`~rlperf.gates.record` — :class:`FirstStepRecord`, :class:`PhaseMemory`, :data:`PHASES`: what the
  loop's first step hands over (the gates read nothing else);
* :mod:`~rlperf.gates.checks` — the four gates, :class:`GateOptions`, :class:`GateResult`;
* :mod:`~rlperf.gates.memory` — ``--memory-limit`` parsing and per-phase peak measurement (CUDA / RSS);
* :mod:`~rlperf.gates.probe` — the worst-case probe: forward + backward at the largest micro-batch;
* :mod:`~rlperf.gates.report` — :class:`GateReport`: console table, JSON, JUnit XML;
* :mod:`~rlperf.gates.runner` — :class:`FirstStepGate` and the ``rlperf gate`` command (flags, exit codes).

Usage: ``report = FirstStepGate(GateOptions()).check(record); print(report.table()); report.exit_code``.
"""
from .checks import GATES, GateOptions, GateResult, kl_zero, logprob_abs_diff, oom_headroom, sanity
from .memory import format_bytes, measure_phase, parse_memory_size, system_memory_bytes
from .probe import worst_case_probe
from .record import PHASES, FirstStepRecord, PhaseMemory
from .report import GateReport
from .runner import FirstStepGate, add_gate_arguments, gate_options_from, run_gate

__all__ = [
    "FirstStepRecord", "PhaseMemory", "PHASES", "GATES", "GateOptions", "GateResult", "GateReport", "FirstStepGate",
    "kl_zero", "logprob_abs_diff", "oom_headroom", "sanity", "parse_memory_size", "format_bytes", "measure_phase",
    "system_memory_bytes", "worst_case_probe",
    "add_gate_arguments", "gate_options_from", "run_gate",
]
