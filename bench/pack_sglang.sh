#!/usr/bin/env bash
# On the CPU machine (it has network; the GPU machines have none): download SGLang's pinned set for the
# GPU machines (CPython 3.12, manylinux x86_64, beside their torch 2.11 + CUDA 13), install it into one
# folder, trim it to SGLang's launch path, compress it and split it into chunks of <= 59 MiB (today one),
# so the pack travels with one device call (a call carries at most 64 MiB: tree + carried files).
# bench/unpack_sglang.sh reassembles it in /tmp/sglang-site on the GPU machine (docs/gpu.md, "SGLang and FlashInfer").
#
#   bash bench/pack_sglang.sh                  # download + install + trim + split, into .sglang-pack/
#   bash bench/pack_sglang.sh --from-site DIR  # trim + split an installed folder (no download; the pack's
#                                              # own .sglang-pack/site is trimmed in place)
#   PACK_DIR=/tmp/p CHUNK_BYTES=$((50 << 20)) bash bench/pack_sglang.sh
#   SGLANG_VERSION=0.5.18 bash bench/pack_sglang.sh   # another release (it must run beside torch 2.11)
#
# Then one device call on a bare GPU machine unpacks the chunk and runs SGLang work (the tree travels anyway):
#   carry [".sglang-pack/MANIFEST", ".sglang-pack/chunk-00"]   command: bash bench/device_sglang.sh "imports check"
# (bench/unpack_sglang.sh alone unpacks; a pack of several chunks, CHUNK_BYTES smaller, still works one
# chunk a call.)
#
# Why these versions: sglang 0.5.17 is the last release that pins torch 2.11.0 (the GPU machines' torch);
# it needs sglang-kernel 0.4.5, flashinfer-python 0.6.15.post1 (JIT: nvcc compiles its kernels on first
# use) with apache-tvm-ffi, and transformers 5.12.1 + tokenizers 0.22.2 (the image's transformers 5.17
# breaks sglang's import: "'qwen3_asr' is already used"). The rest is what sglang's import chain (engine,
# scheduler, model runner, the flashinfer and triton attention backends) imports and the image lacks.
# The image has torch, triton, numpy, aiohttp, requests, packaging, psutil, pillow, jinja2, filelock, fsspec.
#
# One chunk: the pack is trimmed to what SGLang's launch path imports, so the whole site travels in ONE
# device call (the archive, 54 MiB for sglang 0.5.17, beside the project tree and a few MiB of slack in
# the 64 MiB a call carries), and `bash bench/device_sglang.sh STAGES` unpacks it itself on a bare machine.
# The launch path: `python -m sglang.launch_server` (HTTP server, tokenizer manager, scheduler, TP worker,
# model runner, detokenizer) with --attention-backend rlperf (rlperf's plugin: hook_registry, server_args,
# the attention registry, models/registry, sampler, logits_processor, forward_batch_info, mem_cache),
# flashinfer or triton; `python -m sglang_router.launch_router`; `python -m sglang.bench_one_batch`.
# All three attention backends keep what they import: sglang-kernel (imported at module level by SGLang's
# layers on CUDA: its sm90/common_ops loads at `import sgl_kernel`), flashinfer with its JIT sources
# (csrc, include, cutlass, cccl: the flashinfer backend and rlperf's FlashInfer anchors compile from them)
# and xgrammar's Python + bindings (SGLang's OpenAI protocol imports it; default grammar backend).
#
# TRIM below is the one list of what goes (globs under the site; a "!" entry keeps what an earlier glob
# would take). To put something back, delete its line (or add a "!" line) and pack again. It removes:
#   - xgrammar/lib: libxgrammar.a, a static library for C++ builds against xgrammar (62 MB, 28 MB xz);
#   - SGLang's optional Rust extensions: srt/server/_core (the embedded Rust server, SGLANG_RUST_SERVER=1),
#     srt/grpc/_core (--grpc-port), srt/multimodal/_core (Inkling image preprocessing); each is imported
#     only inside the function that needs it, and says what is missing when it is;
#   - sglang/multimodal_gen (diffusion serving: imported by nothing on the launch path);
#   - SGLang's model files but the Qwen3/Qwen2/Llama family the launch path imports at module level
#     (http_server -> serving_transcription -> qwen3_asr -> qwen3_omni_moe/qwen3_vl(_moe)/qwen3_moe/qwen2_moe):
#     the model registry imports each file of sglang/srt/models and skips what is absent; rlperf's plugin
#     brings its own Qwen3 models (SGLANG_EXTERNAL_MODEL_PACKAGE);
#   - transformers' model folders but the ones SGLang's configs and kept models import, and the auto
#     mappings (AutoConfig for qwen3/qwen2/llama configs, the Qwen2 tokenizer);
#   - packages nothing on the launch path imports: llguidance (--grammar-backend llguidance), blobfile,
#     tiktoken (xgrammar tries it and goes on without), and the interactive half of IPython's stack
#     (jedi, parso, prompt_toolkit, wcwidth, stack_data, executing, asttokens, pure_eval, pexpect,
#     ptyprocess, matplotlib_inline). IPython itself stays: sglang/utils.py imports IPython.display at
#     module level (for notebooks) and http_server imports sglang.utils;
#   - console scripts (bin/), man pages (share/), stray top-level files of the wheels, *.pyi stubs,
#     bytecode caches, the packages' own PKG/tests folders, and sglang-kernel's FlashAttention-3 library
#     and every other compiled library of it but sm90/common_ops and spatial_ops (~370 MB of its 383);
#   - and the shared libraries' debug sections and static symbol tables (strip --strip-unneeded; the
#     dynamic symbols Python loads by stay): xgrammar's bindings 9 -> 0.7 MB xz, uvloop 3.2 -> 0.6 MB,
#     the router 20 -> 17.5 MB. sglang-kernel's libraries ship stripped and are left as they are.
# Kept though imported only in corners: gguf, soundfile (+ libsndfile), sentencepiece, openai,
# compressed-tensors, jsonschema, dill, loguru: each is imported at module level on the launch path.
# The device check `bash bench/device_sglang.sh imports` imports the launch-path modules from the
# unpacked site and prints each missing module on its own line ("missing MODULE (imported by ...)").
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
# What the trim removes, as globs under the site ("!GLOB": keep what matches, though an entry takes it).
# Each line says why; the header above says why it is safe. Delete a line to put that back.
TRIM=(
  'xgrammar/lib'                                   # libxgrammar.a: static library, build time only
  'sglang/srt/server/_core.*' 'sglang/srt/grpc/_core.*' 'sglang/srt/multimodal/_core.*'  # opt-in Rust parts
  'sglang/multimodal_gen'                          # diffusion serving (nothing on the launch path imports it)
  'sglang/srt/models/*'                            # model files, but these (the launch path imports them):
  '!sglang/srt/models/__init__.py' '!sglang/srt/models/registry.py' '!sglang/srt/models/utils.py'
  '!sglang/srt/models/llama.py' '!sglang/srt/models/qwen2.py' '!sglang/srt/models/qwen2_moe.py'
  '!sglang/srt/models/qwen3.py' '!sglang/srt/models/qwen3_moe.py' '!sglang/srt/models/qwen3_vl.py'
  '!sglang/srt/models/qwen3_vl_moe.py' '!sglang/srt/models/qwen3_omni_moe.py' '!sglang/srt/models/qwen3_asr.py'
  '!sglang/srt/models/deepseek_common' '!sglang/srt/models/inkling_common'  # the MoE and LoRA layers import them
  'transformers/models/*'                          # transformers' model folders, but these:
  '!transformers/models/__init__.py' '!transformers/models/auto'
  '!transformers/models/deepseek_v3' '!transformers/models/encoder_decoder' '!transformers/models/gemma4'  # imported on the launch path
  '!transformers/models/gpt_oss' '!transformers/models/lfm2' '!transformers/models/lfm2_vl'
  '!transformers/models/llama' '!transformers/models/mellum' '!transformers/models/nemotron_h'
  '!transformers/models/qwen2' '!transformers/models/qwen2_5_vl' '!transformers/models/qwen3'
  '!transformers/models/qwen3_moe' '!transformers/models/siglip' '!transformers/models/whisper'
  '!transformers/models/qwen2_moe' '!transformers/models/qwen2_vl' '!transformers/models/qwen2_audio'  # a margin: Qwen/Mistral/GPT-2 configs and tokenizers
  '!transformers/models/qwen3_vl' '!transformers/models/qwen3_vl_moe' '!transformers/models/qwen3_omni_moe'
  '!transformers/models/mistral' '!transformers/models/gpt2'
  'llguidance' 'llguidance-*.dist-info'            # --grammar-backend llguidance only
  'blobfile' 'blobfile-*.dist-info'                # tiktoken's remote files
  'tiktoken' 'tiktoken_ext' 'tiktoken-*.dist-info' # xgrammar tries it, goes on without
  'jedi' 'jedi-*.dist-info' 'parso' 'parso-*.dist-info'   # IPython's completer (interactive only)
  'prompt_toolkit' 'prompt_toolkit-*.dist-info' 'wcwidth' 'wcwidth-*.dist-info'  # IPython's terminal
  'stack_data' 'stack_data-*.dist-info' 'executing' 'executing-*.dist-info'      # IPython's tracebacks
  'asttokens' 'asttokens-*.dist-info' 'pure_eval' 'pure_eval-*.dist-info'
  'pexpect' 'pexpect-*.dist-info' 'ptyprocess' 'ptyprocess-*.dist-info'          # IPython's shell escapes
  'matplotlib_inline' 'matplotlib_inline-*.dist-info'
  'bin' 'share' 'tools' 'example.py' 'build_backend.py' 'build_utils.py'        # scripts, man pages, strays
)
STRIP=${STRIP:-1}  # 0: leave the shared libraries' symbols and debug sections
from_site=
if [ "${1:-}" = "--from-site" ]; then
  from_site=${2:?--from-site needs a folder}
fi
mkdir -p "$PACK_DIR"
rm -rf "$PACK_DIR"/chunk-* "$PACK_DIR/MANIFEST" "$PACK_DIR/sglang-site.tar.xz"
if [ -n "$from_site" ]; then
  [ -d "$from_site" ] || { echo "pack_sglang: --from-site $from_site is not a folder" >&2; exit 2; }
  # the pack's own site (--from-site $PACK_DIR/site) is trimmed where it is: the trim only removes
  if [ "$(realpath "$from_site")" != "$(realpath -m "$PACK_DIR/site")" ]; then
    rm -rf "$PACK_DIR/site"
    cp -a "$from_site" "$PACK_DIR/site"
  fi
else
  rm -rf "$PACK_DIR/site"
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
  find "$site/sgl_kernel" -name '*.so*' | { grep -Ev "$SGL_KERNEL_KEEP" || true; } | xargs -r rm -f  # none left: a re-trim
fi
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$site" -mindepth 2 -maxdepth 2 -type d -name tests -prune -exec rm -rf {} +  # PKG/tests (never imported)
find "$site" -name '*.pyi' -type f -delete  # type stubs (never imported)
# TRIM: every glob's matches go, but those a "!" entry names
keep=()
for e in "${TRIM[@]}"; do [[ $e == '!'* ]] && keep+=("${e#!}"); done
for e in "${TRIM[@]}"; do
  [[ $e == '!'* ]] && continue
  for path in "$site"/$e; do
    [ -e "$path" ] || continue
    rel=${path#"$site"/}
    kept=
    for k in "${keep[@]}"; do
      # shellcheck disable=SC2053  # $k is a glob
      if [[ $rel == $k ]]; then kept=1; break; fi
    done
    [ -n "$kept" ] || rm -rf "$path"
  done
done
# the shared libraries' debug sections and static symbols (the dynamic ones, which Python loads by, stay)
if [ "$STRIP" = 1 ] && command -v strip > /dev/null; then
  find "$site" -name '*.so' -type f -not -path "$site/sgl_kernel/*" -exec strip --strip-unneeded {} +
fi
after=$(du -sb "$site" | cut -f1)
PACK_DIR=$PACK_DIR CHUNK_BYTES=$CHUNK_BYTES XZ_LEVEL=$XZ_LEVEL bash bench/pack_chunks.sh  # the archive, its chunks, MANIFEST
chunks=("$PACK_DIR"/chunk-*)
echo "pack_sglang: $site $((before >> 20)) MiB installed, $((after >> 20)) MiB trimmed;" \
     "${#chunks[@]} chunk(s) of <= $((CHUNK_BYTES >> 20)) MiB in $PACK_DIR:"
for c in "${chunks[@]}"; do echo "  $(basename "$c") $(( $(stat -c %s "$c") >> 10 )) KiB"; done
