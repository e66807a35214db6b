"""torch.profiler traces of a window of training steps (``rlperf train --profile-step-*``).

Flags (slime's names and meaning)::

    --profile-step-start S --profile-step-end E [--profile-target T [T ...]]

profile steps ``S <= i < E`` of this run, where ``i`` counts the steps the run executes from 0 (the
rollout id without ``--load``; with ``--load`` the first resumed rollout is step 0, as in slime).
Targets (default ``train_overall``):

* ``train_overall`` — whole steps (rollout, log-probs, train, weight sync, metrics, checkpoint):
  one profiler session from the start of step ``S`` to the end of step ``E - 1``, one file
  ``torch_trace_train_overall_steps{a}-{b}.json.gz`` (``_step{a}`` for a single step);
* ``train_actor`` — only the actor's training of each step: forward, backward and AdamW over its
  optimizer steps (the loop's ``train`` phase);
* ``train_log_probs`` — only the old/ref log-prob pass of each step (the loop's ``log_prob`` phase).

A phase target records one session per step, so nothing outside the phase is in its trace: one
file ``torch_trace_{target}_step{k}.json.gz`` per step. Files go to the run's output dir and are
named by rollout id ``k`` (the ``step`` of the phase timeline and ``rollout_id`` of metrics.jsonl);
each holds a ``{target} step {k}`` span. In ``--async`` mode the next rollout runs in a second
thread during training, and its ops show up in the ``train_actor`` / ``train_log_probs`` traces
too (the profiler records every thread of the process).

Differences from slime, on purpose: the window alone turns profiling on (no
``--use-pytorch-profiler``, no default window); no warm-up step before the window (the session starts at the
window so each file covers exactly its steps), and the phase targets count steps (rollouts), not
iterations inside one rollout. ``train_overall`` cannot be combined with another target: its
session would have to nest theirs, and torch runs one profiler at a time.

The sessions record CPU ops (plus CUDA kernels on a CUDA device) with shapes, memory and FLOPs;
no Python stacks (they multiply the trace size and the export time). Traces are Chrome JSON
(gzip), timestamps ``baseTimeNanoseconds + ts * 1000`` on the wall clock of the phase timeline
(:mod:`rlperf.telemetry.timeline`), so the two line up in Perfetto.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.profiler import profile


TARGETS = ("train_overall", "train_actor", "train_log_probs")
TARGET_PHASE = {"train_actor": "train", "train_log_probs": "log_prob"}
"""The loop phase (its :class:`rlperf.telemetry.meter.PhaseMeter` name) each phase target records."""

TRACE_PREFIX = "torch_trace_"
TRACE_SUFFIX = ".json.gz"


def trace_name(target: str, first: int, last: int) -> str:
    """File name of ``target``'s trace of rollouts ``first..last`` (inclusive)."""
    steps = f"step{first}" if first == last else f"steps{first}-{last}"
    return f"{TRACE_PREFIX}{target}_{steps}{TRACE_SUFFIX}"


def add_trace_window_arguments(parser) -> None:
    """``rlperf train``'s torch.profiler window: ``--profile-step-start``, ``--profile-step-end``,
    ``--profile-target`` (not ``rlperf profile``'s flags, which are the rollout servers')."""
    g = parser.add_argument_group("trainer traces (torch.profiler)")
    g.add_argument("--profile-step-start", type=int, default=None,
                   help="first step of the traced window (0: the run's first step)")
    g.add_argument("--profile-step-end", type=int, default=None, help="end of the window (exclusive)")
    g.add_argument("--profile-target", nargs="+", choices=TARGETS, default=None,
                   help="what to trace in the window (default train_overall)")


def check_profile_args(ns, num_steps: int | None = None, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` for an unusable window or target; fill ``ns.profile_target``'s default.

    ``num_steps``: steps this run executes (default ``ns.num_rollout``; a resumed run has fewer).
    """
    try:
        _check(ns, ns.num_rollout if num_steps is None else num_steps)
    except ValueError as exc:
        raise error(str(exc)) from None


def _check(ns, num_steps: int) -> None:
    start, end, targets = (getattr(ns, f"profile_{k}", None) for k in ("step_start", "step_end", "target"))
    if start is None and end is None:
        if targets:
            raise ValueError("--profile-target needs a window: --profile-step-start and --profile-step-end")
        return
    if start is None or end is None:
        raise ValueError("give both --profile-step-start and --profile-step-end (the window is start <= step < end)")
    if start < 0:
        raise ValueError(f"--profile-step-start must be >= 0, got {start}")
    if end <= start:
        raise ValueError(f"--profile-step-end ({end}) must be greater than --profile-step-start ({start}): "
                         f"the window is start <= step < end")
    if end > num_steps:
        raise ValueError(f"the profile window (steps {start}..{end - 1}) ends past this run's {num_steps} steps "
                         f"(steps count from 0 at the run's first step)")
    targets = list(dict.fromkeys(targets or ["train_overall"]))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"--profile-target {' '.join(unknown)}: unknown (choose from {', '.join(TARGETS)})")
    if "train_overall" in targets and len(targets) > 1:
        raise ValueError("--profile-target train_overall already covers the other targets; torch runs one profiler "
                         "at a time, so trace them in separate runs")
    if getattr(ns, "debug_rollout_only", False) and set(targets) & set(TARGET_PHASE):
        raise ValueError(f"--profile-target {' '.join(targets)}: --debug-rollout-only runs no training phase")
    ns.profile_target = targets


class TrainerTrace:
    """The profiler sessions of one run; inert (every call a no-op) without a window.

    The loop calls :meth:`step` at the top of each step, wraps each phase in :meth:`phase`, and
    calls :meth:`close` when it ends (a window cut short by an error is still written).

    ``ns``: the run's flags, checked again here against the steps the run executes (``error`` is
    raised); ``out_dir``: where traces go; ``first_step``: the rollout id of the run's step 0;
    ``device``: the training device.
    """

    def __init__(self, ns, out_dir, first_step: int = 0, device=None, error: type[Exception] = ValueError):
        check_profile_args(ns, ns.num_rollout - first_step, error)
        self.start, self.end = getattr(ns, "profile_step_start", None), getattr(ns, "profile_step_end", None)
        self.targets = tuple(getattr(ns, "profile_target", None) or ()) if self.start is not None else ()
        self.out = Path(out_dir)
        self.first = first_step
        self.cuda = device is not None and str(device).startswith("cuda")
        self.files: list[Path] = []
        self._overall = None  # (profiler, first rollout id) while train_overall records
        self._span = None  # the open "train_overall step k" span
        self._last = None

    def _in_window(self, k: int) -> bool:
        return self.start is not None and self.start <= k - self.first < self.end

    def _session(self) -> profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        prof = profile(activities=acts, record_shapes=True, profile_memory=True, with_flops=True)
        prof.start()
        return prof

    def _write(self, prof: profile, target: str, first: int, last: int) -> None:
        prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / trace_name(target, first, last)
        prof.export_chrome_trace(str(path))  # a .gz path: torch writes gzip
        self.files.append(path)
        print(f"rlperf train: torch trace of {target} -> {path}", file=sys.stderr)

    def step(self, k: int) -> None:
        """Rollout ``k`` begins: open, advance or close the ``train_overall`` session."""
        if "train_overall" not in self.targets:
            return
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
        if not self._in_window(k):
            self.close()
            return
        if self._overall is None:
            self._overall = (self._session(), k)
        self._last = k
        from torch.profiler import record_function

        self._span = record_function(f"train_overall step {k}")
        self._span.__enter__()

    @contextlib.contextmanager
    def phase(self, name: str, k: int):
        """Wrap the loop phase ``name`` of rollout ``k``: a session of its own when a target wants it."""
        target = next((t for t in self.targets if TARGET_PHASE.get(t) == name), None)
        if target is None or not self._in_window(k):
            yield
            return
        from torch.profiler import record_function

        prof = self._session()
        try:
            with record_function(f"{target} step {k}"):
                yield
        finally:
            self._write(prof, target, k, k)

    def close(self) -> None:
        """End an open ``train_overall`` session and write its trace (idempotent)."""
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
        if self._overall is not None:
            prof, first = self._overall
            self._overall = None
            self._write(prof, "train_overall", first, self._last)
