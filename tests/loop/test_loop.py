"""rlperf.loop / rlperf train on the CPU: the embedded run learns, runs are reproducible, resume is
exact, true-on-policy gives abs diff 0, bad inputs fail before any step."""
import hashlib
import json
from pathlib import Path

import pytest
import torch

from rlperf.cli import main
from rlperf.loop import METRICS_FILE, first_step, train
from rlperf.loop.generation import load_rollout_data

# keys that depend on time or memory, not on the computation
VOLATILE = ("perf/", "memory/")


def _stable(m):
    return {k: v for k, v in m.items() if not k.startswith(VOLATILE)}


def _run(tmp, *flags):
    return train(["--output-dir", str(tmp), "--no-progress", *flags])


# the runs that compare bits, not learning: 4 prompts x 4 samples a rollout instead of the embedded 8 x 16
SMALL = ("--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16")


def _short(tmp, *flags):
    return _run(tmp, *SMALL, *flags)


def _tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_embedded_default_learns(tmp_path):
    # the embedded defaults (80 rollouts of 8 prompts x 16 samples, lr 3e-3), with 16 samples packed per
    # micro-batch instead of 1: each sample's forward is the same bits (batch-invariant kernels), only the
    # summation order of the global batch's gradient differs, and the run takes a third of the time; the
    # one-sample micro-batches of the default are what every other run in this file uses
    hist = _run(tmp_path, "--micro-batch-size", "16")
    rewards = [m["rollout/raw_reward"] for m in hist]
    assert len(rewards) == 80
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert 0.1 <= start <= 0.4, f"the run must start near chance (0.25), got {start}"
    assert end >= 0.8, f"mean reward of the last 5 rollouts {end} < 0.8: {rewards}"
    lines = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert len(lines) == 80
    for name in ("rollout/raw_reward", "rollout/log_probs", "rollout/rollout_log_probs", "train/loss", "train/pg_loss",
                 "train/pg_clipfrac", "train/ppo_kl", "train/entropy_loss", "train/grad_norm",
                 "train/train_rollout_logprob_abs_diff", "perf/rollout_time", "perf/train_time",
                 "perf/update_weights_time", "perf/longest_sample_tokens_per_sec", "memory/rollout_peak_bytes",
                 "memory/train_peak_bytes", "memory/weight_sync_peak_bytes", "sync/weights_checksum"):
        assert name in lines[0], name
    assert any(p.name.startswith("timeline") for p in tmp_path.iterdir())


@pytest.fixture
def restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)  # --deterministic-mode sets it for the whole process


def test_deterministic_runs_are_identical(tmp_path, restore_determinism):
    a = _short(tmp_path / "a", "--deterministic-mode", "--num-rollout", "3")
    b = _short(tmp_path / "b", "--deterministic-mode", "--num-rollout", "3")
    assert [_stable(m) for m in a] == [_stable(m) for m in b]
    assert len({m["sync/weights_checksum"] for m in a}) == 3  # the weights do change every step
    c = _short(tmp_path / "c", "--deterministic-mode", "--num-rollout", "3", "--seed", "7")
    assert [_stable(m) for m in c] != [_stable(m) for m in a]  # the comparison can fail


@pytest.mark.gpu
def test_gpu_deterministic_runs_are_identical(tmp_path, restore_determinism, monkeypatch):
    """Two --deterministic-mode runs on CUDA (bf16, invariant kernels, in-process engine with CUDA
    graphs) give the same weight checksum and metrics at every step. Training differentiates
    attention with the fixed-order Triton backward (kernels/attention_backward.py), counted here."""
    from rlperf.kernels import attention as attn

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].device.type)
        return backward(*args, **kwargs)

    backward = attn.attention_backward
    monkeypatch.setattr(attn, "attention_backward", counted)
    a = _run(tmp_path / "a", "--device", "cuda", "--deterministic-mode", "--num-rollout", "3")
    b = _run(tmp_path / "b", "--device", "cuda", "--deterministic-mode", "--num-rollout", "3")
    assert calls and set(calls) == {"cuda"}
    assert [m["sync/weights_checksum"] for m in a] == [m["sync/weights_checksum"] for m in b]
    assert len({m["sync/weights_checksum"] for m in a}) == 3  # the weights do change every step
    assert [_stable(m) for m in a] == [_stable(m) for m in b]


def test_resume_continues_identically(tmp_path):
    full = _short(tmp_path / "full", "--num-rollout", "4")
    _short(tmp_path / "first", "--num-rollout", "2", "--save", str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (tmp_path / "ckpt" / "iter_0000002" / "model" / "model.safetensors").is_file()
    rest = _short(tmp_path / "rest", "--num-rollout", "4", "--load", str(tmp_path / "ckpt"))
    assert [m["rollout_id"] for m in rest] == [2, 3]
    assert [_stable(m) for m in rest] == [_stable(m) for m in full[2:]]


def test_save_interval_writes_latest_last(tmp_path):
    _short(tmp_path / "o", "--num-rollout", "3", "--save", str(tmp_path / "ckpt"), "--save-interval", "2")
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (tmp_path / "ckpt" / "iter_0000003" / "trainer.pt").is_file()


def test_true_on_policy_abs_diff_is_exactly_zero(tmp_path):
    hist = _short(tmp_path / "t", "--true-on-policy-mode", "--num-rollout", "3")
    assert [m["train/train_rollout_logprob_abs_diff"] for m in hist] == [0.0, 0.0, 0.0]
    # one log-prob path (fused_logprob on both sides): without the flag the difference is 0 too; the flag
    # adds the gate's exact-0 requirement (tests/gates and tests/train/test_losses show a difference caught)
    plain = _short(tmp_path / "p", "--num-rollout", "1")
    assert plain[0]["train/train_rollout_logprob_abs_diff"] == 0.0


def test_async_rollout_is_one_step_off_policy(tmp_path):
    tpl = str(tmp_path / "{}" / "r{{rollout_id}}.jsonl")
    hist = _short(tmp_path / "a", "--async", "--num-rollout", "3", "--save-debug-rollout-data", tpl.format("async"))
    assert [m["rollout_id"] for m in hist] == [0, 1, 2]
    # rollout 1 of the async run came from the initial weights: it equals a rollout-only run's rollout 1
    _short(tmp_path / "r", "--debug-rollout-only", "--num-rollout", "2", "--save-debug-rollout-data", tpl.format("ro"))
    _short(tmp_path / "s", "--num-rollout", "2", "--save-debug-rollout-data", tpl.format("sync"))
    load = lambda kind: load_rollout_data(tmp_path / kind / "r1.jsonl")  # noqa: E731
    key = lambda ss: [(s.tokens, s.rollout_log_probs) for s in ss]  # noqa: E731
    assert key(load("async")) == key(load("ro"))
    assert key(load("sync")) != key(load("ro"))


def test_debug_train_only_replays_saved_rollouts(tmp_path):
    tpl = str(tmp_path / "data" / "r{rollout_id}.jsonl")
    a = _short(tmp_path / "a", "--num-rollout", "2", "--save-debug-rollout-data", tpl)
    b = _short(tmp_path / "b", "--num-rollout", "2", "--debug-train-only", "--load-debug-rollout-data", tpl)
    for x, y in zip(a, b):
        assert {k: v for k, v in _stable(x).items() if k.startswith("train/")} == \
               {k: v for k, v in _stable(y).items() if k.startswith("train/")}


def test_first_step_record_for_the_gates(tmp_path):
    rec = first_step(["--output-dir", str(tmp_path), "--true-on-policy-mode", "--num-rollout", "1"])
    assert rec.true_on_policy and rec.memory_kind == "cpu_rss"
    assert rec.first_micro_step["train/ppo_kl"] == 0.0 and rec.first_micro_step["train/pg_clipfrac"] == 0.0
    assert rec.step_metrics["train/train_rollout_logprob_abs_diff"] == 0.0
    assert [p.phase for p in rec.phases] == ["rollout", "log_prob", "train", "weight_sync"]
    assert all(p.peak_bytes > 0 for p in rec.phases)
    assert len(rec.samples) == 128
    for s in rec.samples:
        assert torch.equal(s.log_probs, s.ref_log_probs) and torch.equal(s.log_probs, s.rollout_log_probs_tensor())


# ---- bad inputs: a clear error, exit 2, no step, existing checkpoints untouched ----------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    _run(root / "out", "--num-rollout", "1", "--save", str(root / "save"))
    return root / "save"


def _bad(tmp_path, checkpoint, capsys, *flags):
    before = _tree_digest(checkpoint)
    code = main(["train", "--output-dir", str(tmp_path / "out"), "--no-progress", "--save", str(checkpoint),
                 "--overwrite-save", *flags])  # even when allowed to overwrite it, a bad input leaves it untouched
    assert code == 2
    assert not (tmp_path / "out" / METRICS_FILE).exists()  # no step ran
    assert _tree_digest(checkpoint) == before
    return capsys.readouterr().err


def test_missing_data_file(tmp_path, checkpoint, capsys):
    err = _bad(tmp_path, checkpoint, capsys, "--prompt-data", str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl: no such file" in err


def test_bad_jsonl_line_named_by_number(tmp_path, checkpoint, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1+1", "label": "2"}\n\n{"input": "2+2", "label": "4"\n')
    err = _bad(tmp_path, checkpoint, capsys, "--prompt-data", str(data), "--rollout-batch-size", "1",
               "--n-samples-per-prompt", "2")
    assert "d.jsonl:3: not valid JSON" in err


def test_missing_input_key_named_by_line(tmp_path, checkpoint, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1+1", "label": "2"}\n{"question": "2+2"}\n')
    err = _bad(tmp_path, checkpoint, capsys, "--prompt-data", str(data))
    assert "d.jsonl:2: no --input-key 'input'" in err


def test_broken_batch_relation(tmp_path, checkpoint, capsys):
    err = _bad(tmp_path, checkpoint, capsys, "--global-batch-size", "48")
    assert "batch relation broken" in err and "128" in err and "48" in err


def test_engine_memory_fraction_out_of_range(tmp_path, checkpoint, capsys):
    err = _bad(tmp_path, checkpoint, capsys, "--sglang-mem-fraction-static", "1.5")
    assert "--sglang-mem-fraction-static must be in (0, 1), got 1.5" in err


def test_unknown_estimator(tmp_path, checkpoint, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse refuses it: exit 2 before anything runs
        _bad(tmp_path, checkpoint, capsys, "--advantage-estimator", "ppo_v9")
    assert exc.value.code == 2
    assert "ppo_v9" in capsys.readouterr().err


def test_unwritable_save(tmp_path, checkpoint, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    before = _tree_digest(checkpoint)
    code = main(["train", "--output-dir", str(tmp_path / "out"), "--no-progress", "--save", str(blocker / "ckpt")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--save" in err and "not writable" in err
    assert not (tmp_path / "out" / METRICS_FILE).exists()
    assert _tree_digest(checkpoint) == before


def test_load_without_checkpoint(tmp_path, checkpoint, capsys):
    err = _bad(tmp_path, checkpoint, capsys, "--load", str(tmp_path))
    assert "latest_checkpointed_iteration.txt" in err


def test_ref_load_kl_loss_starts_at_zero(tmp_path):
    _short(tmp_path / "a", "--num-rollout", "1", "--save", str(tmp_path / "ckpt"))
    hist = _short(tmp_path / "b", "--num-rollout", "3", "--load", str(tmp_path / "ckpt"), "--ref-load",
                str(tmp_path / "ckpt"), "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl")
    # rollout 1: the actor is the checkpoint, so is the reference: KL exactly 0 in every micro-step
    assert hist[0]["rollout/ref_log_probs"] == hist[0]["rollout/log_probs"]
    assert hist[0]["train/kl_loss"] == 0.0
    assert hist[1]["train/kl_loss"] != 0.0  # the actor has moved, the reference has not
