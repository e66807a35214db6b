"""Training-core options, with slime's flag names (``--eps-clip`` -> ``eps_clip``); light to import (nothing
but the standard library and :mod:`rlperf.flags`: ``rlperf train --help`` reads these flags without torch)."""
from __future__ import annotations

import argparse
import dataclasses
import math

from rlperf.flags import AUTO_BUCKETS, check_token_buckets, token_buckets

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
FSDP_GATHER_MODES = ("auto", "step", "micro-batch")
"""When data-parallel ranks gather their FSDP2 shards (:class:`rlperf.train.fsdp.FSDPTrainer`)."""
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
GATHERED_STEP_MEMORY_FRACTION = 0.25
"""``--fsdp-gather auto`` keeps a step's parameters gathered when full parameters (compute dtype) plus
float32 gradients take at most this share of the device's memory (:mod:`rlperf.train.fsdp`)."""
AUTO_BUCKET_FLOOR = 512
"""``--cuda-graph-buckets auto``: no bucket below this many tokens (:func:`auto_cuda_graph_buckets`)."""
AUTO_BUCKET_FRACTIONS = (1, 3 / 4, 1 / 2, 3 / 8, 1 / 4, 3 / 16)
"""``--cuda-graph-buckets auto``: the buckets as fractions of M, ``M, 3M/4, M/2, 3M/8, M/4, 3M/16`` (at most
this many buckets)."""
AUTO_BUCKET_ROUNDING = 64
"""``--cuda-graph-buckets auto``: each bucket below M is rounded up to a multiple of this many tokens."""
AUTO_GRAPH_GRADIENT_FRACTION = 0.10
"""``--cuda-graph-buckets auto``: the share of the device's memory the buckets' gradient copies may take."""


def auto_cuda_graph_buckets(max_tokens_per_gpu: int, gradient_set_bytes: int = 0,
                            capacity: int | None = None) -> tuple[int, ...]:
    """The buckets of ``--cuda-graph-buckets auto`` where graphs apply (the one place this rule lives).

    ``max_tokens_per_gpu`` M: ``--max-tokens-per-gpu``; ``gradient_set_bytes``: the trainable parameters
    in the compute dtype (what each captured train step keeps as its gradient outputs); ``capacity``:
    the device's memory in bytes (None: no memory bound). Returns the sorted buckets, ``()`` for eager.

    The ladder: M times :data:`AUTO_BUCKET_FRACTIONS` (below M each rounded up to a multiple of
    :data:`AUTO_BUCKET_ROUNDING`) while they stay >= :data:`AUTO_BUCKET_FLOOR`; so M=4096 gives 768, 1024,
    1536, 2048, 3072, 4096 and M=3000 gives 576, 768, 1152, 1536, 2304, 3000. Why:

    * the top bucket is M, not the next power of two: the packer fills micro-batches up to M, so every
      micro-batch of a step but its last is close to M and pads by little;
    * a step's last micro-batch holds what is left, anywhere from a few tokens to M: for a remainder
      spread evenly over that range, halves alone pad it by about M/6 on average (almost M/2 when it is
      just over M/2), steps of 3/4 and 2/3 by about M/12 down to the smallest bucket (measured: the 0.6b synthetic loop packs 3,792, 3,792 and 2,616
      tokens; 4096, 4096 and 4096 with halves, 4096, 4096 and 3072 with this ladder: 8% fewer
      padded tokens in each step's forward and backward);
    * within the ladder a micro-batch pads to at most 3/2 of its size, and one below the smallest
      bucket pads up to it: a micro-step of fewer than 512 tokens is launch-bound (its kernels take less
      GPU time than the host takes to issue some 950 launches), so padding it costs close to nothing;
    * each (bucket, sequence-slot count) a run meets is captured on first use (two warm-up runs and the
      capture, for the actor's and the reference's log-prob passes and the train step) and keeps one
      set of parameter gradients in the compute dtype as graph outputs. Only the largest buckets whose
      gradient sets fit :data:`AUTO_GRAPH_GRADIENT_FRACTION` of ``capacity`` are kept (a large model on
      one GPU gets one bucket, or none: eager).
    """
    top = max(int(max_tokens_per_gpu), 2)
    ladder = [top]
    for fraction in AUTO_BUCKET_FRACTIONS[1:]:
        bucket = -(-int(top * fraction) // AUTO_BUCKET_ROUNDING) * AUTO_BUCKET_ROUNDING
        if bucket < AUTO_BUCKET_FLOOR or bucket >= ladder[-1]:
            break
        ladder.append(bucket)
    if capacity is not None and gradient_set_bytes > 0:
        ladder = ladder[:int(AUTO_GRAPH_GRADIENT_FRACTION * capacity // gradient_set_bytes)]
    return tuple(sorted(ladder))


@dataclasses.dataclass
class TrainArgs:
    """What :class:`rlperf.train.Trainer` needs; defaults follow slime (and Megatron's optimizer defaults)."""

    advantage_estimator: str = "grpo"
    """``grpo``, ``gspo``, ``reinforce_plus_plus`` or ``reinforce_plus_plus_baseline``."""
    n_samples_per_prompt: int = 1
    """Group size: samples ``[g * n, (g + 1) * n)`` answer the same prompt (group-normalized rewards)."""
    rewards_normalization: bool = True
    """Subtract the group mean reward (grpo, gspo, reinforce_plus_plus_baseline); slime's ``--disable-rewards-normalization``."""
    grpo_std_normalization: bool = True
    """grpo/gspo: also divide by the group's (unbiased) std + 1e-6; slime's ``--disable-grpo-std-normalization``."""
    normalize_advantages: bool = False
    """Whiten advantages over the loss-masked tokens of the rollout (mean 0, unbiased var 1)."""
    kl_coef: float = 0.0
    """Reward-shaping KL (reinforce_plus_plus*): per-token reward ``-kl_coef * kl(actor, ref)``."""
    gamma: float = 1.0
    """Discount of the reinforce_plus_plus token returns."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    """Upper clip of the ratio (``1 + eps_clip_high``); None: ``eps_clip`` (symmetric)."""
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    """``k1`` (log r), ``k2`` ((log r)^2 / 2), ``low_var_kl`` (k3 = r' - 1 - log r', clamped to [-10, 10])."""
    entropy_coef: float = 0.0
    use_tis: bool = False
    """Truncated importance sampling: weight each token's pg loss by ``clamp(exp(old - rollout), tis_clip_low, tis_clip)``."""
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    calculate_per_token_loss: bool = False
    """False: mean over samples of each sample's token mean; True: sum over tokens / number of loss tokens."""
    rollout_temperature: float = 1.0
    """Log-probs are of ``softmax(logits / rollout_temperature)`` (what the rollout reported)."""

    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    """With ``use_dynamic_batch_size``: the most tokens (prompt + response) of one packed micro-batch."""
    micro_batch_size: int = 1
    """Samples per micro-batch without ``use_dynamic_batch_size``."""
    global_batch_size: int | None = None
    """Samples per optimizer step; None: all samples given to one ``train_step``."""
    cuda_graph_buckets: tuple[int, ...] = ()
    """Token counts (sorted): pad each packed micro-batch to the smallest bucket >= its tokens and replay
    CUDA graphs captured per bucket for the log-prob passes and the train micro-step's forward and
    backward (:mod:`rlperf.train.cuda_graph`); empty: eager. Needs ``use_dynamic_batch_size`` with
    ``max_tokens_per_gpu`` <= the largest bucket, so every micro-batch fits one. Always concrete here:
    the flag's ``auto`` is the loop's to resolve for its host (:func:`rlperf.loop.resolve.resolve_cuda_graph_buckets`;
    :func:`train_args_from` reads an unresolved ``auto`` as eager)."""
    fsdp_gather: str = "auto"
    """Data parallel only (:class:`rlperf.train.fsdp.FSDPTrainer`): ``step`` gathers each layer's
    parameters once per log-prob pass and once per optimizer step, accumulates the micro-batches'
    gradients unsharded in float32 and reduce-scatters them once, after the last micro-batch;
    ``micro-batch`` gathers and reduce-scatters around every micro-batch (FSDP2's default, the least
    memory); ``auto``: ``step`` when the full parameters in the compute dtype plus float32 gradients
    take at most :data:`GATHERED_STEP_MEMORY_FRACTION` of the device's memory."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global grad norm to this (0 disables clipping; the norm is still reported)."""

    def __post_init__(self):
        self.validate()

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    def validate(self) -> None:
        """Raise ValueError naming the flag for an option slime would reject."""
        for f in dataclasses.fields(self):  # nan/inf in any number would only surface steps later
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {v}")
        if self.lr < 0:
            raise ValueError(f"--lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps < 0:
            raise ValueError(f"--adam-eps must be >= 0, got {self.adam_eps}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"--advantage-estimator {self.advantage_estimator!r} is not supported; "
                             f"choose from {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.kl_loss_type not in KL_LOSS_TYPES:
            raise ValueError(f"--kl-loss-type {self.kl_loss_type!r} is not supported; choose from {', '.join(KL_LOSS_TYPES)}")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.eps_clip < 0 or self.clip_high < 0:
            raise ValueError(f"--eps-clip / --eps-clip-high must be >= 0, got {self.eps_clip} / {self.eps_clip_high}")
        if not 0 <= self.tis_clip_low <= self.tis_clip:
            raise ValueError(f"need 0 <= --tis-clip-low <= --tis-clip, got {self.tis_clip_low} and {self.tis_clip}")
        if self.use_dynamic_batch_size and (self.max_tokens_per_gpu is None or self.max_tokens_per_gpu < 1):
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu >= 1")
        if isinstance(self.cuda_graph_buckets, str):  # "auto" that no loop resolved: nothing may guess a device here
            raise ValueError(f"--cuda-graph-buckets {self.cuda_graph_buckets!r}: TrainArgs takes token counts (or () "
                             f"for eager); auto is resolved by rlperf train / rlperf gate for their device")
        if self.cuda_graph_buckets:
            check_token_buckets(self.cuda_graph_buckets)
            if not self.use_dynamic_batch_size:
                raise ValueError("--cuda-graph-buckets needs --use-dynamic-batch-size (with --max-tokens-per-gpu <= the "
                                 "largest bucket, every micro-batch fits a bucket)")
            if self.max_tokens_per_gpu > max(self.cuda_graph_buckets):
                raise ValueError(f"--max-tokens-per-gpu {self.max_tokens_per_gpu} exceeds the largest --cuda-graph-buckets "
                                 f"bucket ({max(self.cuda_graph_buckets)}): a micro-batch would not fit")
        if self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.fsdp_gather not in FSDP_GATHER_MODES:
            raise ValueError(f"--fsdp-gather {self.fsdp_gather!r}: choose from {', '.join(FSDP_GATHER_MODES)}")
        if not self.rollout_temperature > 0:
            raise ValueError(f"--rollout-temperature must be > 0 for log-probs, got {self.rollout_temperature}")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")


def add_train_arguments(p, skip=(), task_defaults=()) -> None:
    """Add the training-core flags (slime's names) to an ``argparse.ArgumentParser``.

    ``skip``: flags another group of the same parser already defines; :func:`train_args_from` reads
    them from the namespace all the same. ``task_defaults``: destinations (``lr``, ...) whose default
    depends on the command's task: they parse to None and the command fills them (``rlperf train``:
    :data:`rlperf.loop.args.TASK_DEFAULTS`), so each default is stated in one place.
    """
    d = TrainArgs()

    def add(flag, **kw):
        if flag in skip:
            return
        if flag.lstrip("-").replace("-", "_") in task_defaults:
            kw["default"] = None
        p.add_argument(flag, **kw)

    def switch(flag, help):
        if flag.lstrip("-").replace("-", "_") in task_defaults:  # a task may turn it on: --no-... turns it off
            add(flag, action=argparse.BooleanOptionalAction, help=help)
        else:
            add(flag, action="store_true", help=help)

    add("--advantage-estimator", default=d.advantage_estimator, choices=ADVANTAGE_ESTIMATORS,
        help="how rewards become per-token advantages (grpo: group-normalized rewards)")
    add("--n-samples-per-prompt", type=int, default=d.n_samples_per_prompt, help="samples per prompt (group size)")
    switch("--disable-rewards-normalization", "grpo/gspo/reinforce_plus_plus_baseline: keep raw rewards")
    switch("--disable-grpo-std-normalization", "grpo/gspo: center group rewards without dividing by their std")
    switch("--normalize-advantages", "whiten advantages over the rollout's loss tokens")
    add("--kl-coef", type=float, default=d.kl_coef, help="reward-shaping KL for reinforce_plus_plus*")
    add("--gamma", type=float, default=d.gamma, help="discount of reinforce_plus_plus returns")
    add("--eps-clip", type=float, default=d.eps_clip, help="PPO clip: the ratio is clipped to [1 - eps-clip, 1 + eps-clip-high]")
    add("--eps-clip-high", type=float, default=None, help="upper clip (default: --eps-clip)")
    switch("--use-kl-loss", "add kl_loss_coef * KL(actor || reference) to the loss")
    add("--kl-loss-coef", type=float, default=d.kl_loss_coef, help="weight of the KL loss (with --use-kl-loss)")
    add("--kl-loss-type", default=d.kl_loss_type, choices=KL_LOSS_TYPES,
        help="KL estimator: k1 (log r), k2 ((log r)^2 / 2), k3 (exp(-log r) - 1 + log r), low_var_kl (k3 clamped to "
             "[-10, 10])")
    add("--entropy-coef", type=float, default=d.entropy_coef, help="weight of the entropy bonus (subtracted from the loss)")
    switch("--use-tis", "truncated importance sampling from the rollout's log-probs")
    add("--tis-clip", type=float, default=d.tis_clip, help="--use-tis: upper bound of the importance weight")
    add("--tis-clip-low", type=float, default=d.tis_clip_low, help="--use-tis: lower bound of the importance weight")
    switch("--calculate-per-token-loss", "average the loss over tokens instead of over samples")
    add("--rollout-temperature", type=float, default=d.rollout_temperature,
        help="sampling temperature; log-probs are of softmax(logits / temperature), rollout and train alike")
    switch("--use-dynamic-batch-size", "pack micro-batches up to --max-tokens-per-gpu tokens")
    add("--max-tokens-per-gpu", type=int, default=None, help="with --use-dynamic-batch-size: the most tokens of one "
                                                             "packed micro-batch")
    add("--micro-batch-size", type=int, default=d.micro_batch_size,
        help="samples per micro-batch without --use-dynamic-batch-size")
    add("--global-batch-size", type=int, default=None, help="samples per optimizer step")
    add("--cuda-graph-buckets", type=token_buckets, default=AUTO_BUCKETS, metavar="auto|none|LIST",
        help="graphed micro-steps: pad each packed micro-batch with masked tokens to the smallest of these token "
             "counts >= its size and replay CUDA graphs captured per bucket for the log-prob passes and the train "
             "micro-step (forward + backward): far fewer kernel launches from the host; the log-probs, gradients "
             "and weights keep eager's bits in invariant mode (docs/train.md). auto: where graphs apply (a CUDA "
             "device, one actor process of the fsdp or the megatron backend, a dense model without "
             "--use-rollout-routing-replay, "
             f"--use-dynamic-batch-size with --max-tokens-per-gpu M) the buckets M, 3M/4, M/2, 3M/8, M/4, 3M/16, none below "
             f"{AUTO_BUCKET_FLOOR} tokens, and only as many as keep their gradient copies within "
             f"{AUTO_GRAPH_GRADIENT_FRACTION * 100:g}%% of the GPU's memory; elsewhere eager. none: eager. LIST: "
             "comma-separated token counts (e.g. 1024,2048,4096), which need all of the above with M <= the "
             "largest bucket; the megatron backend's graphs capture its tree step at one rank (default: auto)")
    add("--fsdp-gather", default=d.fsdp_gather, choices=FSDP_GATHER_MODES,
        help="data-parallel ranks: gather the FSDP shards once per step and reduce-scatter the gradients once "
             "after the last micro-batch (step), or around every micro-batch (micro-batch: least memory); "
             "auto: step when full parameters + float32 gradients take at most "
             f"{GATHERED_STEP_MEMORY_FRACTION * 100:g}%% of the device (default: auto)")
    add("--lr", type=float, default=d.lr, help="AdamW learning rate")
    add("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (decoupled)")
    add("--adam-beta1", type=float, default=d.adam_beta1, help="AdamW beta1")
    add("--adam-beta2", type=float, default=d.adam_beta2, help="AdamW beta2")
    add("--adam-eps", type=float, default=d.adam_eps, help="AdamW epsilon")
    add("--clip-grad", type=float, default=d.clip_grad, help="clip the global gradient norm to this (0: no clipping)")


_NEGATED = {"rewards_normalization": "disable_rewards_normalization",
            "grpo_std_normalization": "disable_grpo_std_normalization"}


def train_args_from(ns) -> TrainArgs:
    """:class:`TrainArgs` from parsed flags (missing attributes keep their defaults); validates."""
    kw = {}
    for f in dataclasses.fields(TrainArgs):
        if f.name in _NEGATED:
            if hasattr(ns, _NEGATED[f.name]):
                kw[f.name] = not getattr(ns, _NEGATED[f.name])
        elif hasattr(ns, f.name):
            kw[f.name] = getattr(ns, f.name)
    if kw.get("cuda_graph_buckets") == AUTO_BUCKETS:  # not resolved by a loop (a hand-made first step): eager
        kw["cuda_graph_buckets"] = ()
    return TrainArgs(**kw)
