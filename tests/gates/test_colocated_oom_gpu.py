"""``oom_headroom`` with a real SGLang engine on the trainer's GPU (GPU; SGLang 0.5.17 and sglang-router
importable: bench/device_sglang.sh puts the unpacked pack on the path).

``rlperf gate --rollout-backend sglang --colocate`` starts one SGLang engine (rlperf's plugin) on the
trainer's own GPU, holding ``--sglang-mem-fraction-static`` of it for the whole run. The gate's limit for
the trainer is ``(1 - headroom) x capacity`` minus that engine's static share as the engine reports it.
With the headroom at 0.5 and the engine at 0.45 of the GPU, the 0.6b trainer's peak (a few GiB) fits
under ``0.5 x capacity`` alone but not under ``0.05 x capacity`` beside the engine: the gate must fail
and name both numbers. At the default headroom the same run passes and names the engine's share.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

needs = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None
    or importlib.util.find_spec("sglang_router") is None,
    reason="needs CUDA, SGLang 0.5.17 and sglang-router (bench/device_sglang.sh puts the unpacked pack on the path)")

FLAGS = ["--model", "qwen3-0.6b", "--device", "cuda", "--rollout-backend", "sglang", "--colocate",
         "--sglang-mem-fraction-static", "0.45", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
         "--global-batch-size", "32", "--rollout-max-response-len", "16", "--no-progress"]


def _gate(tmp_path, name, *extra):
    report = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "rlperf", "gate", *FLAGS, *extra, "--output-dir", str(tmp_path / name),
                           "--report-json", str(report)], capture_output=True, text=True, timeout=560)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("oom_headroom ")), None)
    assert line is not None, f"no oom_headroom line (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, line, json.loads(report.read_text())


@needs
def test_trainer_that_fits_alone_but_not_beside_the_colocated_engine_fails_the_gate(tmp_path):
    code, line, report = _gate(tmp_path, "tight", "--oom-headroom", "0.5")
    assert code == 1 and "FAIL" in line, line
    assert "held by 1 colocated engine" in line and "the trainer alone would fit" in line, line
    gate = next(g for g in report["gates"] if g["name"] == "oom_headroom")
    engines = gate["measured"]["colocated_engines"]
    assert len(engines) == 1 and engines[0]["source"].startswith("reported"), engines


@needs
def test_the_same_run_at_the_default_headroom_passes_and_names_the_engines_share(tmp_path):
    code, line, _ = _gate(tmp_path, "default")
    assert code == 0 and "PASS" in line and "colocated engine" in line, line
