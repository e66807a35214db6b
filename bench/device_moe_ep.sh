#!/usr/bin/env bash
# One device call for MoE training on GPUs (nvidia-h100-x2: 2 GPUs): install, then
#   - expert parallel over NCCL: 2 ranks with --expert-model-parallel-size 2 (bf16 compute, the Triton
#     expert kernels through per-source gradient taps) give the one-GPU first step bit for bit
#     (rollout, log-probs, metrics, every gradient, the updated weights) on qwen3-moe-tiny;
#   - rollout routing replay on the reduced 30B-A3B shape (qwen3-30b-a3b-2l) on one GPU: the
#     routing_agreement gate at 1.0 and two steps with abs diff exactly 0.
# Logs land in $OUT. About 5 minutes.
#
#   bash bench/device_moe_ep.sh
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider tests/loop/test_expert_parallel_train.py \
  2>&1 | tee "$OUT/gpu-ep-tests.log" | tail -40
exit "${PIPESTATUS[0]}"
