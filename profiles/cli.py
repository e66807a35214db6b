"""``rlperf profile`` arguments and handler (``rlperf.cli`` wires them in).

* ``rlperf profile --router-url URL --action start|stop [options]``: slime's ``profile_rollout.py``.
* ``rlperf profile run --router-url URL [options] [load options]``: start, load, stop, collect, merge, summarize.
* ``rlperf profile summarize TRACE...``: the summary of existing traces (worker traces, SGLang's
  ``*.trace.json.gz``, or a merged ``rlperf profile run`` trace, whose request slices give the load numbers).

Exit codes: 0 done, 1 a router/worker failed or refused (the message says which; a ``run`` that lost
a worker still writes the merged trace and summary of the others), 2 bad usage (flags, ``--dataset``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from rlperf import flags
from rlperf.rollout.args import API_KEY_ENV

from .control import ACTIVITIES

ROUTER_URL_EXAMPLE = "http://127.0.0.1:30080"
"""Where ``rlperf serve --router N`` puts the router by default (its ``--router-port``); a plain
``rlperf serve`` has no router: its server's port (30000) answers ``/generate``, not ``GET /workers``."""

USAGE = ("%(prog)s --router-url URL --action {start,stop} [options]\n"
         "       %(prog)s run --router-url URL [options] [load options]\n"
         "       %(prog)s summarize TRACE [TRACE ...] [--top-n N] [--json FILE]")
"""The three forms; the mode (``run``, ``summarize``) is optional: without one, ``--action`` says what to do."""


def _add_target(p: argparse.ArgumentParser, required_url: bool) -> None:
    p.add_argument("--router-url", type=flags.http_url, required=required_url, help=f"the sglang-router's URL, e.g. {ROUTER_URL_EXAMPLE} "
                        "(where rlperf serve --router N puts it by default)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="Bearer key of the router and the workers' admin endpoints (rlperf serve --api-key; default: "
                        f"the {API_KEY_ENV} environment variable, which, unlike this flag, ps does not show)")
    p.add_argument("--output-dir", default=None,
                   help="where the workers write their traces (a path on each worker's host; SGLang's default: "
                        "$SGLANG_TORCH_PROFILER_DIR); run mode also writes the merged trace, summary and request log "
                        "here (default ./rlperf-profile)")
    p.add_argument("--num-steps", type=flags.positive_int, default=None, help="each worker stops by itself after this many engine steps")
    p.add_argument("--activities", nargs="+", choices=ACTIVITIES, default=None,
                   help="what to record (default: the worker's choice: CPU, and GPU when it has one)")
    p.add_argument("--profile-by-stage", action="store_true", help="SGLang: one trace per stage (prefill, decode)")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks")
    p.add_argument("--record-shapes", action="store_true", help="record input shapes of ops")


PNG_HELP = ("draw per-worker phase bars (busy time; prefill and decode) into this PNG (needs matplotlib: "
            "pip install 'rlperf[plot]')")


def add_profile_command_arguments(p: argparse.ArgumentParser) -> None:
    """``rlperf profile``'s flags and its optional modes ``run`` and ``summarize`` (not ``rlperf train``'s
    ``--profile-step-*`` trace window, :func:`rlperf.telemetry.trainer_trace.add_trace_window_arguments`)."""
    p.usage = USAGE
    _add_target(p, required_url=False)
    p.add_argument("--action", choices=("start", "stop"), default=None,
                   help="start or stop profiling on every worker the router lists (the form without a mode)")
    sub = p.add_subparsers(dest="profile_mode", metavar="{run,summarize}", required=False,
                           title="modes (optional: without one, --action start|stop)")
    r = sub.add_parser("run", prog=f"{p.prog} run", help="start, drive load through the router, stop, collect, merge, summarize",
                       usage="%(prog)s --router-url URL [options] [load options]",
                       description="Profile every worker behind the router under a built-in load, merge their traces "
                                   "into one Perfetto trace (a process per worker, plus the requests) and summarize.")
    _add_target(r, required_url=True)
    r.add_argument("--num-prompts", type=flags.positive_int, default=16, help="requests sent")
    r.add_argument("--input-len", type=flags.positive_int, default=128, help="random prompts of this many token ids")
    r.add_argument("--output-len", type=flags.positive_int, default=64, help="tokens generated per request (ignore_eos)")
    r.add_argument("--concurrency", type=flags.positive_int, default=8, help="requests in flight at a time")
    r.add_argument("--dataset", default=None,
                   help="a jsonl of prompts ({'text'|'prompt'|'input_ids', optional 'max_new_tokens'}) instead of random ones")
    r.add_argument("--seed", type=flags.seed, default=0, help="seed of the random prompts and of each request's sampling")
    r.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the requests")
    r.add_argument("--top-n", type=flags.positive_int, default=15, help="kernels (or CPU ops) listed in the summary")
    r.add_argument("--png", default=None, metavar="PATH", help=PNG_HELP)
    s = sub.add_parser("summarize", prog=f"{p.prog} summarize", help="summarize existing trace files (SGLang's *.trace.json.gz too)",
                       usage="%(prog)s TRACE [TRACE ...] [--top-n N] [--json FILE]")
    s.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (.json or .json.gz)")
    s.add_argument("--top-n", type=flags.positive_int, default=15, help="kernels (or CPU ops) listed in the summary")
    s.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    s.add_argument("--png", default=None, metavar="PATH", help=PNG_HELP)


def run_profile(args: argparse.Namespace) -> int:
    from .control import ProfileError, ProfileUsageError, StartOptions

    def fail(msg: str) -> int:
        print(f"rlperf profile: error: {msg}", file=sys.stderr)
        return 1

    import importlib.util

    if getattr(args, "png", None) and importlib.util.find_spec("matplotlib") is None:
        print("rlperf profile: --png needs matplotlib, which is not installed: pip install 'rlperf[plot]' "
              "(or: pip install matplotlib)", file=sys.stderr)
        return 2
    try:
        if args.profile_mode == "summarize":
            return _summarize(args)
        if not args.router_url:
            print("rlperf profile: --router-url is required (or use 'rlperf profile summarize TRACE...')", file=sys.stderr)
            return 2
        if args.num_steps is not None and args.num_steps <= 0:
            print("rlperf profile: --num-steps must be positive", file=sys.stderr)
            return 2
        options = StartOptions(output_dir=args.output_dir, num_steps=args.num_steps, activities=args.activities,
                               profile_by_stage=args.profile_by_stage, with_stack=args.with_stack,
                               record_shapes=args.record_shapes)
        if args.profile_mode == "run":
            return _run(args, options)
        if args.action is None:
            print("rlperf profile: give --action start|stop, or 'run' / 'summarize' (rlperf profile --help)",
                  file=sys.stderr)
            return 2
        from . import control

        workers = control.list_workers(args.router_url, args.api_key)
        if args.action == "start":
            replies = control.start(workers, options, args.api_key)
        else:
            replies = control.stop(workers, args.api_key)
        for r in replies:
            where = f": {r.trace_path}" if r.trace_path else ""
            print(f"{args.action}_profile {r.url}: ok{where}")
        print(f"rlperf profile: {args.action} succeeded on {len(replies)} worker(s)")
        return 0
    except ProfileUsageError as exc:  # bad flags or input files, found before anything started
        print(f"rlperf profile: error: {exc}", file=sys.stderr)
        return 2
    except ProfileError as exc:
        return fail(str(exc))


def _run(args, options) -> int:
    from .control import ProfileUsageError
    from .harness import profile_run
    from .load import LoadSpec, make_prompts

    spec = LoadSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                    concurrency=args.concurrency, dataset=args.dataset, seed=args.seed, temperature=args.temperature)
    try:  # the prompts (--dataset) are read once before any worker is touched: a bad file is bad usage
        make_prompts(spec)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise ProfileUsageError(f"--dataset {args.dataset}: {exc}") from None
    result = profile_run(args.router_url, options, spec, args.output_dir or "rlperf-profile", args.api_key, args.top_n)
    if args.png:
        from .summary import write_phase_png

        write_phase_png(result.summary, args.png)
    load = result.summary["load"]
    if result.lost_workers:
        print(f"rlperf profile: lost {len(result.lost_workers)} worker(s) during the run: "
              f"{', '.join(result.lost_workers)}; the merged trace and summary hold the others'", file=sys.stderr)
        return 1
    return 0 if load and load["failed"] == 0 else 1


def _summarize(args) -> int:
    from pathlib import Path

    from .control import ProfileError
    from .summary import format_summary, summarize
    from .traces import is_merged, read_json, split_merged, to_epoch, stage_of

    workers, requests = [], []
    for t in args.traces:
        try:
            doc = read_json(t)
        except (OSError, ValueError, EOFError) as exc:
            raise ProfileError(f"{t}: not a readable Chrome trace ({exc})") from None
        if is_merged(doc):
            w, r = split_merged(doc)
            workers += w
            requests += r
        else:
            workers.append(to_epoch(doc, Path(t).name, stage_of(t), t))
    s = summarize(workers, requests, args.top_n)
    print(format_summary(s))
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2))
    if args.png:
        from .summary import write_phase_png

        write_phase_png(s, args.png)
    return 0
