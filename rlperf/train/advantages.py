"""Advantage estimators (slime's ``--advantage-estimator``), per response token.

Inputs: one scalar reward per sample ([B] float), samples of a prompt contiguous in groups of
``n_samples_per_prompt``; per sample a ``loss_mask`` [R_i] and (for the KL-shaped estimators) a
per-token ``kl`` [R_i] = ``compute_approx_kl(log_probs, ref_log_probs, kl_loss_type)``.
Outputs: one advantages tensor [R_i] float32 per sample.

1. Reward post-processing (:func:`normalize_rewards`, slime does it when the rollout ends): for
   grpo, gspo and reinforce_plus_plus_baseline, ``r <- r - mean_group(r)``; for grpo and gspo also
   ``r <- r / (std_group(r) + 1e-6)`` (unbiased std; a group of one has std NaN, so groups of one
   are only centered: slime would produce NaN there). The statistics are taken in float64 and a
   group whose rewards are all equal gets exactly 0: in float32, ``0.9 - mean(0.9, 0.9, 0.9)`` is
   ~1e-8, which the std division turns into a spurious advantage of ~0.06 (a noise slime's docs
   warn about for non-binary rewards).
2. Estimators:

   * grpo, gspo: ``A_i,t = r_i`` (every token of a sample gets its normalized reward);
   * reinforce_plus_plus: token rewards ``-kl_coef * kl_t * mask_t``, plus ``r_i`` at the last
     loss token; ``A_i,t = sum_{s >= t} gamma^(s - t) reward_s`` (discounted return);
   * reinforce_plus_plus_baseline: ``A_i,t = r_i - kl_coef * kl_t`` (r_i group-centered).
3. Optional whitening (``normalize_advantages``): over all loss tokens of the batch,
   ``(A - mean) / sqrt(var_unbiased + 1e-8)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .args import ADVANTAGE_ESTIMATORS, TrainArgs

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


def _check_estimator(name: str) -> None:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {', '.join(ADVANTAGE_ESTIMATORS)}")


def normalize_rewards(rewards: torch.Tensor, n_samples_per_prompt: int, advantage_estimator: str,
                      rewards_normalization: bool = True, grpo_std_normalization: bool = True) -> torch.Tensor:
    """Group-normalized rewards [B] (float32) from raw rewards [B], B a multiple of the group size."""
    _check_estimator(advantage_estimator)
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if not rewards_normalization or advantage_estimator == "reinforce_plus_plus":
        return rewards.clone()
    if rewards.numel() % n_samples_per_prompt:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of n_samples_per_prompt="
                         f"{n_samples_per_prompt}")
    groups = rewards.view(-1, n_samples_per_prompt).double()
    centered = groups - groups.mean(dim=-1, keepdim=True)
    if advantage_estimator in ("grpo", "gspo") and grpo_std_normalization and n_samples_per_prompt > 1:
        centered = centered / (groups.std(dim=-1, keepdim=True) + GROUP_STD_EPS)
    uniform = (groups == groups[:, :1]).all(dim=-1, keepdim=True)
    return centered.masked_fill(uniform, 0.0).float().flatten()


def grpo_advantages(rewards: torch.Tensor, response_lengths: Sequence[int]) -> list[torch.Tensor]:
    """grpo / gspo: the (normalized) reward on every token of its sample."""
    return [torch.full((n,), float(r), dtype=torch.float32) for r, n in zip(rewards.tolist(), response_lengths)]


def reinforce_plus_plus_returns(rewards: torch.Tensor, kl: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor],
                                kl_coef: float, gamma: float) -> list[torch.Tensor]:
    """Discounted token returns of ``-kl_coef * kl * mask`` plus the reward at the last loss token."""
    out = []
    for r, k, m in zip(rewards.tolist(), kl, loss_masks):
        token_rewards = (-kl_coef * k.double() * m.double()).clone()
        nz = m.nonzero()
        if len(nz):  # a sample with no loss token trains nothing; its reward has nowhere to go
            token_rewards[int(nz[-1])] += r
        if gamma == 1.0:  # undiscounted: a reversed cumulative sum (float64)
            returns = token_rewards.flip(0).cumsum(0).flip(0)
        else:  # gamma^t scaling would underflow on long responses: the recurrence, on Python floats
            values, running = token_rewards.tolist(), 0.0
            for t in range(len(values) - 1, -1, -1):
                running = values[t] + gamma * running
                values[t] = running
            returns = torch.tensor(values, dtype=torch.float64)
        out.append(returns.float())
    return out


def reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, kl: Sequence[torch.Tensor],
                                            kl_coef: float) -> list[torch.Tensor]:
    """``r_i - kl_coef * kl_t`` per token (``rewards`` already group-centered)."""
    return [float(r) - kl_coef * k.float() for r, k in zip(rewards.tolist(), kl)]


def masked_whiten(values: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Whiten per-token values over the masked tokens of all samples (unbiased variance)."""
    flat = torch.cat([v.float() for v in values])
    mask = torch.cat([m.float() for m in loss_masks])
    count = mask.sum()
    if count == 0:
        return [v.clone() for v in values]
    mean = (flat * mask).sum() / count
    var = ((flat - mean).square() * mask).sum() / count
    if count >= 2:
        var = var * count / (count - 1)
    out = (flat - mean) * torch.rsqrt(var + WHITEN_EPS)
    return list(out.split([v.numel() for v in values]))


def compute_advantages(args: TrainArgs, raw_rewards: torch.Tensor, response_lengths: Sequence[int],
                       loss_masks: Sequence[torch.Tensor], kl: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Advantages [R_i] float32 per sample, from raw rewards [B] (normalization included).

    ``kl`` (per-token actor-vs-reference estimates) is needed only when ``args.kl_coef != 0`` with
    the reinforce_plus_plus estimators; otherwise zeros, as in slime.
    """
    _check_estimator(args.advantage_estimator)
    rewards = normalize_rewards(raw_rewards, args.n_samples_per_prompt, args.advantage_estimator,
                                args.rewards_normalization, args.grpo_std_normalization)
    if len(rewards) != len(response_lengths) or len(loss_masks) != len(response_lengths):
        raise ValueError(f"{len(rewards)} rewards, {len(response_lengths)} samples, {len(loss_masks)} loss masks")
    if kl is None or args.kl_coef == 0:
        kl = [torch.zeros(n) for n in response_lengths]
    if args.advantage_estimator in ("grpo", "gspo"):
        adv = grpo_advantages(rewards, response_lengths)
    elif args.advantage_estimator == "reinforce_plus_plus":
        adv = reinforce_plus_plus_returns(rewards, kl, loss_masks, args.kl_coef, args.gamma)
    else:
        adv = reinforce_plus_plus_baseline_advantages(rewards, kl, args.kl_coef)
    if args.normalize_advantages:
        adv = masked_whiten(adv, loss_masks)
    return adv
