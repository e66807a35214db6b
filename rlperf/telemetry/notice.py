"""Say what a long phase is doing while it runs.

A large model on the CPU can build for minutes, and a step of it takes minutes: a silent console then
looks like a hang. :func:`slow_phase_notice` prints one line on stderr once a block has run for
:func:`slow_phase_seconds` (``what ...``) and one when it ends (``what: done in N s``); a block that ends
sooner prints nothing, so the embedded default run's console stays one line per rollout.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

SLOW_PHASE_S = 5.0
"""Seconds a phase runs before it says what it is doing."""
SLOW_PHASE_ENV = "RLPERF_SLOW_PHASE_S"
"""Environment variable that replaces :data:`SLOW_PHASE_S` (0: every phase says so; tests use it)."""


SETUP_DESCRIPTIONS = {
    "model": "building the model",
    "data": "loading the prompts and the reward",
    "trainer": "building the trainer (the embedded task's format warm-up, the reference model, optimizer state)",
    "engines": "starting the rollout engines",
}
"""What each stage of building a run does (:class:`rlperf.loop.runner.Run`), in words."""
PHASE_DESCRIPTIONS = {"rollout": "generating rollout {n}", "log_prob": "log-probs of rollout {n}",
                      "train": "training on rollout {n}", "weight_sync": "weight sync after rollout {n}"}
"""What each phase of a step does (:class:`rlperf.telemetry.meter.PhaseMeter`'s names), in words; ``{n}``:
the rollout counted from 1, as the console's step lines count."""


def phase_description(name: str, step: int | None) -> str:
    """Phase ``name`` of rollout ``step`` (0-based; -1 or None: before the first) in words."""
    if step is None or step < 0:
        return "weight sync to the engines" if name == "weight_sync" else name.replace("_", " ")
    return PHASE_DESCRIPTIONS.get(name, name.replace("_", " ") + " of rollout {n}").format(n=step + 1)


def slow_phase_seconds() -> float:
    """:data:`SLOW_PHASE_S`, or the number in :data:`SLOW_PHASE_ENV`."""
    try:
        return max(0.0, float(os.environ.get(SLOW_PHASE_ENV, SLOW_PHASE_S)))
    except ValueError:
        return SLOW_PHASE_S


@contextlib.contextmanager
def slow_phase_notice(what: str, prefix: str = "rlperf train", enabled: bool = True, stream=None):
    """Print ``{prefix}: {what} ...`` on ``stream`` (stderr) if the ``with`` block is still running after
    :func:`slow_phase_seconds`, then ``{prefix}: {what}: done in N s`` when it ends; nothing for a quick
    block or when not ``enabled`` (ranks other than 0). A timer thread prints, so a block busy in one
    long native call (a model's random init, a matmul) is announced all the same."""
    if not enabled:
        yield
        return
    out = stream or sys.stderr
    lock = threading.Lock()
    state = {"told": False, "ended": False}
    t0 = time.perf_counter()

    def tell():
        with lock:
            if state["ended"]:
                return
            state["told"] = True
            print(f"{prefix}: {what} ...", file=out, flush=True)

    timer = threading.Timer(slow_phase_seconds(), tell)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["ended"] = True
            told = state["told"]
        if told:
            print(f"{prefix}: {what}: done in {time.perf_counter() - t0:.0f} s", file=out, flush=True)
