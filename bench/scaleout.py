"""Scale-out benchmark (issue #14): the synthetic loop's tokens/s on 1 GPU against DP=2 + 2 engines on 4.

    python -m rlperf.bench.scaleout [--layouts 1gpu,dp2-engines2,dp2] [--prompts 32] [--samples 8]
                                    [--response-len 256] [--num-rollout 4] [--output-dir DIR]
                                    [--train-flags "--fsdp-gather micro-batch --num-threads 8"]

Every layout runs ``rlperf train --skip-gates`` in a process of its own on the same synthetic loop
(:func:`rlperf.bench.loop.loop_flags` and :func:`~rlperf.bench.loop.write_synthetic_prompts`: the same
prompt file, seed and flags; qwen3-0.6b shape at random init, ``--true-on-policy-mode``, packed
micro-batches), one after the other on this machine:

* ``1gpu``: one GPU, the in-process engine (colocated), the baseline;
* ``dp2-engines2``: ``--actor-num-gpus-per-node 2 --rollout-num-gpus 2``: two FSDP2 ranks on GPUs 0
  and 1, two ``rlperf serve`` engines on GPUs 2 and 3 behind the sglang-router, weights by NCCL
  broadcast from rank 0 (4 GPUs);
* ``dp2``: ``--actor-num-gpus-per-node 2``: two ranks, each with its in-process engine (2 GPUs).

The default size, 32 prompts x 8 samples = 256 samples of up to 256 tokens (``rlperf bench loop`` has
32 samples), gives the engines work to share: an engine runs at most 64 sequences at once (the
``--max-running-requests`` default of ``rlperf serve`` and of the in-process engine), so one engine
decodes the rollout in 4 waves and two engines in 2 each; 32 samples fit one wave either way.

``--train-flags`` adds the same ``rlperf train`` flags to every layout (an A/B of a trainer or engine
setting is two calls of this bench on the same machine). Each layout's row: ``perf/tokens_per_sec``
(prompt + response tokens of the rollout / step wall time), step, rollout, train, log-prob and sync
times, each the mean over the rollouts after the first (the first compiles kernels and captures graphs), its tokens/s over the ``1gpu`` row's (the issue's target:
``dp2-engines2`` at least :data:`TARGET_SPEEDUP` x), and ``train/train_rollout_logprob_abs_diff`` of
every step (0 with ``--true-on-policy-mode``). Rollout 1 of every layout draws the same samples (same
weights, seeds by sample index, batch-invariant engines); later rollouts differ in rounding between
1 and 2 ranks (the ranks' gradient sum), so response lengths, and tokens per step, may differ a
little: the ``tokens`` column shows them. A layout that needs more GPUs than are visible is skipped
and says so. Logs and ``metrics.jsonl`` of each layout go to ``OUTPUT_DIR/<layout>/``.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
import time
from pathlib import Path

from .harness import environment
from .loop import loop_flags, write_synthetic_prompts
from .train_run import load_metrics

TARGET_SPEEDUP = 1.8
"""Issue #14: tokens/s of DP=2 + 2 engines on 4 GPUs over the 1-GPU colocated run of the same samples."""
BASELINE = "1gpu"


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    flags: tuple[str, ...]
    gpus: int
    what: str


LAYOUTS = {
    "1gpu": Layout("1gpu", (), 1, "1 GPU, in-process engine (colocated)"),
    "dp2-engines2": Layout("dp2-engines2", ("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"), 4,
                           "DP=2 (FSDP2, GPUs 0-1) + 2 engines (GPUs 2-3), NCCL broadcast"),
    "dp2": Layout("dp2", ("--actor-num-gpus-per-node", "2"), 2, "DP=2, each rank its in-process engine"),
}


def summarize_layout(metrics: list[dict], skip_first: int = 1) -> dict:
    """One layout's row from its metrics lines (module docstring); means over the rollouts after the first
    ``skip_first`` (all of them when there are no more)."""
    steady = metrics[skip_first:] or metrics

    def mean(key, scale=1.0):
        vals = [m[key] * scale for m in steady if m.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    return {"tokens_per_s": mean("perf/tokens_per_sec"), "step_s": mean("perf/step_time"),
            "rollout_s": mean("perf/rollout_time"), "train_s": mean("perf/train_time"),
            "log_prob_s": mean("perf/log_prob_time"),
            "sync_ms": mean("perf/update_weights_time", 1e3), "tokens": mean("rollout/total_tokens"),
            "abs_diff": [m.get("train/train_rollout_logprob_abs_diff") for m in metrics], "rollouts": len(metrics)}


def report(rows: dict[str, dict]) -> str:
    """The markdown table of the layouts measured (``rows``: layout name -> :func:`summarize_layout`, or
    ``{"skipped": why}``) with each one's speedup over :data:`BASELINE`, then the target's verdict."""
    base = rows.get(BASELINE, {}).get("tokens_per_s")
    lines = ["| layout | GPUs | tokens/s | vs 1gpu | step s | rollout s | train s | log-prob s | sync ms | tokens | "
             "abs diff per step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in rows.items():
        layout = LAYOUTS[name]
        if "skipped" in r:
            lines.append(f"| {name} | {layout.gpus} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        speedup = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        diffs = ", ".join("-" if d is None else f"{d:g}" for d in r["abs_diff"])
        lines.append(f"| {name} | {layout.gpus} | {r['tokens_per_s']:.0f} | {speedup} | {r['step_s']:.3f} | "
                     f"{r['rollout_s']:.3f} | {r['train_s']:.3f} | {r['log_prob_s']:.3f} | {r['sync_ms']:.1f} | "
                     f"{r['tokens']:.0f} | {diffs} |")
    target = rows.get("dp2-engines2", {})
    if base and "tokens_per_s" in target:
        speedup = target["tokens_per_s"] / base
        lines.append(f"\ndp2-engines2 / 1gpu tokens/s = {speedup:.2f}x (target >= {TARGET_SPEEDUP}x: "
                     f"{'met' if speedup >= TARGET_SPEEDUP else 'missed'})")
    exact = all(d == 0.0 for r in rows.values() for d in r.get("abs_diff", []))
    lines.append(f"abs diff exactly 0 at every step of every layout measured: {'yes' if exact else 'NO'}")
    return "\n".join(lines)


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_layout(layout: Layout, flags: list[str], out: Path, timeout: float) -> dict:
    """``rlperf train --skip-gates FLAGS LAYOUT-FLAGS`` in a process of its own (``flags`` name ``out`` as
    the output directory; the output goes to ``out/train.log``); its :func:`summarize_layout` row, or
    ``{"failed": ..., "tail": ...}``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rlperf", "train", "--skip-gates", *flags, *layout.flags]
    t0 = time.perf_counter()
    with open(out / "train.log", "w") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - t0
    if code != 0:
        tail = (out / "train.log").read_text(errors="replace").splitlines()[-15:]
        return {"failed": f"exit {code} after {wall:.0f} s", "tail": tail, "wall_s": wall}
    row = summarize_layout(load_metrics(out / "metrics.jsonl"))
    row["wall_s"] = wall
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlperf.bench.scaleout", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--prompts", type=int, default=32, help="--rollout-batch-size")
    p.add_argument("--samples", type=int, default=8, help="--n-samples-per-prompt")
    p.add_argument("--response-len", type=int, default=256, help="--rollout-max-response-len")
    p.add_argument("--num-rollout", type=int, default=4, help="rollouts per layout (the first is left out of the means)")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds one layout may take")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for all layouts: one is skipped when the time left is less than the last one took")
    p.add_argument("--output-dir", default="rlperf-scaleout")
    p.add_argument("--train-flags", default="", metavar="FLAGS",
                   help="more rlperf train flags for every layout, one quoted string "
                        "(e.g. '--fsdp-gather micro-batch')")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        print(f"scaleout: --layouts {args.layouts}: choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    for flag in ("prompts", "samples", "response_len", "num_rollout"):
        if getattr(args, flag) < 1:
            print(f"scaleout: --{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        extra = shlex.split(args.train_flags)
    except ValueError as exc:
        print(f"scaleout: --train-flags {args.train_flags!r}: {exc}", file=sys.stderr)
        return 2
    gpus = visible_gpus()
    if gpus == 0:
        print("scaleout: needs CUDA GPUs (4 for dp2-engines2)", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = write_synthetic_prompts(out / "synthetic.jsonl")
    rows: dict[str, dict] = {}
    status, started, last_wall = 0, time.perf_counter(), 0.0
    for name in names:
        layout = LAYOUTS[name]
        left = args.budget - (time.perf_counter() - started)
        if layout.gpus > gpus:
            rows[name] = {"skipped": f"needs {layout.gpus} GPUs, {gpus} visible"}
            continue
        if left < last_wall or left <= 0:
            rows[name] = {"skipped": f"--budget {args.budget:g} s: {max(left, 0):.0f} s left, the last layout took "
                                     f"{last_wall:.0f} s"}
            continue
        flags = loop_flags(data, out / name, model=args.model, prompts=args.prompts, samples_per_prompt=args.samples,
                           response_len=args.response_len, num_rollout=args.num_rollout) + extra
        print(f"scaleout: {name}: {layout.what} ...", flush=True)
        row = run_layout(layout, flags, out / name, min(args.timeout, left))
        last_wall = row.get("wall_s", 0.0)
        if "failed" in row:
            print(f"scaleout: {name} failed ({row['failed']}); last lines of {out / name / 'train.log'}:\n  "
                  + "\n  ".join(row["tail"]), file=sys.stderr, flush=True)
            rows[name] = {"skipped": row["failed"]}
            status = 1
            continue
        print(f"scaleout: {name}: {row['tokens_per_s']:.0f} tokens/s, step {row['step_s']:.3f} s "
              f"({row['rollouts']} rollouts, {row['wall_s']:.0f} s with start-up)", flush=True)
        rows[name] = row
    info = environment()
    print(f"\n# {gpus} x {info['card']} | commit {info['commit']} | torch {info['torch']} | {info['date']}\n"
          f"synthetic loop, {args.model}, {args.prompts}x{args.samples} samples x {args.response_len} tokens, "
          f"{args.num_rollout} rollouts per layout (the means leave out the first)"
          + (f", every layout with {args.train_flags}" if extra else ""))
    print(report(rows))
    return status


if __name__ == "__main__":
    sys.exit(main())
