#!/usr/bin/env bash
# On a machine with network (the CPU machine), download into .whl/ the wheels the GPU machines lack,
# built for them: CPython 3.12, manylinux x86_64. bench/device.sh installs whatever .whl/ holds
# (--no-deps, into /tmp/site) before its tests; carry .whl/ with the tree on the device call.
#
#   bash bench/fetch_wheels.sh            # every wheel below, into .whl/ (kept: a second run downloads nothing new)
#   WHEEL_DIR=/tmp/w bash bench/fetch_wheels.sh
#
# What the GPU image lacks, with the versions these tests ran with there:
#   the sglang-router and its server stack (fastapi and the opentelemetry-api it imports, starlette, pydantic,
#   uvicorn, orjson, setproctitle);
#   sglang, whose FlattenedTensorBucket the bucket interop tests load (installed without its own
#   dependencies, as on the CPU); pytest-benchmark (bench/test_microbench.py); perfetto (trace checks);
#   megatron-core 0.19 (the megatron trainer backend; 0.19 needs Python >= 3.12, which the image has);
#   flashinfer-python with apache-tvm-ffi (the FlashInfer anchors of the attention and sampling benches;
#   JIT: nvcc compiles each kernel on first use).
# The image has torch, triton, aiohttp, anyio, click and h11. pydantic pins pydantic-core exactly: change
# the two together.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_DIR=${WHEEL_DIR:-.whl}
PYTHON=${PYTHON:-python3}
WHEELS=(
  sglang-router==0.3.2
  fastapi==0.165.0
  opentelemetry-api==1.45.2
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  uvicorn==0.54.0
  orjson==3.13.0
  setproctitle==1.3.8
  sglang==0.5.9
  pytest-benchmark==5.3.1
  perfetto==0.59.1
  megatron-core==0.19.0
  flashinfer-python==0.6.15.post1
  apache-tvm-ffi==0.1.15.post2
)
mkdir -p "$WHEEL_DIR"
# --no-deps: exactly this list (the image has the rest); --only-binary: wheels, never an sdist to build;
# manylinux2014 (glibc 2.17) first, manylinux_2_28 for projects that ship only that.
"$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --dest "$WHEEL_DIR" "${WHEELS[@]}"
# one wheel per project: a run that named other versions earlier leaves two, and device.sh installs all
dupes=$(ls "$WHEEL_DIR"/*.whl | xargs -n1 basename | cut -d- -f1 | tr '[:upper:]' '[:lower:]' | sort | uniq -d)
if [ -n "$dupes" ]; then
  echo "fetch_wheels: $WHEEL_DIR holds two versions of: $dupes; remove the old ones" >&2
  exit 1
fi
n=$(ls "$WHEEL_DIR"/*.whl | wc -l)
echo "fetch_wheels: $n wheels in $WHEEL_DIR ($(du -sh "$WHEEL_DIR" | cut -f1)) for CPython 3.12 manylinux x86_64:"
ls "$WHEEL_DIR"/*.whl | xargs -n1 basename | sed 's/^/  /'
