"""``python -m rlperf.bench.kernel_profile trace``: the kernel table of a saved torch-profiler trace (CPU).

The traces are real Chrome-trace files in the layout torch's profiler exports (what
``sglang.bench_one_batch --profile`` writes); the GPU cases themselves need a device."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest
import torch

from rlperf.bench.kernel_profile import trace_kernels


def _write(path, events, compress):
    opener = gzip.open if compress else open
    with opener(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


EVENTS = [
    {"ph": "X", "cat": "kernel", "name": "_matmul_kernel", "ts": 100.0, "dur": 10.0},
    {"ph": "X", "cat": "kernel", "name": "_attn_fwd_kernel", "ts": 112.0, "dur": 6.0},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 120.0, "dur": 1.0},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 90.0, "dur": 500.0},  # host work: not GPU time
    {"ph": "X", "cat": "kernel", "name": "_matmul_kernel", "ts": 130.0, "dur": 14.0},
    {"ph": "i", "cat": "kernel", "name": "instant", "ts": 131.0},  # not a complete event
]


@pytest.mark.parametrize("compress", [True, False])
def test_trace_kernels_sums_gpu_events(tmp_path, compress):
    path = _write(tmp_path / ("t.trace.json" + (".gz" if compress else "")), EVENTS, compress)
    kernels, span = trace_kernels(path)
    assert kernels == {"_matmul_kernel": [24.0, 2], "_attn_fwd_kernel": [6.0, 1],
                       "Memcpy DtoH (Device -> Pinned)": [1.0, 1]}
    assert span == pytest.approx(44.0)  # 100 .. 144: GPU events only


def test_trace_kernels_by_launch_counts_each_grid_apart(tmp_path):
    """``--by-launch``: one kernel's launches of different grids (a step's products of different shapes) are
    rows of their own; the same grid twice is one row; events without a grid keep their name."""
    events = [dict(e) for e in EVENTS]
    events[0]["args"] = {"grid": [16, 1, 1], "block": [128, 1, 1]}
    events[4]["args"] = {"grid": [64, 1, 1], "block": [128, 1, 1]}
    events.append({"ph": "X", "cat": "kernel", "name": "_matmul_kernel", "ts": 150.0, "dur": 11.0,
                   "args": {"grid": [16, 1, 1], "block": [128, 1, 1]}})
    path = _write(tmp_path / "t.trace.json", events, False)
    kernels, _ = trace_kernels(path, by_launch=True)
    assert kernels["_matmul_kernel grid=[16, 1, 1] block=[128, 1, 1]"] == [21.0, 2]
    assert kernels["_matmul_kernel grid=[64, 1, 1] block=[128, 1, 1]"] == [14.0, 1]
    assert kernels["_attn_fwd_kernel"] == [6.0, 1] and "_matmul_kernel" not in kernels
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.kernel_profile", "trace", "--by-launch", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "_matmul_kernel grid=[64, 1, 1] block=[128, 1, 1]" in proc.stdout


def test_trace_command_prints_per_step_table(tmp_path):
    path = _write(tmp_path / "t.trace.json.gz", EVENTS, True)
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.kernel_profile", "trace", "--steps", "2", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    head = next(ln for ln in lines if ln.startswith("== "))
    assert "trace span 0.022 ms/step" in head and "GPU busy 0.015 ms/step" in head and "2 kernels/step" in head
    rows = [ln.split() for ln in lines if ln.strip().endswith("_matmul_kernel")]
    assert rows and rows[0][0] == "0.0120" and rows[0][2] == "1.0"  # 24 us over 2 steps, one call per step


def test_trace_command_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    empty = _write(tmp_path / "cpu-only.json", [e for e in EVENTS if e["cat"] == "cpu_op"], False)
    for path, needle in ((bad, "not a Chrome trace"), (empty, "no GPU events")):
        proc = subprocess.run([sys.executable, "-m", "rlperf.bench.kernel_profile", "trace", str(path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and str(path) in proc.stderr and needle in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.kernel_profile", "trace"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "name at least one Chrome trace FILE" in proc.stderr


def test_prefill_case_checks_its_flags_before_needing_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.kernel_profile", "prefill", "--prompts", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--prompts" in proc.stderr and "got 10 and 0" in proc.stderr, proc.stderr


def test_launch_floor_checks_its_flags_then_needs_a_gpu():
    """``launch-floor``: a bad ``--programs`` exits 2 naming it before anything else; without CUDA, exit 2 saying so."""
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.kernel_profile", "launch-floor", "--programs", "16", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--programs must be >= 1, got 16 0" in proc.stderr, proc.stderr
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, "-m", "rlperf.bench.kernel_profile", "launch-floor"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_gpu_launch_floor_replays_every_link_of_the_chain(pdl):
    """The chain's graph runs each of its launches once per replay (program 0 of each adds one to what the launch
    before it wrote: a lost link, or one that read the counter before the launch before it wrote it, would leave
    the counter short), and its time grows with its length."""
    from rlperf.bench.kernel_profile import launch_floor

    short, long = launch_floor(10, 16, pdl, reps=10), launch_floor(200, 16, pdl, reps=10)
    assert 0 < short < long
