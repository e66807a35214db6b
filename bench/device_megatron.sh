#!/usr/bin/env bash
# The megatron trainer backend on 2 GPUs (NCCL): TP-invariance and the three throughput targets,
# every ratio against its anchor from this same run. Results in $OUT (one JSON per run, summary.json).
#
#   bash bench/device_megatron.sh
#   MEGATRON_RUNS="fsdp-0.6b-tp1 tree-0.6b-tp1" bash bench/device_megatron.sh   # a subset (one call ~ 10 min:
#                                                   split the six runs over two calls on a warm machine)
#
# Needs megatron-core in the image or as a wheel in .whl/ (Python 3.12 there: megatron-core 0.19.x;
# carry .whl/ as for bench/device.sh). Runs (bench/megatron.py, one torchrun each):
#   fsdp-0.6b-tp1        rlperf's one-GPU trainer, 0.6b                       (anchor of target 1)
#   tree-0.6b-tp1        megatron backend, tree numerics, 1 GPU, engine samples
#   tree-0.6b-tp2        the same on 2 GPUs (TP=2)                             (bits vs tp1; target 2's subject)
#   plain-0.6b-tp2       megatron backend, Megatron's all-reduce order, TP=2   (anchor of target 2)
#   tree-1.7b-tp1 / tree-1.7b-tp2                                             (target 3; bits tp1 vs tp2)
# With --engine the responses come from rlperf's engine on GPU 0 (tree mode, bf16): the trainer's old
# log-probs must equal the rollout log-probs exactly (train_rollout_logprob_abs_diff 0) at TP=1 and TP=2.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 \
    || { tail -30 "$OUT/wheels.log"; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 3; }
python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)" | tee "$OUT/versions.txt" \
  || { echo "megatron-core is not importable: put its wheel in .whl/"; exit 3; }
python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_megatron_runtime.py tests/kernels/test_tree_reduce.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -5
status=${PIPESTATUS[0]}
COMMON="--samples ${MEGATRON_SAMPLES:-8} --tokens ${MEGATRON_TOKENS:-1024} --response ${MEGATRON_RESPONSE:-256} --steps ${MEGATRON_STEPS:-3}"
RUNS=${MEGATRON_RUNS:-all}
bench() {  # name nproc args...
  local name=$1 nproc=$2; shift 2
  if [ "$RUNS" != all ] && [[ " $RUNS " != *" $name "* ]]; then return; fi
  echo "== $name"
  timeout ${MEGATRON_RUN_TIMEOUT:-240} python3 -m torch.distributed.run --nproc-per-node "$nproc" -m rlperf.bench.megatron $COMMON "$@" \
    --out "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || { echo "$name failed"; tail -20 "$OUT/$name.log"; status=1; }
}
bench fsdp-0.6b-tp1 1 --backend fsdp --shape qwen3-0.6b --tp 1
bench tree-0.6b-tp1 1 --backend megatron --shape qwen3-0.6b --tp 1 --engine
bench tree-0.6b-tp2 2 --backend megatron --shape qwen3-0.6b --tp 2 --engine
bench plain-0.6b-tp2 2 --backend megatron-plain --shape qwen3-0.6b --tp 2
bench tree-1.7b-tp1 1 --backend megatron --shape qwen3-1.7b --tp 1 --engine
bench tree-1.7b-tp2 2 --backend megatron --shape qwen3-1.7b --tp 2 --engine
python3 -m rlperf.bench.megatron --summary "$OUT" | tee "$OUT/summary.json"
exit $status
