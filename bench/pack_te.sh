#!/usr/bin/env bash
# On the CPU machine (it has network; the GPU machines have none): pack Transformer Engine for the GPU
# machines (CPython 3.12, torch 2.11 + CUDA 13, H100/H200) into chunks a device call can carry, for the
# plain-Megatron anchor with TE layers (issue #38). bench/device_te.sh unpacks, builds and checks it there.
#
#   bash bench/pack_te.sh                        # download, install into .te-pack/site, keep SM 90, split
#   TE_VERSION=2.12.0 TE_SM=90 PACK_DIR=/tmp/p bash bench/pack_te.sh
#
# What travels (TE 2.12.0): transformer-engine (the Python package, 0.7 MB), transformer-engine-cu13 (the
# core library: a 190 MB wheel whose libtransformer_engine.so holds 440 of its 466 MiB as device code
# for seven GPU architectures), the pydantic packages and nvdlfw-inspect (TE's PyTorch front end imports
# them; the GPU image lacks them), and transformer-engine-torch as its source (0.3 MB: 28 C++ files built
# on the GPU machine against its torch, the only way to match torch 2.11's ABI).
# Size: xz of the whole library is 137 MiB (three device calls). `python -m rlperf.bench.fatbin_keep_arch`
# keeps the SM 90 cubins and zeroes the other architectures' device code in place (the file keeps its
# layout), which compresses to ~9 MiB: the pack is one chunk, carried with one call. The library then
# runs on SM 90 GPUs only (H100, H200): the GPUs these scripts are run on.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK_DIR=${PACK_DIR:-.te-pack}
TE_VERSION=${TE_VERSION:-2.12.0}
TE_SM=${TE_SM:-90}
PYTHON=${PYTHON:-python3}
# what TE's PyTorch front end imports that the GPU image lacks (it has einops, onnx, onnxscript, pybind11, cuDNN)
DEPS=(pydantic pydantic-core annotated-types typing-inspection nvdlfw-inspect)
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
rm -rf "$PACK_DIR/site" "$PACK_DIR/wheels"
mkdir -p "$PACK_DIR/wheels" "$PACK_DIR/site/_sdist"
if ! "$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps "${PLATFORM[@]}" \
    --dest "$PACK_DIR/wheels" "transformer-engine==$TE_VERSION" "transformer-engine-cu13==$TE_VERSION" "${DEPS[@]}"; then
  echo "pack_te: the package index here lacks TE $TE_VERSION's wheels (pip's error names them): PIP_INDEX_URL or TE_VERSION" >&2
  exit 1
fi
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
  --dest "$PACK_DIR/site/_sdist" "transformer-engine-torch==$TE_VERSION"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --only-binary=:all: \
  "${PLATFORM[@]}" --target "$PACK_DIR/site" "$PACK_DIR"/wheels/*.whl
lib="$PACK_DIR/site/transformer_engine/wheel_lib/libtransformer_engine.so"
[ -f "$lib" ] || { echo "pack_te: $lib is missing (the cu13 wheel's layout changed?)" >&2; exit 1; }
"$PYTHON" -m rlperf.bench.fatbin_keep_arch "$lib" "$lib.kept" --arch "$TE_SM"
mv "$lib.kept" "$lib"
rm -rf "$PACK_DIR/site/transformer_engine/jax"  # the JAX front end (its extension is another package)
find "$PACK_DIR/site" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf "$PACK_DIR/wheels"
PACK_DIR=$PACK_DIR bash bench/pack_chunks.sh
chunks=("$PACK_DIR"/chunk-*)
echo "pack_te: Transformer Engine $TE_VERSION (SM $TE_SM device code) in ${#chunks[@]} chunk(s) in $PACK_DIR:"
for c in "${chunks[@]}"; do echo "  $(basename "$c") $(( $(stat -c %s "$c") >> 10 )) KiB"; done
echo "  device call: carry [\"$PACK_DIR/MANIFEST\", \"$PACK_DIR/chunk-00\"], command: bash bench/device_te.sh"
