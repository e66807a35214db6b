#!/usr/bin/env bash
# The GPU runs of issue #23 (real SGLang and FlashInfer), one stage per device call on a warm
# nvidia-h100-x2 (trainer on GPU 0, SGLang engines on GPU 1; the profile stage uses both GPUs for two
# workers). Logs, reports and results land in $OUT.
#
#   bash bench/device_sglang.sh STAGES     STAGES: any of "imports check gate train profile flashinfer decode
#                                                  plugin-test plugin-gate plugin-colocate plugin-train plugin-moe
#                                                  plugin-tp2-gate plugin-tp2-train plugin-tp2-plain-gate
#                                                  plugin-megatron-tp2
#                                                  plugin-moe-ep2"
#
# First, on the CPU machine: bash bench/pack_sglang.sh (one chunk). Then ONE device call, even on a bare
# machine, unpacks the carried chunk and runs the stages:
#   carry [".sglang-pack/MANIFEST", ".sglang-pack/chunk-00"], command: bash bench/device_sglang.sh "imports check"
# Whenever .sglang-pack/MANIFEST came with the call, bench/unpack_sglang.sh runs first (nothing to do when
# /tmp/sglang-site already holds that archive). Every stage needs /tmp/sglang-site/site (exit 3 naming
# what is missing otherwise; a pack of several chunks still unpacks one chunk a call).
#
#   imports     bench/sglang_imports.py: SGLang's launch-path modules (launch_server, the router,
#               bench_one_batch, the rlperf/flashinfer/triton attention backends, rlperf's plugin) from
#               the unpacked site, each missing module on a line of its own; then --help of the three
#               entry points (python -m sglang.launch_server, sglang_router.launch_router, sglang.bench_one_batch)
#   check       import sglang, sgl_kernel, flashinfer, sglang_router from the unpacked site; the CPU
#               tests of the backend; the FlashInfer GPU test (its JIT compiles here: 1-3 min per kernel)
#   gate        rlperf gate --rollout-backend sglang on the qwen3-0.6b shape: one SGLang engine on GPU 1,
#               weights by NCCL broadcast; the report names the measured |train - rollout| and KL
#   train       3 rollouts with --rollout-backend sglang (the gate first), metrics.jsonl
#   profile     two SGLang workers (dummy 0.6b weights, GPUs 0 and 1) behind the sglang-router, then
#               rlperf profile run --router-url: traces merged into one Perfetto file, summary
#   flashinfer  rlperf bench attention and logprob (FlashInfer anchors beside SDPA and torch)
#   plugin-test tests/sglang_plugin/test_plugin_gpu.py: two SGLang + rlperf plugin engines behind the router,
#               one seeded request in 50 mixed batches == rlperf's engine, bit for bit
#   plugin-gate rlperf gate --sglang-numerics rlperf --true-on-policy-mode (qwen3-0.6b; engine on GPU 1, weights
#               by NCCL broadcast through /update_weights_from_distributed): abs diff exactly 0
#   plugin-colocate  the same on ONE GPU with --colocate (weights through /update_weights_from_tensor, CUDA IPC)
#   plugin-train     rlperf train --sglang-numerics rlperf --true-on-policy-mode --num-rollout 3 (gate first)
#   plugin-tp2-gate  rlperf gate --train-backend megatron --colocate --rollout-num-gpus-per-engine 2 (2 GPUs: one
#               SGLang engine at --tp-size 2 in the plugin's tree numerics, rank 0 beside the trainer on GPU 0, rank 1
#               on GPU 1; weights through /update_weights_from_tensor to both ranks): abs diff exactly 0
#   plugin-tp2-train the same layout, rlperf train --num-rollout 3 (gate first)
#   plugin-tp2-plain-gate  the same layout with the fsdp trainer: the engine in plain tensor parallelism (no
#               rlperf_reduction_leaves), rlperf gate and rlperf train --num-rollout 3: abs diff exactly 0
#   plugin-megatron-tp2  4 GPUs: the megatron trainer at TP=2 on GPUs 0-1 (2 actor ranks), one --tp-size 2 engine
#               on GPUs 2-3 (weights by NCCL broadcast from rank 0): rlperf gate, then rlperf train --num-rollout 3
#   plugin-moe-ep2   3+ GPUs: qwen3-30b-a3b-2l, the trainer at --expert-model-parallel-size 2 on GPUs 0-1, one
#               engine on GPU 2 (RLPERF_PLUGIN_MOE_ENGINE_GPUS=2: a --tp-size 2 engine on GPUs 2-3, plain tensor
#               parallelism): rlperf gate with and without --use-rollout-routing-replay
#   plugin-moe  plugin-gate on qwen3-30b-a3b-2l (RLPERF_PLUGIN_MOE_MODEL to change it; RLPERF_PLUGIN_MOE_LAYOUT
#               for the layout flags, default "--rollout-num-gpus 1")
#   decode-profile  where a decode step's GPU time goes (python -m rlperf.bench.kernel_profile): rlperf's
#               engine, then SGLang with rlperf's plugin and SGLang's fast mode (bench_one_batch --profile)
#               at B = $PROFILE_BATCHES (default "1 64 256")
#   decode      rlperf bench rollout (full): rlperf's decode step at B = 1, 16, 64, 256 and, as anchors in
#               the same run, SGLang's (sglang.bench_one_batch, dummy 0.6b weights, CUDA graphs on; default
#               fast mode, then --enable-deterministic-inference) and compiled transformers
set -uo pipefail
STAGES=${1:-check gate}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/device_setup.sh
put_sglang_on_path || { echo "device_sglang: SGLang's runtime is not on this machine"; exit 3; }
MODEL=${RLPERF_SGLANG_MODEL:-qwen3-0.6b}
RUN_FLAGS=(--model "$MODEL" --device cuda --rollout-backend sglang --rollout-num-gpus 1
           --sglang-attention-backend "${SGLANG_ATTENTION:-flashinfer}" --rollout-batch-size 8
           --n-samples-per-prompt 4 --global-batch-size 32 --rollout-max-response-len 16 --lr 1e-5 --no-progress)
PLUGIN_FLAGS=(--model "$MODEL" --device cuda --rollout-backend sglang --sglang-numerics rlperf --true-on-policy-mode
              --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32 --rollout-max-response-len 16
              --lr 1e-5 --no-progress)
status=0
run() {  # run NAME TIMEOUT CMD...: the command's output in $OUT/NAME.log (tail shown), failure noted
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -25 "$OUT/$name.log"
  echo "== $name: exit $rc"
  [ $rc = 0 ] || status=1
  return $rc
}
gate_and_train() {  # gate_and_train NAME FLAGS...: rlperf gate (report NAME-gate.json), then 3 rollouts of rlperf train
  local name=$1
  shift
  run "$name-gate" 560 python3 -m rlperf gate "$@" --output-dir "$OUT/$name-gate" --report-json "$OUT/$name-gate.json"
  run "$name-train" 560 python3 -m rlperf train "$@" --num-rollout 3 --output-dir "$OUT/$name-train"
  cp "$OUT/$name-train/metrics.jsonl" "$OUT/$name-train-metrics.jsonl" 2>/dev/null
  rm -rf "$OUT/$name-gate/sglang-model" "$OUT/$name-train/sglang-model"  # the saved model: the bundle must fit
}
model_config() {  # a folder with the 0.6b shape's config.json (dummy weights)
  python3 - "$1" "$MODEL" <<'PY'
import json, pathlib, sys, torch
from rlperf.model import preset
from rlperf.model.qwen3 import config_to_hf
path = pathlib.Path(sys.argv[1]); path.mkdir(parents=True, exist_ok=True)
(path / "config.json").write_text(json.dumps(config_to_hf(preset(sys.argv[2]), torch.bfloat16)))
PY
}

if [[ " $STAGES " == *" plugin-test "* ]]; then
  run plugin-test 560 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/sglang_plugin/test_plugin_gpu.py
fi
if [[ " $STAGES " == *" plugin-gate "* ]]; then
  run plugin-gate 560 python3 -m rlperf gate "${PLUGIN_FLAGS[@]}" --rollout-num-gpus 1 --output-dir "$OUT/plugin-gate" \
    --report-json "$OUT/plugin-gate.json"
  cp "$OUT"/plugin-gate/engines/*.log "$OUT/" 2>/dev/null
  rm -rf "$OUT/plugin-gate/sglang-model"
fi
if [[ " $STAGES " == *" plugin-colocate "* ]]; then
  run plugin-colocate 560 python3 -m rlperf gate "${PLUGIN_FLAGS[@]}" --colocate --sglang-mem-fraction-static 0.4 \
    --output-dir "$OUT/plugin-colocate" --report-json "$OUT/plugin-colocate.json"
  rm -rf "$OUT/plugin-colocate/sglang-model"
fi
if [[ " $STAGES " == *" plugin-train "* ]]; then
  run plugin-train 560 python3 -m rlperf train "${PLUGIN_FLAGS[@]}" --rollout-num-gpus 1 --num-rollout 3 \
    --output-dir "$OUT/plugin-train"
  cp "$OUT/plugin-train/metrics.jsonl" "$OUT/plugin-train-metrics.jsonl" 2>/dev/null
  rm -rf "$OUT/plugin-train/sglang-model"
fi
TP2_FLAGS=("${PLUGIN_FLAGS[@]}" --train-backend megatron --colocate --rollout-num-gpus-per-engine 2
           --sglang-mem-fraction-static 0.4)
if [[ " $STAGES " == *" plugin-tp2-gate "* ]]; then
  run plugin-tp2-gate 560 python3 -m rlperf gate "${TP2_FLAGS[@]}" --output-dir "$OUT/plugin-tp2-gate" \
    --report-json "$OUT/plugin-tp2-gate.json"
  cp "$OUT"/plugin-tp2-gate/engines/*.log "$OUT/" 2>/dev/null
  rm -rf "$OUT/plugin-tp2-gate/sglang-model"
fi
if [[ " $STAGES " == *" plugin-tp2-train "* ]]; then
  run plugin-tp2-train 560 python3 -m rlperf train "${TP2_FLAGS[@]}" --num-rollout 3 --output-dir "$OUT/plugin-tp2-train"
  cp "$OUT/plugin-tp2-train/metrics.jsonl" "$OUT/plugin-tp2-train-metrics.jsonl" 2>/dev/null
  rm -rf "$OUT/plugin-tp2-train/sglang-model"
fi
PLAIN_TP2_FLAGS=("${PLUGIN_FLAGS[@]}" --colocate --rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.4)
if [[ " $STAGES " == *" plugin-tp2-plain-gate "* ]]; then
  gate_and_train plugin-tp2-plain "${PLAIN_TP2_FLAGS[@]}"
fi
MEG_TP2_FLAGS=("${PLUGIN_FLAGS[@]}" --train-backend megatron --tensor-model-parallel-size 2 --actor-num-gpus-per-node 2
               --rollout-num-gpus 2 --rollout-num-gpus-per-engine 2)
if [[ " $STAGES " == *" plugin-megatron-tp2 "* ]]; then
  gate_and_train plugin-megatron-tp2 "${MEG_TP2_FLAGS[@]}"
fi
if [[ " $STAGES " == *" plugin-moe-ep2 "* ]]; then
  ENGINE_GPUS=${RLPERF_PLUGIN_MOE_ENGINE_GPUS:-1}  # 2: one --tp-size 2 engine (plain tensor parallelism), 4 GPUs in all
  EP2_FLAGS=("${PLUGIN_FLAGS[@]}" --expert-model-parallel-size 2 --actor-num-gpus-per-node 2
             --rollout-num-gpus "$ENGINE_GPUS" --rollout-num-gpus-per-engine "$ENGINE_GPUS")
  EP2_FLAGS[1]=${RLPERF_PLUGIN_MOE_MODEL:-qwen3-30b-a3b-2l}
  run plugin-moe-ep2 560 python3 -m rlperf gate "${EP2_FLAGS[@]}" --output-dir "$OUT/plugin-moe-ep2" \
    --report-json "$OUT/plugin-moe-ep2.json"
  run plugin-moe-ep2-replay 560 python3 -m rlperf gate "${EP2_FLAGS[@]}" --use-rollout-routing-replay \
    --output-dir "$OUT/plugin-moe-ep2-replay" --report-json "$OUT/plugin-moe-ep2-replay.json"
  rm -rf "$OUT"/plugin-moe-ep2*/sglang-model
fi
if [[ " $STAGES " == *" plugin-moe "* ]]; then
  MOE_FLAGS=("${PLUGIN_FLAGS[@]}")
  MOE_FLAGS[1]=${RLPERF_PLUGIN_MOE_MODEL:-qwen3-30b-a3b-2l}
  # RLPERF_PLUGIN_MOE_LAYOUT="--colocate --sglang-mem-fraction-static 0.4": trainer and engine on one GPU
  read -r -a MOE_LAYOUT <<< "${RLPERF_PLUGIN_MOE_LAYOUT:---rollout-num-gpus 1}"
  run plugin-moe 560 python3 -m rlperf gate "${MOE_FLAGS[@]}" "${MOE_LAYOUT[@]}" --output-dir "$OUT/plugin-moe" \
    --report-json "$OUT/plugin-moe.json"
  cp "$OUT"/plugin-moe/engines/*.log "$OUT/" 2>/dev/null
  rm -rf "$OUT/plugin-moe/sglang-model"
fi
if [[ " $STAGES " == *" imports "* ]]; then
  run imports-launch-path 300 python3 bench/sglang_imports.py
  run help-launch-server 120 python3 -m sglang.launch_server --help
  run help-launch-router 120 python3 -m sglang_router.launch_router --help
  run help-bench-one-batch 120 python3 -m sglang.bench_one_batch --help
fi
if [[ " $STAGES " == *" check "* ]]; then
  run imports 300 python3 -c "import sglang, sgl_kernel, flashinfer, sglang_router, transformers; \
print('sglang', sglang.__version__, 'flashinfer', flashinfer.__version__, 'transformers', transformers.__version__); \
import sglang.srt.entrypoints.http_server, sglang.srt.layers.attention.flashinfer_backend"
  run cpu-tests 300 python3 -m pytest -q -m "not gpu" -p no:cacheprovider tests/loop/test_sglang_backend.py tests/test_flashinfer_anchors.py tests/sync/test_distributed.py
  run gpu-tests 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer_anchors.py
fi
if [[ " $STAGES " == *" gate "* ]]; then
  run gate 560 python3 -m rlperf gate "${RUN_FLAGS[@]}" --output-dir "$OUT/gate" --report-json "$OUT/gate.json"
  cp "$OUT"/gate/engines/*.log "$OUT/" 2>/dev/null
  rm -rf "$OUT/gate/sglang-model"  # the saved 0.6b model (1.2 GB): a lane's bundle must fit the call
fi
if [[ " $STAGES " == *" train "* ]]; then
  run train 560 python3 -m rlperf train "${RUN_FLAGS[@]}" --num-rollout 3 --output-dir "$OUT/train"
  cp "$OUT/train/metrics.jsonl" "$OUT/train-metrics.jsonl" 2>/dev/null
  rm -rf "$OUT/train/sglang-model"
fi
if [[ " $STAGES " == *" profile "* ]]; then
  model_config /tmp/sglang-0.6b
  pids=()
  for g in 0 1; do
    CUDA_VISIBLE_DEVICES=$g python3 -m sglang.launch_server --model-path /tmp/sglang-0.6b --load-format dummy \
      --skip-tokenizer-init --host 127.0.0.1 --port $((31000 + g)) --attention-backend flashinfer \
      --mem-fraction-static 0.8 > "$OUT/sglang-worker-$g.log" 2>&1 &
    pids+=($!)
  done
  for g in 0 1; do
    timeout 400 bash -c "until curl -sf http://127.0.0.1:$((31000 + g))/health >/dev/null; do sleep 2; done" \
      || { echo "worker $g did not start:"; tail -20 "$OUT/sglang-worker-$g.log"; status=1; }
  done
  python3 -m sglang_router.launch_router --host 127.0.0.1 --port 31080 \
    --worker-urls http://127.0.0.1:31000 http://127.0.0.1:31001 > "$OUT/router.log" 2>&1 &
  pids+=($!)
  timeout 60 bash -c "until curl -sf http://127.0.0.1:31080/workers >/dev/null; do sleep 1; done"
  python3 -c "import json, random; r = random.Random(0); print('\n'.join(json.dumps({'input_ids': [r.randrange(1000, 50000) for _ in range(512)]}) for _ in range(64)))" > /tmp/sglang-prompts.jsonl
  run profile 300 python3 -m rlperf profile run --router-url http://127.0.0.1:31080 --output-dir "$OUT/profile" \
    --dataset /tmp/sglang-prompts.jsonl --num-prompts 64 --output-len 64 --num-steps 40
  kill "${pids[@]}" 2>/dev/null
  wait 2>/dev/null
fi
if [[ " $STAGES " == *" flashinfer "* ]]; then
  run bench-attention 400 python3 -m rlperf bench attention --json "$OUT/bench-attention.json" --markdown "$OUT/BENCHMARKS.md"
  # FlashInfer's first sampling-kernel compiles take minutes (longer while another lane compiles the same)
  run bench-logprob 480 python3 -m rlperf bench logprob --quick --json "$OUT/bench-logprob.json" --markdown "$OUT/BENCHMARKS.md"
fi
if [[ " $STAGES " == *" decode-profile "* ]]; then
  read -r -a PB <<< "${PROFILE_BATCHES:-1 64 256}"
  run profile-rlperf-decode 300 python3 -m rlperf.bench.kernel_profile decode --batch "${PB[@]}" --top 40
  read -r -a PV <<< "${PROFILE_VARIANTS:-plugin fast}"
  run profile-sglang-decode 500 python3 -m rlperf.bench.kernel_profile sglang --variants "${PV[@]}" --batch "${PB[@]}" \
    --steps 5 --top 40
fi
if [[ " $STAGES " == *" decode "* ]]; then
  # the full rollout bench: rlperf's decode steps, then the same shapes on transformers (compiled) and on
  # SGLang (python -m sglang.bench_one_batch, one process per variant of $SGLANG_VARIANTS, default all:
  # fast, det-flashinfer, det-triton, plugin = SGLang with rlperf's plugin, --attention-backend rlperf);
  # when all four do not fit one call, SGLANG_VARIANTS=fast,det-flashinfer,plugin (the plugin's targets)
  # and then SGLANG_VARIANTS=det-triton. The plugin needs rlperf's entry point (device_setup's pip install -e .)
  python3 -c "from rlperf.bench.sglang_anchor import rlperf_plugin_entry_points as f; \
print('rlperf SGLang plugin entry points:', f() or 'none (the plugin rows will say so)')"
  # ROLLOUT_BENCH_FLAGS=--no-transformers-anchor leaves out the compiled-transformers rows: with them, three
  # SGLang variants ran past one 600 s call on an H200
  read -r -a RBF <<< "${ROLLOUT_BENCH_FLAGS:-}"
  run rlperf-rollout 560 python3 -m rlperf bench rollout "${RBF[@]}" --sglang-variants "${SGLANG_VARIANTS:-all}" \
    --json "$OUT/bench-rollout.json" --markdown "$OUT/BENCHMARKS.md"
fi
exit $status
