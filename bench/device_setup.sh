# Sourced by the bench/device*.sh scripts: the one device-call setup they share. Sets OUT (a fresh
# folder unless given) and PYTHONUNBUFFERED, records the GPU in $OUT/gpu.txt, installs the carried
# wheels of .whl/ into /tmp/site (on PYTHONPATH; bench/fetch_wheels.sh downloads them) and the project
# itself (editable). Exits 3 with the log's tail when an install fails. Under bench/device_lanes.sh the
# installs ran once before the lanes started (RLPERF_SETUP_DONE=1): only OUT and the GPU record are set.
# Defines `step` (at the end), the timed and logged step of the scripts that run several in one call.
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
# The GPU image's Python packages hold no bytecode and keep none: every python3 process compiled the
# sources of ~1,700 modules again (5.3 s of a 0.6b `rlperf gate`, profiled). An installed environment
# keeps its bytecode; here it goes to /tmp (kept between calls while the machine stays warm).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -z "${RLPERF_SETUP_DONE:-}" ]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 \
      || { tail -30 "$OUT/wheels.log"; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "no .whl/ (bash bench/fetch_wheels.sh, then carry .whl): tests that need the router or sglang skip"
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 3; }
fi

# step NAME SECONDS COMMAND...: run COMMAND under `timeout`, its output in $OUT/NAME.log and "rc seconds" in
# $OUT/NAME.rc-seconds; a failure prints the log's tail and sets the caller's `status` to 1 without stopping
# the script (the device scripts that run several steps in one call use it)
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"
  echo "$rc $((SECONDS - t0))" >"$OUT/$name.rc-seconds"
  if [ "$rc" != 0 ]; then status=1; tail -25 "$OUT/$name.log"; fi
}

# put_sglang_on_path: SGLang's runtime (bench/pack_sglang.sh's pack: SGLang, FlashInfer, the router and their
# pinned dependencies) on PYTHONPATH. When .sglang-pack/MANIFEST came with the call, bench/unpack_sglang.sh
# runs first (a no-op when $SGLANG_SITE already holds that archive). Returns 1, saying what to carry, when
# no unpacked SGLang is there: the scripts that start SGLang engines stop then instead of failing test by test.
put_sglang_on_path() {
  local site=${SGLANG_SITE:-/tmp/sglang-site/site} pack=${PACK_DIR:-.sglang-pack} rc
  if [ -f "$pack/MANIFEST" ] && [ "$(basename "$site")" = site ]; then
    PACK_DIR=$pack DEST=$(dirname "$site") bash bench/unpack_sglang.sh
    rc=$?
    [ $rc = 0 ] || echo "bench/unpack_sglang.sh exit $rc; going on with the site already in $site"
  fi
  if [ ! -d "$site/sglang" ]; then
    echo "$site has no sglang: carry .sglang-pack/MANIFEST and .sglang-pack/chunk-00" \
         "(bash bench/pack_sglang.sh on the CPU machine) or run bench/unpack_sglang.sh first"
    return 1
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
}
