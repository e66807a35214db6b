"""The summary of a profile: where the time went, and what the load got.

* **top kernels**: events of category ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` summed by name
  over every worker (GPU time; concurrent streams add up). A CPU-only trace has none, so it ranks
  ``cpu_op`` events by *self* time instead (an op's duration minus its children's on the same
  thread: ``aten::linear`` would otherwise count its ``aten::matmul`` twice).
* **prefill vs decode**: the time inside ``record_function`` ranges (``user_annotation``) named
  prefill/extend or decode, or, for SGLang's ``--profile-by-stage`` files, the GPU (else CPU) busy
  time of each stage's file. ``None`` when the traces carry neither.
* **requests** (when a request log is known: ``rlperf profile run``, or a merged trace, which holds
  one slice per request): count, request/s and output tokens/s over the load's wall time
  (first send to last reply), latency percentiles, and tokens/s of the longest sample (most
  completion tokens; its completion tokens / its latency).
"""
from __future__ import annotations

import re

from .traces import WorkerTrace

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
PREFILL = re.compile(r"(^|[^a-z])(prefill|extend)", re.IGNORECASE)
DECODE = re.compile(r"(^|[^a-z])decode", re.IGNORECASE)


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = q / 100.0 * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _self_times(events: list[dict]) -> list[tuple[str, float]]:
    """(name, self µs) of complete events, per thread, children subtracted from their parent."""
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []  # [end, name, self]
        for e in evs:
            ts, dur = e["ts"], float(e.get("dur", 0))
            while stack and stack[-1][0] <= ts:
                _, name, self_us = stack.pop()
                out.append((name, self_us))
            if stack:
                stack[-1][2] -= min(dur, stack[-1][0] - ts)
            stack.append([ts + dur, e.get("name", "?"), dur])
        out.extend((name, self_us) for _, name, self_us in stack)
    return out


def _complete(events, cats) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in cats and "ts" in e]


def top_ops(workers: list[WorkerTrace], top_n: int = 10) -> tuple[str, list[dict]]:
    """("gpu", kernels) when any trace has GPU kernels, else ("cpu", cpu ops by self time)."""
    kernels = [e for w in workers for e in _complete(w.events, GPU_CATS)]
    if kernels:
        kind, pairs = "gpu", [(e.get("name", "?"), float(e.get("dur", 0))) for e in kernels]
    else:
        kind, pairs = "cpu", [p for w in workers for p in _self_times(_complete(w.events, ("cpu_op",)))]
    total = sum(d for _, d in pairs) or 1.0
    agg: dict[str, list] = {}
    for name, d in pairs:
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += d
    rows = [{"name": n, "count": c, "total_ms": t / 1e3, "avg_us": t / c, "percent": 100.0 * t / total}
            for n, (c, t) in agg.items()]
    rows.sort(key=lambda r: -r["total_ms"])
    return kind, rows[:top_n]


def stage_times(workers: list[WorkerTrace]) -> dict | None:
    """{"prefill": {"count", "total_ms"}, "decode": {...}, "source": ...} or None if not annotated."""
    out = {"prefill": {"count": 0, "total_ms": 0.0}, "decode": {"count": 0, "total_ms": 0.0}}
    source = None
    for w in workers:
        if w.stage:
            busy = _complete(w.events, GPU_CATS) or [e for e in _complete(w.events, ("cpu_op",))]
            ms = sum(d for _, d in _self_times(busy)) / 1e3
            out[w.stage]["count"] += 1
            out[w.stage]["total_ms"] += ms
            source = "per-stage trace files (busy time)"
            continue
        for e in _complete(w.events, ("user_annotation", "gpu_user_annotation")):
            name = str(e.get("name", ""))
            stage = "decode" if DECODE.search(name) else "prefill" if PREFILL.search(name) else None
            if stage and str(e.get("cat")).lower() == "user_annotation":  # the GPU copy would count it twice
                out[stage]["count"] += 1
                out[stage]["total_ms"] += float(e.get("dur", 0)) / 1e3
                source = source or "record_function ranges (wall time)"
    if source is None:
        return None
    out["source"] = source
    return out


def request_stats(requests) -> dict | None:
    """Load statistics from RequestRecords or the merged trace's request slices."""
    rows = []
    for r in requests:
        if isinstance(r, dict):  # a request slice of a merged trace: ts/dur in µs
            a = r.get("args", {})
            rows.append((r["ts"] / 1e6, (r["ts"] + r.get("dur", 0)) / 1e6, a.get("prompt_tokens", 0),
                         a.get("completion_tokens", 0), bool(a.get("ok", True))))
        else:
            rows.append((r.start, r.end, r.prompt_tokens, r.completion_tokens, r.ok))
    if not rows:
        return None
    ok = [x for x in rows if x[4]]
    wall = max(x[1] for x in rows) - min(x[0] for x in rows)
    out = {"requests": len(rows), "succeeded": len(ok), "failed": len(rows) - len(ok), "wall_s": wall,
           "input_tokens": sum(x[2] for x in ok), "output_tokens": sum(x[3] for x in ok)}
    out["requests_per_s"] = len(ok) / wall if wall > 0 else None
    out["output_tokens_per_s"] = out["output_tokens"] / wall if wall > 0 else None
    if ok:
        lat = sorted(x[1] - x[0] for x in ok)
        out["latency_ms"] = {f"p{q}": 1e3 * _percentile(lat, q) for q in (50, 90, 99)}
        out["latency_ms"]["max"] = 1e3 * lat[-1]
        longest = max(ok, key=lambda x: (x[3], -(x[1] - x[0])))
        dt = longest[1] - longest[0]
        out["longest_sample"] = {"completion_tokens": longest[3], "latency_ms": 1e3 * dt,
                                 "tokens_per_s": longest[3] / dt if dt > 0 else None}
    return out


def per_worker(workers: list[WorkerTrace], kind: str) -> list[dict]:
    """Each trace's total of the ranked time (GPU kernel time, or CPU op self time): imbalance shows here;
    and its own prefill and decode time (:func:`stage_times` of that trace alone; None when it has neither)."""
    out = []
    for w in workers:
        if kind == "gpu":
            times = [float(e.get("dur", 0)) for e in _complete(w.events, GPU_CATS)]
        else:
            times = [d for _, d in _self_times(_complete(w.events, ("cpu_op",)))]
        stages = stage_times([w])
        out.append({"name": w.name, "stage": w.stage, "events": len(times), "total_ms": sum(times) / 1e3,
                    "prefill_ms": stages["prefill"]["total_ms"] if stages else None,
                    "decode_ms": stages["decode"]["total_ms"] if stages else None})
    return out


def summarize(workers: list[WorkerTrace], requests=(), top_n: int = 10) -> dict:
    kind, rows = top_ops(workers, top_n)
    return {"workers": [w.name for w in workers], "top_kind": kind, "top": rows,
            "per_worker": per_worker(workers, kind), "stages": stage_times(workers), "load": request_stats(requests)}


def format_summary(s: dict) -> str:
    """The summary as the text ``rlperf profile`` prints."""
    lines = [f"traces: {len(s['workers'])} ({', '.join(s['workers'])})"]
    for url, why in (s.get("lost_workers") or {}).items():
        lines.append(f"lost worker (no trace): {url}: {why}")
    what = "GPU kernels by GPU time" if s["top_kind"] == "gpu" else "CPU ops by self time (no GPU kernels in the traces)"
    lines.append(f"top {len(s['top'])} {what}:")
    lines.append(f"  {'total ms':>10} {'%':>6} {'count':>7} {'avg us':>9}  name")
    for r in s["top"]:
        lines.append(f"  {r['total_ms']:10.3f} {r['percent']:6.1f} {r['count']:7d} {r['avg_us']:9.1f}  {r['name'][:100]}")
    unit = "GPU kernel time" if s["top_kind"] == "gpu" else "CPU op self time"
    for w in s["per_worker"]:
        stage = f" [{w['stage']}]" if w["stage"] else ""
        lines.append(f"  {w['name']}{stage}: {w['total_ms']:.3f} ms {unit} in {w['events']} events")
    st = s["stages"]
    if st is None:
        lines.append("prefill vs decode: not annotated in these traces (no prefill/extend/decode ranges or stage files)")
    else:
        p, d = st["prefill"]["total_ms"], st["decode"]["total_ms"]
        share = f" (prefill {100 * p / (p + d):.1f}%)" if p + d > 0 else ""
        lines.append(f"prefill vs decode [{st['source']}]: prefill {p:.3f} ms in {st['prefill']['count']}, "
                     f"decode {d:.3f} ms in {st['decode']['count']}{share}")
    ld = s["load"]
    if ld is None:
        lines.append("requests: no request log in these traces")
    else:
        def f(x, spec=".2f"):
            return "n/a" if x is None else format(x, spec)
        lines.append(f"requests: {ld['succeeded']}/{ld['requests']} succeeded in {ld['wall_s']:.3f} s: "
                     f"{f(ld['requests_per_s'])} req/s, {f(ld['output_tokens_per_s'], '.1f')} output tok/s "
                     f"({ld['input_tokens']} input, {ld['output_tokens']} output tokens)")
        if "latency_ms" in ld:
            lat = ld["latency_ms"]
            lines.append(f"latency ms: p50 {lat['p50']:.1f}  p90 {lat['p90']:.1f}  p99 {lat['p99']:.1f}  max {lat['max']:.1f}")
            ls = ld["longest_sample"]
            lines.append(f"longest sample: {ls['completion_tokens']} tokens in {ls['latency_ms']:.1f} ms = "
                         f"{f(ls['tokens_per_s'], '.1f')} tok/s")
    return "\n".join(lines)


def write_phase_png(s: dict, path) -> None:
    """Per-worker phase bars of a summary (:func:`summarize`): for each trace, its ranked busy time (GPU
    kernel time, or CPU op self time) and, stacked on a bar of their own, its prefill and decode time
    (where annotated). A worker whose bars are shorter than the others' is idle while they work."""
    from rlperf.plots import new_figure, save_png

    rows = s["per_worker"]
    unit = "GPU kernel time" if s["top_kind"] == "gpu" else "CPU op self time"
    fig = new_figure(8, 1.2 + 0.6 * len(rows))
    ax = fig.add_subplot(1, 1, 1)
    for i, w in enumerate(rows):
        ax.barh(i - 0.2, w["total_ms"], height=0.36, color="C0", label=unit if i == 0 else None)
        prefill, decode = w.get("prefill_ms"), w.get("decode_ms")
        if prefill is not None:
            ax.barh(i + 0.2, prefill, height=0.36, color="C1", label="prefill" if i == 0 else None)
            ax.barh(i + 0.2, decode, left=prefill, height=0.36, color="C2", label="decode" if i == 0 else None)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([w["name"] + (f" [{w['stage']}]" if w.get("stage") else "") for w in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"per worker: {unit}; prefill and decode", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    if rows:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    save_png(fig, path)
