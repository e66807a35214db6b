"""TrainArgs flags: slime's names, defaults round trip, validation errors."""
import argparse

import pytest

from rlperf.train import TrainArgs, add_train_arguments, train_args_from


def _parse(argv, skip=()):
    p = argparse.ArgumentParser()
    add_train_arguments(p, skip=skip)
    return p, p.parse_args(argv)


def test_defaults_round_trip_and_slime_flags():
    _, ns = _parse([])
    assert train_args_from(ns) == TrainArgs()
    _, ns = _parse(["--advantage-estimator", "gspo", "--n-samples-per-prompt", "8", "--eps-clip", "0.2",
                    "--eps-clip-high", "0.28", "--use-kl-loss", "--kl-loss-coef", "0.001", "--kl-loss-type",
                    "low_var_kl", "--entropy-coef", "0.01", "--use-tis", "--calculate-per-token-loss",
                    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--disable-grpo-std-normalization",
                    "--lr", "1e-5", "--clip-grad", "0.5"])
    a = train_args_from(ns)
    assert (a.advantage_estimator, a.n_samples_per_prompt, a.clip_high, a.kl_loss_type) == ("gspo", 8, 0.28, "low_var_kl")
    assert a.use_kl_loss and a.use_tis and a.calculate_per_token_loss and a.use_dynamic_batch_size
    assert a.max_tokens_per_gpu == 4096 and a.lr == 1e-5 and a.clip_grad == 0.5
    assert a.rewards_normalization and not a.grpo_std_normalization


def test_bad_values_are_clear_errors(capsys):
    p, _ = _parse([])
    with pytest.raises(SystemExit):
        p.parse_args(["--advantage-estimator", "ppo"])
    assert "invalid choice: 'ppo'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--kl-loss-type", "k5"])
    _, ns = _parse(["--use-dynamic-batch-size"])
    with pytest.raises(ValueError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu"):
        train_args_from(ns)
    with pytest.raises(ValueError, match="--tis-clip-low <= --tis-clip"):
        TrainArgs(tis_clip=0.5, tis_clip_low=0.9)


def test_shared_flags_can_live_in_another_group():
    p = argparse.ArgumentParser()
    p.add_argument("--global-batch-size", type=int, default=64)  # e.g. defined by the rollout flags
    add_train_arguments(p, skip={"--global-batch-size"})
    assert train_args_from(p.parse_args([])).global_batch_size == 64
