#!/usr/bin/env bash
# The megatron trainer backend on 2 GPUs (NCCL): TP-invariance and the issue's three throughput targets,
# every ratio against its anchor from this same run. Results in $OUT (one JSON per run, summary.json).
#
#   bash bench/device_megatron.sh
#   MEGATRON_RUNS="fsdp-0.6b-tp1 tree-0.6b-tp1" bash bench/device_megatron.sh   # a subset (one call ~ 10 min:
#                                                   split the runs over two calls, or lanes of bench/device_lanes.sh)
#   MEGATRON_TESTS=0 skips the GPU tests at the start.
#   MEGATRON_ARGS: flags of python -m rlperf.bench.megatron added to every run (default "--kernel-table 12":
#                   where one step's GPU time goes, per kernel, and its GPU busy time; MEGATRON_ARGS= turns it off).
#                   The busy time is the steadier comparison: the steps are host-bound, and their wall times
#                   moved 1.5x between calls on one card (bench/BENCHMARKS.md, megatron).
#   MEGATRON_STEPS: timed optimizer steps per run (default 6; the median is reported).
#
# Needs megatron-core in the image or as a wheel in .whl/ (Python 3.12 there: megatron-core 0.19.x;
# carry .whl/ as for bench/device.sh). Runs (bench/megatron.py, one torchrun each):
#   fsdp-0.6b-tp1        rlperf's one-GPU trainer, 0.6b                       (anchor of target 1)
#   tree-0.6b-tp1        megatron backend, tree numerics, 1 GPU, engine samples
#   tree-0.6b-tp2        the same on 2 GPUs (TP=2)                             (bits vs tp1; target 2's subject)
#   tree-0.6b-tp2-sp     TP=2 with --sequence-parallel                          (bits vs tp1; its cost vs tp2)
#   tree-0.6b-pp2        PP=2 on 2 GPUs                                         (bits vs tp1)
#   plain-0.6b-tp2       megatron backend, Megatron's all-reduce order, TP=2   (anchor of target 2)
#   tree-1.7b-tp1 / tree-1.7b-tp2                                             (target 3; bits tp1 vs tp2)
#   tree-0.6b-tp2-dp2    TP=2 x DP=2 on 4 GPUs (only where 4 are visible)       (bits vs tp1; tokens/s vs tp2)
#   train-0.6b-tp2 / gate-0.6b-tp2   rlperf train (3 rollouts, abs diff 0 at each) and rlperf gate with
#                        --train-backend megatron --tensor-model-parallel-size 2 on 2 GPUs
#   train-0.6b-tp2-dp2 / gate-0.6b-tp2-dp2   the same on 4 GPUs, TP=2 x DP=2 (only where 4 are visible)
#   gate-0.6b-tp2-sp     rlperf gate as above with --sequence-parallel
#   tree-0.6b-tp1-perleaf  tree-0.6b-tp1 with a launch per tree leaf (--per-leaf-tree: the fused tree
#                        node's A/B; the same bits)
#   te-0.6b-tp1          plain Megatron-core with Transformer Engine layers, 1 GPU (the plain user's step:
#                        the anchor of what the tree numerics cost); only when TE is usable here (carry
#                        .te-pack/MANIFEST and .te-pack/chunk-00 from bash bench/pack_te.sh: bench/device_te.sh)
# With --engine the responses come from rlperf's engine on GPU 0 (tree mode, bf16): the trainer's old
# log-probs must equal the rollout log-probs exactly (train_rollout_logprob_abs_diff 0) at TP=1 and TP=2.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)" | tee "$OUT/versions.txt" \
  || { echo "megatron-core is not importable: put its wheel in .whl/"; exit 3; }
status=0
if [ "${MEGATRON_TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_megatron_runtime.py tests/kernels/test_tree_reduce.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -5
  status=${PIPESTATUS[0]}
fi
EXTRA=${MEGATRON_ARGS-"--kernel-table 12"}  # unset: the default; set and empty: no extra flags
COMMON="--samples ${MEGATRON_SAMPLES:-8} --tokens ${MEGATRON_TOKENS:-1024} --response ${MEGATRON_RESPONSE:-256} --steps ${MEGATRON_STEPS:-6} $EXTRA"
RUNS=${MEGATRON_RUNS:-all}
bench() {  # name nproc args...
  local name=$1 nproc=$2; shift 2
  if [ "$RUNS" != all ] && [[ " $RUNS " != *" $name "* ]]; then return; fi
  echo "== $name"
  timeout ${MEGATRON_RUN_TIMEOUT:-240} python3 -m torch.distributed.run --nproc-per-node "$nproc" -m rlperf.bench.megatron $COMMON "$@" \
    --out "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || { echo "$name failed"; tail -20 "$OUT/$name.log"; status=1; }
}
bench fsdp-0.6b-tp1 1 --backend fsdp --shape qwen3-0.6b --tp 1
if { [ "$RUNS" = all ] || [[ " $RUNS " == *" te-0.6b-tp1 "* ]]; } && { [ -f .te-pack/MANIFEST ] || [ -d /tmp/te-site/site ]; }; then
  if source bench/device_te.sh; then
    bench te-0.6b-tp1 1 --backend megatron-te --shape qwen3-0.6b --tp 1
  else
    status=1
  fi
fi
bench tree-0.6b-tp1 1 --backend megatron --shape qwen3-0.6b --tp 1 --engine
bench tree-0.6b-tp1-perleaf 1 --backend megatron --shape qwen3-0.6b --tp 1 --engine --per-leaf-tree
bench tree-0.6b-tp2 2 --backend megatron --shape qwen3-0.6b --tp 2 --engine
bench tree-0.6b-tp2-sp 2 --backend megatron --shape qwen3-0.6b --tp 2 --sequence-parallel --engine
bench tree-0.6b-pp2 2 --backend megatron --shape qwen3-0.6b --pp 2 --engine
bench plain-0.6b-tp2 2 --backend megatron-plain --shape qwen3-0.6b --tp 2
bench tree-1.7b-tp1 1 --backend megatron --shape qwen3-1.7b --tp 1 --engine
bench tree-1.7b-tp2 2 --backend megatron --shape qwen3-1.7b --tp 2 --engine
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 4 ]; then
  bench tree-0.6b-tp2-dp2 4 --backend megatron --shape qwen3-0.6b --tp 2 --engine
fi
# rlperf train / rlperf gate with the megatron backend at TP=2 on 2 GPUs (NCCL), the 0.6b shape on the
# embedded task, one in-process engine per rank in tree mode: abs diff exactly 0 at every rollout
cli() {  # name command...
  local name=$1; shift
  if [ "$RUNS" != all ] && [[ " $RUNS " != *" $name "* ]]; then return; fi
  echo "== $name"
  timeout ${MEGATRON_RUN_TIMEOUT:-240} "$@" >"$OUT/$name.log" 2>&1 || { echo "$name failed"; tail -20 "$OUT/$name.log"; status=1; }
}
TRAIN="--train-backend megatron --tensor-model-parallel-size 2 --device cuda
  --model qwen3-0.6b --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32
  --rollout-max-response-len 16 --lr 1e-5 --true-on-policy-mode --use-dynamic-batch-size --max-tokens-per-gpu 4096
  --no-progress"
train_and_gate() {  # SUFFIX GPUS: rlperf train (3 rollouts, abs diff 0 at each) and rlperf gate on GPUS ranks
  local suffix=$1 gpus=$2
  cli "train-0.6b-$suffix" python3 -m rlperf train $TRAIN --actor-num-gpus-per-node "$gpus" --num-rollout 3 --skip-gates \
    --output-dir "$OUT/train-0.6b-$suffix"
  if [ -f "$OUT/train-0.6b-$suffix/metrics.jsonl" ]; then
    python3 - "$OUT/train-0.6b-$suffix/metrics.jsonl" "train-0.6b-$suffix" <<'PY' || status=1
import json, sys
lines = [json.loads(x) for x in open(sys.argv[1])]
diffs = [m["train/train_rollout_logprob_abs_diff"] for m in lines]
print(f"{sys.argv[2]}: rollouts", len(lines), "abs diffs", diffs, "rewards", [m["rollout/raw_reward"] for m in lines])
sys.exit(0 if len(lines) == 3 and all(d == 0.0 for d in diffs) else 1)
PY
  fi
  cli "gate-0.6b-$suffix" python3 -m rlperf gate $TRAIN --actor-num-gpus-per-node "$gpus" \
    --output-dir "$OUT/gate-0.6b-$suffix" --report-json "$OUT/gate-0.6b-$suffix.json"
  [ -f "$OUT/gate-0.6b-$suffix.json" ] && grep -o '"passed": [a-z]*' "$OUT/gate-0.6b-$suffix.json" | head -1
}
train_and_gate tp2 2
# TP=2 x DP=2 (4 ranks, only where 4 GPUs are visible)
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 4 ]; then
  train_and_gate tp2-dp2 4
fi
# the same gate with --sequence-parallel (its logprob_abs_diff gate: exactly 0 with --true-on-policy-mode)
cli gate-0.6b-tp2-sp python3 -m rlperf gate $TRAIN --actor-num-gpus-per-node 2 --sequence-parallel --output-dir "$OUT/gate-0.6b-tp2-sp" \
  --report-json "$OUT/gate-0.6b-tp2-sp.json"
[ -f "$OUT/gate-0.6b-tp2-sp.json" ] && grep -o '"passed": [a-z]*' "$OUT/gate-0.6b-tp2-sp.json" | head -1
python3 -m rlperf.bench.megatron --summary "$OUT" | tee "$OUT/summary.json"
exit $status
