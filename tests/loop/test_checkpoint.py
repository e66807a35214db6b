"""Checkpoints and metrics across kills (issue #12, items 7 and 8), in process.

A kill inside :func:`rlperf.loop.checkpoint.save_checkpoint` is simulated by making its fault point
raise (nothing of the save runs after it, as after SIGKILL); tests/loop/test_checkpoint_faults.py
kills real ``rlperf train`` processes.
"""
import json

import pytest
import torch

from rlperf.cli import main
from rlperf.loop import METRICS_FILE, checkpoint as ckpt, train
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import Trainer, TrainArgs

CHEAP = ("--no-progress", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4")


class Killed(BaseException):
    """Stands for SIGKILL: raised by the fault point, caught by the test only."""


@pytest.fixture
def kill_at(monkeypatch):
    """``kill_at(step, n=1)``: the n-th time save_checkpoint reaches ``step``, it stops dead (raises Killed)."""
    def die():
        raise Killed

    def arm(step, n=1):  # step None: disarmed
        if step is None:
            monkeypatch.delenv(ckpt.FAULT_ENV, raising=False)
        else:
            monkeypatch.setenv(ckpt.FAULT_ENV, f"checkpoint:{step}:{n}")
        ckpt._fault_hits.clear()

    monkeypatch.setattr(ckpt, "_die", die)
    yield arm
    ckpt._fault_hits.clear()


def _model(seed):
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=seed)
    return model, Trainer(model, TrainArgs())


def _weights(path):
    return Qwen3ForCausalLM.from_pretrained(ckpt.model_dir(path)).hf_state_dict()


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("step", ckpt.STEPS)
def test_resaving_the_pointed_iteration_never_leaves_the_pointer_on_a_missing_checkpoint(tmp_path, kill_at, step):
    """Item 7: re-saving the iteration the pointer names; a kill at any step leaves it loadable."""
    old_model, old_trainer = _model(1)
    new_model, new_trainer = _model(2)
    ckpt.save_checkpoint(tmp_path, 3, old_model, old_trainer.state_dict())
    old, new = old_model.hf_state_dict(), new_model.hf_state_dict()
    kill_at(step)
    with pytest.raises(Killed):
        ckpt.save_checkpoint(tmp_path, 3, new_model, new_trainer.state_dict())
    assert ckpt.latest_iteration(tmp_path) == 3
    loaded = _weights(tmp_path)  # loadable at every step: the old copy until the new one is in place
    in_place = ckpt.STEPS.index(step) >= ckpt.STEPS.index("rename-into-place")
    assert _same(loaded, new if in_place else old)
    ckpt.check_weights(ckpt.model_dir(tmp_path))
    ckpt.check_trainer_state(tmp_path)
    assert ckpt.load_trainer_state(tmp_path, _model(3)[1]) == 3
    # the next save leaves no temporaries or old copies behind, and iteration 3 as the pointer knew it
    kill_at(None)
    ckpt.save_checkpoint(tmp_path, 4, new_model, new_trainer.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", ckpt.LATEST]
    assert _same(_weights(tmp_path / "iter_0000003" / "model"), loaded)


def test_fresh_run_into_a_save_with_checkpoints_is_refused(tmp_path, capsys):
    """Item 7: a fresh run into a non-empty --save would move the pointer back and overwrite."""
    save, out = tmp_path / "save", tmp_path / "out"
    assert main(["train", *CHEAP, "--skip-gates", "--num-rollout", "2", "--save", str(save),
                 "--output-dir", str(out)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in save.rglob("*")}
    assert main(["train", *CHEAP, "--skip-gates", "--num-rollout", "1", "--save", str(save),
                 "--output-dir", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert f"--save {save}" in err and "--overwrite-save" in err and "iteration 2" in err
    assert {p.name: p.stat().st_mtime_ns for p in save.rglob("*")} == before  # untouched
    # a resume from it may write into it; --overwrite-save lets a fresh run do so (the pointer moves to it)
    assert main(["train", *CHEAP, "--skip-gates", "--num-rollout", "3", "--load", str(save), "--save", str(save),
                 "--output-dir", str(out)]) == 0
    assert ckpt.latest_iteration(save) == 3
    assert main(["train", *CHEAP, "--skip-gates", "--num-rollout", "1", "--save", str(save), "--overwrite-save",
                 "--output-dir", str(tmp_path / "o3")]) == 0
    assert ckpt.latest_iteration(save) == 1
    # a --save holding only a temporary (a run killed inside its first save) holds no checkpoint: not refused
    leftover = tmp_path / "leftover"
    (leftover / "iter_0000001.tmp" / "model").mkdir(parents=True)
    assert ckpt.existing_checkpoints(leftover) == []


def test_resume_truncates_metrics_to_its_checkpoint(tmp_path):
    """Item 8: lines a killed run wrote after its last checkpoint (and a torn last line) are dropped on
    resume, so each rollout is in metrics.jsonl exactly once and the resumed run's lines are the ones kept."""
    out, save = tmp_path / "out", tmp_path / "save"
    train(["--output-dir", str(out), *CHEAP, "--num-rollout", "2", "--save", str(save)])
    metrics = out / METRICS_FILE
    with open(metrics, "a") as f:  # what a run killed after rollouts 2 and 3 (checkpoint 2) left behind
        f.write(json.dumps({"rollout_id": 2, "stale": True}) + "\n")
        f.write(json.dumps({"rollout_id": 3, "stale": True}) + "\n")
        f.write('{"rollout_id": 4, "perf/st')
    rest = train(["--output-dir", str(out), *CHEAP, "--num-rollout", "4", "--load", str(save)])
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [m["rollout_id"] for m in lines] == [0, 1, 2, 3]
    assert lines[2:] == rest and not any("stale" in m for m in lines)
