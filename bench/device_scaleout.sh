#!/usr/bin/env bash
# One device call (4 GPUs, under 10 minutes): the scale-out benchmark of issue #14. The synthetic loop
# (bench/loop.py's flags and prompts) on 1 GPU with the in-process engine, then DP=2 + 2 engines on 4
# GPUs, then DP=2 colocated on 2 GPUs if the time budget allows; prints each layout's tokens/s (mean
# over the rollouts after the first), its speedup over 1 GPU and the abs diff of every step
# (bench/scaleout.py). Logs and metrics land in $OUT/$SCALEOUT_NAME/<layout>/, bundled in
# $OUT/$SCALEOUT_NAME.tar.gz, the output in $OUT/$SCALEOUT_NAME.log (SCALEOUT_NAME: default scaleout).
#
#   bash bench/device_scaleout.sh [flags of python -m rlperf.bench.scaleout]
#   e.g. RLPERF_COMMIT=$(git rev-parse --short HEAD) bash bench/device_scaleout.sh --prompts 32 --samples 8
#   an A/B of a setting on the same machine, in one device command:
#   bash bench/device_scaleout.sh --layouts 1gpu,dp2-engines2 && \
#     SCALEOUT_NAME=scaleout-mb bash bench/device_scaleout.sh --layouts 1gpu,dp2-engines2 --train-flags "--fsdp-gather micro-batch"
#
# Packages the device image lacks (sglang-router and its server stack) travel as wheels in .whl/
# (carry it, as for bench/device.sh).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 \
    || { tail -30 "$OUT/wheels.log"; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 3; }
NAME=${SCALEOUT_NAME:-scaleout}
python3 -m rlperf.bench.scaleout --output-dir "$OUT/$NAME" "$@" 2>&1 | tee "$OUT/$NAME.log"
status=${PIPESTATUS[0]}
(cd "$OUT" && tar czf "$NAME.tar.gz" "$NAME" && rm -rf "$NAME")
exit $status
