"""``rlperf train`` / ``rlperf gate`` with ``--train-backend megatron`` on the CPU (gloo rank processes).

The megatron trainer's reductions are fixed trees (``rlperf.kernels.tree_reduce``) and the loop's
engines run rlperf's model in the same tree mode (``reduction_leaves``): a run at TP=2 or PP=2 is
exactly on-policy at every step (``train_rollout_logprob_abs_diff`` 0), and it is the one-process run
(TP=1) bit for bit, rollout after rollout: same rewards, log-probs, losses, grad norms and weights
checksums. Usage errors exit 2 naming the flag before any rank starts.
"""
import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from rlperf.cli import main  # noqa: E402
from rlperf.loop import METRICS_FILE, train  # noqa: E402

FAST = ["--device", "cpu", "--num-threads", "1", "--no-progress"]
SHORT = ["--num-rollout", "2", "--true-on-policy-mode"]
# what must be the same bits at every layout (perf/ and memory/ keys depend on time and processes)
EXACT = ("rollout/raw_reward", "rollout/rollout_log_probs", "rollout/log_probs", "train/loss", "train/pg_loss",
         "train/entropy_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff", "sync/weights_checksum")


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]


def _megatron_cli(out: Path, *flags) -> int:
    return main(["train", "--train-backend", "megatron", "--skip-gates", "--output-dir", str(out), *FAST, *flags])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The TP=1 run in this process (the reference of the layouts below)."""
    out = tmp_path_factory.mktemp("tp1")
    train(["--train-backend", "megatron", "--output-dir", str(out), *FAST, *SHORT])
    return _lines(out)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]],
                         ids=["tp2", "pp2"])
def test_two_rank_layouts_are_true_on_policy_and_equal_the_one_rank_run(tmp_path, one_rank, layout):
    assert _megatron_cli(tmp_path, *layout, "--actor-num-gpus-per-node", "2", *SHORT) == 0
    lines = _lines(tmp_path)
    assert [m["rollout_id"] for m in lines] == [0, 1]
    assert [m["train/train_rollout_logprob_abs_diff"] for m in lines] == [0.0, 0.0]
    assert lines[0]["sync/weights_checksum"] != lines[1]["sync/weights_checksum"]  # the weights did change
    for got, ref in zip(lines, one_rank):
        for key in EXACT:
            assert got[key] == ref[key], f"{layout}: {key} at rollout {got['rollout_id']}"


def test_checkpoint_saved_at_tp2_resumes_at_tp1(tmp_path, one_rank):
    """2 rollouts at TP=2 saving after the first; resumed at TP=1 from it, the second rollout is the
    straight run's bit for bit (weights and AdamW moments saved under HF names)."""
    ckpt = tmp_path / "ckpt"
    assert _megatron_cli(tmp_path / "tp2", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
                         "--num-rollout", "1", "--true-on-policy-mode", "--save", str(ckpt)) == 0
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert _megatron_cli(tmp_path / "resumed", *SHORT, "--load", str(ckpt)) == 0
    (resumed,) = _lines(tmp_path / "resumed")
    assert resumed["rollout_id"] == 1
    for key in EXACT:
        assert resumed[key] == one_rank[1][key], key


def test_embedded_task_learns(tmp_path):
    # 30 rollouts of the embedded defaults (measured: chance 0.24 over the first 5, about 0.5 over the
    # last 5; the reward keeps rising, about 0.55 by rollout 40)
    hist = train(["--train-backend", "megatron", "--output-dir", str(tmp_path), *FAST, "--num-rollout", "30"])
    rewards = [m["rollout/raw_reward"] for m in hist]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert 0.1 <= start <= 0.35, f"the run must start near chance (0.25), got {start}"
    assert end >= 0.4 and end - start >= 0.15, f"mean reward of the last 5 rollouts {end} (first 5: {start}): {rewards}"
    assert all(m["train/train_rollout_logprob_abs_diff"] == 0.0 for m in hist)  # the engine is in tree mode


@pytest.mark.parametrize("layout", ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"],
                         ids=["tp2", "pp2"])
def test_gate_passes(tmp_path, capfd, layout):
    report = tmp_path / "gate.json"
    assert main(["gate", "--train-backend", "megatron", layout, "2",
                 "--actor-num-gpus-per-node", "2", "--output-dir", str(tmp_path / "out"), "--report-json", str(report),
                 *FAST]) == 0
    out, _ = capfd.readouterr()
    assert out.count("all gates passed") == 1
    assert json.loads(report.read_text())["passed"] is True


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size needs --train-backend megatron"),
    (["--sequence-parallel"], "--sequence-parallel needs --train-backend megatron"),
    (["--train-backend", "megatron", "--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism"),
    (["--train-backend", "megatron", "--sequence-parallel"], "--sequence-parallel is not implemented"),
    (["--train-backend", "megatron", "--use-distributed-optimizer"], "--use-distributed-optimizer is not implemented"),
    (["--train-backend", "megatron", "--recompute-granularity", "selective"], "--recompute-granularity selective"),
    (["--train-backend", "megatron", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "--recompute-granularity full needs CUDA"),
    (["--train-backend", "megatron", "--recompute-method", "block"], "--recompute-method needs --recompute-granularity"),
    (["--train-backend", "megatron", "--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1"),
    (["--train-backend", "megatron", "--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 2 does not divide the 1 actor rank"),
    (["--train-backend", "megatron", "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "3"],
     "= 2 does not divide the 3 actor rank"),
    (["--train-backend", "megatron", "--engine-weights", "shared"], "--engine-weights shared with --train-backend megatron"),
])
@pytest.mark.parametrize("command", ["train", "gate"])
def test_usage_errors_exit_2_naming_the_flag(tmp_path, capsys, command, flags, message):
    if "--actor-num-gpus-per-node" in flags:
        flags = [*flags, "--global-batch-size", "126", "--rollout-batch-size", "63", "--n-samples-per-prompt", "2"]
    code = main([command, *FAST, "--output-dir", str(tmp_path / "out"), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out" / METRICS_FILE).exists()


def test_layout_the_model_cannot_split_exits_2_before_any_rank_starts(tmp_path, capsys):
    # the tiny preset has 2 layers: 4 pipeline stages cannot hold them
    code = _megatron_cli(tmp_path, "--pipeline-model-parallel-size", "4", "--actor-num-gpus-per-node", "4")
    assert code == 2
    err = capsys.readouterr().err
    assert "--pipeline-model-parallel-size 4: --model tiny has 2 layers" in err and "Traceback" not in err
