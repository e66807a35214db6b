"""The engine thread: the one thread that touches the :class:`~rlperf.rollout.engine.Engine`.

Everything else (the HTTP handlers on the asyncio loop) talks to it through a queue of commands
run between steps: ``submit`` (a new request), ``call`` (any function of the engine — abort,
weight loads, flush, profiling — whose result comes back as a ``concurrent.futures.Future``).
Pausing stops the steps but keeps serving commands, so weights can be loaded while paused.

``rlperf.kernels`` picks its backend per thread (``use_backend`` is thread-local), so the thread
enters ``use_backend(backend)`` itself.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import traceback

from rlperf import kernels as K

from .engine import Engine
from .profiler import TraceProfiler


class EngineLoop:
    def __init__(self, engine: Engine, backend: str | None = None):
        self.engine, self.backend = engine, backend
        self.profiler = TraceProfiler()
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

    def set_paused(self, paused: bool) -> concurrent.futures.Future:
        def apply(engine):
            self._paused = paused
        return self.call(apply)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # handed to the caller, who answers with it
                    fut.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        with K.use_backend(self.backend):
            while not self._stop:
                busy = self.engine.has_work() and not self._paused
                self._drain(block=not busy)
                if self._stop or self._paused or not self.engine.has_work():
                    continue
                try:
                    self.engine.step()
                except Exception:  # a failed step aborts what was in flight; the server keeps serving
                    self.error = traceback.format_exc()
                    self.engine.abort(None, message="engine step failed: " + self.error.strip().splitlines()[-1])
                    self.engine.running.clear()
                    self.engine.waiting.clear()
                    self.engine.kv.reset()
                try:
                    self.profiler.on_step()
                except Exception:  # a trace that cannot be written is lost; serving goes on
                    self.error = traceback.format_exc()
