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
  ``torch.distributed``); :mod:`~rlperf.train.expert_parallel` and :mod:`~rlperf.train.megatron` likewise;
* :mod:`~rlperf.train.config` — :class:`TrainConfig`, the trainer's typed configuration;
* :mod:`~rlperf.train.backend` — :class:`TrainerBackend`, the one protocol the loop trains through, and
  the registry from ``--train-backend`` and the layout flags to its implementations (:func:`build_trainer`).
"""
from rlperf.lazy_exports import lazy_exports

_EXPORTS = {
    'TrainerBackend': '.backend',
    'TrainerSetup': '.backend',
    'build_trainer': '.backend',
    'register_trainer_backend': '.backend',
    'TrainConfig': '.config',
    'compute_advantages': '.advantages',
    'masked_whiten': '.advantages',
    'normalize_rewards': '.advantages',
    'ADVANTAGE_ESTIMATORS': '.args',
    'KL_LOSS_TYPES': '.args',
    'TrainArgs': '.args',
    'add_train_arguments': '.args',
    'train_args_from': '.args',
    'MicroBatch': '.batching',
    'compute_log_probs': '.batching',
    'compute_routed_experts': '.batching',
    'micro_batch_log_probs': '.batching',
    'pack_micro_batches': '.batching',
    'partition': '.batching',
    'compute_approx_kl': '.losses',
    'compute_policy_loss': '.losses',
    'policy_loss': '.losses',
    'sample_reducer': '.losses',
    'Sample': '.sample',
    'Trainer': '.trainer',
    'frozen_copy': '.trainer',
}
"""Each exported name -> the submodule that defines it (imported when the name is first used)."""
__all__ = [
    "TrainArgs", "add_train_arguments", "train_args_from", "ADVANTAGE_ESTIMATORS", "KL_LOSS_TYPES", "compute_advantages", "normalize_rewards", "masked_whiten",
    "Sample", "MicroBatch", "pack_micro_batches", "partition", "micro_batch_log_probs", "compute_log_probs",
    "compute_routed_experts",
    "compute_approx_kl", "compute_policy_loss", "policy_loss", "sample_reducer", "Trainer", "frozen_copy",
    "TrainConfig", "TrainerBackend", "TrainerSetup", "build_trainer", "register_trainer_backend",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
