"""The engine thread: the one thread that touches the :class:`~rlperf.rollout.engine.Engine`.

Everything else (the HTTP handlers on the asyncio loop) talks to it through a queue of commands
run between steps: :meth:`EngineLoop.call` runs any function of the engine (adding requests, abort,
weight loads, flush, profiling) and hands its result back as a ``concurrent.futures.Future``.
:meth:`EngineLoop.pause` stops the steps (SGLang's ``/pause_generation`` modes: abort what is in
flight, retract it, or keep it in place) but keeps serving commands, so weights can be loaded while
paused; :meth:`EngineLoop.resume` starts the steps again.

A step that raises fails only the requests that make it fail: :meth:`Engine.recover` retries the
failed batch's requests one at a time (bit-exact, through retraction) and fails the ones that break
a step of their own, with an error their clients receive; every other request goes on.

A kernel policy set with ``rlperf.kernels.use_backend`` lives in a context variable, which a new
thread does not inherit, so the thread enters ``use_backend(backend)`` itself; the mode is the
process default (``rlperf.kernels.set_mode``, which ``rlperf serve --mode`` calls).
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import traceback

from rlperf import kernels as K

from .engine import Engine
from .profiler import TraceProfiler

PAUSE_MODES = ("abort", "retract", "in_place")
"""What :meth:`EngineLoop.pause` does with requests in flight (SGLang's ``/pause_generation`` modes)."""


class EngineLoop:
    """The engine's thread and its command queue (module docstring)."""

    def __init__(self, engine: Engine, backend: str | None = None, profile_root: str | None = None):
        self.engine, self.backend = engine, backend
        self.profiler = TraceProfiler(root=profile_root)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._paused = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rlperf-engine", daemon=True)
        self.error: str | None = None

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception in the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, fut))
        return fut

    def pause(self, mode: str = "abort") -> concurrent.futures.Future:
        """Stop stepping after the current step, and per ``mode`` (:data:`PAUSE_MODES`, SGLang's):
        ``abort`` every request in flight, ``retract`` the running ones (pages freed, tokens kept:
        they re-prefill and go on after :meth:`resume`), or leave them ``in_place``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")

        def apply(engine: Engine):
            self._paused = True
            if mode == "abort":
                engine.abort(None, "generation paused (mode=abort)")
            elif mode == "retract":
                engine.retract_all()
        return self.call(apply)

    def resume(self) -> concurrent.futures.Future:
        """Step again (after :meth:`pause`)."""
        def apply(engine: Engine):
            self._paused = False
        return self.call(apply)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                self._advance(self.engine.drain)  # a step launched ahead (overlap) is read before anything changes
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # handed to the caller, who answers with it
                    fut.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _advance(self, work) -> None:
        """``work()``: a step, or reading the step in flight (``Engine.drain``); when it raises, only the
        requests that make a step fail fail (``Engine.recover``)."""
        try:
            work()
        except Exception as exc:
            self.error = traceback.format_exc()
            try:
                self.engine.recover(exc)
            except Exception:  # the last resort: abort what was in flight; the server keeps serving
                self.error = traceback.format_exc()
                self.engine.abort(None, message="engine step failed: " + self.error.strip().splitlines()[-1])
                self.engine.running.clear()
                self.engine.waiting.clear()
                self.engine._suspects.clear()
                self.engine.kv.reset()

    def _run(self) -> None:
        with K.use_backend(self.backend):
            while not self._stop:
                busy = self.engine.has_work() and not self._paused
                self._drain(block=not busy)
                if self._stop or self._paused or not self.engine.has_work():
                    continue
                self._advance(self.engine.step)
                try:
                    self.profiler.on_step()
                except Exception:  # a trace that cannot be written is lost; serving goes on
                    self.error = traceback.format_exc()
