"""rlperf's SGLang plugin against the real SGLang 0.5.17 package (CPU).

SGLang 0.5.17 pins transformers 5.12.1 (the suite's transformers is newer), so it lives in its own
folder, ``.sglang-cpu`` at the repository root (the README's test command installs it: ``pip install
--no-deps --target .sglang-cpu sglang==0.5.17 ...``), and the checks run in one subprocess whose path
puts that folder first (:mod:`sglang_checks`, which says what each check does). Its kernels run on the
torch references rather than Triton's interpreter: the kernels' own tests cover the interpreter; the
interpreter would take minutes over these multi-page prompts.

Tensor parallelism: the model class at ``--tp-size 2`` runs in two forked workers joined by a gloo group
(standing where SGLang's TP group stands, ``rlperf.sglang_plugin.contract.tensor_parallel_group``), each
with its own KV pool of its key-value heads, and both must give rlperf's engine's tree-mode bits.

What cannot run here: an SGLang engine process (its model runner needs CUDA), CUDA-graph capture, NCCL,
and bf16 — the GPU tests in ``tests/sglang_plugin/test_plugin_gpu.py`` start real engines (the
``--tp-size 2`` engine needs two GPUs, issue #42).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SITE = ROOT / ".sglang-cpu"
HERE = pathlib.Path(__file__).resolve().parent
CHECKS = ("check_registration", "check_server_args", "check_model_registry", "check_dense_steps_match_rlperf_engine",
          "check_moe_steps_match_rlperf_engine", "check_moe_routed_experts_reach_sglangs_capturer",
          "check_load_weights_errors", "check_sampler_pieces", "check_greedy_rows_and_host_temperatures",
          "check_tree_and_tp_server_args", "check_tp2_steps_match_tree_engine",
          "check_tp2_plain_steps_match_plain_engine")


@pytest.fixture(scope="module")
def results():
    if not (SITE / "sglang" / "version.py").is_file():
        pytest.skip(f"{SITE.name}/ holds no SGLang 0.5.17: run the README's test command (its pip install --target "
                    f"{SITE.name} line)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["RLPERF_BACKEND"] = "reference"
    proc = subprocess.run([sys.executable, str(HERE / "sglang_checks.py")], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"the checks did not run (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def test_every_check_ran(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_check(results, name):
    outcome = results[name]
    assert outcome["ok"], outcome["detail"]
