"""The picture of one or several ``rlperf train`` runs, from their ``metrics.jsonl``.

Panels (x: the rollout counted from 1, ``rollout_id + 1``, as the console's ``rollout k/N`` lines count;
several runs overlay, one colour each):

* reward: ``rollout/raw_reward``;
* KL and the train/rollout log-prob gap: ``|train/ppo_kl|``, ``train/kl_loss`` (when the run has one) and
  ``train/train_rollout_logprob_abs_diff``, nonzero values on a log scale. A log axis cannot show 0, and 0
  is the value that matters (a true on-policy run has exactly zero gap): a strip under the panel marks the
  steps whose value is exactly 0, one row per series and run, named with its count; when no value is
  nonzero the panel says so instead of drawing an empty log axis;
* response length: ``rollout/response_length`` (mean response tokens), from 0 (an axis fitted to the
  values would turn one shorter answer in 128 into a cliff);
* tokens/s: ``perf/tokens_per_sec`` (every token of the rollout over the step's wall time, solid, left
  axis) and ``perf/longest_sample_tokens_per_sec`` (the longest response over the rollout time, dashed,
  right axis: it is often 100x smaller);
* peak memory: the largest ``memory/*_peak_bytes`` of the step, GiB, from 0;
* the step split, one panel per run: ``perf/rollout_time``, ``perf/log_prob_time``, ``perf/train_time``,
  ``perf/update_weights_time`` as stacked areas, ``perf/step_time`` as a line over them (a gap between the
  two is time outside the four phases; with ``--async`` the rollout overlaps training and the stack can
  exceed the step).

Drawn with matplotlib's Agg canvas directly (no pyplot, no display, no global backend switch).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .common import PlotInputError, new_figure, save_png, write_html

METRICS_FILE = "metrics.jsonl"
REWARD = "rollout/raw_reward"
GAP_KEYS = (("train/ppo_kl", "|ppo_kl|", "-", "^"), ("train/kl_loss", "kl_loss", ":", "s"),
            ("train/train_rollout_logprob_abs_diff", "logprob abs diff", "--", "D"))
"""The log-scale panel's series: metric, label, line style, marker of its exact zeros (absolute values
are drawn)."""
RESPONSE_LENGTH = "rollout/response_length"
TOKENS_PER_SEC = (("perf/tokens_per_sec", "tokens/s (step)", "-"),
                  ("perf/longest_sample_tokens_per_sec", "longest sample tokens/s", "--"))
STEP_SPLIT = (("perf/rollout_time", "rollout"), ("perf/log_prob_time", "log-prob"), ("perf/train_time", "train"),
              ("perf/update_weights_time", "weight sync"))
"""The stacked phases of a step, bottom to top, with the metric each one reads."""
STEP_TIME = "perf/step_time"
MARKERS_UP_TO = 40
"""Runs of at most this many rollouts get a dot per step; longer ones plain lines (dots would blot them)."""
HEADROOM = 1.15
"""Panels that start at 0 end at this times their largest value (a line at the top edge is hard to read)."""


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics lines of ``run_dir/metrics.jsonl``, in file order.

    Raises :class:`PlotInputError` naming the path (and line) for a missing directory or file, an empty
    file and a line that is not a JSON object with an integer ``rollout_id``. An unterminated last line
    is a line the run is writing right now, and is left out."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotInputError(f"{run_dir}: no such directory (give a run directory: rlperf train --output-dir)")
    path = run_dir / METRICS_FILE
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlotInputError(f"{path}: cannot read ({exc.strerror or exc}); is {run_dir} an rlperf train "
                             f"--output-dir?") from None
    lines = text.split("\n")
    complete, torn = lines[:-1], lines[-1]  # the text after the last newline: a line still being written
    rows = []
    for n, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise PlotInputError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("rollout_id"), int):
            raise PlotInputError(f"{path}:{n}: not a metrics line (a JSON object with an integer rollout_id)")
        rows.append(row)
    if not rows:
        extra = " (one unterminated line)" if torn.strip() else ""
        raise PlotInputError(f"{path}: no metrics lines{extra}: no rollout has finished yet")
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(rollouts counted from 1, values) of metric ``key`` where it is a finite number."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["rollout_id"] + 1)
            ys.append(float(v))
    return xs, ys


def _from_zero(ax, values: list[float]) -> None:
    """``ax``'s y axis from 0 to :data:`HEADROOM` times the largest of ``values`` (1 when there are none)."""
    top = max([v for v in values if v > 0], default=0.0)
    ax.set_ylim(0.0, top * HEADROOM if top > 0 else 1.0)


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run's name in the legend: its directory's name, or its whole path where two names collide."""
    names = [p.resolve().name or str(p) for p in run_dirs]
    return [str(p) if names.count(n) > 1 else n for p, n in zip(run_dirs, names)]


def draw_runs(runs: dict[str, list[dict]], title: str | None = None):
    """The figure of ``runs`` (label -> metrics lines); see the module docstring for its panels."""
    n_runs = len(runs)
    n_panels = 5 + n_runs
    ncols = 3
    nrows = math.ceil(n_panels / ncols)
    fig = new_figure(width=15, height=3.6 * nrows)
    grid = fig.add_gridspec(nrows, ncols)
    cells = [grid[i // ncols, i % ncols] for i in range(n_panels)]
    axes = [fig.add_subplot(cells[0])]
    gap_cell = cells[1].subgridspec(2, 1, height_ratios=(3, 1), hspace=0.08)  # log values over the zeros' strip
    ax_gap = fig.add_subplot(gap_cell[0], sharex=axes[0])
    ax_zero = fig.add_subplot(gap_cell[1], sharex=axes[0])
    axes.append(ax_gap)
    axes += [fig.add_subplot(cell, sharex=axes[0]) for cell in cells[2:]]  # one rollout axis
    ax_reward, _, ax_len, ax_tps, ax_mem = axes[:5]
    ax_longest = ax_tps.twinx()
    colors = [f"C{i % 10}" for i in range(n_runs)]
    gap_values, zero_rows, lengths, rates, longest, gibs = [], [], [], [], [], []
    for (label, rows), color in zip(runs.items(), colors):
        dot = "." if len(rows) <= MARKERS_UP_TO else None
        ax_reward.plot(*_series(rows, REWARD), color=color, marker=dot, label=label)
        xs, ys = _series(rows, RESPONSE_LENGTH)
        ax_len.plot(xs, ys, color=color, marker=dot, label=label)
        lengths += ys
        for (key, name, style), ax, seen in zip(TOKENS_PER_SEC, (ax_tps, ax_longest), (rates, longest)):
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, color=color, linestyle=style, marker=dot, label=f"{label}: {name}")
                seen += ys
        for key, name, style, zero_marker in GAP_KEYS:
            xs, ys = _series(rows, key)
            if not xs:
                continue
            nonzero = [(x, abs(y)) for x, y in zip(xs, ys) if y != 0.0]
            zeros = [x for x, y in zip(xs, ys) if y == 0.0]
            if nonzero:
                ax_gap.plot(*zip(*nonzero), color=color, linestyle=style, marker=dot, label=f"{label}: {name}")
                gap_values += [v for _, v in nonzero]
            if zeros:
                who = f"{label}: " if n_runs > 1 else ""
                zero_rows.append((zeros, zero_marker, color, f"{who}{name} = 0 ({len(zeros)}/{len(xs)})"))
        peaks = [(r["rollout_id"] + 1, max(v for k, v in r.items() if k.startswith("memory/") and k.endswith("_peak_bytes")
                                           and isinstance(v, (int, float))) / 2**30)
                 for r in rows if any(k.startswith("memory/") and k.endswith("_peak_bytes") for k in r)]
        if peaks:
            ax_mem.plot(*zip(*peaks), color=color, marker=dot, label=f"{label} ({rows[-1].get('memory/kind', '?')})")
            gibs += [g for _, g in peaks]
    _draw_gap(ax_gap, ax_zero, gap_values, zero_rows)
    _from_zero(ax_len, lengths)
    _from_zero(ax_tps, rates)
    _from_zero(ax_longest, longest)
    _from_zero(ax_mem, gibs)
    ax_longest.set_ylabel("longest sample tokens/s (dashed)")
    for ax, title_, ylabel in ((ax_reward, "reward", REWARD), (ax_gap, "KL and train/rollout log-prob gap", "|value|"),
                               (ax_len, "response length", "tokens"), (ax_tps, "throughput", "tokens/s (solid)"),
                               (ax_mem, "peak memory (largest phase)", "GiB")):
        ax.set_title(title_)
        ax.set_ylabel(ylabel)
    for (label, rows), ax in zip(runs.items(), axes[5:]):
        xs = [r["rollout_id"] + 1 for r in rows]
        stacks, names = [], []
        for key, name in STEP_SPLIT:
            if any(key in r for r in rows):
                v = [r.get(key) for r in rows]
                stacks.append([x if isinstance(x, (int, float)) else 0.0 for x in v])
                names.append(name)
        if stacks:
            ax.stackplot(xs, *stacks, labels=names, colors=[f"C{i}" for i in range(len(stacks))])
        sx, sy = _series(rows, STEP_TIME)
        if sx:
            ax.plot(sx, sy, color="black", linestyle="--", linewidth=1, label="step time")
        ax.set_title(f"step split: {label}" if n_runs > 1 else "step split")
        ax.set_ylabel("seconds")
    for ax in axes + [ax_zero]:
        if ax is not ax_gap:  # the strip under it carries the rollout axis
            ax.set_xlabel("rollout")
        ax.grid(True, alpha=0.3)
    ax_gap.tick_params(labelbottom=False)
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        if ax is ax_tps:
            more = ax_longest.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        if handles:
            ax.legend(handles, labels, fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _draw_gap(ax_gap, ax_zero, values: list[float], zero_rows: list) -> None:
    """The KL / gap panel: nonzero values on a log axis (or, when there are none, the words saying so: an
    empty log axis reads as missing data), and under it one row of marks per series with exact zeros."""
    if values:
        ax_gap.set_yscale("log")
    else:
        ax_gap.set_yticks([])
        ax_gap.text(0.5, 0.5, "every value is exactly 0\n(marked below)" if zero_rows else "no values",
                    transform=ax_gap.transAxes, ha="center", va="center", fontsize=10)
    for row, (xs, marker, color, _) in enumerate(zero_rows):
        ax_zero.scatter(xs, [row] * len(xs), marker=marker, color=color, s=16, zorder=3)
    ax_zero.set_yticks(range(len(zero_rows)), [name for *_, name in zero_rows], fontsize=7)
    ax_zero.set_ylim(-0.7, max(len(zero_rows), 1) - 0.3)  # whole marks, none cut by the edges


def write_run_plot(run_dirs: list[str | Path], out_png: str | Path, html: bool = True,
                   labels: list[str] | None = None) -> Path:
    """Draw the runs of ``run_dirs`` (overlaid) into ``out_png`` and, with ``html``, a page next to it
    (same name, ``.html``) that embeds the picture. Returns the PNG's path. Raises
    :class:`PlotInputError` for an unreadable run (:func:`read_metrics`)."""
    run_dirs = [Path(d) for d in run_dirs]
    labels = labels or _labels(run_dirs)
    runs = {}
    for label, d in zip(labels, run_dirs):
        runs[label] = read_metrics(d)
    title = "rlperf train: " + ", ".join(f"{k} ({len(v)} rollouts)" for k, v in runs.items())
    fig = draw_runs(runs, title)
    out_png = save_png(fig, out_png)
    if html:
        write_html(out_png, title, [f"{label}: {d}" for label, d in zip(labels, run_dirs)])
    return out_png
