"""Step-time table of an ``rlperf train`` run, from its ``metrics.jsonl`` (issue #5's loop benchmark).

    python -m rlperf.bench.train_run OUTPUT_DIR/metrics.jsonl [--skip-first N] [--title TEXT]

Prints a markdown table, one row per rollout, and a mean over the rollouts after the first
``--skip-first`` (default 1: the first step compiles the Triton kernels):

* ``step s`` = ``perf/step_time`` (rollout + train + weight sync, wall clock);
* ``rollout s``, ``log-prob s``, ``train s``, ``sync ms``: ``perf/rollout_time``, ``perf/log_prob_time``
  (the trainer's old/reference log-prob passes, inside ``perf/train_time``), ``perf/train_time``
  minus log-prob (forward + backward + optimizer), ``perf/update_weights_time``;
* ``tokens/s`` = ``perf/tokens_per_sec`` (prompt + response tokens of the rollout / step time);
* peak GiB per phase: ``memory/{rollout,log_prob,train,weight_sync}_peak_bytes``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PHASES = ("rollout", "log_prob", "train", "weight_sync")
COLUMNS = ("rollout", "step s", "rollout s", "log-prob s", "train s", "sync ms", "tokens", "tokens/s",
           *(f"peak {p} GiB" for p in PHASES))


def load_metrics(path: str | Path) -> list[dict]:
    """The metrics of each rollout, in order; a line that is not a JSON object is an error naming it.

    A rollout id that appears more than once (a file written by a resumed run before resumes
    truncated it) counts once: its last line, the resumed run's."""
    from rlperf.data.jsonl import iter_json_objects

    rows = [m for _, m in iter_json_objects(Path(path), error=ValueError)]
    if not rows:
        raise ValueError(f"{path}: no metrics (did the run reach step 1?)")
    last = {m["rollout_id"]: i for i, m in enumerate(rows) if "rollout_id" in m}
    return [m for i, m in enumerate(rows) if "rollout_id" not in m or last[m["rollout_id"]] == i]


def step_row(m: dict) -> dict:
    """One rollout's split (the columns above); missing phases are None."""
    def get(key, scale=1.0):
        return m[key] * scale if key in m else None

    train, log_prob = get("perf/train_time"), get("perf/log_prob_time") or 0.0
    row = {"rollout": m.get("rollout_id"), "step s": get("perf/step_time"), "rollout s": get("perf/rollout_time"),
           "log-prob s": log_prob, "train s": None if train is None else train - log_prob,
           "sync ms": get("perf/update_weights_time", 1e3), "tokens": m.get("rollout/total_tokens"),
           "tokens/s": get("perf/tokens_per_sec")}
    for p in PHASES:
        row[f"peak {p} GiB"] = get(f"memory/{p}_peak_bytes", 2.0 ** -30)
    return row


def mean_row(rows: list[dict]) -> dict:
    out = {"rollout": "mean"}
    for c in COLUMNS[1:]:
        vals = [r[c] for r in rows if r[c] is not None]
        out[c] = sum(vals) / len(vals) if vals else None
    return out


def markdown(rows: list[dict], skip_first: int = 1) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    steady = rows[skip_first:] or rows
    for r in rows + [mean_row(steady)]:
        lines.append("| " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlperf.bench.train_run", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="metrics.jsonl of an rlperf train run")
    p.add_argument("--skip-first", type=int, default=1, help="rollouts left out of the mean (compilation)")
    args = p.parse_args(argv)
    try:
        rows = [step_row(m) for m in load_metrics(args.metrics)]
    except (OSError, ValueError) as exc:
        print(f"train_run: {exc}", file=sys.stderr)
        return 2
    print(markdown(rows, args.skip_first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
