"""``python -m rlperf.bench.aot_preflight``: kernel launches recorded under Triton's interpreter, compiled
ahead of time for SM 90 on this CPU (Triton's compiler and ptxas, no GPU). A kernel module written here has
a kernel that compiles and one the interpreter runs but the GPU compiler refuses (a tuple of mixed constexpr
arguments unpacked with ``*args``): the tool must name the second, count the first, and exit 1."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import torch

from rlperf.bench.aot_preflight import launch_spec

DEMO = textwrap.dedent('''
    import triton
    import triton.language as tl


    @triton.jit
    def _scale(x, offs, n, FACTOR: tl.constexpr, MODE: tl.constexpr):
        v = tl.load(x + offs, mask=offs < n)
        if MODE == "double":
            v = v * 2
        return v * FACTOR


    @triton.jit
    def good(x, out, n, BLOCK: tl.constexpr, FACTOR: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out + offs, _scale(x, offs, n, FACTOR, "double"), mask=offs < n)


    @triton.jit
    def bad(x, out, n, BLOCK: tl.constexpr, FACTOR: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        args = (offs, n, FACTOR, "double")
        tl.store(out + offs, _scale(x, *args), mask=offs < n)
''')

TEST = textwrap.dedent('''
    import torch
    import aot_demo_kernels


    def test_launch():
        x, out = torch.arange(10, dtype=torch.float32), torch.empty(16)
        aot_demo_kernels.good[(1,)](x, out, 10, BLOCK=16, FACTOR=3)
        assert out[:10].tolist() == [6.0 * i for i in range(10)]
''')


def _env(tmp_path, interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def test_a_launch_the_gpu_compiler_refuses_is_named_and_fails_the_check(tmp_path, monkeypatch):
    (tmp_path / "aot_demo_kernels.py").write_text(DEMO)
    monkeypatch.syspath_prepend(str(tmp_path))
    demo = importlib.import_module("aot_demo_kernels")  # under the interpreter (tests run with TRITON_INTERPRET=1)
    x, out = torch.arange(10, dtype=torch.float32), torch.empty(16)
    specs = []
    for kernel in (demo.good, demo.bad):
        kernel[(1,)](x, out, 10, BLOCK=16, FACTOR=3)  # both run under the interpreter
        assert out[:10].tolist() == [6.0 * i for i in range(10)]
        specs.append(launch_spec(kernel, (x, out, 10), {"BLOCK": 16, "FACTOR": 3, "num_warps": 4}))
    assert specs[0]["signature"] == {"x": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr",
                                     "FACTOR": "constexpr"}
    assert specs[0]["constexprs"] == {"BLOCK": 16, "FACTOR": 3} and specs[0]["options"] == {"num_warps": 4}
    record = tmp_path / "launches.jsonl"
    record.write_text("".join(json.dumps(s) + "\n" for s in specs))
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.aot_preflight", "--compile", str(record)],
                          env=_env(tmp_path, interpret=False), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("aot_preflight:")]
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith("aot_preflight: FAIL aot_demo_kernels.bad") and "cannot convert double" in lines[0]
    assert lines[1] == "aot_preflight: 1 of 2 launch(es) compiled for SM 90"


def test_the_tool_records_a_test_run_and_compiles_what_it_launched(tmp_path):
    (tmp_path / "aot_demo_kernels.py").write_text(DEMO)
    (tmp_path / "test_demo_launch.py").write_text(TEST)
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.aot_preflight", str(tmp_path / "test_demo_launch.py")],
                          env=_env(tmp_path, interpret=False), capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "aot_preflight: 1 of 1 launch(es) compiled for SM 90" in proc.stdout, proc.stdout[-2000:]
