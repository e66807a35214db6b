#!/usr/bin/env bash
# One device call: the synthetic loop (bench/device_e2e.sh's `synthetic` stage) on an earlier tree
# and on this one, same card, same run, so a change to the loop is reported as before/after.
#
#   bash bench/device_before_after.sh BASE_DIR
#
# BASE_DIR holds the earlier tree (e.g. `git archive <commit> | tar -x -C .base`, carried along).
# Each tree is installed in turn (the earlier one as a plain install, this one editable); the
# step-time tables land in $OUT/before-table.md and $OUT/after-table.md.
set -uo pipefail
BASE=${1:?usage: bench/device_before_after.sh BASE_DIR}
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
HERE=$(pwd)
BASE=$(cd "$BASE" && pwd)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
for side in before after; do
  if [ "$side" = before ]; then src=$BASE; flags=(); else src=$HERE; flags=(-e); fi
  python3 -m pip install -q --no-deps --no-build-isolation "${flags[@]}" "$src" >"$OUT/install-$side.log" 2>&1 \
    || { tail -20 "$OUT/install-$side.log"; exit 3; }
  echo "== $side ($src)"
  mkdir -p "$OUT/$side"
  # from a neutral folder: run in a checkout, `python3 -m rlperf` would import that folder's rlperf/
  (cd /tmp && OUT="$OUT/$side" bash "$src/bench/device_e2e.sh" synthetic >"$OUT/$side.log" 2>&1)
  rc=$?
  [ "$rc" = 0 ] || { status=1; tail -30 "$OUT/$side.log"; }
  tar -xzf "$OUT/$side/e2e.tar.gz" -C "$OUT/$side" 2>/dev/null
  cp "$OUT/$side/synthetic-table.md" "$OUT/$side-table.md" 2>/dev/null
  tail -14 "$OUT/$side.log"
done
exit $status
