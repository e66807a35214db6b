"""``rlperf profile run``: start on every worker, drive load, stop, collect, merge, summarize.

Collecting: a worker that reports its trace path (rlperf servers do, in the ``/start_profile`` and
``/stop_profile`` replies) is read from that path when this host sees it, else fetched over HTTP
from the worker's ``GET /profile_trace`` (so remote workers work). A worker that reports no path
(SGLang) is matched to the ``*.trace.json.gz`` files that appeared in ``--output-dir`` during the
run: files that share a profile id (the name before ``-TP-``) are one worker's (SGLang's
``--profile-by-stage`` writes an ``-EXTEND`` and a ``-DECODE`` file), and the ids are given to the
workers in the router's order by time written; if the count of ids is not the count of workers, the
run says so instead of guessing. Without ``--output-dir`` the workers write in their own default
directory (an rlperf server: its ``--profile-root``), and only reported paths can be collected.

A worker lost during the run (killed, crashed: it no longer answers when it is stopped) is named in
the log and in the summary's ``lost_workers``; the traces of the others are still collected, merged
and summarized (and the command exits 1).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import time
from pathlib import Path

from . import control
from .control import ProfileError, StartOptions
from .load import LoadSpec, run_load
from .summary import format_summary, summarize
from .traces import WorkerTrace, load_worker_trace, merge, read_json, to_epoch, write_trace

MERGED_NAME = "rlperf-profile-{run_id}.merged.json.gz"
SUMMARY_NAME = "rlperf-profile-{run_id}.summary.json"
REQUESTS_NAME = "rlperf-profile-{run_id}.requests.jsonl"
LOST_PROBE_TIMEOUT_S = 5.0
"""How long a worker that refused or failed ``/stop_profile`` has to answer ``GET /health`` before it
counts as lost (killed, crashed, unreachable) rather than refusing."""


@dataclasses.dataclass
class RunResult:
    merged_path: Path
    summary_path: Path
    requests_path: Path
    summary: dict
    trace_sources: dict[str, str]
    """Worker URL -> where its trace came from (a local path or ``url/profile_trace``)."""
    lost_workers: dict[str, str] = dataclasses.field(default_factory=dict)
    """Worker URL -> why it was lost during the run (it stopped answering); its trace is missing."""


def _fetch(worker: str, expected: str | None, api_key: str | None, wait_s: float) -> tuple[dict, str]:
    """The worker's last trace over ``GET /profile_trace``; waits up to ``wait_s`` until it is ``expected``
    (the path ``/start_profile`` reported: a ``num_steps`` trace is written when the steps ran out)."""
    url = worker.rstrip("/") + "/profile_trace"
    deadline = time.time() + wait_s
    while True:
        status, payload, headers = control.http(url, api_key=api_key, timeout=300.0)
        got = {k.lower(): v for k, v in headers.items()}.get("x-trace-path")
        if status == 200 and (expected is None or got == expected):
            return json.loads(gzip.decompress(payload) if payload[:2] == b"\x1f\x8b" else payload), url
        if status not in (200, 404) or time.time() > deadline:
            what = f"trace {expected}" if expected else "a trace"
            raise ProfileError(f"{url}: {what} not available (HTTP {status}, last trace {got}: "
                               f"{payload[:300].decode(errors='replace')})")
        time.sleep(0.5)


def _answers(worker: str) -> bool:
    """Whether ``worker`` still answers HTTP (``GET /health``, any status) within a few seconds."""
    try:
        control.http(worker.rstrip("/") + "/health", timeout=LOST_PROBE_TIMEOUT_S)
    except ProfileError:
        return False
    return True


def collect(workers: list[str], starts: list, stops: list, output_dir: str | None, since: float,
            api_key: str | None = None, wait_s: float = 120.0) -> tuple[list[WorkerTrace], dict[str, str]]:
    """The :class:`WorkerTrace` s of every worker, in ``workers`` order (one per file: a worker that
    profiled by stage has two); see the module docstring."""
    reported = {}
    for r in list(starts) + list(stops):
        if r.trace_path:
            reported[r.url] = r.trace_path
    traces, sources = [], {}
    unreported = [w for w in workers if w not in reported]
    groups: list[list[Path]] = []
    if unreported:
        if not output_dir:
            raise ProfileError(f"{', '.join(unreported)} did not report a trace path: pass --output-dir "
                               f"(a directory this host can read) to collect their traces")
        taken = set(reported.values())
        found = sorted((p for p in Path(output_dir).glob("*.trace.json.gz")
                        if p.stat().st_mtime >= since - 1 and str(p) not in taken and not p.name.startswith("merged")),
                       key=lambda p: p.stat().st_mtime)
        # one profile id per worker: SGLang's --profile-by-stage files of one worker share it
        by_id: dict[str, list[Path]] = {}
        for p in found:
            by_id.setdefault(p.name.split("-TP-")[0], []).append(p)
        groups = list(by_id.values())
        if len(groups) != len(unreported):
            raise ProfileError(f"found {len(groups)} new profile ids ({len(found)} trace files) in {output_dir} for "
                               f"{len(unreported)} workers that reported no path ({', '.join(unreported)}); "
                               f"cannot tell which is whose")
    for w in workers:
        if w in reported:
            path = Path(reported[w])
            if path.exists():
                deadline = time.time() + wait_s
                while True:  # a num_steps trace appears when the worker finishes writing it
                    try:
                        doc, src = read_json(path), str(path)
                        break
                    except (OSError, ValueError, EOFError):
                        if time.time() > deadline:
                            raise ProfileError(f"{w}: trace {path} could not be read") from None
                        time.sleep(0.5)
            else:
                doc, src = _fetch(w, reported[w], api_key, wait_s)
            traces.append(to_epoch(doc, w, None, str(path)))
        else:
            files = groups.pop(0)
            traces += [load_worker_trace(p, w) for p in files]
            src = ", ".join(map(str, files))
        sources[w] = src
    return traces, sources


def profile_run(router_url: str, options: StartOptions, spec: LoadSpec, output_dir: str, api_key: str | None = None,
                top_n: int = 10, log=print) -> RunResult:
    """The whole ``rlperf profile run``; ProfileError on any failure (workers are stopped first)."""
    workers = control.list_workers(router_url, api_key)
    log(f"rlperf profile: {len(workers)} workers behind {router_url}: {', '.join(workers)}")
    run_id = time.strftime("%Y%m%d-%H%M%S")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # without --output-dir the workers write where they write by default (an rlperf server: under its
    # --profile-root, which refuses any other directory) and report the path, read here or over HTTP;
    # a path of this host is not theirs to write to
    since = time.time()
    starts = control.start(workers, options, api_key)
    log(f"rlperf profile: profiling on {len(workers)} workers; load: {spec.num_prompts} requests, "
        f"{spec.concurrency} at a time")
    try:
        records, load_start, load_end = run_load(router_url, spec, api_key)
    except BaseException:
        for w in workers:  # do not leave profilers running behind a failed run
            try:
                control.stop([w], api_key)
            except ProfileError:
                pass
        raise
    # each worker is stopped on its own: one that was lost during the load (it no longer answers) is
    # named and left out; the others' traces are still collected, merged and summarized
    stops, lost, refusals = [], {}, []
    for w in workers:
        try:
            stops += control.stop([w], api_key)
        except ProfileError as exc:
            reason = str(exc).splitlines()[0]
            if not _answers(w):
                lost[w] = reason
                log(f"rlperf profile: lost worker {w} during the run ({reason}); its trace is left out")
            elif options.num_steps is not None:  # a worker whose num_steps ran out stopped itself, and refuses
                log(f"rlperf profile: {w} refused /stop_profile, as a worker that stopped by itself after "
                    f"--num-steps does ({reason})")
            else:
                refusals.append(str(exc))
    if refusals:
        raise ProfileError("\n".join(refusals))
    survivors = [w for w in workers if w not in lost]
    if not survivors:
        raise ProfileError(f"every worker was lost during the run: {', '.join(lost)}")
    t_stop = time.time()
    failed = [r for r in records if not r.ok]
    log(f"rlperf profile: {len(records) - len(failed)}/{len(records)} requests succeeded in {load_end - load_start:.2f} s")
    traces, sources = collect(survivors, starts, stops, options.output_dir, since, api_key)
    merged = merge(traces, records, (since, t_stop))
    merged_path = write_trace(merged, out / MERGED_NAME.format(run_id=run_id))
    requests_path = out / REQUESTS_NAME.format(run_id=run_id)
    requests_path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in records))
    summary = summarize(traces, records, top_n)
    summary["merged_trace"] = str(merged_path)
    summary["trace_sources"] = sources
    summary["lost_workers"] = lost
    summary_path = out / SUMMARY_NAME.format(run_id=run_id)
    summary_path.write_text(json.dumps(summary, indent=2))
    log(format_summary(summary))
    log(f"merged trace (open in https://ui.perfetto.dev): {merged_path}")
    return RunResult(merged_path, summary_path, requests_path, summary, sources, lost)
