"""Issue #12's fault test: ``rlperf train`` killed at every step of a checkpoint write, then resumed.

Each run is a real process; ``RLPERF_FAULT_AT=checkpoint:<step>:<n>`` makes it SIGKILL itself at the
n-th time it reaches ``<step>`` of :func:`rlperf.loop.checkpoint.save_checkpoint` (the steps are named,
no sleeps). The runs chain: the first is killed in its second save, each later one resumes (``--load``)
from what the previous left and is killed in its first save, one step of :data:`STEPS` each, and a
last one finishes. After every kill the pointer names a loadable checkpoint and metrics.jsonl holds
rollouts 0..k once each; at the end every rollout is there exactly once, with the lines and the final
weights and optimizer state of an uninterrupted run, bit for bit.
"""
import json
import os
import signal
import subprocess
import sys

import torch

from checkpoint_state import bit_equal, saved_state
from rlperf.loop import METRICS_FILE, train
from rlperf.loop import checkpoint as ckpt
from rlperf.model.qwen3 import Qwen3ForCausalLM

NUM_ROLLOUT = 8  # >= 2 + len(STEPS) - 1: every run reaches the save it is killed in
FLAGS = ("--no-progress", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1")
VOLATILE = ("perf/", "memory/")


def _stable(m):
    return {k: v for k, v in m.items() if not k.startswith(VOLATILE)}


def _rlperf_train(*flags, fault=None):
    env = {k: v for k, v in os.environ.items() if k != ckpt.FAULT_ENV}
    if fault:
        env[ckpt.FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-m", "rlperf", "train", "--skip-gates", *FLAGS, *map(str, flags)],
                          env=env, capture_output=True, text=True, timeout=300)


def _loadable(save) -> int:
    """The pointer's iteration, once its checkpoint is shown to load (weights and trainer state)."""
    it = ckpt.latest_iteration(save)
    d = ckpt.checkpoint_dir(save)
    ckpt.check_weights(d / "model")
    ckpt.check_trainer_state(save)
    Qwen3ForCausalLM.from_pretrained(d / "model")
    assert torch.load(d / "trainer.pt", weights_only=True)["iteration"] == it
    return it


def _metrics(out):
    return [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]


def test_kill_at_every_checkpoint_step_then_resume(tmp_path):
    reference = train(["--output-dir", str(tmp_path / "ref_out"), "--save", str(tmp_path / "ref_save"), *FLAGS])
    save, out = tmp_path / "save", tmp_path / "out"
    pointers = []
    for i, step in enumerate(ckpt.STEPS):
        resume = ["--load", save] if i else []
        n = 2 if i == 0 else 1  # the first run has one checkpoint in place before it is killed
        proc = _rlperf_train(*resume, "--save", save, "--output-dir", out, fault=f"checkpoint:{step}:{n}")
        assert proc.returncode == -signal.SIGKILL, f"{step}: rc {proc.returncode}\n{proc.stderr[-3000:]}"
        pointers.append(_loadable(save))  # never a pointer on a missing or half-written checkpoint
        ids = [m["rollout_id"] for m in _metrics(out)]
        assert ids == list(range(len(ids))) and len(ids) >= pointers[-1], (step, ids, pointers[-1])
    # the kill before the pointer moved left the previous checkpoint; the one after it, the new one
    assert pointers[0] == 1 and pointers[-1] > pointers[0], pointers
    proc = _rlperf_train("--load", save, "--save", save, "--output-dir", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _loadable(save) == NUM_ROLLOUT
    lines = _metrics(out)
    assert [m["rollout_id"] for m in lines] == list(range(NUM_ROLLOUT))  # each rollout exactly once
    assert [_stable(m) for m in lines] == [_stable(m) for m in reference]
    (w, t), (rw, rt) = saved_state(save), saved_state(tmp_path / "ref_save")
    assert bit_equal(w, rw) and bit_equal(t, rt)  # bit-identical to the uninterrupted run
    # beside the checkpoints: the pointer and the run lock (rlperf.loop.run_lock, left by the killed runs)
    # the killed runs' lock files were taken over; the run that ended removed its own
    assert sorted(p.name for p in save.iterdir() if not p.name.startswith("iter_0")) == [ckpt.LATEST]
    assert not [p for p in save.iterdir() if p.suffix in (".tmp", ".old")]
