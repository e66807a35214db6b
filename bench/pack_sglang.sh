#!/usr/bin/env bash
# On the CPU machine (it has network; the GPU machines have none): download SGLang's pinned set for the
# GPU machines (CPython 3.12, manylinux x86_64, beside their torch 2.11 + CUDA 13), install it into one
# folder, trim it, compress it and split it into chunks of < 60 MiB, so each chunk travels with one
# device call (a call carries at most 64 MiB of ignored files). bench/unpack_sglang.sh reassembles the
# chunks in /tmp/sglang-site on a warm GPU machine, one call at a time (docs/gpu.md, "SGLang and FlashInfer").
#
#   bash bench/pack_sglang.sh                  # download + install + trim + split, into .sglang-pack/
#   bash bench/pack_sglang.sh --from-site DIR  # trim + split an installed folder (no download)
#   PACK_DIR=/tmp/p CHUNK_BYTES=$((50 << 20)) bash bench/pack_sglang.sh
#   SGLANG_VERSION=0.5.18 bash bench/pack_sglang.sh   # another release (it must run beside torch 2.11)
#
# Then, once per chunk, on the same warm machine (carry MANIFEST and the chunk; the tree travels anyway):
#   carry [".sglang-pack/MANIFEST", ".sglang-pack/chunk-00"]   command: bash bench/unpack_sglang.sh
#
# Why these versions: sglang 0.5.17 is the last release that pins torch 2.11.0 (the GPU machines' torch);
# it needs sglang-kernel 0.4.5, flashinfer-python 0.6.15.post1 (JIT: nvcc compiles its kernels on first
# use) with apache-tvm-ffi, and transformers 5.12.1 + tokenizers 0.22.2 (the image's transformers 5.17
# breaks sglang's import: "'qwen3_asr' is already used"). The rest is what sglang's import chain (engine,
# scheduler, model runner, the flashinfer and triton attention backends) imports and the image lacks.
# The image has torch, triton, numpy, aiohttp, requests, packaging, psutil, pillow, jinja2, filelock, fsspec.
#
# Trimmed: sglang-kernel's FlashAttention-3 library and every other compiled library of it but
# sm90/common_ops and spatial_ops (~370 MB of its 383; rlperf runs SGLang with --attention-backend
# flashinfer or triton, which need no FA3), bytecode caches, and the packages' own PKG/tests folders.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK_DIR=${PACK_DIR:-.sglang-pack}
CHUNK_BYTES=${CHUNK_BYTES:-$((59 << 20))}
PYTHON=${PYTHON:-python3}
XZ_LEVEL=${XZ_LEVEL:-6}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.17}
PACKAGES=(
  "sglang==$SGLANG_VERSION"
  sglang-kernel==0.4.5
  flashinfer-python==0.6.15.post1
  apache-tvm-ffi==0.1.11
  transformers==5.12.1
  tokenizers==0.22.2
  huggingface-hub==1.33.0
  safetensors
  sglang-router
  xgrammar==0.2.1
  # sglang's server and scheduler
  fastapi starlette uvicorn uvloop pydantic pydantic-core annotated-types typing-inspection
  orjson pybase64 pyzmq msgspec setproctitle python-multipart prometheus-client
  partial-json-parser compressed-tensors interegular einops ninja nvidia-ml-py
  openai==2.6.1 httpx httpcore anyio sniffio h11 distro jiter tqdm regex sentencepiece tiktoken
  llguidance blobfile pyyaml tabulate click
  # imported on sglang 0.5.17's launch path and missing from the GPU image (found by importing the
  # engine, scheduler, model runner and both attention backends from the packed site on Python 3.12)
  opentelemetry-api dill loguru gguf jsonschema jsonschema-specifications referencing rpds-py
  soundfile==0.13.1 cffi pycparser
  ipython ipython-pygments-lexers traitlets jedi parso matplotlib-inline prompt-toolkit wcwidth
  stack-data executing asttokens pure-eval pexpect ptyprocess
)
SGL_KERNEL_KEEP='sm90/common_ops|spatial_ops'
from_site=
if [ "${1:-}" = "--from-site" ]; then
  from_site=${2:?--from-site needs a folder}
fi
mkdir -p "$PACK_DIR"
rm -rf "$PACK_DIR/site" "$PACK_DIR"/chunk-* "$PACK_DIR/MANIFEST" "$PACK_DIR/sglang-site.tar.xz"
if [ -n "$from_site" ]; then
  cp -a "$from_site" "$PACK_DIR/site"
else
  rm -rf "$PACK_DIR/wheels"  # exactly this list's wheels: a version left by an earlier pack would clash
  mkdir -p "$PACK_DIR/wheels"
  # --no-deps: exactly this list (the GPU image has the rest); --only-binary: wheels, never an sdist
  if ! "$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
      --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 --dest "$PACK_DIR/wheels" "${PACKAGES[@]}"; then
    echo "pack_sglang: the package index here lacks a pinned version above (pip's error names it); point pip at" \
         "one that has it (PIP_INDEX_URL) or set SGLANG_VERSION to one it has and torch 2.11 runs" >&2
    exit 1
  fi
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
    --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 --target "$PACK_DIR/site" "$PACK_DIR"/wheels/*.whl
fi
site="$PACK_DIR/site"
before=$(du -sb "$site" | cut -f1)
# sglang-kernel: its Python and the two libraries SGLang's flashinfer/triton paths load
if [ -d "$site/sgl_kernel" ]; then
  find "$site/sgl_kernel" -name '*.so*' | grep -Ev "$SGL_KERNEL_KEEP" | xargs -r rm -f
fi
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$site" -mindepth 2 -maxdepth 2 -type d -name tests -prune -exec rm -rf {} +  # PKG/tests (never imported)
after=$(du -sb "$site" | cut -f1)
tar -C "$PACK_DIR" -cf - site | xz -T0 "-$XZ_LEVEL" > "$PACK_DIR/sglang-site.tar.xz"
split -b "$CHUNK_BYTES" -d -a 2 "$PACK_DIR/sglang-site.tar.xz" "$PACK_DIR/chunk-"
chunks=("$PACK_DIR"/chunk-*)
{
  echo "archive $(sha256sum "$PACK_DIR/sglang-site.tar.xz" | cut -d' ' -f1) $(stat -c %s "$PACK_DIR/sglang-site.tar.xz") ${#chunks[@]}"
  for c in "${chunks[@]}"; do
    echo "chunk $(basename "$c") $(sha256sum "$c" | cut -d' ' -f1) $(stat -c %s "$c")"
  done
  ls "$site" | grep -E '\.dist-info$' | sed 's/\.dist-info$//; s/^/package /'
} > "$PACK_DIR/MANIFEST"
rm -f "$PACK_DIR/sglang-site.tar.xz"
echo "pack_sglang: $site $((before >> 20)) MiB installed, $((after >> 20)) MiB trimmed;" \
     "${#chunks[@]} chunk(s) of <= $((CHUNK_BYTES >> 20)) MiB in $PACK_DIR:"
for c in "${chunks[@]}"; do echo "  $(basename "$c") $(( $(stat -c %s "$c") >> 10 )) KiB"; done
