#!/usr/bin/env bash
# Programmatic dependent launch (PDL: the default on SM 90+; RLPERF_PDL, kernels/pipeline.py) against
# plain launches on ONE GPU: first the bits, then the time, every PDL number next to the plain one of the
# same call. Results in $OUT:
#   gpu-tests.log        the PDL bit tests: engine tokens and log-probs (eager and graphed decode) and the
#                        packed forward/backward's gradients with PDL on equal them with it off
#                        (tests/kernels/test_programmatic_launch.py), and graphed train micro-steps captured
#                        with PDL equal to plain eager calls (tests/train/test_cuda_graph_train.py -k pdl)
#   fusion-ab.log        python -m rlperf.bench.fusion_ab --variants "no pdl": decode B = $BATCHES and prefill 16x512,
#                        the engine's default (PDL) and plain launches in one process (ms and the ratio
#                        to the default)
#   rollout-plain.json/.log, rollout-pdl.json/.log   rlperf bench rollout --quick with RLPERF_PDL=0 and =1
#   loop-plain.json/.log, loop-pdl.json/.log         rlperf bench loop --quick --cuda-graph-buckets auto
#                        (graphed micro-steps, rlperf train's default), with RLPERF_PDL=0 and =1:
#                        tokens/s and the train phase
#
#   bash bench/device_pdl.sh
#   STEPS="tests fusion" bash bench/device_pdl.sh      # a subset of: tests fusion rollout loop
#   BATCHES=1,64 bash bench/device_pdl.sh              # decode batches of the A/B (default 1,16,64,256)
#
# Each step runs under `timeout` (tests 240 s, fusion 200 s, rollout 2 x 280 s, loop 2 x 150 s: 1,300 s of
# limits in all, more than one call's 600 s; split them with STEPS, as `tests fusion loop` (740 s of limits,
# 125 s on an H200) then `rollout` (560 s: the rollout bench's FlashInfer anchor compiles on first use, and
# both runs ran past a 100 s limit there)) and a failing step does not stop the next; the exit status is 1
# if any step failed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
BATCHES=${BATCHES:-1,16,64,256}
status=0
STEPS=" ${STEPS:-tests fusion rollout loop} "
wanted() { [[ "$STEPS" == *" $1 "* ]]; }
if wanted tests; then
  step gpu-tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_programmatic_launch.py \
    tests/train/test_cuda_graph_train.py -k "pdl or programmatic"
  grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
fi
if wanted fusion; then
  step fusion-ab 200 python3 -m rlperf.bench.fusion_ab --variants "no pdl" --batches "$BATCHES"
  grep -E "^\|" "$OUT/fusion-ab.log" || true
fi
if wanted rollout; then
  step rollout-plain 280 env RLPERF_PDL=0 python3 -m rlperf bench rollout --quick --json "$OUT/rollout-plain.json"
  step rollout-pdl 280 env RLPERF_PDL=1 python3 -m rlperf bench rollout --quick --json "$OUT/rollout-pdl.json"
  grep -h "summary" "$OUT/rollout-plain.log" "$OUT/rollout-pdl.log" || true
fi
if wanted loop; then
  for pdl in 0 1; do
    name=loop-$([ $pdl = 1 ] && echo pdl || echo plain)
    step "$name" 150 env RLPERF_PDL=$pdl python3 -m rlperf bench loop --quick --cuda-graph-buckets auto \
      --json "$OUT/$name.json"
  done
  grep -h "summary" "$OUT/loop-plain.log" "$OUT/loop-pdl.log" || true
fi
exit $status
