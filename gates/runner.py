"""``FirstStepGate`` (run every gate on a :class:`FirstStepRecord`) and the ``rlperf gate`` command.

The command: parse the gate and training flags, run one rollout and one train step through the
loop's first-step hook (:func:`rlperf.loop.first_step` ``(args) -> FirstStepRecord``; the gates sit
above the loop and import it, the loop never imports the gates), run the gates, print
the table, write ``--report-json`` / ``--junit-xml`` (and ``--report-png``, the per-token log-prob
differences), and exit 0 (all passed), 1 (a gate failed, or
the first step itself crashed or ran out of memory) or 2 (bad usage, or no loop to run).
``rlperf train`` uses :class:`FirstStepGate` and :func:`add_gate_arguments` the same way before step 1.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from collections.abc import Callable

from rlperf import flags, loop
from rlperf.loop.args import add_loop_arguments, has_loop_flags
from rlperf.loop.record import FirstStepRecord
from rlperf.train.args import add_train_arguments, train_args_from

from .checks import (DEFAULT_LOGPROB_ABS_DIFF_THRESHOLD, DEFAULT_OOM_HEADROOM, GATES, OOM_REMEDIES, GateOptions,
                     GateResult, gates_for)
from .memory import parse_memory_size, system_memory_bytes
from .report import GateReport, check_report_path, write_logprob_png

FirstStepFn = Callable[[argparse.Namespace], FirstStepRecord]

DESCRIPTION = """\
Run one rollout and one train step, then check the first-step gates, each reported on its own:

  kl_zero           at step 0 the actor's log-probs equal the reference's bit for bit (KL exactly 0),
                    and the first micro-step's train/ppo_kl and train/pg_clipfrac are exactly 0
  logprob_abs_diff  mean |train - rollout| log-prob over loss tokens: exactly 0 with
                    --true-on-policy-mode, else <= --logprob-abs-diff-threshold
  oom_headroom      every phase's peak memory (rollout, log_prob, train, weight_sync) and the
                    worst-case probe stay under (1 - --oom-headroom) x capacity (the GPU's memory;
                    on the CPU the process's resident memory against --memory-limit,
                    by default the cgroup limit or the machine's memory); several ranks: the
                    worst rank's; with --rollout-num-gpus every engine's own peak too, against
                    its own GPU's memory (CPU engines: as the trainer's process)
  sanity            finite losses, rewards and grad norm; log-probs finite and <= 0
  routing_agreement MoE models only: the share of (token, MoE layer) pairs the rollout and the
                    trainer's own routers send to the same experts: exactly 1.0 with
                    --true-on-policy-mode, else >= 0.99; a sample without routed experts fails

A failing gate names the first offending token, sample or phase, and what to try.
Output: a table on stdout, --report-json PATH, --junit-xml PATH (one testcase per gate), --report-png PATH
(the per-token train - rollout log-prob differences, flat at 0 when bit-identical).
Exit codes: 0 all gates passed, 1 a gate failed (or the first step crashed), 2 bad usage.
"""


class FirstStepGate:
    """Runs the gates (default: all of :data:`rlperf.gates.checks.GATES`, in order) on a first step."""

    def __init__(self, options: GateOptions | None = None, gates: dict | None = None):
        self.options = options or GateOptions()
        self.gates = dict(GATES if gates is None else gates)

    def check(self, record: FirstStepRecord, seconds: float = 0.0) -> GateReport:
        """Every gate on ``record``; a gate that raises is reported as failed with the exception."""
        results = []
        for name, gate in gates_for(record, self.gates).items():  # MoE models: routing_agreement too
            try:
                results.append(gate(record, self.options))
            except Exception as e:  # one broken gate must not hide the others' verdicts
                results.append(GateResult(name, False, {}, None, f"the gate raised {type(e).__name__}: {e}",
                                          "a malformed FirstStepRecord (shapes, missing fields)"))
        stages = dict(record.stage_seconds)
        if stages:
            stages["other"] = max(seconds - sum(stages.values()), 0.0)  # the record, closing the engines
        return GateReport(results, seconds, _config(record), stages, dict(record.setup_seconds))

    def run(self, first_step: Callable[[], FirstStepRecord], usage_errors: tuple = ()) -> GateReport:
        """Run ``first_step()`` and check its record. If it raises, every gate fails with the cause:
        out of memory fails ``oom_headroom`` with slime's remedies, anything else names the exception.
        Exceptions of the ``usage_errors`` types (bad flags or inputs found by the step) propagate."""
        t0 = time.perf_counter()
        try:
            record = first_step()
        except usage_errors:
            raise
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            return self.crashed(e, time.perf_counter() - t0)
        return self.check(record, time.perf_counter() - t0)

    def crashed(self, error: BaseException, seconds: float = 0.0) -> GateReport:
        """The report of a first step that did not finish: every gate failed, the cause named."""
        oom = _is_oom(error)
        cause = f"the first step raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        results = []
        for name in self.gates:
            if name == "oom_headroom" and oom:
                results.append(GateResult(name, False, {"error": str(error)[:500]}, None,
                                          f"out of memory during the first step ({cause})",
                                          "in order: " + "; ".join(f"{k + 1}. {r}" for k, r in enumerate(OOM_REMEDIES))))
            else:
                results.append(GateResult(name, False, {}, None, f"not checked: {cause}",
                                          "fix the first step's error (see the traceback on stderr)"))
        return GateReport(results, seconds)


def _is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(error).lower()


def _config(record: FirstStepRecord) -> dict:
    return {"true_on_policy": record.true_on_policy, "memory_kind": record.memory_kind,
            "samples": len(record.samples), **{k: v for k, v in record.config.items()}}


def add_gate_arguments(p: argparse.ArgumentParser) -> None:
    """The gates' own flags (``rlperf gate`` and ``rlperf train`` both add them)."""
    g = p.add_argument_group("first-step gates")
    g.add_argument("--junit-xml", metavar="PATH", default=None, help="write JUnit XML, one testcase per gate")
    g.add_argument("--report-json", metavar="PATH", default=None,
                   help="write the JSON report (every gate's measured values, threshold, message, hint)")
    g.add_argument("--report-png", metavar="PATH", default=None,
                   help="draw the first step's per-token train - rollout log-prob differences (a flat line at 0 "
                        "when they are bit-identical) into this PNG (needs matplotlib: pip install 'rlperf[plot]')")
    g.add_argument("--memory-limit", metavar="SIZE", default=None,
                   help="on the CPU: the capacity the process's resident memory is checked against, e.g. 8GiB, "
                        "512MiB, 1.5GB (binary K/M/G/T, decimal kB/MB/GB); default: the cgroup's memory limit, "
                        "else the machine's memory")
    g.add_argument("--oom-headroom", type=float, default=DEFAULT_OOM_HEADROOM, metavar="FRACTION",
                   help=f"fraction of capacity every phase's peak must leave free (default {DEFAULT_OOM_HEADROOM})")
    g.add_argument("--logprob-abs-diff-threshold", type=float, default=DEFAULT_LOGPROB_ABS_DIFF_THRESHOLD,
                   metavar="X", help="most mean |train - rollout| log-prob allowed without --true-on-policy-mode "
                                     f"(default {DEFAULT_LOGPROB_ABS_DIFF_THRESHOLD})")


def gate_options_from(ns: argparse.Namespace) -> GateOptions:
    """:class:`GateOptions` from parsed flags; ValueError naming the flag for a bad value."""
    if ns.memory_limit is not None:
        parse_memory_size(ns.memory_limit)  # validate early: before any step runs
    return GateOptions(oom_headroom=ns.oom_headroom, logprob_abs_diff_threshold=ns.logprob_abs_diff_threshold)


def add_gate_command_arguments(p: argparse.ArgumentParser, with_loop: bool = True) -> None:
    """Everything ``rlperf gate`` takes: the gate flags, then the loop's (``rlperf train``'s, which include
    the training core's; ``--output-dir`` defaults to ``rlperf-gate``) with ``with_loop``, else the
    training core's alone (a hand-made first step)."""
    add_gate_arguments(p)
    if with_loop:
        add_loop_arguments(p, command="gate")
    else:
        add_train_arguments(p)


def build_gate_parser(prog: str = "rlperf gate", with_loop: bool = True) -> argparse.ArgumentParser:
    p = flags.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=flags.RawDescriptionHelpFormatter)
    add_gate_command_arguments(p, with_loop)
    return p


def _resolve_flags(args: argparse.Namespace, with_loop: bool) -> argparse.Namespace:
    """Check the non-gate flags before any step: the loop's :func:`resolve_args` (which fills the task's
    defaults) when its flags were parsed, else :func:`rlperf.train.train_args_from`. ValueError if bad."""
    if with_loop and has_loop_flags(args):
        return loop.resolve_args(args)
    train_args_from(args)
    return args


def run_gate(args: argparse.Namespace, first_step: FirstStepFn | None = None, announce: bool = False) -> int:
    """``rlperf gate`` on parsed flags: 0 all gates passed, 1 a gate failed, 2 bad usage.

    ``first_step``: the hook that runs one rollout and one train step (default
    ``rlperf.loop.first_step``, with the loop's flags). ``args.memory_limit`` is replaced by its
    value in bytes (an int) before the hook runs; for a ``cpu_rss`` record it is the capacity.
    ``announce``: once the flags are checked, name on stderr the directory the first step writes under
    (``--output-dir``; ``rlperf gate`` defaults to ``rlperf-gate``).
    """
    with_loop = first_step is None
    if with_loop:  # the function, from its module: once that module is imported, the package's
        # attribute `rlperf.loop.first_step` is the module, not the lazily exported function
        from rlperf.loop.first_step import first_step
    try:
        options = gate_options_from(args)
        for flag, path in (("--report-json", args.report_json), ("--junit-xml", args.junit_xml),
                           ("--report-png", args.report_png)):
            if path:  # checked before the step: a report that cannot be written is bad usage, not a crash after it
                check_report_path(path, flag)
        if args.report_png and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--report-png needs matplotlib, which is not installed: pip install 'rlperf[plot]' "
                             "(or: pip install matplotlib)")
        if args.memory_limit is not None:
            args.memory_limit = parse_memory_size(args.memory_limit)
        args = _resolve_flags(args, with_loop)
    except ValueError as e:
        print(f"rlperf gate: {e}", file=sys.stderr)
        return 2
    limit = args.memory_limit
    if announce and has_loop_flags(args):
        print(f"rlperf gate: one rollout and one train step, then the gates; the step writes under {args.output_dir} "
              f"(--output-dir)", file=sys.stderr, flush=True)
    records = []  # the step's record, for --report-png

    def step() -> FirstStepRecord:
        record = first_step(args)
        records.append(record)
        if record.memory_kind == "cpu_rss":
            if limit is not None:
                record.capacity_bytes = limit
            elif record.capacity_bytes is None:  # no --memory-limit: what the OOM killer would enforce
                record.capacity_bytes = system_memory_bytes()
                record.config["memory_limit"] = f"{record.capacity_bytes} (cgroup limit or MemTotal)"
        if limit is not None:  # engines on the CPU are processes of this host: held to the same limit
            for engine in record.engines:
                if engine.kind == "cpu_rss":
                    engine.capacity_bytes = limit
        return record

    try:
        report = FirstStepGate(options).run(step, usage_errors=(loop.UsageError,) if with_loop else ())
    except ValueError as e:  # only the loop's UsageError gets here: bad inputs found before any step
        print(f"rlperf gate: {e}", file=sys.stderr)
        return 2
    print(report.table())
    for flag, path, write in (("--report-json", args.report_json, report.write_json),
                              ("--junit-xml", args.junit_xml, report.write_junit)):
        if path:
            try:
                write(path)
            except OSError as e:  # it could be written before the step; not any more
                print(f"rlperf gate: {flag} {path}: cannot write the report ({e.strerror or e})", file=sys.stderr)
                return 2
    png = getattr(args, "report_png", None)
    if png and records:  # no record: the first step crashed, there is nothing to draw
        try:
            write_logprob_png(records[-1], report, png)
        except OSError as e:
            print(f"rlperf gate: --report-png {png}: cannot write the picture ({e.strerror or e})", file=sys.stderr)
            return 2
    return report.exit_code


def main(argv: list[str] | None = None, first_step: FirstStepFn | None = None) -> int:
    """``rlperf gate`` from an argument list; argparse's own usage errors also exit 2.

    Without ``first_step`` the loop's hook runs with the loop's flags (``rlperf train``'s); an
    injected hook (tests, other loops) gets the gate and training-core flags only.
    """
    try:
        args = build_gate_parser(with_loop=first_step is None).parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    return run_gate(args, first_step)
