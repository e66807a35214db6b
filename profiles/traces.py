"""Chrome-trace files in, one Perfetto-loadable trace out.

A worker's trace is torch.profiler's Chrome JSON (``{"traceEvents": [...], "baseTimeNanoseconds":
...}``), gzip-compressed as SGLang writes it (``*.trace.json.gz``) or plain. Kineto's ``ts`` values
are microseconds relative to ``baseTimeNanoseconds`` (the epoch, in ns), so ``ts +
baseTimeNanoseconds / 1000`` puts every worker and the load generator (``time.time()``) on one
clock. :func:`merge` writes one trace where each worker is one process (named by its URL, sorted in
worker order) whose threads are the worker's own CPU threads and GPU streams, plus a
``load generator`` process with one slice per request.

The merged trace stores every timestamp relative to its first event (and that origin in its own
``baseTimeNanoseconds``): epoch microseconds as doubles would lose sub-microsecond precision.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

LOAD_PROCESS = "load generator"
REQUEST_CAT = "request"
WINDOW_NAME = "profile window"
FLOW_ID_STRIDE = 1 << 40
STAGE_IN_NAME = re.compile(r"-(EXTEND|PREFILL|DECODE)(?=[-.])", re.IGNORECASE)
"""SGLang's ``--profile-by-stage`` writes one trace per stage, the stage in the file name."""


@dataclasses.dataclass
class WorkerTrace:
    """One worker's events on the epoch clock (``ts`` in epoch microseconds)."""

    name: str
    events: list[dict]
    stage: str | None = None
    """``prefill`` or ``decode`` when the whole file is one stage (SGLang ``--profile-by-stage``)."""
    source: str | None = None


def read_json(path: str | Path) -> dict | list:
    """A Chrome trace file, gzip-compressed or not (sniffed from the magic bytes, not the name)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def stage_of(path: str | Path) -> str | None:
    m = STAGE_IN_NAME.search(Path(path).name)
    if not m:
        return None
    return "decode" if m.group(1).upper() == "DECODE" else "prefill"


def to_epoch(doc: dict | list, name: str, stage: str | None = None, source: str | None = None) -> WorkerTrace:
    """Events of one torch/SGLang trace with ``ts`` moved onto the epoch clock (µs)."""
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else list(doc)
    base_us = (doc.get("baseTimeNanoseconds", 0) if isinstance(doc, dict) else 0) / 1000.0
    out = []
    for e in events:
        if not isinstance(e, dict):
            continue
        e = dict(e)
        if "ts" in e and e.get("ph") != "M":
            e["ts"] = float(e["ts"]) + base_us
        out.append(e)
    return WorkerTrace(name, out, stage, source)


def load_worker_trace(path: str | Path, name: str | None = None) -> WorkerTrace:
    return to_epoch(read_json(path), name or Path(path).name, stage_of(path), str(path))


def _flow_id(pid: int, fid):
    """Flow ids are unique per file only: give each worker its own range (numbers stay numbers,
    which every JSON importer takes; kineto's ids are small integers)."""
    try:
        return pid * FLOW_ID_STRIDE + int(fid)
    except (TypeError, ValueError):
        return f"{pid}:{fid}"


def _meta(pid: int, tid: int, kind: str, args: dict) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "ts": 0, "args": args}


def merge(workers: list[WorkerTrace], requests=(), window: tuple[float, float] | None = None) -> dict:
    """One Chrome trace: a process per worker (in the given order), then the load generator.

    ``requests`` are :class:`~rlperf.profiles.load.RequestRecord` s; ``window`` the (start, end) wall
    seconds of the profile, drawn on the load generator's track.
    """
    stamps = [e["ts"] for w in workers for e in w.events if "ts" in e and e.get("ph") != "M"]
    stamps += [r.start * 1e6 for r in requests] + ([window[0] * 1e6] if window else [])
    origin_us = int(min(stamps)) if stamps else 0
    out: list[dict] = []
    for i, w in enumerate(workers):
        pid = i + 1
        out.append(_meta(pid, 0, "process_name", {"name": f"{w.name} [{w.stage}]" if w.stage else w.name}))
        out.append(_meta(pid, 0, "process_sort_index", {"sort_index": pid}))
        labels = [s for s in (w.stage, w.source and Path(w.source).name) if s]
        if labels:
            out.append(_meta(pid, 0, "process_labels", {"labels": ", ".join(labels)}))
        proc_label, thread_name, tids = {}, {}, {}
        for e in w.events:  # the original track names, to name the merged threads after them
            if e.get("ph") == "M":
                key = (e.get("pid"), e.get("tid"))
                if e.get("name") == "process_labels":
                    proc_label[e.get("pid")] = e.get("args", {}).get("labels")
                elif e.get("name") == "process_name" and e.get("pid") not in proc_label:
                    proc_label[e.get("pid")] = e.get("args", {}).get("name")
                elif e.get("name") == "thread_name":
                    thread_name[key] = e.get("args", {}).get("name")

        def tid_of(p, t):
            if (p, t) not in tids:
                tids[(p, t)] = len(tids) + 1
            return tids[(p, t)]

        for e in w.events:
            if e.get("ph") == "M":
                continue
            e = dict(e)
            p, t = e.get("pid", 0), e.get("tid", 0)
            e["pid"], e["tid"] = pid, tid_of(p, t)
            if "ts" in e:
                e["ts"] = e["ts"] - origin_us
            if e.get("ph") in ("s", "t", "f") and "id" in e:
                e["id"] = _flow_id(pid, e["id"])
            out.append(e)
        for (p, t), new in sorted(tids.items(), key=lambda kv: kv[1]):
            label = proc_label.get(p) or f"pid {p}"
            out.append(_meta(pid, new, "thread_name", {"name": f"{label} / {thread_name.get((p, t)) or f'tid {t}'}"}))
            out.append(_meta(pid, new, "thread_sort_index", {"sort_index": new}))
    if requests or window:
        pid = len(workers) + 1
        out.append(_meta(pid, 0, "process_name", {"name": LOAD_PROCESS}))
        out.append(_meta(pid, 0, "process_sort_index", {"sort_index": pid}))
        out.append(_meta(pid, 0, "thread_name", {"name": WINDOW_NAME}))
        if window:
            out.append({"ph": "X", "cat": "profile", "name": WINDOW_NAME, "pid": pid, "tid": 0,
                        "ts": window[0] * 1e6 - origin_us, "dur": (window[1] - window[0]) * 1e6})
        lanes: list[float] = []  # greedy lanes so concurrent requests do not overlap on one track
        for r in sorted(requests, key=lambda r: (r.start, r.index)):
            lane = next((k for k, end in enumerate(lanes) if end <= r.start), len(lanes))
            if lane == len(lanes):
                lanes.append(0.0)
                out.append(_meta(pid, lane + 1, "thread_name", {"name": f"requests {lane + 1}"}))
            lanes[lane] = r.end
            out.append({"ph": "X", "cat": REQUEST_CAT, "name": f"request {r.index}", "pid": pid, "tid": lane + 1,
                        "ts": r.start * 1e6 - origin_us, "dur": max(r.end - r.start, 0.0) * 1e6,
                        "args": {"index": r.index, "prompt_tokens": r.prompt_tokens,
                                 "completion_tokens": r.completion_tokens, "ok": r.ok, "error": r.error}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "baseTimeNanoseconds": origin_us * 1000,
            "otherData": {"producer": "rlperf profile", "workers": [w.name for w in workers]}}


def write_trace(doc: dict, path: str | Path) -> Path:
    """Write gzip-compressed JSON when the name ends in ``.gz`` (Perfetto opens both)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(data, compresslevel=6) if path.suffix == ".gz" else data)
    return path


def split_merged(doc: dict) -> tuple[list[WorkerTrace], list[dict]]:
    """Undo :func:`merge` for summarizing: (worker traces, request slices); epoch µs again."""
    base_us = doc.get("baseTimeNanoseconds", 0) / 1000.0
    names, stages = {}, {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "process_labels":
            first = str(e["args"].get("labels", "")).split(",")[0].strip()
            stages[e["pid"]] = first if first in ("prefill", "decode") else None
    by_pid: dict[int, list[dict]] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "M":
            continue
        e = dict(e)
        if "ts" in e:
            e["ts"] = e["ts"] + base_us
        by_pid.setdefault(e.get("pid"), []).append(e)
    workers, requests = [], []
    for pid in sorted(names):
        if stages.get(pid) and names[pid].endswith(f" [{stages[pid]}]"):
            names[pid] = names[pid][: -len(stages[pid]) - 3]
        if names[pid] == LOAD_PROCESS:
            requests = [e for e in by_pid.get(pid, []) if e.get("cat") == REQUEST_CAT]
        else:
            workers.append(WorkerTrace(names[pid], by_pid.get(pid, []), stages.get(pid)))
    return workers, requests


def is_merged(doc) -> bool:
    return isinstance(doc, dict) and (doc.get("otherData") or {}).get("producer") == "rlperf profile"
