#!/usr/bin/env bash
# One device call for the loop/engine seam (issue 19): the GPU tests of the loop, the trainer and the
# broadcast weight sync, then a deterministic bf16 run whose metrics can be compared with the same
# run of another commit on the same card (every metric but perf/*, *time* and memory/* must be equal).
#
#   bash bench/device_seam.sh [BASELINE_METRICS_JSONL]
#
# Writes $OUT/gpu-tests.log, $OUT/det/metrics.jsonl and, with a baseline, $OUT/compare.txt.
set -uo pipefail
export OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
bash bench/device.sh "tests/loop tests/train tests/rollout/test_weight_broadcast.py" none
status=$?
timeout 300 python3 -m rlperf train --deterministic-mode --num-rollout 12 --skip-gates --no-progress \
  --output-dir "$OUT/det" >"$OUT/det.log" 2>&1 || { tail -20 "$OUT/det.log"; status=1; }
if [ $# -ge 1 ] && [ -f "$1" ]; then
  python3 - "$1" "$OUT/det/metrics.jsonl" <<'PY' | tee "$OUT/compare.txt"
import json, sys
skip = lambda k: k.startswith(("perf/", "memory/")) or "time" in k
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
bad = [(x["rollout_id"], k, x.get(k), y.get(k)) for x, y in zip(a, b) for k in set(x) | set(y)
       if not skip(k) and x.get(k) != y.get(k)]
print(f"{len(a)} vs {len(b)} lines; {len(bad)} differences", *bad[:20], sep="\n")
sys.exit(1 if bad or len(a) != len(b) else 0)
PY
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
