#!/usr/bin/env bash
# Device side of bench/pack_te.sh: Transformer Engine on the GPU machine (no network there), for the
# plain-Megatron anchor (`python -m rlperf.bench.megatron --backend megatron-te`, run by
# bench/device_megatron.sh as te-0.6b-tp1).
#
#   carry [".te-pack/MANIFEST", ".te-pack/chunk-00"] (+ ".whl" for megatron-core), command:
#   bash bench/device_te.sh                 # unpack, build TE's PyTorch extension, check it; exit 0 when usable
#   source bench/device_te.sh               # the same, and PYTHONPATH keeps the site for what follows
#
# 1. bench/unpack_sglang.sh (the chunk unpacker of every pack) puts the site in $TE_DEST/site (default
#    /tmp/te-site; it outlives the call while the machine stays warm);
# 2. the first time, transformer-engine-torch is built from its source (site/_sdist) against this
#    machine's torch and CUDA into the site (28 C++ files, MAX_JOBS = the cores; log in $OUT/te-build.log);
# 3. a check: TE's Linear and RMSNorm in bf16 against float32 torch on one random input (their errors
#    printed, a bound of bf16 rounding asserted). Exit 3 when TE is not usable, naming the step.
te_main() {
  local pack=${TE_PACK_DIR:-.te-pack} dest=${TE_DEST:-/tmp/te-site} out=${OUT:-/tmp}
  local site=$dest/site
  if [ -f "$pack/MANIFEST" ]; then
    PACK_DIR=$pack DEST=$dest bash bench/unpack_sglang.sh || { echo "device_te: unpacking $pack failed"; return 3; }
  fi
  [ -d "$site/transformer_engine" ] || { echo "device_te: no $site/transformer_engine (carry $pack/MANIFEST and its chunk)"; return 3; }
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  # TE looks for its torch extension (transformer_engine_torch*.so) in the site's top level, in
  # transformer_engine/ or in transformer_engine/wheel_lib/ (transformer_engine/common/__init__.py)
  if [ -z "$(find "$site" -maxdepth 3 -name 'transformer_engine_torch*.so' -print -quit)" ]; then
    local build=/tmp/te-build
    rm -rf "$build" && mkdir -p "$build/out"
    tar -xzf "$site"/_sdist/transformer_engine_torch-*.tar.gz -C "$build"
    echo "device_te: building transformer-engine-torch against torch $(python3 -c 'import torch; print(torch.__version__)') ..."
    local t0=$SECONDS
    if ! (cd "$build"/transformer_engine_torch-*/ && NVTE_FRAMEWORK=pytorch MAX_JOBS=$(nproc) \
          python3 -m pip install --no-deps --no-build-isolation --no-index --target "$build/out" . ) \
          > "$out/te-build.log" 2>&1; then
      echo "device_te: the build failed ($((SECONDS - t0)) s); the end of $out/te-build.log:"
      tail -30 "$out/te-build.log"
      return 3
    fi
    cp -a "$build"/out/transformer_engine_torch*.dist-info "$site"/
    # the built extension, wherever the sdist's wheel put it, goes to the top level (TE's first search place)
    find "$build/out" -name 'transformer_engine_torch*.so' -exec cp -a {} "$site"/ \;
    [ -n "$(find "$site" -maxdepth 1 -name 'transformer_engine_torch*.so' -print -quit)" ] \
      || { echo "device_te: the build made no transformer_engine_torch*.so; what it made:"; find "$build/out" -maxdepth 3 | head -30; return 3; }
    echo "device_te: built in $((SECONDS - t0)) s"
  fi
  python3 - <<'PY' || { echo "device_te: Transformer Engine does not run here (above)"; return 3; }
import torch
import transformer_engine
import transformer_engine.pytorch as te

torch.manual_seed(0)
x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
lin = te.Linear(1024, 2048, bias=False, params_dtype=torch.bfloat16).cuda()
norm = te.RMSNorm(1024, eps=1e-6, params_dtype=torch.bfloat16).cuda()
with torch.no_grad():
    y = lin(x)
    ref = x.float() @ lin.weight.float().T
    z = norm(x)
    zref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()
lin_err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
norm_err = ((z.float() - zref).abs().max() / zref.abs().max()).item()
print(f"transformer_engine {transformer_engine.__version__} on {torch.cuda.get_device_name()}: "
      f"Linear bf16 rel err {lin_err:.2e}, RMSNorm bf16 rel err {norm_err:.2e}")
assert lin_err < 2e-2 and norm_err < 2e-2, "errors beyond bf16 rounding"
PY
}
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  cd "$(dirname "$0")/.."
  te_main
  exit $?
fi
te_main
