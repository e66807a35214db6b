#!/usr/bin/env bash
# One device call (2 GPUs) for the weight-update hardening: the NCCL path through an engine on the
# second GPU (its join now takes a connect timeout; a failed receive leaves the group), the gloo
# receiver child feeding a CUDA engine, and the CPU hostile-peer tests on the device's CPU.
#
#   bash bench/device_harden.sh
#
# Assumes nothing installed: installs the project (and .whl/ wheels when carried), logs into $OUT.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
status=0
echo "== GPU: NCCL broadcast to an engine on GPU 1; gloo receiver child into a CUDA engine"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/loop/test_disaggregated.py::test_nccl_broadcast_to_an_engine_on_the_second_gpu \
  tests/rollout/test_weight_update_hostile.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -20
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "== CPU: hostile peers, server faults, flags (on the device's CPU)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_weight_update_hostile.py \
  tests/rollout/test_server_faults.py tests/test_flags.py 2>&1 | tee "$OUT/cpu-tests.log" | tail -20
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
