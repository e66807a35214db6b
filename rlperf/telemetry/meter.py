"""The phase meter: wall time and peak memory of each named phase of a step.

One meter measures every phase the loop runs (``perf/*_time`` and ``memory/{phase}_peak_bytes`` of
metrics.jsonl, the :class:`~rlperf.loop.record.PhaseMemory` list the first-step gates read) and the
gates' worst-case probe; the oom_headroom gate (:mod:`rlperf.gates.memory`) only compares its
numbers with a capacity. ::

    meter = PhaseMeter(device, timeline)           # timeline: optional, one slice per phase
    with meter.phase("train", step=k) as sample:
        ...
    sample.seconds, sample.peak_bytes              # this phase
    meter.times["train"], meter.peaks["train"]     # summed / maxed over the phases of that name since reset()

Peak memory, by device (:attr:`PhaseMeter.kind`):

* ``"cuda"``: ``torch.cuda.max_memory_allocated`` within the phase (the allocator's peak, reset at
  the phase's start after a synchronize; add reserved-memory headroom yourself if fragmentation
  matters). The phase's time includes a synchronize at its end, so it covers the queued kernels.
* ``"cpu_rss"``: the process's peak resident set within the phase (VmHWM, reset at the phase's
  start where the kernel allows, else the lifetime peak: an over-estimate, the safe side for a
  headroom check). See :mod:`rlperf.telemetry.memory`.

Phases may overlap (``--async``: the rollout thread's phase runs during training). The peak is reset
only when no other phase is open, so every phase's peak covers its whole span; an overlapping
phase's allocations count in both (the process's peak over the span, which is what a capacity
check needs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import torch

from .memory import memory_kind, peak_rss_bytes, reset_peak_rss
from .notice import phase_description, slow_phase_notice


@dataclasses.dataclass
class PhaseSample:
    """One phase as measured; ``seconds`` and ``peak_bytes`` are filled when its block exits normally."""

    name: str
    seconds: float | None = None
    peak_bytes: int | None = None


class PhaseMeter:
    """Wall time and peak memory of named phases on ``device``.

    ``timeline``: a :class:`~rlperf.telemetry.timeline.PhaseTimeline` that gets one slice per phase
    (with its memory counters), or None. :attr:`trace`: a
    :class:`~rlperf.telemetry.trainer_trace.TrainerTrace` wrapped around each phase once armed (the
    loop arms it for a run; the gates' first step never does).
    """

    def __init__(self, device=None, timeline=None, notice: str | None = None):
        self.device = torch.device(device if device is not None else "cpu")
        self.timeline = timeline
        self.trace = None
        self.notice = notice  # a prefix ("rlperf train"): a phase still running after a few seconds says so
        self.kind = memory_kind(self.device)
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self._open = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None):
        """Measure the ``with`` block as phase ``name`` (of step ``step``); yields its :class:`PhaseSample`."""
        # the torch trace (when armed) wraps the measurement: its start and export stay out of the phase's time
        with slow_phase_notice(phase_description(name, step), self.notice or "", enabled=self.notice is not None), \
                self.trace.phase(name, step) if self.trace is not None else contextlib.nullcontext(), \
                self._measure(name, step) as sample:
            yield sample

    @contextlib.contextmanager
    def _measure(self, name: str, step: int | None):
        cuda = self.kind == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        with self._lock:
            if self._open == 0:  # an open phase's peak must keep covering its whole span
                if cuda:
                    torch.cuda.reset_peak_memory_stats(self.device)
                else:
                    reset_peak_rss()
            self._open += 1
        sample = PhaseSample(name)
        try:
            t = time.perf_counter()
            slice_args = {} if step is None else {"step": step}
            with self.timeline.phase(name, **slice_args) if self.timeline is not None else contextlib.nullcontext():
                yield sample
                if cuda:
                    torch.cuda.synchronize(self.device)
            sample.seconds = time.perf_counter() - t
            sample.peak_bytes = int(torch.cuda.max_memory_allocated(self.device) if cuda else peak_rss_bytes())
            with self._lock:
                self.times[name] = self.times.get(name, 0.0) + sample.seconds
                self.peaks[name] = max(self.peaks.get(name, 0), sample.peak_bytes)
        finally:
            with self._lock:
                self._open -= 1

    def reset(self) -> None:
        """Forget the phases measured so far (the loop calls it at the top of every step)."""
        with self._lock:
            self.times, self.peaks = {}, {}
