#!/usr/bin/env bash
# One device call on a multi-GPU machine, several jobs ("lanes") at once, each on its own GPUs: the
# installs run once, then every lane runs with CUDA_VISIBLE_DEVICES set to its GPUs, OUT set to
# $OUT/lane-<i>, its own torchrun port, and a time limit (LANE_TIMEOUT seconds, default 500). A lane's
# output lands in $OUT/lane-<i>.log and its exit status in $OUT/lane-<i>.rc; at the end each lane's status
# and the tail of its log are printed (also into $OUT/lanes.txt), and everything the lanes wrote is
# bundled into $OUT/lanes.tar.gz (a device call brings back at most 8 files). The exit status is 0 only
# if every lane's is.
#
#   bash bench/device_lanes.sh "GPUS:COMMAND" ["GPUS:COMMAND" ...]
#   e.g. (4 GPUs, device kind nvidia-h100-x4):
#   RLPERF_COMMIT=$(git rev-parse --short HEAD) bash bench/device_lanes.sh \
#     "0:bash bench/device.sh tests 1" "1:bash bench/device.sh tests 2" \
#     "2,3:MEGATRON_RUNS='tree-0.6b-tp1 tree-0.6b-tp2' bash bench/device_megatron.sh"
#
# Lanes share the host's CPU cores, so a launch-bound benchmark in one lane can read a little slower
# than alone: ratios are measured within one lane (anchor and subject on the same GPUs, back to back).
#
# The lanes' limit never runs past the device call: it is LANE_TIMEOUT or, if less, what is left of
# CALL_LIMIT (default 600 s, one device call) after the installs, less 30 s to bundle the results. A
# call that the device tool stops at its own limit brings back only its first 8 files, so the bundle
# must be written before that.
set -uo pipefail
SCRIPT_START=$(date +%s)
cd "$(dirname "$0")/.."
if [ $# = 0 ]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
for lane in "$@"; do
  if [[ ! "$lane" =~ ^[0-9]+(,[0-9]+)*: ]]; then
    echo "bench/device_lanes.sh: lane '$lane' does not start with GPUS: (e.g. 0: or 2,3:)" >&2
    exit 2
  fi
done
OUT=${OUT:-$(mktemp -d)}
source bench/device_setup.sh
export RLPERF_SETUP_DONE=1
start=$(date +%s)
LIMIT=${LANE_TIMEOUT:-500}
LEFT=$(( ${CALL_LIMIT:-600} - (start - SCRIPT_START) - 30 ))
if [ "$LEFT" -lt "$LIMIT" ]; then
  echo "lanes: the installs took $((start - SCRIPT_START)) s: each lane gets ${LEFT} s (CALL_LIMIT=${CALL_LIMIT:-600})"
  LIMIT=$LEFT
fi
if [ "$LIMIT" -lt 30 ]; then
  echo "bench/device_lanes.sh: ${LIMIT} s left for the lanes: raise CALL_LIMIT or carry fewer wheels" >&2
  exit 3
fi
ROOT_OUT=$OUT
i=0
for lane in "$@"; do
  gpus=${lane%%:*}
  cmd=${lane#*:}
  mkdir -p "$ROOT_OUT/lane-$i"
  echo "lane $i on GPU $gpus: $cmd" | tee "$ROOT_OUT/lane-$i.cmd"
  (
    export CUDA_VISIBLE_DEVICES=$gpus OUT=$ROOT_OUT/lane-$i PET_MASTER_PORT=$((29500 + 17 * i))
    timeout -k 15 "$LIMIT" bash -c "$cmd" >"$ROOT_OUT/lane-$i.log" 2>&1
    echo $? >"$ROOT_OUT/lane-$i.rc"
  ) &
  i=$((i + 1))
done
wait
status=0
for ((j = 0; j < i; j++)); do
  rc=$(cat "$ROOT_OUT/lane-$j.rc" 2>/dev/null || echo missing)
  note=""
  [ "$rc" = 124 ] && note=" (stopped at its ${LIMIT} s limit)"
  echo "===== lane $j: exit $rc$note: $(cut -d: -f2- "$ROOT_OUT/lane-$j.cmd")"
  tail -n "${LANE_TAIL:-25}" "$ROOT_OUT/lane-$j.log"
  [ "$rc" = 0 ] || status=1
done 2>&1 | tee "$ROOT_OUT/lanes.txt"
grep -q "^===== lane [0-9]*: exit [^0]" "$ROOT_OUT/lanes.txt" && status=1
(cd "$ROOT_OUT" && find . -mindepth 1 -maxdepth 1 ! -name lanes.txt ! -name lanes.tar.gz -print0 \
  | tar czf lanes.tar.gz --null -T - && find . -mindepth 1 -maxdepth 1 ! -name lanes.txt ! -name lanes.tar.gz \
  -exec rm -rf {} +)
echo "lanes done in $(($(date +%s) - start)) s; everything in $ROOT_OUT/lanes.tar.gz"
exit $status
