"""Timing and reporting shared by every rlperf benchmark.

Timing (:func:`cuda_time`): CUDA events around each call, a warm-up first (compilation, autotune
caches, cuBLAS handles stay out), the L2 cache flushed before every timed call by writing a
buffer larger than it (so inputs come from HBM, as they do inside a model), and the median of many
repetitions. Reporting (:class:`BenchRow`): every row carries its anchor measured in the same run
and the ratio ``anchor_ms / kernel_ms`` (> 1 means faster than the anchor), never a lone time.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > L2 of every current datacenter GPU (H100 50 MB, H200 60 MB)


@dataclasses.dataclass
class Timing:
    """Milliseconds per call over ``reps`` timed repetitions."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int


@dataclasses.dataclass
class BenchRow:
    """One benchmark result next to its anchor.

    ``ratio`` = anchor_ms / kernel_ms: 1.0 means as fast as the anchor, 0.5 half as fast.
    ``work`` is FLOPs (``unit='TFLOP/s'``) or bytes (``unit='GB/s'``) per call, for the rate.
    """

    bench: str
    case: str
    kernel: str
    kernel_ms: float
    anchor: str
    anchor_ms: float
    work: float = 0.0
    unit: str = "TFLOP/s"
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.anchor_ms / self.kernel_ms if self.kernel_ms > 0 else float("nan")

    def rate(self, ms: float) -> float:
        if not self.work or ms <= 0:
            return float("nan")
        scale = 1e12 if self.unit == "TFLOP/s" else 1e9
        return self.work / (ms * 1e-3) / scale

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        d["kernel_rate"] = self.rate(self.kernel_ms)
        d["anchor_rate"] = self.rate(self.anchor_ms)
        return d


_flush_buffer: torch.Tensor | None = None


def _flush_l2() -> None:
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    _flush_buffer.zero_()


def cuda_time(fn: Callable[[], object], *, warmup: int = 5, reps: int = 50, flush_l2: bool = True) -> Timing:
    """Time ``fn`` on the current CUDA stream: ``warmup`` untimed calls, then ``reps`` timed ones.

    Each timed call is bracketed by its own pair of CUDA events, after an L2 flush when
    ``flush_l2`` (the flush itself is outside the events).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_time needs a CUDA device; CPU timings are not performance results")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush_l2:
            _flush_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    return Timing(median_ms=statistics.median(times), p20_ms=q[0], p80_ms=q[3], reps=reps)


def git_commit() -> str:
    """The commit being measured: ``RLPERF_COMMIT`` if set, else ``git rev-parse``, else 'unknown'."""
    if os.environ.get("RLPERF_COMMIT"):
        return os.environ["RLPERF_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    """Card, software versions, commit and date: recorded with every result file."""
    import triton

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(card=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info["card"] = "cpu"
    return info


def format_table(rows: list[BenchRow]) -> str:
    """A plain-text table: case, kernel ms, anchor ms, ratio, rates."""
    header = f"{'bench':<10} {'case':<34} {'kernel':<16} {'ms':>9} {'anchor':<16} {'ms':>9} {'ratio':>6} {'rate':>10} {'anchor rate':>11}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.bench:<10} {r.case:<34} {r.kernel:<16} {r.kernel_ms:9.4f} {r.anchor:<16} {r.anchor_ms:9.4f} "
            f"{r.ratio:6.3f} {r.rate(r.kernel_ms):10.1f} {r.rate(r.anchor_ms):11.1f} {r.unit}"
        )
    return "\n".join(lines)


def geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    if not values:
        return float("nan")
    import math

    return math.exp(sum(math.log(v) for v in values) / len(values))


def write_json(path: str | Path, rows: list[BenchRow], info: dict, summary: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": info, "summary": summary, "rows": [r.to_dict() for r in rows]}
    path.write_text(json.dumps(payload, indent=2))
