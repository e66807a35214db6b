#!/usr/bin/env bash
# One device call (2 GPUs) for the weight-update hardening: the NCCL path through an engine on the
# second GPU (its join now takes a connect timeout; a failed receive leaves the group), the gloo
# receiver child feeding a CUDA engine, and the CPU hostile-peer tests on the device's CPU.
#
#   bash bench/device_harden.sh
#
# Assumes nothing installed: installs the project (and .whl/ wheels when carried), logs into $OUT.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 \
    || { tail -30 "$OUT/wheels.log"; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 3; }
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
