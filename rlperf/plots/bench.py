"""The picture of ``rlperf bench`` results: each case's ratio to its anchor, with its target.

``rlperf bench`` writes ``{"environment": {...}, "summary": {...}, "rows": [...]}``; each row holds
``bench``, ``case``, ``kernel``, ``anchor`` and ``ratio`` = anchor ms / kernel ms (1.0: as fast as the
anchor measured in the same run). One panel per benchmark, one horizontal bar per row; a dotted line at
1.0 (the anchor's speed) and, where the row has a target, a red tick at it (the target comes from the
caller: ``target(row) -> float | None``; ``rlperf plot`` passes the benchmarks' own,
:func:`rlperf.bench.harness.ratio_target`). Several result files overlay as grouped bars, one colour
each, matched by (bench, case, kernel, anchor).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from .common import PlotInputError, new_figure, save_png, write_html

ROW_FIELDS = ("bench", "case", "kernel", "anchor", "ratio")


def read_bench(path: str | Path) -> dict:
    """The result file ``path`` as written by ``rlperf bench``. Raises :class:`PlotInputError` naming
    the path (and line, or row) for a missing file, bad JSON or a row without the fields of
    :data:`ROW_FIELDS`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlotInputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise PlotInputError(f"{path}:{getattr(exc, 'lineno', '?')}: not JSON ({getattr(exc, 'msg', exc)})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise PlotInputError(f"{path}: not an rlperf bench result (a JSON object with a 'rows' list)")
    if not rows:
        raise PlotInputError(f"{path}: 'rows' is empty: no benchmark ran")
    for i, row in enumerate(rows):
        missing = [f for f in ROW_FIELDS if not isinstance(row, dict) or f not in row]
        if missing:
            raise PlotInputError(f"{path}: rows[{i}] lacks {', '.join(missing)}")
        if row["ratio"] is not None and not isinstance(row["ratio"], (int, float)):
            raise PlotInputError(f"{path}: rows[{i}] ratio {row['ratio']!r} is not a number")
    return data


def _key(row: dict) -> tuple:
    return row["bench"], row["case"], row["kernel"], row["anchor"]


def _label(path: Path, data: dict) -> str:
    env = data.get("environment") or {}
    card, commit = env.get("card"), env.get("commit")
    return f"{path.name}" + (f" ({card}, {commit})" if card or commit else "")


def draw_bench(results: dict[str, dict], target: Callable[[dict], float | None] | None = None, title: str | None = None):
    """The figure of ``results`` (label -> result file contents); see the module docstring."""
    order: dict[str, list[tuple]] = {}  # bench -> its row keys, first seen first
    rows_by: list[dict[tuple, dict]] = []
    for data in results.values():
        by = {}
        for row in data["rows"]:
            k = _key(row)
            by[k] = row
            keys = order.setdefault(row["bench"], [])
            if k not in keys:
                keys.append(k)
        rows_by.append(by)
    benches = list(order)
    heights = [max(1.6, 0.32 * len(order[b]) * max(1, len(results) * 0.7) + 1.0) for b in benches]
    fig = new_figure(width=12, height=sum(heights))
    grid = fig.add_gridspec(len(benches), 1, height_ratios=heights)
    n = len(results)
    bar_h = 0.8 / n
    for bi, bench in enumerate(benches):
        ax = fig.add_subplot(grid[bi])
        keys = order[bench]
        for ri, (label, by) in enumerate(zip(results, rows_by)):
            ys, ws = [], []
            for y, k in enumerate(keys):
                row = by.get(k)
                if row is None or row["ratio"] is None or not math.isfinite(row["ratio"]):
                    continue
                ys.append(y - 0.4 + bar_h * (ri + 0.5))
                ws.append(row["ratio"])
            ax.barh(ys, ws, height=bar_h * 0.9, color=f"C{ri % 10}", label=label if bi == 0 else None)
            for y, w in zip(ys, ws):
                ax.text(w, y, f" {w:.2f}", va="center", fontsize=7)
        marked = False
        if target is not None:
            for y, k in enumerate(keys):
                row = next((by[k] for by in rows_by if k in by), None)
                t = target(row) if row is not None else None
                if t is not None:
                    ax.plot([t, t], [y - 0.45, y + 0.45], color="red", linewidth=2,
                            label=None if marked else "target")
                    marked = True
        widest = max((r["ratio"] for by in rows_by for k, r in by.items() if k in keys and r["ratio"] is not None
                      and math.isfinite(r["ratio"])), default=1.0)
        ax.set_xlim(0, max(1.0, widest) * 1.35)  # room for the values' labels and the legend on the right
        ax.axvline(1.0, color="black", linestyle=":", linewidth=1, label="anchor's speed (1.0)")
        ax.set_yticks(range(len(keys)))
        ax.set_yticklabels([f"{c}: {kern} vs {anc}" for _, c, kern, anc in keys], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{bench}: ratio = anchor ms / kernel ms (higher is faster)", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_bench_plot(paths: list[str | Path], out_png: str | Path, target=None, html: bool = True) -> Path:
    """Draw the result files ``paths`` (grouped bars) into ``out_png`` (and its ``.html`` page)."""
    paths = [Path(p) for p in paths]
    results = {}
    for p in paths:
        data = read_bench(p)
        label = _label(p, data)
        results[label if label not in results else str(p)] = data
    title = "rlperf bench: " + ", ".join(results)
    out_png = save_png(draw_bench(results, target, title), out_png)
    if html:
        write_html(out_png, title, [str(p) for p in paths])
    return out_png
