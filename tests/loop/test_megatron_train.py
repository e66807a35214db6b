"""``rlperf train`` / ``rlperf gate`` with ``--train-backend megatron`` on the CPU (gloo rank processes).

The megatron trainer's reductions are fixed trees (``rlperf.kernels.tree_reduce``) and the loop's
engines run rlperf's model in the same tree mode (``reduction_leaves``): a run at TP=2 or PP=2 is
exactly on-policy at every step (``train_rollout_logprob_abs_diff`` 0), and it is the one-process run
(TP=1) bit for bit, rollout after rollout: same rewards, log-probs, losses, grad norms and weights
checksums. Usage errors exit 2 naming the flag before any rank starts.
"""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from rlperf.cli import main  # noqa: E402
from rlperf.loop import METRICS_FILE, train  # noqa: E402

FAST = ["--device", "cpu", "--num-threads", "1", "--no-progress"]
# bits are the point, not learning: 2 prompts x 4 samples a rollout instead of the embedded task's 8 x 16,
# 4 samples a micro-batch (2 micro-batches a step)
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
         "--micro-batch-size", "4"]
SHORT = ["--num-rollout", "2", "--true-on-policy-mode", *SMALL]
TWO_RANKS = ["--actor-num-gpus-per-node", "2"]
# what must be the same bits at every layout (perf/ and memory/ keys depend on time and processes)
# the learning run: the embedded defaults (8 prompts x 16 samples a rollout) in micro-batches of 32 samples
# (the default, 1, makes 128 micro-batches a step: ten times slower, the same rewards). Measured at 40
# rollouts: the first 5 average 0.231 (chance 0.25), the reward leaves chance after ~25 rollouts and the
# last 5 average 0.588; a rollout's mean has std ~0.04
LEARN_ROLLOUTS, LEARN_END = 40, 0.33
EXACT = ("rollout/raw_reward", "rollout/rollout_log_probs", "rollout/log_probs", "train/loss", "train/pg_loss",
         "train/entropy_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff", "sync/weights_checksum")


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]


def _megatron_cli(out: Path, *flags) -> int:
    return main(["train", "--train-backend", "megatron", "--output-dir", str(out), *FAST, *flags])


def _gates_passed(capfd, report: Path) -> None:
    out, _ = capfd.readouterr()
    assert out.count("all gates passed") == 1
    assert json.loads(report.read_text())["passed"] is True


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The TP=1 run in this process (the reference of the layouts below)."""
    out = tmp_path_factory.mktemp("tp1")
    train(["--train-backend", "megatron", "--output-dir", str(out), *FAST, *SHORT])
    return _lines(out)


@pytest.mark.parametrize("sequence_parallel", [[], ["--sequence-parallel"]], ids=["tp2", "tp2-sp"])
def test_tp2_gates_pass_and_equal_the_one_rank_run(tmp_path, capfd, one_rank, sequence_parallel):
    """``rlperf train`` at TP=2 on 2 gloo ranks, without and with sequence parallelism: the first-step
    gates run first and pass (what ``rlperf gate`` runs), then every rollout is exactly on-policy and the
    one-rank run bit for bit."""
    report = tmp_path / "gate.json"
    assert _megatron_cli(tmp_path, "--tensor-model-parallel-size", "2", *sequence_parallel, *TWO_RANKS, *SHORT,
                         "--report-json", str(report)) == 0
    _gates_passed(capfd, report)
    lines = _lines(tmp_path)
    assert [m["rollout_id"] for m in lines] == [0, 1]
    assert [m["train/train_rollout_logprob_abs_diff"] for m in lines] == [0.0, 0.0]
    assert lines[0]["sync/weights_checksum"] != lines[1]["sync/weights_checksum"]  # the weights did change
    for got, ref in zip(lines, one_rank):
        for key in EXACT:
            assert got[key] == ref[key], f"{key} at rollout {got['rollout_id']}"


def test_pp2_distributed_optimizer_checkpoint_resumes_at_tp1(tmp_path, capfd, one_rank):
    """1 rollout at PP=2 with the distributed optimizer (gates first, then the rollout, then a checkpoint
    of HF-named weights and AdamW moments); resumed at TP=1, the second rollout is the straight run's
    bit for bit."""
    ckpt, report = tmp_path / "ckpt", tmp_path / "gate.json"
    assert _megatron_cli(tmp_path / "pp2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                         *TWO_RANKS, *SHORT[2:], "--num-rollout", "1", "--save", str(ckpt),
                         "--report-json", str(report)) == 0
    _gates_passed(capfd, report)
    (first,) = _lines(tmp_path / "pp2")
    for key in EXACT:
        assert first[key] == one_rank[0][key], key
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert _megatron_cli(tmp_path / "resumed", "--skip-gates", *SHORT, "--load", str(ckpt)) == 0
    (resumed,) = _lines(tmp_path / "resumed")
    assert resumed["rollout_id"] == 1
    for key in EXACT:
        assert resumed[key] == one_rank[1][key], key


def test_embedded_task_learns(tmp_path):
    # the reward leaves chance (0.25) and rises (LEARN_ROLLOUTS); 0.1 is 4 standard deviations of the
    # difference of two 5-rollout means at chance
    hist = train(["--train-backend", "megatron", "--output-dir", str(tmp_path), *FAST, "--num-rollout",
                  str(LEARN_ROLLOUTS), "--micro-batch-size", "32"])
    rewards = [m["rollout/raw_reward"] for m in hist]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert 0.1 <= start <= 0.35, f"the run must start near chance (0.25), got {start}"
    assert end >= LEARN_END and end - start >= 0.1, \
        f"mean reward of the last 5 rollouts {end} (first 5: {start}): {rewards}"
    assert all(m["train/train_rollout_logprob_abs_diff"] == 0.0 for m in hist)  # the engine is in tree mode


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size needs --train-backend megatron"),
    (["--sequence-parallel"], "--sequence-parallel needs --train-backend megatron"),
    (["--train-backend", "megatron", "--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism"),
    (["--use-distributed-optimizer"], "--use-distributed-optimizer needs --train-backend megatron"),
    (["--train-backend", "megatron", "--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine needs Transformer Engine, which does not load here: ModuleNotFoundError"),
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
    if "transformer_engine" in flags and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here: its refusal names what else is missing")
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
