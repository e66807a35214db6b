"""torch.profiler plumbing of the rollout server (``/start_profile``, ``/stop_profile``).

Traces are written as SGLang names them, ``{output_dir}/{profile_id}-TP-{rank}.trace.json.gz``
(``profile_id`` = the start time in seconds, as SGLang uses), so slime's and rlperf's profile tools
find them. The profiler runs on the engine thread: it is started and stopped between engine steps,
and with ``num_steps`` it stops itself after that many steps.
"""
from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

TRACE_NAME = "{profile_id}-TP-{rank}.trace.json.gz"
DEFAULT_OUTPUT_DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"
ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA,
              "CUDA": torch.profiler.ProfilerActivity.CUDA}


class TraceProfiler:
    """At most one torch.profiler session at a time; ``rank`` is the tensor-parallel rank (0 here)."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self._prof = None
        self._path: Path | None = None
        self._steps_left: int | None = None
        self.last_trace: Path | None = None

    def start(self, output_dir: str | None = None, num_steps: int | None = None, activities=None,
              with_stack: bool = False, record_shapes: bool = False, profile_id: str | None = None) -> Path:
        """Start profiling; returns the trace path that :meth:`stop` will write. ValueError on bad input."""
        if self._prof is not None:
            raise ValueError("a profile is already running; POST /stop_profile first")
        names = activities or (["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"])
        unknown = [a for a in names if a not in ACTIVITIES]
        if unknown:
            raise ValueError(f"unknown profiler activities {unknown}; choose from {sorted(ACTIVITIES)}")
        acts = sorted({ACTIVITIES[a] for a in names if ACTIVITIES[a] != torch.profiler.ProfilerActivity.CUDA
                       or torch.cuda.is_available()}, key=str)
        if num_steps is not None and num_steps <= 0:
            raise ValueError(f"num_steps must be positive, got {num_steps}")
        out = Path(output_dir or os.environ.get(DEFAULT_OUTPUT_DIR_ENV) or tempfile.gettempdir())
        out.mkdir(parents=True, exist_ok=True)
        pid = profile_id or str(time.time())
        self._path = out / TRACE_NAME.format(profile_id=pid, rank=self.rank)
        self._prof = torch.profiler.profile(activities=acts, with_stack=with_stack, record_shapes=record_shapes)
        self._prof.__enter__()
        self._steps_left = num_steps
        return self._path

    def on_step(self) -> Path | None:
        """Called after every engine step; stops and writes the trace once ``num_steps`` steps ran."""
        if self._prof is None or self._steps_left is None:
            return None
        self._steps_left -= 1
        return self.stop() if self._steps_left <= 0 else None

    def stop(self) -> Path:
        """Stop and write the gzip-compressed Chrome trace; ValueError when nothing is running."""
        if self._prof is None:
            raise ValueError("no profile is running; POST /start_profile first")
        prof, path = self._prof, self._path
        self._prof = self._path = self._steps_left = None
        prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
        self.last_trace = path
        return path
