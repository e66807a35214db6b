#!/usr/bin/env bash
# One device call for the end-to-end GPU runs: the first-step gate and a short RL run on a
# qwen3-0.6b-shaped model, then `rlperf profile run` against 0.6b-shaped rlperf servers behind the
# sglang-router. Logs, reports, metrics, traces and summaries land in $OUT.
#
#   bash bench/device_e2e.sh [STAGES]     STAGES: any of "gate train synthetic profile" (default: all)
#
#   gate       rlperf gate on the embedded task (wall time including start-up)
#   train      4 rollouts of the embedded task (2-token answers) with the gate first
#   synthetic  the loop benchmark: random prompts, 256-token responses (a random-init model
#              rarely stops), packed micro-batches; prints the step-time table (bench/train_run.py)
#   profile    rlperf profile run against two servers behind the sglang-router
#
# Everything but the traces is bundled into $OUT/e2e.tar.gz at the end.
# Assumes the project is installed (bench/device.sh does it) and, for the profile stage,
# that sglang-router is importable.
set -uo pipefail
STAGES=${1:-gate train synthetic profile}
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
MODEL=${RLPERF_E2E_MODEL:-qwen3-0.6b}
# a short synthetic run: the embedded key->letter task on the 0.6b shape, 32 samples per rollout
RUN_FLAGS=(--model "$MODEL" --device cuda --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32
           --rollout-max-response-len 16 --true-on-policy-mode --lr 1e-5 --no-progress)
status=0

if [[ " $STAGES " == *" gate "* ]]; then
  echo "== rlperf gate ($MODEL, wall time includes start-up)"
  start=$(date +%s.%N)
  python3 -m rlperf gate "${RUN_FLAGS[@]}" --output-dir "$OUT/gate" --report-json "$OUT/gate.json" \
    --junit-xml "$OUT/gate.xml" 2>&1 | tee "$OUT/gate.log" | tail -30
  rc=${PIPESTATUS[0]}
  echo "gate exit $rc, wall $(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')") s" | tee -a "$OUT/gate.log"
  [ "$rc" = 0 ] || status=1
fi

if [[ " $STAGES " == *" train "* ]]; then
  echo "== rlperf train ($MODEL, 4 rollouts)"
  python3 -m rlperf train "${RUN_FLAGS[@]}" --num-rollout 4 --output-dir "$OUT/train" \
    --report-json "$OUT/train-gate.json" 2>&1 | tee "$OUT/train.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if [[ " $STAGES " == *" synthetic "* ]]; then
  echo "== rlperf train ($MODEL, synthetic task: 32 samples x 256 response tokens, 3 rollouts)"
  python3 - "$OUT/synthetic.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
words = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "tensor", "kernel", "policy", "reward"]
with open(sys.argv[1], "w") as f:
    for i in range(64):
        f.write(json.dumps({"input": " ".join(rng.choice(words) for _ in range(12)), "label": "A"}) + "\n")
PY
  python3 -m rlperf train --model "$MODEL" --device cuda --prompt-data "$OUT/synthetic.jsonl" --rm-type exact \
    --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32 --rollout-max-response-len 256 \
    --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
    --true-on-policy-mode --lr 1e-6 --num-rollout 3 \
    --no-progress --output-dir "$OUT/synthetic" --report-json "$OUT/synthetic-gate.json" 2>&1 | tee "$OUT/synthetic.log" | tail -12
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 -m rlperf.bench.train_run "$OUT/synthetic/metrics.jsonl" | tee "$OUT/synthetic-table.md"
fi

if [[ " $STAGES " == *" profile "* ]]; then
  echo "== rlperf profile run against 2 x $MODEL servers behind the sglang-router"
  python3 -m rlperf serve --model-path "$MODEL" --dtype bfloat16 --port 31000 --router 2 --router-port 30999 \
    --mem-fraction-static 0.35 >"$OUT/serve.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 240); do
    curl -sf http://127.0.0.1:30999/health >/dev/null 2>&1 && break
    kill -0 $serve_pid 2>/dev/null || break
    sleep 1
  done
  python3 -m rlperf profile run --router-url http://127.0.0.1:30999 --output-dir "$OUT/profile" \
    --num-prompts 64 --input-len 256 --output-len 128 --concurrency 16 2>&1 | tee "$OUT/profile.log" | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  kill -TERM $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null
  tail -20 "$OUT/serve.log"
fi
# one archive of the small outputs (logs, reports, metrics, timelines, summaries; not the traces),
# since a device call brings back only a few files
(cd "$OUT" && tar czf e2e.tar.gz --exclude='*.trace.json.gz' --exclude='*.merged.json.gz' --exclude='*.pt.trace.json*' \
  $(ls -d gate gate.* train train.* train-gate.json synthetic synthetic* profile profile.log serve.log 2>/dev/null) && \
  rm -rf gate.log gate.xml train.log train-gate.json synthetic.log synthetic.jsonl synthetic-gate.json profile.log serve.log)
exit $status
