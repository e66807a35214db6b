"""The picture of one or several ``rlperf train`` runs, from their ``metrics.jsonl``.

Panels (x: the rollout, ``rollout_id``; several runs overlay, one colour each):

* reward: ``rollout/raw_reward``;
* KL and the train/rollout log-prob gap, log scale: ``|train/ppo_kl|``, ``train/kl_loss`` (when the run
  has one) and ``train/train_rollout_logprob_abs_diff``. A log axis cannot show 0, and 0 is the value that
  matters (a true on-policy run has exactly zero gap): steps whose value is exactly 0 are marked along the panel's bottom edge instead (one
  row of marks per series and run);
* response length: ``rollout/response_length`` (mean response tokens);
* tokens/s: ``perf/tokens_per_sec`` (every token of the rollout over the step's wall time, solid) and
  ``perf/longest_sample_tokens_per_sec`` (the longest response over the rollout time, dashed);
* peak memory: the largest ``memory/*_peak_bytes`` of the step, GiB;
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
ZERO_FLOOR = 1e-12
"""The log panel's lower limit when every value is exactly 0 (nothing else sets its range)."""


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
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["rollout_id"])
            ys.append(float(v))
    return xs, ys


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
    axes = [fig.add_subplot(nrows, ncols, 1)]
    axes += [fig.add_subplot(nrows, ncols, i + 1, sharex=axes[0]) for i in range(1, n_panels)]  # one rollout axis
    ax_reward, ax_gap, ax_len, ax_tps, ax_mem = axes[:5]
    colors = [f"C{i % 10}" for i in range(n_runs)]
    gap_max = 0.0
    for (label, rows), color in zip(runs.items(), colors):
        dot = "." if len(rows) <= MARKERS_UP_TO else None
        ax_reward.plot(*_series(rows, REWARD), color=color, marker=dot, label=label)
        ax_len.plot(*_series(rows, RESPONSE_LENGTH), color=color, marker=dot, label=label)
        for key, name, style in TOKENS_PER_SEC:
            xs, ys = _series(rows, key)
            if xs:
                ax_tps.plot(xs, ys, color=color, linestyle=style, marker=dot, label=f"{label}: {name}")
        for series, (key, name, style, zero_marker) in enumerate(GAP_KEYS):
            xs, ys = _series(rows, key)
            if not xs:
                continue
            nonzero = [(x, abs(y)) for x, y in zip(xs, ys) if y != 0.0]
            zeros = [x for x, y in zip(xs, ys) if y == 0.0]
            if nonzero:
                ax_gap.plot(*zip(*nonzero), color=color, linestyle=style, marker=dot, label=f"{label}: {name}")
                gap_max = max(gap_max, max(v for _, v in nonzero))
            if zeros:
                # on the bottom edge (x in data, y in axes coordinates): a log axis has no 0
                height = 0.03 * (series + len(GAP_KEYS) * colors.index(color))  # one row of marks per series
                ax_gap.scatter(zeros, [height] * len(zeros), transform=ax_gap.get_xaxis_transform(), marker=zero_marker,
                               color=color, s=36, clip_on=False, zorder=3,
                               label=f"{label}: {name} = 0 exactly ({len(zeros)}/{len(xs)} steps)")
        peaks = [(r["rollout_id"], max(v for k, v in r.items() if k.startswith("memory/") and k.endswith("_peak_bytes")
                                       and isinstance(v, (int, float))) / 2**30)
                 for r in rows if any(k.startswith("memory/") and k.endswith("_peak_bytes") for k in r)]
        if peaks:
            ax_mem.plot(*zip(*peaks), color=color, marker=dot, label=f"{label} ({rows[-1].get('memory/kind', '?')})")
    ax_gap.set_yscale("log")
    if gap_max == 0.0:
        ax_gap.set_ylim(ZERO_FLOOR, 1.0)
    for ax, title_, ylabel in ((ax_reward, "reward", REWARD), (ax_gap, "KL and train/rollout log-prob gap (log)", "|value|"),
                               (ax_len, "response length", "tokens"), (ax_tps, "throughput", "tokens/s"),
                               (ax_mem, "peak memory (largest phase)", "GiB")):
        ax.set_title(title_)
        ax.set_ylabel(ylabel)
    for (label, rows), ax in zip(runs.items(), axes[5:]):
        xs = [r["rollout_id"] for r in rows]
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
    for ax in axes:
        ax.set_xlabel("rollout")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


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
