#!/usr/bin/env bash
# One device call: install, run GPU tests and/or benchmarks, leave logs and results in $OUT.
#
#   bash bench/device.sh tests N              GPU test group N (1..7, below), no benchmarks; ends by
#                                             printing the command for the next group
#   bash bench/device.sh groups               list the groups (runs nothing, needs no GPU)
#   bash bench/device.sh none all             every benchmark, no tests
#   bash bench/device.sh [TESTS] [BENCHES] [extra rlperf-bench flags]
#       TESTS   pytest selection run with -m gpu (default: tests, the whole suite, which does not
#               fit one 10-minute call: run it by groups); "none" skips tests
#       BENCHES benchmark names for `rlperf bench` (default: all); "none" skips benchmarks
#
# Example (device tool): bash bench/device.sh tests/kernels/test_matmul.py matmul
# Group 6 starts SGLang engines: carry .sglang-pack/MANIFEST and .sglang-pack/chunk-00 (55 MB, unpacked here
# into /tmp, which a warm machine keeps; with .whl the carry passes a call's 64 MB, so carry the pack alone or
# in an earlier call), or it stops with exit 3 before running anything.
# Each group fits well inside a 10-minute device call on one H100 (install included). Group 7's
# tests need 2 and 4 GPUs: on one GPU they skip; run it on a 4-GPU machine (kind nvidia-h100-x4). The slowest tests of a
# group are listed at the end of its log (pytest --durations), to rebalance the groups.
# The device's copy of the tree may carry stale git metadata: prefix the command with
# RLPERF_COMMIT=$(git rev-parse --short HEAD) (expanded here, before the call) so result headers
# name the commit measured.
set -uo pipefail
cd "$(dirname "$0")/.."

# GPU test groups: every test file with a `gpu` test is in exactly one (tests/test_device_groups.py checks).
TEST_GROUPS=(
  "tests/kernels/test_matmul.py tests/kernels/test_attention.py"
  "tests/kernels/test_attention_backward.py tests/kernels/test_autograd.py tests/kernels/test_fused_logprob.py tests/kernels/test_logprob.py tests/kernels/test_moe.py"
  "tests/kernels/test_norm.py tests/kernels/test_rope.py tests/kernels/test_sampling.py tests/kernels/test_activation.py tests/kernels/test_programmatic_launch.py tests/model/test_qwen3.py tests/model/test_qwen3_moe.py tests/train/test_batching.py tests/telemetry/test_meter.py tests/kernels/test_tree_reduce.py tests/train/test_megatron_runtime.py tests/test_kernel_profile.py"
  "tests/sync/test_buckets.py tests/sync/test_transports.py tests/test_bench_sync.py tests/rollout/test_engine.py tests/rollout/test_warmup.py tests/rollout/test_weight_update_hostile.py"
  "tests/loop/test_loop.py tests/loop/test_precision.py tests/train/test_cuda_graph_train.py tests/train/test_megatron_graphs.py tests/train/test_adamw.py tests/loop/test_format_warmup.py tests/kernels/test_precompile.py"
  "tests/profiles/test_profile.py tests/test_flashinfer_anchors.py tests/rollout/test_flashinfer_attention.py tests/sglang_plugin/test_plugin_gpu.py tests/gates/test_colocated_oom_gpu.py tests/loop/test_sglang_backend.py"
  "tests/loop/test_data_parallel.py tests/loop/test_disaggregated.py tests/loop/test_expert_parallel_train.py"
)
NGROUPS=${#TEST_GROUPS[@]}

if [ "${1:-}" = groups ]; then
  for i in "${!TEST_GROUPS[@]}"; do echo "$((i + 1)): ${TEST_GROUPS[$i]}"; done
  exit 0
fi

TESTS=${1:-tests}
BENCHES=${2:-all}
GROUP=""
if [ "$TESTS" = tests ] && [[ "$BENCHES" =~ ^[0-9]+$ ]]; then  # `tests N`: group N, no benchmarks
  GROUP=$BENCHES
  if [ "$GROUP" -lt 1 ] || [ "$GROUP" -gt "$NGROUPS" ]; then
    echo "bench/device.sh: no test group $GROUP: the groups are 1..$NGROUPS (bash bench/device.sh groups)" >&2
    exit 2
  fi
  TESTS=${TEST_GROUPS[$((GROUP - 1))]}
  BENCHES=none
fi
shift 2 2>/dev/null || shift $#
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
status=0
SGLANG_GROUP=6  # its tests start SGLang engines: SGLang's runtime must be on the path (the pack, not only .whl)
if [ "$GROUP" = "$SGLANG_GROUP" ]; then
  put_sglang_on_path || { echo "bench/device.sh: test group $GROUP starts SGLang engines: nothing run"; exit 3; }
fi
if [ "$TESTS" != "none" ]; then
  log="$OUT/gpu-tests${GROUP:+-$GROUP}.log"
  [ -n "$GROUP" ] && echo "== GPU test group $GROUP of $NGROUPS: $TESTS"
  python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 $TESTS 2>&1 | tee "$log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$BENCHES" != "none" ]; then
  python3 -m rlperf bench $BENCHES --json "$OUT/bench.json" --markdown "$OUT/BENCHMARKS.md" "$@" 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ -n "$GROUP" ]; then
  if [ "$GROUP" -lt "$NGROUPS" ]; then
    note=""
    [ "$((GROUP + 1))" = "$NGROUPS" ] && note="; its tests need 2 and 4 GPUs: a 4-GPU machine"
    echo "next: bash bench/device.sh tests $((GROUP + 1))   (group $((GROUP + 1)) of $NGROUPS$note)"
  else
    echo "next: none: that was the last group ($NGROUPS of $NGROUPS); benchmarks: bash bench/device.sh none all"
  fi
fi
exit $status
