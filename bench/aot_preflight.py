"""Compile, on this CPU, every Triton kernel launch some CPU tests make, for the GPU: a pre-flight check.

    python -m rlperf.bench.aot_preflight [PYTEST ARGS ...]      # default: tests/kernels
    python -m rlperf.bench.aot_preflight tests/kernels/test_matmul.py -k interpreter

CI runs every kernel under Triton's CPU interpreter, which executes a kernel's Python: it accepts code
the GPU compiler refuses (a tuple of mixed constexpr arguments unpacked with ``*args`` ran there and
failed Triton's compile with ``cannot convert tf32 of type str to tensor``). Such a slip otherwise costs
a device call to find. This tool

1. runs the given tests under the interpreter with a recorder on ``InterpretedFunction.run``: each
   launch's kernel (module and name), argument types (``triton.runtime.jit.mangle_type``: ``*fp16``,
   ``i32``, ``tensordesc<...>``), constexpr values, ``num_warps`` and ``num_stages``, deduplicated;
2. compiles each distinct launch ahead of time for ``--arch`` (default SM 90, the H100/H200) in a
   process without the interpreter, with Triton's own compiler and its bundled ptxas: no GPU needed;
3. prints one line per failure (kernel, constexprs, the last line of the compiler's error) and a count;
   exit 1 when any launch fails to compile, 2 when the tests themselves failed or recorded nothing.

What it proves: the recorded launches compile for that GPU with this machine's Triton (CI: 3.9; the
GPU machines run 3.6). Not their bits, their speed or launches the tests never make (bf16 tiles run
under the interpreter only where its bf16 rounding is not the point, so most records are fp32/fp16).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RECORD_ENV = "RLPERF_AOT_RECORD"
"""When set (a file path), :func:`pytest_configure` (this module used as a pytest plugin) records every
interpreted kernel launch into that file, one JSON object per line."""


def _constexpr_value(value):
    """A constexpr as JSON: tl dtypes by name, everything else as it is (ints, floats, str, bool, None)."""
    if value.__class__.__name__ == "dtype":
        return {"dtype": str(value)}
    if value.__class__.__name__ == "constexpr":
        return _constexpr_value(value.value)
    return value


def launch_spec(fn, args, kwargs) -> dict:
    """The compile-relevant description of one launch of ``fn`` (an ``InterpretedFunction``)."""
    import inspect

    from triton.runtime.jit import mangle_type

    params = list(inspect.signature(fn.fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    bound.update({k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "num_ctas")})
    signature, constexprs = {}, {}
    for p in params:
        value = bound[p.name] if p.name in bound else p.default
        if "constexpr" in str(p.annotation):
            signature[p.name] = "constexpr"
            constexprs[p.name] = _constexpr_value(value)
        elif value is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = None
        else:
            signature[p.name] = mangle_type(value)
    return {"module": fn.fn.__module__, "file": fn.fn.__code__.co_filename, "name": fn.fn.__qualname__,
            "signature": signature, "constexprs": constexprs, "options": options}


def _kernel(spec: dict):
    """The recorded kernel, imported by module name, else from its file (kernels defined in test modules)."""
    import importlib
    import importlib.util

    try:
        module = importlib.import_module(spec["module"])
    except ImportError:
        name = f"_aot_preflight_{abs(hash(spec['file']))}"
        module = sys.modules.get(name)
        if module is None:
            loader = importlib.util.spec_from_file_location(name, spec["file"])
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            loader.loader.exec_module(module)
    return getattr(module, spec["name"])


def pytest_configure(config):  # the recorder, as a pytest plugin (-p rlperf.bench.aot_preflight)
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            line = json.dumps(launch_spec(self, args, kwargs), sort_keys=True, default=str)
        except Exception as exc:  # noqa: BLE001  (a launch the recorder cannot describe: say so, do not fail the test)
            line = json.dumps({"module": self.fn.__module__, "name": self.fn.__qualname__, "unrecorded": repr(exc)})
        if line not in seen:
            seen.add(line)
            with open(path, "a") as f:
                f.write(line + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def compile_specs(lines: list[str], arch: int) -> tuple[list[tuple[dict, str]], list[tuple[dict, object]]]:
    """Compile each recorded launch (a JSON line of :func:`launch_spec`) for SM ``arch``: ``(failures,
    compiled)``, the (spec, last line of the compiler's error) of each failure and the (spec, compiled kernel:
    ``.asm["ptx"]`` ...) of each success. Runs in a process where ``TRITON_INTERPRET`` is unset (the kernels
    are then real ``JITFunction`` objects)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures, compiled = [], []
    for line in lines:
        spec = json.loads(line)
        if "unrecorded" in spec:
            failures.append((spec, f"not recorded: {spec['unrecorded']}"))
            continue
        try:
            fn = _kernel(spec)
            names = fn.arg_names
            constexprs = {}
            for name, value in spec["constexprs"].items():
                if isinstance(value, dict) and "dtype" in value:
                    value = getattr(tl, value["dtype"])
                constexprs[(names.index(name),)] = value
            src = ASTSource(fn=fn, signature=spec["signature"], constexprs=constexprs)
            compiled.append((spec, triton.compile(src, target=GPUTarget("cuda", arch, 32), options=spec["options"])))
        except Exception as exc:  # noqa: BLE001  (every failure is reported, not just the first)
            text = str(exc).strip().splitlines()
            failures.append((spec, text[-1] if text else type(exc).__name__))
    return failures, compiled


def _describe(spec: dict) -> str:
    const = {k: v for k, v in spec.get("constexprs", {}).items() if v is not None}
    return f"{spec['module']}.{spec['name']} {json.dumps(const, default=str)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlperf.bench.aot_preflight", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="the SM to compile for (default: 90, H100/H200)")
    p.add_argument("--compile", metavar="FILE", help=argparse.SUPPRESS)  # the second stage, in its own process
    args, pytest_args = p.parse_known_args(argv)
    if args.compile:
        # one line per distinct launch (test workers each record theirs: the same launch may come twice)
        lines = sorted({x for x in Path(args.compile).read_text().splitlines() if x.strip()})
        failures, _ = compile_specs(lines, args.arch)
        for spec, why in failures:
            print(f"aot_preflight: FAIL {_describe(spec)}: {why}")
        print(f"aot_preflight: {len(lines) - len(failures)} of {len(lines)} launch(es) compiled for SM {args.arch}")
        return 1 if failures else 0
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "launches.jsonl"
        env = dict(os.environ, **{RECORD_ENV: str(record), "TRITON_INTERPRET": "1"})
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "rlperf.bench.aot_preflight", "-p",
                                "no:cacheprovider", *(pytest_args or ["tests/kernels"])], env=env)
        if tests.returncode != 0 or not record.exists():
            print(f"aot_preflight: the tests exited {tests.returncode} and recorded "
                  f"{'nothing' if not record.exists() else 'launches'}: fix them first", file=sys.stderr)
            return 2
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton-cache")
        return subprocess.run([sys.executable, "-m", "rlperf.bench.aot_preflight", "--arch", str(args.arch),
                               "--compile", str(record)], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
