"""rlperf.gates — the first-step gates (kl_zero, logprob_abs_diff, oom_headroom, sanity; routing_agreement
on MoE models) behind `rlperf gate`.

The gates consume what the loop's first step produces, and never the reverse: the record
(:class:`FirstStepRecord`, :class:`PhaseMemory`, :class:`EngineMemory`, :data:`PHASES`, defined in
:mod:`rlperf.loop.record` and re-exported here as the gates' input type), its per-phase peaks
(measured by :class:`rlperf.telemetry.PhaseMeter`), the worst-case probe (:mod:`rlperf.loop.probe`)
and, with rollout engines of their own, each engine's memory as it reports it.

* :mod:`~rlperf.gates.checks` — the four gates, :class:`GateOptions`, :class:`GateResult`;
* :mod:`~rlperf.gates.memory` — ``--memory-limit`` parsing, byte formatting, the CPU capacity;
* :mod:`~rlperf.gates.report` — :class:`GateReport`: console table, JSON, JUnit XML;
* :mod:`~rlperf.gates.runner` — :class:`FirstStepGate` and the ``rlperf gate`` command (flags, exit codes).

Usage: ``report = FirstStepGate(GateOptions()).check(record); print(report.table()); report.exit_code``.
"""
from rlperf.lazy_exports import lazy_exports

_EXPORTS = {
    'PHASES': 'rlperf.loop.record',
    'EngineMemory': 'rlperf.loop.record',
    'FirstStepRecord': 'rlperf.loop.record',
    'PhaseMemory': 'rlperf.loop.record',
    'GATES': '.checks',
    'GateOptions': '.checks',
    'GateResult': '.checks',
    'kl_zero': '.checks',
    'logprob_abs_diff': '.checks',
    'oom_headroom': '.checks',
    'sanity': '.checks',
    'format_bytes': '.memory',
    'parse_memory_size': '.memory',
    'system_memory_bytes': '.memory',
    'GateReport': '.report',
    'FirstStepGate': '.runner',
    'add_gate_arguments': '.runner',
    'gate_options_from': '.runner',
    'run_gate': '.runner',
}
"""Each exported name -> the submodule that defines it (imported when the name is first used)."""
__all__ = [
    "FirstStepRecord", "PhaseMemory", "EngineMemory", "PHASES", "GATES", "GateOptions", "GateResult", "GateReport", "FirstStepGate",
    "kl_zero", "logprob_abs_diff", "oom_headroom", "sanity", "parse_memory_size", "format_bytes",
    "system_memory_bytes", "add_gate_arguments", "gate_options_from", "run_gate",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
