"""RL losses on per-token tensors (slime's definitions).

Notation, per response token t of sample i (all [R_i] tensors; flat tensors are the concatenation
over samples in order, [sum R_i]):

* ``log_probs`` — the actor's current log-prob (differentiable), ``old_log_probs`` — the actor's
  log-prob before this rollout's updates, ``ref_log_probs`` — the frozen reference's,
  ``rollout_log_probs`` — what the rollout engine reported, ``loss_mask`` — 1 for trained tokens.
* ``ppo_kl = old_log_probs - log_probs`` (so ``ratio = exp(-ppo_kl) = pi / pi_old``).

Policy loss (PPO clip with asymmetric range)::

    l1 = -ratio * A,   l2 = -clamp(ratio, 1 - eps_clip, 1 + eps_clip_high) * A
    pg_loss = max(l1, l2),   pg_clipfrac = 1[l2 > l1]

GSPO uses the sequence-level ratio: ``ppo_kl_i = sum_t mask (old - new) / max(sum_t mask, 1)``,
broadcast to the sample's tokens (its gradient reaches every token through that mean).

TIS: ``pg_loss *= clamp(exp(old_log_probs - rollout_log_probs), tis_clip_low, tis_clip)`` (a
constant weight; no gradient).

KL against the reference (``log r = log_probs - ref_log_probs``; Schulman's estimators, samples
drawn from the actor): ``k1 = log r`` (unbiased, any sign), ``k2 = (log r)^2 / 2`` (>= 0, biased),
``k3 = exp(-log r) - 1 + log r`` (>= 0, unbiased), ``low_var_kl`` = k3 clamped to [-10, 10].

Reduction: per-sample (default) ``sum_i mean_{t: mask} x_i,t`` or per-token
(``calculate_per_token_loss``) ``sum_{i, t: mask} x_i,t``; :class:`rlperf.train.Trainer` divides
by the global batch's sample count or loss-token count, so micro-batches add up to the step loss.
Total: ``loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .args import KL_LOSS_TYPES, TrainArgs


def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_loss_type: str) -> torch.Tensor:
    """Per-token KL estimate of KL(actor || ref) from log-probs of actor samples (same shapes; >= float32)."""
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    log_ratio = log_probs.to(dtype) - ref_log_probs.to(dtype)
    if kl_loss_type == "k1":
        return log_ratio
    if kl_loss_type == "k2":
        return log_ratio.square() / 2.0
    if kl_loss_type in ("k3", "low_var_kl"):
        # exp(-log r) - 1 + log r >= 0 (x - 1 - log x >= 0 with x = ref/actor); E_actor[.] = KL
        kl = torch.expm1(-log_ratio) + log_ratio
        # the clamp bounds the (rare) huge values when the reference is far more likely than the actor
        return kl.clamp(min=-10.0, max=10.0) if kl_loss_type == "low_var_kl" else kl
    raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; choose from {', '.join(KL_LOSS_TYPES)}")


def compute_policy_loss(ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
                        eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped policy loss and clip indicator (float 0/1) from ``ppo_kl = old - new`` [N]."""
    ratio = torch.exp(-ppo_kl)
    l1 = -ratio * advantages
    l2 = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    return torch.maximum(l1, l2), torch.gt(l2, l1).to(l1.dtype)


def _segments(response_lengths: Sequence[int], device) -> torch.Tensor:
    """Sample index of every token [sum R_i] (int64)."""
    lengths = torch.as_tensor(list(response_lengths), dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)


def sequence_ppo_kl(old_log_probs: torch.Tensor, log_probs: torch.Tensor, loss_masks: Sequence[torch.Tensor],
                    response_lengths: Sequence[int]) -> torch.Tensor:
    """GSPO: each sample's masked mean of ``old - new``, broadcast to its tokens -> [sum R_i]."""
    if not len(response_lengths):
        return old_log_probs - log_probs
    seg = _segments(response_lengths, log_probs.device)
    mask = torch.cat(list(loss_masks)).to(log_probs.dtype)
    diff = (old_log_probs - log_probs) * mask
    num = diff.new_zeros(len(response_lengths)).index_add(0, seg, diff)
    count = mask.new_zeros(len(response_lengths)).index_add(0, seg, mask).clamp_min(1)
    return (num / count)[seg]


def sample_reducer(response_lengths: Sequence[int], loss_masks: Sequence[torch.Tensor],
                   calculate_per_token_loss: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(x [sum R_i]) -> scalar``: sum of per-sample masked means, or the masked token sum (per-token).

    Both are one weighted sum over tokens (no per-sample Python loop: a few launches per metric
    on the GPU, whatever the number of samples): token weight ``mask`` (per-token) or
    ``mask / max(sum of the sample's mask, 1)`` (per-sample).
    """
    if not len(response_lengths):
        return lambda x: x.sum()
    mask = torch.cat(list(loss_masks))
    weight = mask.double()
    if not calculate_per_token_loss:
        seg = _segments(response_lengths, mask.device)
        count = weight.new_zeros(len(response_lengths)).index_add(0, seg, weight).clamp_min(1)
        weight = weight / count[seg]
    cache: dict[torch.dtype, torch.Tensor] = {}

    def reduce(x: torch.Tensor) -> torch.Tensor:
        w = cache.setdefault(x.dtype, weight.to(x.dtype))
        return (x * w).sum()

    return reduce


def policy_loss(args: TrainArgs, log_probs: torch.Tensor, entropy: torch.Tensor, old_log_probs: torch.Tensor,
                advantages: torch.Tensor, loss_masks: Sequence[torch.Tensor], response_lengths: Sequence[int],
                ref_log_probs: torch.Tensor | None = None,
                rollout_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The (unnormalized) loss of a micro-batch and its metrics, slime's ``policy_loss_function``.

    Args (flat over the micro-batch's samples, [sum R_i]; ``loss_masks`` one [R_i] per sample):
        log_probs: current actor log-probs (differentiable); entropy: the actor's entropy per token.
        old_log_probs, advantages, ref_log_probs (needed with ``use_kl_loss``), rollout_log_probs
        (needed with ``use_tis``; also gives ``train_rollout_logprob_abs_diff``): constants.

    Returns:
        ``loss`` (scalar, reduced by :func:`sample_reducer`: divide by the global batch's samples
        or loss tokens), and detached metrics under the same reduction, named without the
        ``train/`` prefix: loss, pg_loss, pg_clipfrac, ppo_kl, entropy_loss, [kl_loss],
        [train_rollout_logprob_abs_diff], [tis, ois, tis_clipfrac].
    """
    if args.use_kl_loss and ref_log_probs is None:
        raise ValueError("use_kl_loss needs ref_log_probs (a frozen reference model)")
    if args.use_tis and rollout_log_probs is None:
        raise ValueError("use_tis needs rollout_log_probs from the rollout engine")
    reduce = sample_reducer(response_lengths, loss_masks, args.calculate_per_token_loss)
    old_log_probs = old_log_probs.to(log_probs.dtype)
    if args.advantage_estimator == "gspo":
        ppo_kl = sequence_ppo_kl(old_log_probs, log_probs, loss_masks, response_lengths)
    else:
        ppo_kl = old_log_probs - log_probs
    pg_losses, clipped = compute_policy_loss(ppo_kl, advantages.to(log_probs.dtype), args.eps_clip, args.clip_high)
    metrics: dict[str, torch.Tensor] = {}
    if args.use_tis:
        tis = torch.exp(old_log_probs - rollout_log_probs.to(log_probs.dtype))
        tis_clipped = tis.clamp(args.tis_clip_low, args.tis_clip)
        pg_losses = pg_losses * tis_clipped
        metrics["tis"] = reduce(tis)
        metrics["ois"] = reduce(torch.exp(-ppo_kl.detach()))
        metrics["tis_clipfrac"] = reduce((tis_clipped != tis).to(tis.dtype))
    pg_loss = reduce(pg_losses)
    entropy_loss = reduce(entropy.to(log_probs.dtype))
    loss = pg_loss - args.entropy_coef * entropy_loss
    if args.use_kl_loss:
        kl_loss = reduce(compute_approx_kl(log_probs, ref_log_probs, args.kl_loss_type))
        loss = loss + args.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    if rollout_log_probs is not None:
        metrics["train_rollout_logprob_abs_diff"] = reduce((old_log_probs - rollout_log_probs.to(log_probs.dtype)).abs())
    metrics.update(loss=loss, pg_loss=pg_loss, pg_clipfrac=reduce(clipped), ppo_kl=reduce(ppo_kl),
                   entropy_loss=entropy_loss)
    return loss, {k: v.detach() for k, v in metrics.items()}
