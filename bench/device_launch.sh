#!/usr/bin/env bash
# Launch-bound to kernel-bound (graphed micro-steps, launches per step) on ONE GPU, in one device call
# (~6-9 minutes). Results in $OUT:
#   gpu-tests.log        the graphed-vs-eager bit-equality tests (tests/train/test_cuda_graph_train.py) and
#                        the padding-invariance test on the GPU, with the launch counts they print
#   loop-eager.json/.log      rlperf bench loop --quick (0.6b shape, 32 x 256 tokens), eager micro-steps
#   loop-graphed.json/.log    the same with --cuda-graph-buckets $BUCKETS
#   rollout.json/.log    rlperf bench rollout --quick: decode step time and launches per decode step
#   embedded/ + .log     rlperf train --device cuda on the embedded default (10 rollouts, gates skipped):
#                        the median step and train phase per rollout (the issue's <= 0.1 s per step); its
#                        kernel manifest in kernel-manifest-train.jsonl
#   gate-cold.log / gate-warm.log / gate-cold-precompiled.log   rlperf gate on the qwen3-0.6b shape three
#                        times: wall seconds with an empty kernel cache of its own (recording the kernel
#                        manifest kernel-manifest.jsonl), with that cache warm, and with another empty cache
#                        and --precompile-kernels (GATE_MANIFEST, default the manifest just recorded); the
#                        first step's stages (the report's stage_seconds: setup, step, probe, other)
#   summary.md           eager vs graphed: tokens/s, train phase s, MFU, the ratio to eager, launches per
#                        micro-step and per log-prob pass; launches per decode step
#
#   bash bench/device_launch.sh
#   BUCKETS=2048,4096 bash bench/device_launch.sh     # other buckets (default 1024,1536,2048,3072,4096)
#   STEPS="embedded gate" bash bench/device_launch.sh # a subset of: tests loops rollout embedded gate
#
# Each step runs under `timeout` (tests loops rollout: 180 + 160 + 140 + 90 s at most; embedded gate:
# 150 + 3 x 90 s: run those two in another lane or call to stay within a device call's 10 minutes) and a failing step does not stop the next; the exit status is 1 if any step failed.
# The Triton cache starts cold on a fresh machine: the tests compile the training kernels, the loops
# reuse them.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
BUCKETS=${BUCKETS:-1024,1536,2048,3072,4096}  # only the buckets the micro-batches use are captured
status=0
STEPS=" ${STEPS:-tests loops rollout embedded gate} "
wanted() { [[ "$STEPS" == *" $1 "* ]]; }
if wanted tests; then
  step gpu-tests 180 python3 -m pytest -q -m gpu -p no:cacheprovider -rP \
    tests/train/test_cuda_graph_train.py tests/train/test_padding.py
  grep -E "passed|failed|error|eager .* graphed|log-prob pass" "$OUT/gpu-tests.log" | tail -8
fi
if wanted loops; then
  step loop-eager 160 python3 -m rlperf bench loop --quick --json "$OUT/loop-eager.json"
  step loop-graphed 140 python3 -m rlperf bench loop --quick --cuda-graph-buckets "$BUCKETS" \
    --json "$OUT/loop-graphed.json"
fi
wanted rollout && step rollout 90 python3 -m rlperf bench rollout --quick --json "$OUT/rollout.json"
if wanted embedded; then
  step embedded 150 python3 -m rlperf train --device cuda --true-on-policy-mode --no-progress --skip-gates \
    --num-rollout 10 --output-dir "$OUT/embedded" --record-kernels "$OUT/kernel-manifest-train.jsonl"
fi
if wanted gate; then
  # cold: an empty Triton cache of its own, no precompile, recording the kernel manifest of the run;
  # warm: that cache again; cold-precompiled: another empty cache with --precompile-kernels of
  # $GATE_MANIFEST (default: the manifest the cold run just recorded; "auto": the one rlperf ships).
  # Python bytecode is cached by device_setup.sh (a fresh machine writes it in its first python3 process:
  # run another step first for a cold-kernels-only number).
  recorded="$OUT/kernel-manifest.jsonl"
  cold_cache=$(mktemp -d)
  gate() {  # run-name cache-dir flags...
    local run=$1 cache=$2; shift 2
    TRITON_CACHE_DIR=$cache step gate-$run 90 python3 -m rlperf gate --device cuda --model qwen3-0.6b --no-progress \
      --output-dir "$OUT/gate-$run" --report-json "$OUT/gate-$run.json" "$@"
  }
  gate cold "$cold_cache" --precompile-kernels off --record-kernels "$recorded"
  gate warm "$cold_cache" --precompile-kernels off
  precompiled_cache=$(mktemp -d)
  gate cold-precompiled "$precompiled_cache" --precompile-kernels "${GATE_MANIFEST:-$recorded}"
  grep -h "kernel precompile" "$OUT/gate-cold-precompiled.log" || true
  # compiled kernels in that cache: the manifest's plus any the run compiled itself (a manifest that
  # covers the run leaves none of the latter)
  echo "cold-precompiled: $(find "$precompiled_cache" -name '*.cubin' | wc -l) compiled kernels in its cache" \
    | tee "$OUT/gate-cold-precompiled.cubins"
fi
python3 - "$OUT" "$BUCKETS" <<'PY' || status=1
import json, sys
from pathlib import Path

out, buckets = Path(sys.argv[1]), sys.argv[2]


def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None


def train_row(doc):
    return next(r for r in doc["rows"] if r["kernel"] == "loop train phase")


lines = ["| run | tokens/s | ratio to eager | train phase s | MFU | kernels / launch calls per micro-step "
         "| per log-prob pass | abs diff max |", "|---|---:|---:|---:|---:|---|---|---:|"]
eager = load("loop-eager.json")
base = eager["summary"]["loop"]["tokens_per_s"] if eager else None
for name, label in (("loop-eager.json", "eager"), ("loop-graphed.json", f"graphed {buckets}")):
    doc = load(name)
    if doc is None:  # a run that did not write its results: failed if it started (its log), else not asked for
        log = name.replace(".json", ".log")
        lines.append(f"| {label} | " + (f"failed: see {log}" if (out / log).exists() else "not run (STEPS)")
                     + " | | | | | | |")
        continue
    s, e = doc["summary"]["loop"], train_row(doc)["extra"]
    ratio = f"{s['tokens_per_s'] / base:.2f}x" if base else "-"
    lines.append(f"| {label} | {s['tokens_per_s']:.0f} | {ratio} | {train_row(doc)['kernel_ms'] / 1e3:.3f} | "
                 f"{s['train_mfu']:.3f} | {e.get('micro_step_kernels')} / {e.get('micro_step_launch_calls')} "
                 f"({e.get('micro_batch_tokens')} tokens) | {e.get('log_prob_pass_kernels')} / "
                 f"{e.get('log_prob_pass_launch_calls')} | {s['abs_diff_max']} |")
rollout = load("rollout.json")
if rollout:
    lines += ["", "| decode | step ms | kernels per step | launch calls per step | graph |", "|---|---:|---:|---:|---|"]
    for r in rollout["rows"]:
        if r["anchor"] == "memory floor":
            x = r["extra"]
            lines.append(f"| {r['case']} | {r['kernel_ms']:.3f} | {x.get('decode_step_kernels')} | "
                         f"{x.get('decode_step_launch_calls')} | {x.get('graph')} |")
metrics = out / "embedded" / "metrics.jsonl"
if metrics.exists():
    import statistics

    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    med = lambda key: statistics.median(r[key] for r in rows if key in r) if any(key in r for r in rows) else float("nan")
    lines += ["", "| embedded default, `rlperf train --device cuda` | rollouts | median step s | median train phase s "
              "| abs diff max | last reward |", "|---|---:|---:|---:|---:|---:|",
              f"| 10 rollouts, gates skipped | {len(rows)} | {med('perf/step_time'):.3f} | {med('perf/train_time'):.3f} "
              f"| {max(r.get('train/train_rollout_logprob_abs_diff', float('nan')) for r in rows)} "
              f"| {rows[-1].get('rollout/raw_reward')} |"]
for run in ("cold", "warm", "cold-precompiled"):
    done = out / f"gate-{run}.rc-seconds"
    report = load(f"gate-{run}.json")
    if done.exists():
        rc, seconds = done.read_text().split()
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in (report or {}).get("stage_seconds", {}).items())
        setup = ", ".join(f"{k} {v:.1f} s" for k, v in (report or {}).get("setup_seconds", {}).items())
        stages += f" (setup: {setup})" if setup else ""
        lines.append(f"`rlperf gate --device cuda --model qwen3-0.6b`, {run} kernel cache: wall {seconds} s "
                     f"(exit {rc}), all gates passed: {report.get('passed') if report else None}"
                     + (f"; first step {report['seconds']:.1f} s: {stages}" if stages else ""))
text = "\n".join(lines)
(out / "summary.md").write_text(text + "\n")
print(text)
PY
exit $status
