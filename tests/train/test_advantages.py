"""Advantage estimators against hand-written float64 loops (slime's definitions)."""
import math

import pytest
import torch

from rlperf.train import TrainArgs, compute_advantages, masked_whiten, normalize_rewards
from rlperf.train.advantages import GROUP_STD_EPS

LENGTHS = [1, 7, 3, 33, 2, 5, 4, 1, 9]  # 3 groups of 3


def _masks(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    masks = [(torch.rand(n, generator=g) > 0.3).float() for n in lengths]
    masks[3][-4:] = 0  # trailing unmasked tokens (a tool output at the end)
    masks[7][:] = 0    # a sample with no loss token
    return masks


def _rewards(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LENGTHS), generator=g)


def _group_stats(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, std


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
@pytest.mark.parametrize("std_norm", [True, False])
def test_grpo_gspo_group_normalized_reward_on_every_token(estimator, std_norm):
    rewards, masks = _rewards(), _masks(LENGTHS)
    args = TrainArgs(advantage_estimator=estimator, n_samples_per_prompt=3, grpo_std_normalization=std_norm)
    adv = compute_advantages(args, rewards, LENGTHS, masks)
    r = rewards.double().tolist()
    for i, (a, n) in enumerate(zip(adv, LENGTHS)):
        group = r[3 * (i // 3): 3 * (i // 3) + 3]
        mean, std = _group_stats(group)
        want = (r[i] - mean) / (std + GROUP_STD_EPS) if std_norm else r[i] - mean
        assert a.shape == (n,) and a.dtype == torch.float32
        torch.testing.assert_close(a.double(), torch.full((n,), want, dtype=torch.float64), atol=1e-5, rtol=1e-5)


def test_equal_rewards_in_a_group_give_zero_advantage_and_groups_of_one_stay_finite():
    rewards = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 1.0])
    out = normalize_rewards(rewards, 3, "grpo")
    assert torch.equal(out[:3], torch.zeros(3))
    single = normalize_rewards(torch.tensor([0.3, 1.0]), 1, "grpo")
    assert torch.equal(single, torch.zeros(2))  # centered on itself; no NaN from a 1-sample std


def test_rewards_normalization_off_and_reinforce_plus_plus_keep_raw_rewards():
    rewards = _rewards()
    assert torch.equal(normalize_rewards(rewards, 3, "grpo", rewards_normalization=False), rewards)
    assert torch.equal(normalize_rewards(rewards, 3, "reinforce_plus_plus"), rewards)


@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_reinforce_plus_plus_discounted_returns_with_kl_penalty(gamma):
    rewards, masks = _rewards(), _masks(LENGTHS)
    g = torch.Generator().manual_seed(2)
    kl = [torch.randn(n, generator=g) * 0.1 for n in LENGTHS]
    args = TrainArgs(advantage_estimator="reinforce_plus_plus", n_samples_per_prompt=3, kl_coef=0.3, gamma=gamma)
    adv = compute_advantages(args, rewards, LENGTHS, masks, kl)
    for i, a in enumerate(adv):
        m, k = masks[i].tolist(), kl[i].double().tolist()
        token_rewards = [-0.3 * k[t] * m[t] for t in range(len(m))]
        loss_tokens = [t for t in range(len(m)) if m[t]]
        if loss_tokens:
            token_rewards[loss_tokens[-1]] += float(rewards[i])  # raw reward, no group normalization
        want, running = [0.0] * len(m), 0.0
        for t in reversed(range(len(m))):
            running = token_rewards[t] + gamma * running
            want[t] = running
        torch.testing.assert_close(a.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_baseline_centered_reward_minus_kl():
    rewards, masks = _rewards(), _masks(LENGTHS)
    g = torch.Generator().manual_seed(3)
    kl = [torch.rand(n, generator=g) for n in LENGTHS]
    args = TrainArgs(advantage_estimator="reinforce_plus_plus_baseline", n_samples_per_prompt=3, kl_coef=0.05)
    adv = compute_advantages(args, rewards, LENGTHS, masks, kl)
    r = rewards.double().tolist()
    for i, a in enumerate(adv):
        mean = sum(r[3 * (i // 3): 3 * (i // 3) + 3]) / 3  # centered only: no std for the baseline
        want = [(r[i] - mean) - 0.05 * k for k in kl[i].double().tolist()]
        torch.testing.assert_close(a.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-6)


def test_kl_is_ignored_without_kl_coef():
    rewards, masks = _rewards(), _masks(LENGTHS)
    kl = [torch.full((n,), 5.0) for n in LENGTHS]
    args = TrainArgs(advantage_estimator="reinforce_plus_plus_baseline", n_samples_per_prompt=3)
    for a, b in zip(compute_advantages(args, rewards, LENGTHS, masks, kl), compute_advantages(args, rewards, LENGTHS, masks)):
        assert torch.equal(a, b)


def test_normalize_advantages_whitens_over_loss_tokens():
    masks = _masks(LENGTHS)
    g = torch.Generator().manual_seed(4)
    values = [torch.randn(n, generator=g) * 3 + 2 for n in LENGTHS]
    out = masked_whiten(values, masks)
    flat = [v for vs, ms in zip(values, masks) for v, m in zip(vs.double().tolist(), ms.tolist()) if m]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    for o, v in zip(out, values):
        torch.testing.assert_close(o.double(), (v.double() - mean) / math.sqrt(var + 1e-8), atol=1e-5, rtol=1e-5)
    masked = torch.cat([o[m.bool()] for o, m in zip(out, masks)]).double()
    assert abs(masked.mean().item()) < 1e-6 and abs(masked.var().item() - 1) < 1e-5
    args = TrainArgs(advantage_estimator="reinforce_plus_plus", normalize_advantages=True)
    adv = compute_advantages(args, _rewards(), LENGTHS, masks)
    masked = torch.cat([a[m.bool()] for a, m in zip(adv, masks)]).double()
    assert abs(masked.mean().item()) < 1e-6 and abs(masked.var().item() - 1) < 1e-5


def test_unknown_estimator_and_bad_groups_are_clear_errors():
    with pytest.raises(ValueError, match="advantage-estimator 'ppo'.*grpo, gspo"):
        TrainArgs(advantage_estimator="ppo")
    with pytest.raises(ValueError, match="unknown advantage estimator 'dapo'"):
        normalize_rewards(torch.zeros(4), 2, "dapo")
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=4"):
        normalize_rewards(torch.zeros(6), 4, "grpo")
    with pytest.raises(ValueError, match="4 rewards, 3 samples"):
        compute_advantages(TrainArgs(), torch.zeros(4), [1, 2, 3], [torch.ones(1), torch.ones(2), torch.ones(3)])
