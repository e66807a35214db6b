"""Compile a run's Triton kernels before their first launch, many at once: the kernel manifest.

A Triton kernel compiles on its first launch with a new specialization: its argument types, which
integer arguments equal 1 or divide by 16 and which pointers are 16-byte aligned, its constexpr
values and its ``num_warps``/``num_stages``. A cold ``rlperf gate`` on the qwen3-0.6b shape compiled them
one after another as the run first reached each kernel (``bench/BENCHMARKS.md``: 47 s cold against 10 s
warm on an H200; compiling the shipped manifest took 98 s of CPU for 59 specializations). Triton keeps every compile
in its on-disk cache (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``) under a key of the kernel's
source, the specialization, the options and the target; a process that compiles the same
specialization later finds it there and loads it in milliseconds.

A **kernel manifest** is the list of specializations a run compiled, one JSON object per line::

    {"kernel": "rlperf.kernels.gemm:_matmul_kernel", "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
     "spec": {"signature": {...}, "constant_keys": [...], "constant_vals": [...], "attrs_keys": [...],
              "attrs_vals": [...], "options": {...}}}

:class:`ManifestRecorder` writes one from Triton's post-compile hook (``rlperf train|gate
--record-kernels FILE``). :func:`precompile` reads one and compiles every entry in a pool of worker
processes with Triton's own compiler for the entry's target: the same source, specialization and
options give the same cache key as the run's own launch, so the run's first launches then load from
the disk cache instead of compiling. The workers need no GPU context; where the host has the GPU's
driver they also build each kernel's host-side launcher (:func:`build_launcher`), which a first launch
would otherwise build with the C compiler. An entry whose kernel is gone or whose
parameters no longer match is counted **stale** and skipped; an entry whose kernel body changed
compiles the new body, which the run may not launch (wasted work in the background, never other
bits: a run always launches what it compiles itself, and a specialization it finds in the cache is
the one it would have compiled).

Manifests shipped with rlperf (``kernels/manifests/<backend>-<arch>-triton<version>.jsonl``, see
:func:`shipped_manifest`) hold what ``rlperf gate`` compiles on the qwen3-0.6b shape (the gate's default),
what ``rlperf train`` compiles on the embedded task, and what an eager ``rlperf train`` of the 0.6b shape
compiles over four rollouts of varying micro-batches (the attention backward's token and sequence
counts divide by 16 or not, the lm head's float32 buffers are 16-byte aligned or not, and each
combination is a specialization of its own: 13 more, ~5 s of compiles in an eager run's second
rollout). On CUDA
those commands start :class:`BackgroundPrecompile` of the manifest that matches the GPU and the Triton
version before they build the model (``--precompile-kernels``). Other models share most specializations
(tile configs and dtypes, not sizes, pick them); what a manifest lacks compiles on first launch as before.
Record a manifest again when a kernel's parameters change (a CPU test names the stale entries):
``bash bench/device_launch.sh`` with ``STEPS="embedded gate"`` records ``kernel-manifest*.jsonl``.

    python -m rlperf.kernels.precompile FILE [--workers N]      # compile a manifest into the cache
    python -m rlperf.kernels.precompile --list                  # the shipped manifests and their sizes
    python -m rlperf.kernels.precompile FILE --resources _attn  # registers, spills, shared memory per entry

``--resources`` compiles the entries on this host (no GPU needed) and prints what the compiler gave each
one (:func:`resource_usage`): a kernel change's register pressure, spills and shared memory can be read
before a device call. The numbers belong to the installed Triton (a manifest for 3.6.0 read with 3.9.0
says so).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

MANIFEST_DIR = Path(__file__).resolve().parent / "manifests"
KERNEL_PREFIX = "rlperf."
"""Only kernels of rlperf's own modules are recorded (a run may launch other packages' Triton kernels)."""


def manifest_name(target: dict, triton_version: str) -> str:
    """``cuda-90-triton3.6.0.jsonl`` for ``target`` ``{"backend": "cuda", "arch": 90, ...}``: a manifest
    holds one target and one Triton version (options and specialization rules change between versions)."""
    return f"{target['backend']}-{target['arch']}-triton{triton_version}.jsonl"


def current_target() -> dict:
    """This process's Triton target as a dict (``backend``, ``arch``, ``warp_size``); needs the GPU."""
    from triton.runtime import driver

    return dict(driver.active.get_current_target().__dict__)


def shipped_manifest_path(target: dict | None = None) -> Path:
    """Where the manifest for ``target`` (default: this process's GPU) and the installed Triton ships,
    whether or not it does."""
    import triton

    return MANIFEST_DIR / manifest_name(target or current_target(), triton.__version__)


def shipped_manifest(target: dict | None = None) -> Path | None:
    """The manifest shipped for ``target`` (default: this process's GPU) and the installed Triton, or
    None when there is none (another GPU generation or Triton version: kernels compile on first launch)."""
    path = shipped_manifest_path(target)
    return path if path.is_file() else None


# ---- recording ------------------------------------------------------------------------------------
def manifest_entry(kernel: str, target: dict, specialization_data: str) -> dict:
    """One manifest line from Triton's ``specialization_data`` (the JSON its post-compile hook passes:
    signature, constexprs, attributes, options) of ``kernel`` (``module:qualname``). Dropped: the in-memory
    cache key (rebuilt by the compiler), the options' ``extern_libs`` (paths of this installation: the
    compiler fills in its own, and the cache key hashes the files' contents, not their paths) and the
    target Triton 3.9 adds (the entry keeps its own)."""
    spec = json.loads(specialization_data)
    spec.pop("key", None)
    spec.pop("target", None)
    spec.pop("name", None)
    spec["options"] = {k: v for k, v in spec["options"].items() if k != "extern_libs"}
    return {"kernel": kernel, "target": dict(target), "spec": spec}


class ManifestRecorder:
    """Appends every compile of an rlperf kernel in this process to ``path`` (one line per distinct
    specialization, in first-compile order; lines already in the file are kept and not repeated), through
    ``triton.knobs.runtime.jit_post_compile_hook`` (a hook set before is still called). A context
    manager: the hook is removed on exit. It fires for compiles and for loads from the disk cache alike,
    so a warm run records the same manifest as a cold one."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._previous = None
        self._target: dict | None = None
        if self.path.exists():
            self._seen.update(line for line in self.path.read_text().splitlines() if line.strip())

    def __enter__(self):
        from triton import knobs

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc):
        from triton import knobs

        if knobs.runtime.jit_post_compile_hook == self._hook:
            knobs.runtime.jit_post_compile_hook = self._previous
        return False

    def _hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        try:
            self.add(f"{fn.module}:{fn.name}", compile["specialization_data"])
        finally:
            if self._previous is not None:
                self._previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                               already_compiled=already_compiled)
        return None

    def add(self, kernel: str, specialization_data: str, target: dict | None = None) -> bool:
        """Record one compile (True when it was new); kernels outside rlperf and kernels defined inside a
        function (not importable by name) are not recorded."""
        if not kernel.startswith(KERNEL_PREFIX) or "<locals>" in kernel:
            return False
        if target is None:
            if self._target is None:
                self._target = current_target()
            target = self._target
        line = json.dumps(manifest_entry(kernel, target, specialization_data))  # key order kept: the signature is ordered
        with self._lock:
            if line in self._seen:
                return False
            self._seen.add(line)
            with self.path.open("a") as f:
                f.write(line + "\n")
        return True


# ---- cache keys ----------------------------------------------------------------------------------
def settle_cache_keys(modules) -> int:
    """Compute the cache key of every ``@triton.jit`` function of ``modules`` (module objects) until none
    changes, so that a kernel's key no longer depends on which kernels this process compiled before.
    Returns how many functions were settled (0 under the interpreter or where Triton keeps keys otherwise).

    Why: a kernel's on-disk cache key hashes the ``tl.constexpr`` globals its helpers read, gathered from
    each helper as the key is computed; Triton (3.6) takes a helper's globals *before* it computes that
    helper's own key, so a helper called once whose key was not computed yet adds nothing. The matmul's key
    then held ``pipeline._GRID_DEPENDENCY`` only in a process that had compiled another kernel calling
    ``grid_dependency_sync`` first: a precompiled matmul (a worker that compiled it first) was compiled
    again by the run (the same code under another key; ``tests/kernels/test_precompile.py``). With every
    helper's globals known before any kernel's key, every process computes the same keys."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        return 0
    fns = list({id(v): v for m in modules for v in vars(m).values() if isinstance(v, JITFunction)}.values())
    if not fns or not all(hasattr(f, "hash") and hasattr(f, "used_global_vals") for f in fns):
        return 0
    keys = None
    for _ in range(8):  # a pass per level of helper calls, until a pass changes no key
        for f in fns:
            f.hash = None
        settled = [f.cache_key for f in fns]
        if settled == keys:
            break
        keys = settled
    return len(fns)


# ---- compiling ------------------------------------------------------------------------------------
@dataclasses.dataclass
class PrecompileReport:
    """What :func:`precompile` did: entries ``compiled`` (or found in the cache), ``stale`` (kernel gone or
    its parameters changed: ``problems`` says which), ``failed`` (the compiler refused: ``problems``),
    ``seconds`` of wall time with ``workers`` processes."""

    entries: int = 0
    compiled: int = 0
    stale: int = 0
    failed: int = 0
    seconds: float = 0.0
    workers: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        extra = "".join(f", {n} {what}" for n, what in ((self.stale, "stale"), (self.failed, "failed")) if n)
        return (f"{self.compiled} of {self.entries} kernel specialization(s) compiled or found in the cache{extra}, "
                f"{self.seconds:.1f} s with {self.workers} worker(s)")


class StaleEntry(Exception):
    """A manifest entry that no longer fits the code (its kernel is gone or its parameters changed)."""


def read_manifest(path: str | os.PathLike) -> list[dict]:
    """The entries of a manifest file; ValueError naming the line that is not a manifest entry."""
    entries = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if not {"kernel", "target", "spec"} <= set(entry):
                raise ValueError("needs kernel, target and spec")
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not a kernel manifest entry ({exc})") from None
        entries.append(entry)
    return entries


def _kernel(name: str):
    """``module:qualname`` -> the JITFunction; StaleEntry when it is not there."""
    import importlib

    module, _, qualname = name.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise StaleEntry(f"{name}: {exc}") from None
    if not hasattr(obj, "arg_names"):
        raise StaleEntry(f"{name}: not a Triton kernel")
    return obj


def _as_tuple(value):
    """JSON turned Triton's tuples (tuple types, tuple constexprs) into lists; a kernel argument is never a list."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def compile_entry(entry: dict, launcher: bool = True):
    """Compile one manifest entry into Triton's on-disk cache (or find it there) and return Triton's
    compiled kernel. The source is rebuilt as Triton's launch builds it (``ASTSource(kernel, signature,
    constexprs, attrs)``) so the cache key is the launch's; an entry recorded with programmatic dependent
    launch compiles without it where it is switched off (``RLPERF_PDL=0``), as the launch would.
    ``launcher``: also build its host-side launcher (:func:`build_launcher`). StaleEntry when the entry no
    longer fits the kernel."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .pipeline import programmatic_launch_switched_on

    fn = _kernel(entry["kernel"])
    spec = entry["spec"]
    signature = {k: _as_tuple(v) for k, v in spec["signature"].items()}
    if list(signature) != list(fn.arg_names):
        raise StaleEntry(f"{entry['kernel']}: parameters {list(fn.arg_names)}, the entry has {list(signature)}")

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(_as_tuple(value["constexpr"]))
        return _as_tuple(value)

    constexprs = {tuple(k): constant(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = launch_attrs(fn, {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])})
    options = {k: _as_tuple(v) for k, v in spec["options"].items()}
    if options.get("launch_pdl") and not programmatic_launch_switched_on():
        options["launch_pdl"] = False  # recorded with PDL, launched without it here (RLPERF_PDL=0)
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, target=GPUTarget(**entry["target"]), options=options)
    if launcher:
        build_launcher(kernel)
    return kernel


def resource_usage(kernel) -> dict:
    """What one program of a compiled CUDA kernel holds: ``registers`` per thread, ``stack`` bytes per
    thread (register spills and call frames: 0 when nothing spills) and ``shared`` bytes (static plus the
    dynamic shared memory Triton requests), read from the kernel's cubin with ``cuobjdump
    --dump-resource-usage`` (shipped with Triton's NVIDIA backend). These are the compiler's numbers for
    the entry's target, on any host: no GPU needed. ValueError for a kernel that has no cubin."""
    from triton import knobs

    cubin = kernel.asm.get("cubin") if hasattr(kernel, "asm") else None
    if cubin is None:
        raise ValueError("not a compiled CUDA kernel (no cubin)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    usage = dict(re.findall(r"\b(REG|STACK|SHARED):(\d+)", out))
    if "REG" not in usage:
        raise ValueError(f"cuobjdump printed no resource usage: {out.strip()[:200]!r}")
    return {"registers": int(usage["REG"]), "stack": int(usage.get("STACK", 0)),
            "shared": int(usage.get("SHARED", 0)) + int(kernel.metadata.shared)}


def entry_label(entry: dict) -> str:
    """``name BLOCK_M=64 ... w4 s1``: an entry's kernel, its integer and boolean constexprs, warps and stages."""
    spec = entry["spec"]
    names = list(spec["signature"])
    consts = [f"{names[k[0]]}={int(v) if isinstance(v, bool) else v}"
              for k, v in zip(spec["constant_keys"], spec["constant_vals"])
              if len(k) == 1 and isinstance(v, (bool, int)) and spec["signature"].get(names[k[0]]) == "constexpr"]
    opts = spec["options"]
    return " ".join([entry["kernel"].rpartition(":")[2], *consts, f"w{opts.get('num_warps')}", f"s{opts.get('num_stages')}"])


def print_resources(manifest: str | os.PathLike, match: str = "") -> int:
    """Compile the entries of ``manifest`` whose kernel name contains ``match`` (in this process, no
    launchers) and print each one's :func:`resource_usage`, one line per entry. Returns the number of
    entries that failed to compile."""
    import triton

    recorded = re.search(r"triton(\d[\w.]*)\.jsonl$", Path(manifest).name)
    print(f"Triton {triton.__version__}" + (f" (the manifest is named for Triton {recorded.group(1)}: registers and "
                                           f"shared memory follow the compiler)"
                                           if recorded and recorded.group(1) != triton.__version__ else ""))
    failed = 0
    for entry in read_manifest(manifest):
        if match not in entry["kernel"]:
            continue
        label = entry_label(entry)
        try:
            use = resource_usage(compile_entry(entry, launcher=False))
        except Exception as exc:  # noqa: BLE001 (one refused entry must not stop the listing)
            lines = str(exc).strip().splitlines()
            print(f"{label}: not compiled ({lines[-1] if lines else type(exc).__name__})")
            failed += 1
            continue
        spills = f", {use['stack']} B of stack (spills)" if use["stack"] else ""
        print(f"{label}: {use['registers']} registers{spills}, {use['shared']} B shared")
    return failed


def launch_attrs(fn, attrs: dict) -> dict:
    """An entry's attributes as a launch of ``fn`` today has them: an argument the kernel no longer
    specializes (``do_not_specialize`` / ``do_not_specialize_on_alignment`` added since the recording)
    carries no divisibility attribute in the launch's cache key, so the entry's is dropped."""
    free = {i for i, p in enumerate(fn.params) if p.do_not_specialize or p.do_not_specialize_on_alignment}
    return {k: v for k, v in attrs.items() if k[0] not in free}


def build_launcher(kernel) -> bool:
    """Build the host-side launcher of a compiled kernel into the cache too: a small C module per argument
    signature that Triton otherwise builds with the host's C compiler on the kernel's first launch; cached
    in ``TRITON_CACHE_DIR`` under a hash of its source, so the run's own first launch loads it. Needs the GPU's driver library (not a GPU context): False where this host
    has no CUDA (the kernel's compile is in the cache all the same)."""
    try:
        from triton.runtime import driver

        launcher_cls = driver.active.launcher_cls
    except Exception:  # noqa: BLE001 (no active GPU driver here: a CPU host)
        return False
    launcher_cls(kernel.src, kernel.metadata)
    return True


def _compile_one(entry: dict) -> tuple[str, str]:
    """Worker: ``("compiled", "")``, ``("stale", why)`` or ``("failed", why)``, never an exception."""
    try:
        compile_entry(entry)
        return "compiled", ""
    except StaleEntry as exc:
        return "stale", str(exc)
    except Exception as exc:  # noqa: BLE001 (one refused entry must not stop the others)
        lines = str(exc).strip().splitlines()
        return "failed", f"{entry['kernel']}: {lines[-1] if lines else type(exc).__name__}"


def default_workers() -> int:
    """Processes for :func:`precompile`: every core this process may use but two (the run's own process
    keeps working meanwhile), at least 1, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores - 2))


def precompile(manifest: str | os.PathLike, workers: int | None = None, progress: bool = False) -> PrecompileReport:
    """Compile every entry of ``manifest`` into Triton's on-disk cache with ``workers`` processes (default
    :func:`default_workers`), in the manifest's order (a recorded run's first compiles first). Blocks until
    done; never raises for an entry (see :class:`PrecompileReport`). ``TRITON_INTERPRET`` must be unset."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("precompile compiles for the GPU: unset TRITON_INTERPRET")
    entries = read_manifest(manifest)
    report = PrecompileReport(entries=len(entries), workers=min(workers or default_workers(), max(1, len(entries))))
    t0 = time.perf_counter()
    if entries:
        bar = _progress(len(entries)) if progress else contextlib.nullcontext(None)
        with bar as tick, ProcessPoolExecutor(report.workers, mp_context=_worker_context(entries)) as pool:
            for future in as_completed([pool.submit(_compile_one, e) for e in entries]):
                status, why = future.result()
                setattr(report, status, getattr(report, status) + 1)
                if why:
                    report.problems.append(why)
                if tick is not None:
                    tick()
    report.seconds = time.perf_counter() - t0
    return report


def _worker_context(entries: list[dict]):
    """How the workers start: forked (Linux) from this process after it imported the manifest's kernel
    modules and Triton's compiler, so no worker spends its first seconds importing torch and Triton (the
    seconds the run's first kernels are wanted); spawned elsewhere. This process touches no GPU, so a
    fork inherits no CUDA state."""
    import importlib
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    importlib.import_module("triton.compiler")
    for module in dict.fromkeys(e["kernel"].partition(":")[0] for e in entries):
        with contextlib.suppress(Exception):  # a module that is gone: its entries report stale in the worker
            importlib.import_module(module)
    return multiprocessing.get_context("fork")


@contextlib.contextmanager
def _progress(total: int):
    """A tick function drawing ``compiled k/total`` on one stderr line."""
    done = [0]

    def tick():
        done[0] += 1
        print(f"\rprecompile: {done[0]}/{total}", end="" if done[0] < total else "\n", file=sys.stderr, flush=True)

    yield tick


class BackgroundPrecompile:
    """:func:`precompile` of ``manifest`` in a child process (``python -m rlperf.kernels.precompile``), so the
    caller goes on building its run while the workers fill the cache. :meth:`finish` waits for it (or
    stops it: what it compiled so far stays in the cache, each entry written whole) and returns its
    one-line summary; a child still running when this process exits is stopped."""

    def __init__(self, manifest: str | os.PathLike, workers: int | None = None):
        self.manifest = Path(manifest)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "rlperf.kernels.precompile", str(self.manifest)]
        if workers:
            cmd += ["--workers", str(workers)]
        self._out = tempfile.TemporaryFile("w+")  # not a pipe: nobody reads it until finish()
        self._proc = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, text=True,
                                      stdin=subprocess.DEVNULL)
        atexit.register(self._stop)

    def running(self) -> bool:
        return self._proc.poll() is None

    def _stop(self) -> None:
        if self.running():
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()

    def finish(self, wait: bool = True, timeout: float | None = None) -> str:
        """Its summary line: after it ends (``wait``; TimeoutExpired after ``timeout`` s), or at once,
        stopping it (``wait=False``)."""
        stopped = not wait and self.running()
        if stopped:
            self._stop()
        else:
            self._proc.wait(timeout)
        atexit.unregister(self._stop)
        self._out.seek(0)
        lines = [x for x in self._out.read().splitlines() if x.strip()]
        self._out.close()
        if stopped:
            return f"stopped before the end ({self.manifest.name}): what it compiled stays in the cache"
        if self._proc.returncode != 0:
            return f"failed (exit {self._proc.returncode}): {lines[-1] if lines else 'no output'}"
        return lines[-1].removeprefix("precompile: ") if lines else "no output"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlperf.kernels.precompile",
                                description="Compile the Triton kernel specializations a kernel manifest lists into "
                                            "Triton's on-disk cache, in parallel (no GPU needed).")
    p.add_argument("manifest", nargs="?", help="a manifest file (JSON lines; `rlperf train|gate --record-kernels FILE` "
                                               "writes one)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"processes (default: the cores this process may use but two, at most 16; here "
                        f"{default_workers()})")
    p.add_argument("--list", action="store_true", help="list the shipped manifests and their entries")
    p.add_argument("--progress", action="store_true", help="draw a progress line on stderr")
    p.add_argument("--resources", nargs="?", const="", default=None, metavar="KERNEL",
                   help="instead of filling the cache, compile each entry here (whose kernel name contains KERNEL, "
                        "if given) and print its registers per thread, stack bytes (spills) and shared memory, "
                        "as the installed Triton compiles it for the entry's GPU (no GPU needed)")
    args = p.parse_args(argv)
    if args.list:
        for path in sorted(MANIFEST_DIR.glob("*.jsonl")):
            print(f"{path.name}: {len(read_manifest(path))} entries")
        return 0
    if not args.manifest:
        p.error("give a manifest file (or --list)")
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if not Path(args.manifest).is_file():
        p.error(f"manifest {args.manifest!r}: no such file")
    if args.resources is not None:
        try:
            return 1 if print_resources(args.manifest, args.resources) else 0
        except ValueError as exc:
            print(f"precompile: {exc}", file=sys.stderr)
            return 2
    try:
        report = precompile(args.manifest, args.workers, progress=args.progress)
    except (ValueError, RuntimeError) as exc:
        print(f"precompile: {exc}", file=sys.stderr)
        return 2
    for why in report.problems:
        print(f"precompile: {why}")
    print(f"precompile: {report.summary()}")
    return 0


if __name__ == "__main__":
    # through the package's module, so the pool's workers unpickle rlperf.kernels.precompile._compile_one
    from rlperf.kernels.precompile import main as _main

    raise SystemExit(_main())
