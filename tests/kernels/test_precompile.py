"""The kernel manifest (rlperf.kernels.precompile): recording, compiling in worker processes, and the cache key.

The compiles run here on the CPU for SM 90 with Triton's own compiler (no GPU needed), in processes
without ``TRITON_INTERPRET``. The key test: an entry that went through the manifest's JSON compiles
to the cache key a launch computes from the original Python values, so the launch loads the
precompiled kernel (no new cache entry). That the post-compile hook of a real launch records such an
entry is checked on the GPU (``test_gpu_recorded_launch_loads_from_precompiled_cache``).
"""
import difflib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from rlperf.kernels import precompile as P

TARGET = {"backend": "cuda", "arch": 90, "warp_size": 32}
SILU = "rlperf.kernels.activation:_silu_mul_kernel"


def _env(cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    return env


# The launch's own values, as JITFunction.run hands them to the compiler (Python objects, tuples):
# SiLU*mul on bf16 rows, every pointer and integer 16-aligned but `inter`, BLOCK 1024, 4 warps.
LAUNCH = textwrap.dedent("""
    import inspect, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import serialize_specialization_data
    from rlperf.kernels.activation import _silu_mul_kernel as fn

    target = GPUTarget("cuda", 90, 32)
    signature = {"x_ptr": "*bf16", "y_ptr": "*bf16", "inter": "i32", "stride_x": "i32", "stride_y": "i32",
                 "BLOCK": "constexpr"}
    constexprs = {(5,): 1024}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]],
             (4,): [["tt.divisibility", 16]]}
    options = make_backend(target).parse_options({"num_warps": 4, "num_stages": 2})
    if sys.argv[1] == "serialize":
        args = ["rlperf.kernels.activation._silu_mul_kernel", signature, constexprs, attrs, options, "key"]
        if "target" in inspect.signature(serialize_specialization_data).parameters:
            args.append(target)
        print(serialize_specialization_data(*args))
    else:  # what JITFunction._do_compile does on a launch
        triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
""")


def _launch(mode, cache_dir):
    out = subprocess.run([sys.executable, "-c", LAUNCH, mode], env=_env(cache_dir), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def _cache_entries(cache_dir):
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


def test_precompiled_entry_is_the_launch_cache_key(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    data = _launch("serialize", cache)
    manifest = tmp_path / "m.jsonl"
    rec = P.ManifestRecorder(manifest)
    assert rec.add(SILU, data, target=TARGET)
    assert not rec.add(SILU, data, target=TARGET)  # one line per specialization
    entry = P.read_manifest(manifest)[0]
    assert "extern_libs" not in entry["spec"]["options"] and "key" not in entry["spec"]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))  # the background child inherits it (not the interpreter)
    summary = P.BackgroundPrecompile(manifest, workers=2).finish(timeout=600)
    assert summary.startswith("1 of 1 kernel specialization(s) compiled"), summary
    before = _cache_entries(cache)
    assert before, "the precompile wrote nothing into TRITON_CACHE_DIR"
    _launch("compile", cache)
    assert _cache_entries(cache) == before, "the launch compiled again: the manifest's entry has another cache key"


def test_stale_and_broken_entries_are_reported_not_raised(tmp_path):
    short = {"kernel": SILU, "target": TARGET, "spec": {"signature": {"x_ptr": "*bf16"}, "constant_keys": [],
                                                        "constant_vals": [], "attrs_keys": [], "attrs_vals": [],
                                                        "options": {"num_warps": 4}}}
    gone = dict(short, kernel="rlperf.kernels.activation:_no_such_kernel")
    not_kernel = dict(short, kernel="rlperf.kernels.activation:silu_mul")
    assert P._compile_one(short)[0] == "stale"  # the kernel has more parameters than the entry
    assert "_no_such_kernel" in P._compile_one(gone)[1]
    assert P._compile_one(not_kernel) == ("stale", "rlperf.kernels.activation:silu_mul: not a Triton kernel")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(e) + "\n" for e in (short, gone)))
    out = subprocess.run([sys.executable, "-m", "rlperf.kernels.precompile", str(manifest), "--workers", "1"],
                         env=_env(tmp_path / "cache"), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("precompile: 0 of 2 kernel specialization(s) compiled or "
                                                         "found in the cache, 2 stale"), out.stdout


def test_background_precompile_stopped_early_says_so(tmp_path, monkeypatch):
    manifest = tmp_path / "m.jsonl"
    entry = {"kernel": SILU, "target": TARGET, "spec": {"signature": {}, "constant_keys": [], "constant_vals": [],
                                                         "attrs_keys": [], "attrs_vals": [], "options": {}}}
    manifest.write_text(json.dumps(entry) + "\n")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    job = P.BackgroundPrecompile(manifest, workers=1)
    assert job.running()
    assert job.finish(wait=False).startswith("stopped before the end (m.jsonl)")
    assert not job.running()


def test_an_argument_no_longer_specialized_loses_its_recorded_attribute(tmp_path):
    code = textwrap.dedent("""
        from rlperf.kernels.norm import _rmsnorm_kernel as fn
        from rlperf.kernels.precompile import launch_attrs
        free = fn.arg_names.index("rows_per_weight")  # do_not_specialize: a launch never marks it divisible
        div = [["tt.divisibility", 16]]
        assert launch_attrs(fn, {(0,): div, (free,): div}) == {(0,): div}
    """)  # a compiled JITFunction (its params), not the interpreter's wrapper
    out = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path / "cache"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_bad_manifest_and_flags_exit_2_naming_them(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kernel": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a kernel manifest entry"):
        P.read_manifest(bad)
    env = _env(tmp_path / "cache")
    for argv, words in (([str(bad)], "bad.jsonl:1"), ([str(tmp_path / "none.jsonl")], "no such file"),
                        ([str(bad), "--workers", "0"], "--workers")):
        out = subprocess.run([sys.executable, "-m", "rlperf.kernels.precompile", *argv], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and words in out.stderr, (argv, out.stderr)


def test_resources_print_each_entrys_registers_spills_and_shared_memory(tmp_path):
    """``--resources``: the shipped SiLU*mul entry compiled here for its GPU (no GPU needed), one line with
    the compiler's registers per thread and shared memory; a bad manifest exits 2 naming its line."""
    shipped = P.MANIFEST_DIR / P.manifest_name({"backend": "cuda", "arch": 90}, "3.6.0")
    entry = next(e for e in P.read_manifest(shipped) if e["kernel"] == SILU)
    manifest = tmp_path / "cuda-90-triton0.0.jsonl"
    manifest.write_text(json.dumps(entry) + "\n")
    env = _env(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-m", "rlperf.kernels.precompile", str(manifest), "--resources", "silu"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, line = out.stdout.strip().splitlines()
    assert "the manifest is named for Triton 0.0" in first
    assert line.startswith("_silu_mul_kernel BLOCK=") and " w4 s" in line, line
    registers = int(line.split(": ")[1].split(" registers")[0])
    assert 1 <= registers <= 255 and line.endswith(" B shared"), line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kernel": "x"}\n')
    out = subprocess.run([sys.executable, "-m", "rlperf.kernels.precompile", str(bad), "--resources"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "bad.jsonl:1" in out.stderr, out.stderr


def test_recorder_hook_keeps_rlperf_kernels_and_chains_the_previous_hook(tmp_path):
    from triton import knobs

    calls = []

    def previous(**kw):
        calls.append(kw["fn"].name)

    class Info:  # Triton's JitFunctionInfo: module, name, jit_function
        def __init__(self, module, name):
            self.module, self.name, self.jit_function = module, name, None

    data = json.dumps({"name": "k", "signature": {"a": "i32"}, "constant_keys": [], "constant_vals": [],
                       "attrs_keys": [], "attrs_vals": [], "options": {"num_warps": 4, "extern_libs": [["libdevice", "/x"]]},
                       "key": "k"})
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = previous
    try:
        path = tmp_path / "rec.jsonl"
        with P.ManifestRecorder(path) as rec:
            rec._target = TARGET
            hook = knobs.runtime.jit_post_compile_hook
            for module, name in (("rlperf.kernels.gemm", "_k"), ("other.pkg", "_k"), ("rlperf.kernels.gemm", "_k"),
                                 ("rlperf.kernels.gemm", "f.<locals>._k")):
                hook(key="k", repr="r", fn=Info(module, name), compile={"specialization_data": data},
                     is_manual_warmup=False, already_compiled=False)
        assert knobs.runtime.jit_post_compile_hook is previous
    finally:
        knobs.runtime.jit_post_compile_hook = old
    assert calls == ["_k", "_k", "_k", "f.<locals>._k"]
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["kernel"] for x in lines] == ["rlperf.kernels.gemm:_k"]
    assert lines[0]["spec"]["options"] == {"num_warps": 4} and lines[0]["target"] == TARGET
    # a second recorder on the same file adds nothing it already holds
    assert not P.ManifestRecorder(path).add("rlperf.kernels.gemm:_k", data, target=TARGET)


# Without the interpreter (JITFunctions, not interpreted ones; no GPU needed for a cache key): the matmul's key
# with every kernel's key forgotten, computed after the kernel named first, then settled; and a fresh import's.
SETTLE = textwrap.dedent("""
    import sys
    import rlperf.kernels
    from rlperf.kernels import activation, gemm, precompile
    modules = [m for n, m in sorted(sys.modules.items()) if n.startswith("rlperf.kernels.")]
    fns = [v for m in modules for v in vars(m).values() if hasattr(v, "used_global_vals") and hasattr(v, "hash")]
    out = {"import": gemm._matmul_kernel.cache_key}
    for first in (gemm._matmul_kernel, activation._silu_mul_kernel):
        for f in fns:
            f.hash, f.used_global_vals = None, {}
        first.cache_key
        out["unsettled, " + first.__name__ + " first"] = gemm._matmul_kernel.cache_key
        precompile.settle_cache_keys(modules)
        out["settled, " + first.__name__ + " first"] = gemm._matmul_kernel.cache_key
    print(repr(out))
""")


def test_a_kernels_cache_key_does_not_depend_on_what_the_process_compiled_before():
    """``settle_cache_keys`` (run when ``rlperf.kernels`` is imported): the matmul's cache key is the same
    whether its key or the SiLU kernel's (which shares ``grid_dependency_sync``) was computed first, and the
    same as a fresh import's. Unsettled, Triton 3.6 (the GPU machines') keys the matmul without
    ``_GRID_DEPENDENCY`` when its key comes first (the precompiled matmul the GPU test below found compiled
    again; reproduced on the CPU with Triton 3.6: 0dda97... first, 8fa76e... after the SiLU kernel or settled);
    Triton 3.9 takes a helper's globals after computing its key, so there all five keys are equal anyway."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SETTLE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    keys = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (this test's own repr of a dict of str)
    settled = {k: v for k, v in keys.items() if not k.startswith("unsettled")}
    assert len(set(settled.values())) == 1, keys
    assert keys["unsettled, _silu_mul_kernel first"] == keys["import"], keys  # the helper's globals known first


def test_shipped_manifests_fit_the_kernels():
    """Every shipped manifest's entries name a kernel that exists with the parameters the entry lists (a
    renamed kernel or parameter makes an entry stale: record the manifest again, bench/device_launch.sh)."""
    paths = sorted(P.MANIFEST_DIR.glob("*.jsonl"))
    for path in paths:
        assert path.name.startswith("cuda-") and "-triton" in path.name
        for entry in P.read_manifest(path):
            fn = P._kernel(entry["kernel"])
            assert list(entry["spec"]["signature"]) == list(fn.arg_names), (path.name, entry["kernel"])


@pytest.mark.gpu
def test_gpu_recorded_launch_loads_from_precompiled_cache(tmp_path):
    """A real launch recorded by the hook, precompiled into an empty cache by the workers, and launched
    again in a fresh process: the launch adds nothing to the cache (it loaded the precompiled kernel)."""
    script = textwrap.dedent("""
        import sys, torch
        from rlperf import kernels as K
        from rlperf.kernels.precompile import ManifestRecorder
        x = torch.randn(7, 2 * 3000, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(160, 2000, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(37, 2000, device="cuda", dtype=torch.bfloat16)
        with ManifestRecorder(sys.argv[1]):
            K.silu_mul(x); K.matmul(a, w); torch.cuda.synchronize()
    """)
    manifest = tmp_path / "m.jsonl"
    first, second = tmp_path / "c1", tmp_path / "c2"
    run = lambda cache: subprocess.run([sys.executable, "-c", script, str(manifest)], env=_env(cache),  # noqa: E731
                                       capture_output=True, text=True, timeout=600)
    out = run(first)
    assert out.returncode == 0, out.stderr[-3000:]
    entries = P.read_manifest(manifest)
    assert len(entries) >= 2 and all(e["target"]["arch"] >= 80 for e in entries)
    out = subprocess.run([sys.executable, "-m", "rlperf.kernels.precompile", str(manifest)], env=_env(second),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and f"{len(entries)} of {len(entries)}" in out.stdout, out.stdout + out.stderr
    before = _cache_entries(second)
    out = run(second)
    assert out.returncode == 0, out.stderr[-3000:]
    # the second run recorded into the same manifest: a launch whose specialization differs from the first
    # run's adds a line (the recorder keeps lines already there)
    assert _cache_entries(second) == before, ("the launches compiled again: " + _new_entries_explained(second, before)
                                              + _new_manifest_lines(entries, P.read_manifest(manifest)))


def _new_manifest_lines(first: list[dict], now: list[dict]) -> str:
    """The manifest entries the second run added, each with the fields of its spec (and target) that differ
    from the first run's entry of the same kernel."""
    lines = []
    for entry in now[len(first):]:
        same = [e for e in first if e["kernel"] == entry["kernel"]]
        if not same:
            lines.append(f"\nnew entry of a kernel the first run did not launch: {entry['kernel']}")
            continue
        old = same[-1]
        diff = {k: (old["spec"].get(k), entry["spec"].get(k)) for k in entry["spec"]
                if old["spec"].get(k) != entry["spec"].get(k)}
        if old["target"] != entry["target"]:
            diff["target"] = (old["target"], entry["target"])
        lines.append(f"\nthe second run's entry of {entry['kernel']} differs from the first's in {diff}")
    return "".join(lines) or "\n(the second run recorded no new specialization)"


def _new_entries_explained(cache_dir, before) -> str:
    """Each cache entry not in ``before``: its files and, for a kernel's metadata (``NAME.json``), the fields
    that differ from the metadata of the same kernel among the precompiled entries; for its Triton source
    and IR (``.source``, ``.ttir``), the first lines of a diff against each precompiled entry's file of
    the same name (the cache key hashes the source's signature, constants and attributes, which the
    metadata does not list)."""
    old, texts = {}, {}
    for name in before:
        for f in (cache_dir / name).glob("*.json"):
            if not f.name.startswith("__grp__"):
                old.setdefault(f.name, json.loads(f.read_text()))
        for f in (cache_dir / name).iterdir():
            if f.suffix in (".source", ".ttir"):
                texts.setdefault(f.name, []).append((name, f.read_text()))
    lines = []
    for name in sorted(set(_cache_entries(cache_dir)) - set(before)):
        files = sorted(f.name for f in (cache_dir / name).iterdir())
        lines.append(f"{name}: {files}")
        for f in (cache_dir / name).glob("*.json"):
            if f.name in old:
                new = json.loads(f.read_text())
                diff = {k: (old[f.name].get(k), new.get(k)) for k in sorted(set(new) | set(old[f.name]))
                        if old[f.name].get(k) != new.get(k) and k != "hash"}
                lines.append(f"  {f.name} differs from the precompiled one in {diff}")
        for f in sorted((cache_dir / name).iterdir()):
            for other, text in texts.get(f.name, []):
                diff = list(difflib.unified_diff(text.splitlines(), f.read_text().splitlines(), f"{other}/{f.name}",
                                                 f"{name}/{f.name}", n=0, lineterm=""))
                lines.append(f"  {f.name} against {other}: " + ("identical" if not diff else
                                                                 "\n    " + "\n    ".join(d[:300] for d in diff[:24])))
    return "\n".join(lines)
