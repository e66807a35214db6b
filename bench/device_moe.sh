#!/usr/bin/env bash
# One device call for the mixture-of-experts work: install, the GPU MoE tests (bf16 invariance of
# the expert block on the 30B-A3B shape, deterministic expert gradients, the model's prefill = decode
# bits), then `rlperf bench moe` (grouped GEMM vs torch._grouped_mm and a per-expert cuBLAS loop,
# invariant MoE layer vs fast, T = 1024 and 8192). Logs and results land in $OUT. About 5 minutes.
#
#   bash bench/device_moe.sh [extra rlperf-bench flags, e.g. --quick]
#
# Prefix with RLPERF_COMMIT=$(git rev-parse --short HEAD) so result headers name the commit measured.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
status=0
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe.py tests/model/test_qwen3_moe.py \
  2>&1 | tee "$OUT/gpu-tests.log" | tail -40
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 240 python3 -m rlperf bench moe --json "$OUT/bench-moe.json" --markdown "$OUT/BENCHMARKS.md" "$@" 2>&1 \
  | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
