"""``rlperf plot PATH...``: the picture of runs (directories) or benchmark results (JSON files).

* ``rlperf plot RUN_DIR [RUN_DIR...]``: :func:`rlperf.plots.runs.write_run_plot`, several runs overlaid;
  default output ``RUN_DIR/plot.png`` for one run, ``./rlperf-plot.png`` for several;
* ``rlperf plot bench.json [more.json...]``: :func:`rlperf.plots.bench.write_bench_plot`; default output
  the first file's name with ``.png``.

Each PNG comes with an HTML page of the same name that embeds it (``--no-html``: none). Exit 0 with the
paths printed, 2 for bad usage: a missing or empty directory, an unreadable or malformed file (the
message names the path and line), directories mixed with files, matplotlib not installed.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from .common import PlotInputError

PIP_COMMAND = "pip install 'rlperf[plot]' (or: pip install matplotlib)"
MULTI_RUN_PNG = "rlperf-plot.png"


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="rlperf train --output-dir directories (overlaid), or rlperf bench JSON files")
    p.add_argument("-o", "--output", default=None, metavar="PNG",
                   help=f"the picture (default: RUN_DIR/plot.png for one run, ./{MULTI_RUN_PNG} for several, "
                        f"BENCH.png next to the first bench JSON)")
    p.add_argument("--label", action="append", default=None, metavar="NAME",
                   help="a run's name in the legend, once per run directory in order (default: the directory's name)")
    p.add_argument("--no-html", action="store_true", help="only the PNG, no HTML page next to it")


def run_plot(args: argparse.Namespace, target=None) -> int:
    """``rlperf plot``; ``target(row) -> float | None``: the benchmark rows' targets (bench files only)."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"rlperf plot: needs matplotlib, which is not installed: {PIP_COMMAND}", file=sys.stderr)
        return 2
    from .bench import write_bench_plot
    from .runs import write_run_plot

    paths = [Path(p) for p in args.paths]
    dirs = [p.is_dir() for p in paths]
    try:
        if all(dirs):
            if args.label is not None and len(args.label) != len(paths):
                raise PlotInputError(f"--label given {len(args.label)} time(s) for {len(paths)} run director"
                                     f"{'y' if len(paths) == 1 else 'ies'}: give one per run, in order")
            out = Path(args.output) if args.output else paths[0] / "plot.png" if len(paths) == 1 else Path(MULTI_RUN_PNG)
            png = write_run_plot(paths, out, html=not args.no_html, labels=args.label)
        elif not any(dirs):
            if args.label is not None:
                raise PlotInputError("--label names run directories; bench files are named by their file names")
            for p in paths:
                if not p.exists():
                    raise PlotInputError(f"{p}: no such file or directory")
            out = Path(args.output) if args.output else paths[0].with_suffix(".png")
            png = write_bench_plot(paths, out, target=target, html=not args.no_html)
        else:
            raise PlotInputError("give run directories or bench JSON files, not both: "
                                 + ", ".join(f"{p} ({'directory' if d else 'file'})" for p, d in zip(paths, dirs)))
    except PlotInputError as exc:
        print(f"rlperf plot: {exc}", file=sys.stderr)
        return 2
    print(png)
    if not args.no_html:
        print(png.with_suffix(".html"))
    return 0
