"""Timing and reporting shared by every rlperf benchmark.

Timing (:func:`cuda_time`): CUDA events around each call, a warm-up first (compilation, autotune
caches, cuBLAS handles stay out), the L2 cache flushed before every timed call by writing a
buffer larger than it (so inputs come from HBM, as they do inside a model), and the median of many
repetitions. Reporting (:class:`BenchRow`): every row carries its anchor measured in the same run
and the ratio ``anchor_ms / kernel_ms`` (> 1 means faster than the anchor), never a lone time.

Cases as data (:class:`BenchCase`, :class:`Workload`): a kernel microbenchmark lists its
kernel-anchor pairs with ``cases(quick)`` (names, work, unit, no device memory) and builds their
inputs only when a case's ``setup`` runs. Its ``run(quick)`` times those cases with
:func:`cuda_time` (plus whatever else it reports: graph replays, memory, bit checks), and
``bench/test_microbench.py`` times the same kernel and anchor calls under pytest-benchmark.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
from pathlib import Path
from typing import Callable, Iterable

import torch

from .sglang_anchor import PLUGIN_VARIANT, SGLANG_VARIANTS, plugin_target

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
        return rate(self.work, self.unit, ms)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        d["kernel_rate"] = self.rate(self.kernel_ms)
        d["anchor_rate"] = self.rate(self.anchor_ms)
        return d


def rate(work: float, unit: str, ms: float) -> float:
    """``work`` (FLOPs for ``unit='TFLOP/s'``, else bytes for GB/s) done in ``ms`` milliseconds."""
    if not work or ms <= 0:
        return float("nan")
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    return work / (ms * 1e-3) / scale


@dataclasses.dataclass
class Workload:
    """The device inputs of one or more benchmark cases, built once, as named calls.

    ``calls`` maps a kernel or anchor name to a zero-argument call on inputs already built (it may
    hold more calls than the cases time: checks use them). ``unavailable`` maps a name to why it
    cannot run on this machine (an SDPA backend or a third-party package missing): its rows are
    left out and its pytest case skips. ``fallible`` names third-party or tuning calls that may fail
    on this stack (a config that does not fit shared memory): a failure moves them to
    ``unavailable`` instead of stopping the benchmark. ``info`` holds what the build found out,
    per name, for the rows' ``extra``.
    """

    calls: dict[str, Callable[[], object]]
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)
    fallible: set[str] = dataclasses.field(default_factory=set)
    info: dict[str, dict] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One kernel-anchor pair of a benchmark, as data: names and work now, device inputs on demand.

    ``setup()`` builds the inputs on the device and returns the :class:`Workload` whose calls named
    ``kernel`` and ``anchor`` are timed. Cases that time calls on the same inputs share one
    ``setup`` object (:func:`by_workload` builds it once for all of them); nothing touches the
    device before ``setup`` runs, so listing cases costs nothing (CPU tests, pytest collection).
    ``case`` is the workload as :class:`BenchRow` shows it; :attr:`name` is unique in a benchmark.
    ``params`` (shape, phase, ...) go into the row's ``extra``.
    """

    bench: str
    case: str
    kernel: str
    anchor: str
    setup: Callable[[], Workload] = dataclasses.field(repr=False, compare=False)
    work: float = 0.0
    unit: str = "TFLOP/s"
    flush_l2: bool = True
    params: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        return f"{self.case}: {self.kernel} vs {self.anchor}"

    def test_id(self, side: str) -> str:
        """The pytest-benchmark test id of one side ('kernel' or 'anchor') of this case."""
        return f"{self.bench}:{self.name}:{side}"

    def row(self, kernel_ms: float, anchor_ms: float, *, kernel: str | None = None, anchor: str | None = None,
            **extra) -> BenchRow:
        """This case's :class:`BenchRow` (``kernel``/``anchor`` rename a side, e.g. a graph replay of it)."""
        return BenchRow(self.bench, self.case, kernel or self.kernel, kernel_ms, anchor or self.anchor, anchor_ms,
                        self.work, self.unit, {**self.params, **extra})


def by_workload(cases: Iterable[BenchCase]) -> list[tuple[Callable[[], Workload], list[BenchCase]]]:
    """``cases`` grouped by their shared ``setup``, in order of first appearance."""
    groups: dict[int, tuple[Callable[[], Workload], list[BenchCase]]] = {}
    for c in cases:
        groups.setdefault(id(c.setup), (c.setup, []))[1].append(c)
    return list(groups.values())


def call_names(cases: Iterable[BenchCase]) -> list[str]:
    """The kernel and anchor names of ``cases``, each once, in order."""
    return list(dict.fromkeys(n for c in cases for n in (c.kernel, c.anchor)))


def time_calls(workload: Workload, names: Iterable[str], timer: Callable[[Callable], Timing],
               bench: str = "bench") -> dict[str, Timing]:
    """``timer`` of each named call, once per name (rows that share a call share its timing).

    A name in ``workload.unavailable`` is left out; a ``fallible`` one that raises joins it. Each
    left-out name is printed once, with its reason.
    """
    times = {}
    for name in names:
        if name not in workload.unavailable:
            try:
                times[name] = timer(workload.calls[name])
                continue
            except Exception as exc:
                if name not in workload.fallible:
                    raise
                first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
                workload.unavailable[name] = f"{type(exc).__name__}: {first_line}"
        print(f"{bench}: {name} left out: {workload.unavailable[name]}")
    return times


_flush_buffer: torch.Tensor | None = None


def flush_l2_cache() -> None:
    """Write a buffer larger than any current GPU's L2, so the next call reads its inputs from HBM."""
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
            flush_l2_cache()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    return Timing(median_ms=statistics.median(times), p20_ms=q[0], p80_ms=q[3], reps=reps)


LAUNCH_APIS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cuLaunchKernel", "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch",
})
"""Host API calls that start GPU work: a kernel launch (runtime or driver API: Triton launches through
the driver) or a CUDA-graph replay (one call, however many kernels the graph holds)."""


@dataclasses.dataclass(frozen=True)
class LaunchCount:
    """What one call of a step put on the GPU, from a torch profiler trace.

    ``kernels``: kernels the GPU ran (graph replays counted kernel by kernel; copies and memsets
    left out); ``launch_calls``: host calls of :data:`LAUNCH_APIS` (a graph replay is one). Eager
    code launches every kernel itself (``launch_calls`` ~ ``kernels``); a graphed step ends up with
    ``launch_calls`` << ``kernels``: the host cost a step pays is ``launch_calls``.
    """

    kernels: int
    launch_calls: int

    def __str__(self) -> str:
        return f"{self.kernels} kernels / {self.launch_calls} launch calls"


def _api_name(name: str) -> str:
    """``cudaLaunchKernel_v7000`` / ``cudaLaunchKernel_ptsz`` -> ``cudaLaunchKernel``: CUPTI's
    callback names carry an API version or a per-thread-stream suffix on some releases."""
    return re.sub(r"(_v\d+)?(_ptsz|_ptds)?$", "", name)


def count_launches(events: Iterable) -> LaunchCount:
    """Reduce profiler events (``torch.profiler.profile(...).events()``: objects with ``name`` and
    ``device_type``) to a :class:`LaunchCount`. A GPU event (``device_type`` CUDA) is a kernel unless
    it is a copy or a memset (``Memcpy ...``, ``Memset ...``); a host event counts as a launch call
    when its name, version suffix stripped, is in :data:`LAUNCH_APIS`."""
    kernels = calls = 0
    for e in events:
        name = str(e.name)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += not name.startswith(("Memcpy", "Memset"))
        elif _api_name(name) in LAUNCH_APIS:
            calls += 1
    return LaunchCount(kernels, calls)


def measure_launches(fn: Callable[[], object], *, warmup: int = 1) -> LaunchCount | None:
    """:class:`LaunchCount` of one call of ``fn`` after ``warmup`` untimed calls (compilation, graph
    capture and allocator growth stay out), under ``torch.profiler`` with CPU and CUDA activities.
    None without CUDA (there is nothing to count), or when the profiler itself raises (printed: a
    benchmark keeps its timed rows); :func:`format_launches` prints ``n/a`` for both."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return count_launches(prof.events())
    except RuntimeError as exc:  # CUPTI unavailable or refused: the launches stay unmeasured, never guessed
        print(f"launch count: the profiler failed ({exc}); reported as n/a")
        return None


def format_launches(count: LaunchCount | None) -> str:
    """``"325 kernels / 1 launch calls"``, or ``"n/a (...)"`` for :func:`measure_launches`' None."""
    if count is None:
        return "n/a (no CUDA)" if not torch.cuda.is_available() else "n/a (the profiler failed)"
    return str(count)


def launch_fields(prefix: str, count: LaunchCount | None) -> dict:
    """``{prefix}_kernels`` and ``{prefix}_launch_calls`` for a row's ``extra`` or a summary;
    ``"n/a"`` for both without CUDA (never a number that was not measured)."""
    if count is None:
        return {f"{prefix}_kernels": "n/a", f"{prefix}_launch_calls": "n/a"}
    return {f"{prefix}_kernels": count.kernels, f"{prefix}_launch_calls": count.launch_calls}


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
    """Card, software versions, commit and date, and whether the kernels launch with programmatic
    dependent launch (``programmatic_launch``: switched on and an SM 90+ GPU) and whether it was
    switched off (``programmatic_launch_off``: ``RLPERF_PDL=0``): recorded with every result file."""
    import triton

    from rlperf.kernels.pipeline import programmatic_launch, programmatic_launch_switched_on

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
    info["programmatic_launch"] = programmatic_launch(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    info["programmatic_launch_off"] = not programmatic_launch_switched_on()
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


def tile_candidates(*tiles: tuple[int, int, int, int, int]) -> dict[str, tuple[int, int, int, int, int]]:
    """A tile sweep's candidates by name: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` ->
    ``"m{BLOCK_M}n{BLOCK_N}k{BLOCK_K}w{num_warps}s{num_stages}"``, in the order given."""
    return {"m{}n{}k{}w{}s{}".format(*t): t for t in tiles}


def sweep_candidate(fn: Callable[[], torch.Tensor], base: torch.Tensor,
                    gpu_ms: Callable[[Callable[[], object]], float]) -> tuple[float | str, bool | None]:
    """One tuning candidate of a sweep tool: ``(gpu_ms(fn), whether fn() gives base's bits)``, or
    ``("failed: Error: message", None)`` when the candidate does not compile or launch on this GPU
    (shared memory, registers): the sweep goes on to the next one."""
    try:
        same = torch.equal(fn(), base)
        return gpu_ms(fn), same
    except Exception as e:
        return f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}", None


def write_sweep_json(path: str | Path | None, rows: list[dict]) -> None:
    """A sweep tool's ``--json``: this machine's environment and the rows (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)


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


def ratio_target(row: dict) -> float | None:
    """The target a result row's ``ratio`` (anchor ms / kernel ms) is held to, or None where the row has
    none (or its target is not a ratio: the sync's 50 ms). ``row``: a row of the JSON file
    (:meth:`BenchRow.to_dict`). The targets are those each benchmark's docstring and BENCHMARKS.md state;
    ``rlperf plot`` draws them next to the bars."""
    bench, kernel, anchor, extra = row.get("bench"), row.get("kernel"), row.get("anchor"), row.get("extra") or {}
    if bench == "matmul" and "M" in extra:  # >= 0.90x cuBLAS at M >= 1024, >= 0.75x at M <= 64
        return 0.90 if extra["M"] >= 1024 else 0.75 if extra["M"] <= 64 else None
    if bench == "attention":  # prefill >= 0.75x cuDNN SDPA; decode no slower than SDPA flash decode
        phase, backend = extra.get("phase"), extra.get("anchor_backend")
        if phase == "prefill" and backend == "cudnn":
            return 0.75
        if phase == "decode" and backend == "flash":
            return 1.0
        return None
    if bench == "layers" and kernel == "invariant":  # invariant mode <= 15% over the fast path
        return 1 / 1.15
    if bench == "flatten" and kernel in ("flatten_buckets", "load_into") and anchor == "d2d copy":
        return 0.90  # >= 0.90x one device copy's bandwidth
    if bench == "logprob" and kernel == "fused_logprob fwd" and anchor == "lm-head matmul":
        return 1 / 1.10  # forward <= 1.10x the lm-head matmul
    if bench == "rollout" and anchor == "memory floor":  # decode step <= 2.5x the floor at B=64, <= 2.0x at B=256
        case = str(row.get("case", ""))
        return 1 / 2.5 if case.startswith("decode B=64 ") else 1 / 2.0 if case.startswith("decode B=256 ") else None
    if bench == "rollout" and kernel == SGLANG_VARIANTS[PLUGIN_VARIANT].label:  # SGLang + rlperf's plugin: decode
        case = str(row.get("case", ""))  # >= 1.0x SGLang deterministic (flashinfer), >= 0.9x its fast mode at B <= 64
        if case.startswith("decode B="):
            return plugin_target(str(anchor), int(case.split()[1].removeprefix("B=")))
        return None
    if bench == "sync-distributed":  # the NCCL broadcast sync >= 0.7x one broadcast of the bytes
        return 0.7
    return None
