#!/usr/bin/env bash
# One device call: install, run the GPU tests, run benchmarks, leave logs and results in $OUT.
#
#   bash bench/device.sh [TESTS] [BENCHES] [extra rlperf-bench flags]
#   TESTS   pytest selection run with -m gpu (default: tests); "none" skips tests
#   BENCHES benchmark names for `rlperf bench` (default: all); "none" skips benchmarks
#
# Example (device tool): bash bench/device.sh tests/kernels/test_matmul.py matmul
# The device's copy of the tree may carry stale git metadata: prefix the command with
# RLPERF_COMMIT=$(git rev-parse --short HEAD) (expanded here, before the call) so result headers
# name the commit measured.
set -uo pipefail
TESTS=${1:-tests}
BENCHES=${2:-all}
shift 2 2>/dev/null || shift $#
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# Packages the device image lacks (sglang-router and its server stack, sglang for the bucket interop
# tests, pytest-benchmark) travel as wheels in .whl/ (carry it; see README "GPU runs").
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 \
    || { tail -30 "$OUT/wheels.log"; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 3; }
status=0
if [ "$TESTS" != "none" ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$BENCHES" != "none" ]; then
  python3 -m rlperf bench $BENCHES --json "$OUT/bench.json" --markdown "$OUT/BENCHMARKS.md" "$@" 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
