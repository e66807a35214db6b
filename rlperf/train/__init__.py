"""rlperf.train — the training core: advantages, RL losses, packed micro-batches, the optimizer step.

* :mod:`~rlperf.train.args` — :class:`TrainArgs` (slime's flag names);
* :mod:`~rlperf.train.advantages` — grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline;
* :mod:`~rlperf.train.losses` — PPO/GSPO policy loss, KL estimators, TIS, per-sample/per-token reduction;
* :mod:`~rlperf.train.sample` — :class:`Sample`, the one sample type from rollout to training
  (slime's field names);
* :mod:`~rlperf.train.batching` — packing under ``max_tokens_per_gpu``, log-probs of response
  tokens through ``rlperf.kernels.fused_logprob``;
* :mod:`~rlperf.train.trainer` — :class:`Trainer` (AdamW + grad clipping), metrics with slime's names.
* :mod:`~rlperf.train.fsdp` — :class:`~rlperf.train.fsdp.FSDPTrainer`, the data-parallel trainer over
  FSDP2 shards, and the bucket-by-bucket gather of the full weights (imported on its own: it loads
  ``torch.distributed``).
"""
from .advantages import compute_advantages, masked_whiten, normalize_rewards
from .args import ADVANTAGE_ESTIMATORS, KL_LOSS_TYPES, TrainArgs, add_train_arguments, train_args_from
from .batching import MicroBatch, compute_log_probs, compute_routed_experts, micro_batch_log_probs, pack_micro_batches, partition
from .losses import compute_approx_kl, compute_policy_loss, policy_loss, sample_reducer
from .sample import Sample
from .trainer import Trainer, frozen_copy

__all__ = [
    "TrainArgs", "add_train_arguments", "train_args_from", "ADVANTAGE_ESTIMATORS", "KL_LOSS_TYPES", "compute_advantages", "normalize_rewards", "masked_whiten",
    "Sample", "MicroBatch", "pack_micro_batches", "partition", "micro_batch_log_probs", "compute_log_probs",
    "compute_routed_experts",
    "compute_approx_kl", "compute_policy_loss", "policy_loss", "sample_reducer", "Trainer", "frozen_copy",
]
