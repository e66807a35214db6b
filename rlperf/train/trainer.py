"""One RL optimizer step: packed micro-batches -> fused log-probs -> policy loss -> AdamW.

:class:`Trainer` owns the actor, an optional frozen reference model and the optimizer
(``torch.optim.AdamW``, no weight decay on 1-D parameters as in Megatron, after
``clip_grad_norm_``). Per rollout:

1. :meth:`Trainer.prepare` — old log-probs (actor, no grad), reference log-probs (when
   ``use_kl_loss`` or ``kl_coef``), advantages (:func:`rlperf.train.advantages.compute_advantages`);
2. :meth:`Trainer.train_step` — one optimizer step over a global batch: each micro-batch's loss is
   divided by the global batch's sample count (per-sample loss) or loss-token count (per-token),
   so the accumulated gradient is that of the whole batch's loss, whatever the packing.

:meth:`Trainer.train` runs both for one rollout: prepare, then one step per global batch.

Metrics use slime's names (``train/loss``, ``train/pg_loss``, ``train/pg_clipfrac``, ``train/ppo_kl``,
``train/kl_loss``, ``train/entropy_loss``, ``train/grad_norm`` (before clipping),
``train/train_rollout_logprob_abs_diff``, with TIS ``train/tis``, ``train/ois``,
``train/tis_clipfrac``), each reduced like the loss. A non-finite grad norm skips the update (the
weights stay as they were) and is reported as is, for the sanity gate to catch.

Mixed precision (Megatron's scheme; ``compute_dtype``, the loop's ``--precision``): the model handed
to the trainer holds the **master weights** in float32 (:attr:`Trainer.master_model`). With a lower
``compute_dtype`` (bf16 on CUDA) the trainer makes :attr:`Trainer.model`, a copy of it in that dtype:
the **compute weights** every forward and backward runs on (and that weight sync sends to the
engines, so trainer and rollout run the same bf16 kernels on the same bf16 bits). Per micro-batch,
after ``backward()``, each compute parameter's bf16 ``.grad`` is added into its master's float32
``.grad`` and freed (:meth:`Trainer._accumulate_master_grads`: gradients accumulate in float32 across
micro-batches, not in bf16). Grad-norm clipping and AdamW (float32 ``exp_avg``/``exp_avg_sq``) run on
the masters; after each step one pass (``torch._foreach_copy_``) rounds the masters into the compute
weights (:meth:`Trainer._copy_master_to_compute`). Checkpoints save the float32 masters, so a resume
starts from the exact masters and AdamW state. With ``compute_dtype`` float32 (or None) master and
compute weights are one set of parameters and nothing is copied (the CPU path, unchanged).

CUDA graphs (``cuda_graph_buckets``, ``--cuda-graph-buckets``; the loop's default on CUDA where they
apply, :func:`rlperf.loop.resolve.resolve_cuda_graph_buckets`): each packed micro-batch is padded
to its token-count bucket and the log-prob passes and the micro-step's forward and backward replay
graphs captured per bucket (:mod:`rlperf.train.cuda_graph`); the policy loss, the master-gradient
accumulation and the optimizer stay eager. The log-probs have the eager step's bits (row-invariant
kernels), and in invariant mode so do the gradients and the update: every sum over tokens runs in
blocks that do not depend on the token count (``tests/train/test_padding.py`` on CPU,
``tests/train/test_cuda_graph_train.py`` on the GPU).

Every kernel the model runs has a backward (``rlperf.kernels.autograd``: the forward is the
batch-invariant kernel, the backward an analytic or recomputed torch gradient), and
:meth:`train_step` still raises when a parameter gets no gradient instead of silently training
part of the model.
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence

import torch

from .adamw import adamw, keep_implementation
from .advantages import compute_advantages
from .args import TrainArgs
from .backend import CheckpointState, TrainerSetup, register_trainer_backend
from .batching import (MicroBatch, compute_log_probs, compute_routed_experts, loss_inputs, micro_batch_log_probs,
                       pack_micro_batches)
from .losses import compute_approx_kl, policy_loss
from .sample import Sample


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy with ``requires_grad=False`` (the reference model at step 0 equals the actor)."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class Trainer:
    """Actor + frozen reference + AdamW; ``train(samples)`` runs one rollout's optimizer steps. The
    one-process :class:`rlperf.train.backend.TrainerBackend`, and the base of the distributed ones."""

    routing_replay: bool = False
    """Rollout routing replay (:meth:`__init__`); a class default for subclasses that build their own state."""
    _engine_model = None

    def __init__(self, model: torch.nn.Module, args: TrainArgs, ref_model: torch.nn.Module | None = None,
                 compute_dtype: torch.dtype | None = None, routing_replay: bool = False):
        """``model``: the master weights (float32 when ``compute_dtype`` is lower); ``compute_dtype``:
        the dtype forward and backward run in (None: the model's own; module docstring).
        ``routing_replay`` (rollout routing replay, MoE models): every forward, the actor's and the
        reference's, routes each token to the experts the rollout routed it to
        (``Sample.rollout_routed_experts``); a sample without them raises
        :class:`rlperf.model.moe.RoutingReplayError` naming it."""
        args.validate()
        self.routing_replay = routing_replay
        self._graphs: dict[int, object] = {}  # id(model) -> its MicroBatchGraphs (cuda_graph_buckets)
        if (args.use_kl_loss or args.kl_coef != 0) and ref_model is None:
            raise ValueError("--use-kl-loss / --kl-coef need a reference model (--ref-load)")
        self.master_model, self.args, self.ref_model = model, args, ref_model
        master_dtype = next(model.parameters()).dtype
        self.mixed = compute_dtype is not None and compute_dtype != master_dtype
        if self.mixed:
            if master_dtype != torch.float32:
                raise ValueError(f"mixed precision needs float32 master weights, the model is {master_dtype}")
            self.model = copy.deepcopy(model).to(compute_dtype)  # the compute weights
        else:
            self.model = model
        if ref_model is not None:
            if self.mixed:
                ref_model.to(compute_dtype)  # the reference runs the actor's kernels, in the same dtype
            for p in ref_model.parameters():
                p.requires_grad_(False)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # the optimizer's parameters are the masters; self.params the compute parameters, same order
        self.master_params = [p for _, p in named]
        compute = dict(self.model.named_parameters())
        self.params = [compute[n] for n, _ in named]
        # Megatron's default: no weight decay on 1-D parameters (norm weights, biases)
        groups = [{"params": [p for _, p in named if p.dim() > 1], "weight_decay": args.weight_decay},
                  {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0}]
        self.optimizer = adamw([g for g in groups if g["params"]], args.lr, (args.adam_beta1, args.adam_beta2),
                               args.adam_eps)
        self.step_count = 0

    def compute_weights(self, bucket_bytes: int = 512 << 20):
        """``(HF name, tensor)`` pairs of the compute weights, detached: what weight sync sends and the
        engines load. One process holds them whole (``bucket_bytes`` is unused here); the data-parallel
        trainer gathers them from its shards bucket by bucket (a collective: every rank walks it)."""
        return ((n, t.detach()) for n, t in self.model.hf_state_dict().items())

    @property
    def device(self) -> torch.device:
        return self.model.head_weight.device

    # ---- the TrainerBackend protocol beyond training (rlperf.train.backend) -------------------------
    @property
    def engine_model(self) -> torch.nn.Module:
        """The model an in-process engine of this process runs: the compute weights themselves here; a
        distributed backend sets its full engine copy (:attr:`rlperf.train.backend.TrainerBackend.engine_model`)."""
        return self._engine_model if self._engine_model is not None else self.model

    @engine_model.setter
    def engine_model(self, model: torch.nn.Module) -> None:
        self._engine_model = model

    def describe(self) -> str:
        """The layout in words for the run's first line: nothing to say for one process."""
        return ""

    def gather_model(self) -> torch.nn.Module | None:
        """The actor with its whole float32 master weights, as a checkpoint writes it: the master model
        itself in one process (the distributed trainers gather it to rank 0: a collective)."""
        return self.master_model

    def checkpoint_state(self) -> CheckpointState | None:
        """What a checkpoint writes (:meth:`gather_model`, :meth:`state_dict`); None on the ranks that write
        nothing (where :meth:`gather_model` gives None). A collective where the weights are sharded."""
        model = self.gather_model()
        state = self.state_dict()
        return CheckpointState(model, state) if model is not None else None

    def close(self) -> None:
        """Nothing to release in one process (the megatron backend leaves its process groups)."""

    def _packing(self) -> dict:
        a = self.args
        replay = dict(replay_routing=True) if self.routing_replay else {}  # every forward routes as the rollout did
        if a.use_dynamic_batch_size:
            return dict(max_tokens_per_gpu=a.max_tokens_per_gpu, **replay)
        return dict(micro_batch_size=a.micro_batch_size, **replay)

    def prepare(self, samples: Sequence[Sample]) -> None:
        """Fill each sample's ``log_probs`` (old actor), ``ref_log_probs`` (if needed) and ``advantages``."""
        a = self.args
        old = self.sample_log_probs(self.model, samples)
        for s, lp in zip(samples, old):
            s.log_probs = lp
        kl = None
        if self.ref_model is not None and (a.use_kl_loss or a.kl_coef != 0):
            ref = self.sample_log_probs(self.ref_model, samples)
            for s, lp in zip(samples, ref):
                s.ref_log_probs = lp
            kl = [compute_approx_kl(s.log_probs, s.ref_log_probs, a.kl_loss_type) for s in samples]
        rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
        adv = compute_advantages(a, rewards, [s.response_length for s in samples], [s.loss_mask_tensor() for s in samples],
                                kl)
        for s, ad in zip(samples, adv):
            s.advantages = ad

    # ---- what a data-parallel trainer replaces (rlperf.train.fsdp.FSDPTrainer) ---------------------
    def sample_log_probs(self, model: torch.nn.Module, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Log-probs of every sample's response tokens ([R_i] float32 on the CPU, sample order) under
        ``model`` (the actor or the reference), without grad: :meth:`prepare`'s old and reference log-probs.
        With ``cuda_graph_buckets`` each micro-batch replays ``model``'s log-prob graph of its bucket."""
        replay = self.micro_batch_graphs(model).log_probs if self.args.cuda_graph_buckets else None
        return compute_log_probs(model, samples, self.args.rollout_temperature, micro_batch_pass=replay,
                                 **self._packing())

    def micro_batch_graphs(self, model: torch.nn.Module):
        """``model``'s :class:`rlperf.train.cuda_graph.MicroBatchGraphs` (made on first use, one per
        model: the actor's and the reference's); ``cuda_graph_buckets`` must be set."""
        from .cuda_graph import MicroBatchGraphs

        graphs = self._graphs.get(id(model))
        if graphs is None:
            graphs = self._graphs[id(model)] = MicroBatchGraphs(model, self.args.cuda_graph_buckets,
                                                                self.args.rollout_temperature)
        return graphs

    def train_routed_experts(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """MoE models: the actor's own routing of every sample (its routers, never a replay), [L_i - 1,
        MoE layers, k] int32 on the CPU per sample (``Sample.rollout_routed_experts``' layout), for the
        routing-agreement gate."""
        packing = {k: v for k, v in self._packing().items() if k != "replay_routing"}
        return compute_routed_experts(self.model, samples, **packing)

    def micro_batches(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """The micro-batches this process trains of one global batch ``samples`` (their ``indices``
        index ``samples``): all of them, packed under ``max_tokens_per_gpu`` or ``micro_batch_size``."""
        return pack_micro_batches(samples, device=self.device, **self._packing())

    def forward_log_probs(self, mb: MicroBatch, with_entropy: bool = False):
        """Log-probs [sum R_i] (and entropy) of a micro-batch's response tokens under the actor, with grad
        (when grad mode is on). With ``cuda_graph_buckets``: replayed from the bucket's graphs (the
        train graphs' backward runs when autograd reaches them)."""
        if not self.args.cuda_graph_buckets:
            return micro_batch_log_probs(self.model, mb, self.args.rollout_temperature, with_entropy=with_entropy)
        graphs = self.micro_batch_graphs(self.model)
        if not torch.is_grad_enabled():
            return graphs.log_probs(mb, with_entropy=with_entropy)
        log_probs, entropy = graphs.log_probs_with_grad(mb)
        return (log_probs, entropy) if with_entropy else log_probs

    def probe_step(self, mb: MicroBatch, loss_of) -> None:
        """One forward with grad and one backward of ``mb`` under the loss ``loss_of(log_probs, entropy)``,
        through the trainer's own log-prob path: what the first-step gates' memory probe runs. Leaves the
        gradients in ``.grad`` (the probe saves and restores them)."""
        log_probs, entropy = self.forward_log_probs(mb, with_entropy=True)
        loss_of(log_probs, entropy).backward()

    def reduce_metric_sums(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This process's share of the step's metric sums (each already divided by the global
        denominator) -> the global batch's: the same here; summed over the ranks in data parallel."""
        return sums

    def before_micro_batch(self, index: int, count: int) -> None:
        """Called before micro-batch ``index`` of the ``count`` of a :meth:`train_step` (data-parallel
        trainers set their gradient synchronisation here); nothing in one process."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global grad norm of the master gradients (before clipping), clipped to ``max_norm``."""
        return float(torch.nn.utils.clip_grad_norm_(self.master_params, max_norm))

    def train_step(self, samples: Sequence[Sample], micro_step_hook=None) -> dict[str, float]:
        """One optimizer step over ``samples`` (prepared); returns the step's metrics.

        ``micro_step_hook`` (optional) is called with the first micro-batch's metrics (slime names,
        each averaged over that micro-batch's samples, or loss tokens with
        ``calculate_per_token_loss``): the first-step gates read ``train/ppo_kl`` and
        ``train/pg_clipfrac`` of step 0's first micro-step.
        """
        with_rollout = self._check_prepared(samples)
        denom = self._loss_denominator(samples)
        self._zero_grads()
        totals: dict[str, torch.Tensor] = {}
        micro_batches = self.micro_batches(samples)
        first_mb = micro_batches[0]
        for index, mb in enumerate(micro_batches):
            self.before_micro_batch(index, len(micro_batches))
            metrics, count = self._micro_step(samples, mb, denom, with_rollout)
            self._accumulate_master_grads()
            if micro_step_hook is not None and mb is first_mb:
                micro_step_hook({f"train/{k}": float(v) / max(count, 1.0) for k, v in metrics.items()})
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v / denom
        return self._finish_step(totals)

    def _check_prepared(self, samples: Sequence[Sample]) -> bool:
        """ValueError unless every sample was prepared (and has what the loss needs); whether every
        sample has rollout log-probs."""
        a = self.args
        if not samples:
            raise ValueError("train_step needs at least one sample")
        for i, s in enumerate(samples):
            if s.log_probs is None or s.advantages is None:
                raise ValueError(f"sample {i} has no log_probs / advantages: call Trainer.prepare first")
            if a.use_kl_loss and s.ref_log_probs is None:
                raise ValueError(f"sample {i} has no ref_log_probs (use_kl_loss)")
        with_rollout = all(s.rollout_log_probs is not None for s in samples)
        if a.use_tis and not with_rollout:
            raise ValueError("--use-tis needs rollout_log_probs on every sample")
        return with_rollout

    def _zero_grads(self) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed:
            for p in self.params:
                p.grad = None

    def _loss_denominator(self, samples: Sequence[Sample]) -> float:
        if self.args.calculate_per_token_loss:
            return max(float(sum(s.loss_mask_tensor().sum() for s in samples)), 1.0)
        return float(len(samples))

    def _micro_step(self, samples: Sequence[Sample], mb: MicroBatch, denom: float, with_rollout: bool):
        """Forward, policy loss and backward of one micro-batch (its loss divided by ``denom``, the
        global batch's); returns its metric sums (slime names without ``train/``; tensors) and the
        count they average over (its samples, or loss tokens with ``calculate_per_token_loss``)."""
        a = self.args
        # the loss inputs go to the device before the forward is queued (loss_inputs: no host wait)
        li = loss_inputs([samples[i] for i in mb.indices], self.device, with_rollout=with_rollout,
                         with_ref=a.use_kl_loss, per_token=a.calculate_per_token_loss)
        log_probs, entropy = self.forward_log_probs(mb, with_entropy=True)
        if a.entropy_coef == 0:
            entropy = entropy.detach()  # a metric only: no backward through the entropy
        loss, metrics = policy_loss(a, log_probs, entropy, li.old_log_probs, li.advantages, li.masks,
                                    mb.response_lengths, ref_log_probs=li.ref_log_probs,
                                    rollout_log_probs=li.rollout_log_probs)
        (loss / denom).backward()
        return metrics, li.count

    def _finish_step(self, totals: dict) -> dict[str, float]:
        """After a step's backward passes: the metric sums over the ranks, every trainable parameter's
        gradient checked, the grad norm clipped, AdamW, the compute weights refreshed; the step's metrics."""
        a = self.args
        totals = self.reduce_metric_sums(totals)
        missing = [n for n, p in self.master_model.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            raise RuntimeError(f"no gradient reached {missing[:4]}{' ...' if len(missing) > 4 else ''}: the kernel "
                               f"backend has no backward for some op (use the reference backend to train on CPU)")
        max_norm = a.clip_grad if a.clip_grad > 0 else math.inf
        grad_norm = self.clip_grad_norm(max_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self._copy_master_to_compute()
        self.step_count += 1
        out = {f"train/{k}": float(v) for k, v in totals.items()}
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    @torch.no_grad()
    def _accumulate_master_grads(self) -> None:
        """Mixed precision: each compute parameter's ``.grad`` (this micro-batch's, in the compute dtype)
        into its master's float32 ``.grad``, then freed; a no-op when master is compute. Multi-tensor
        calls, not a launch per parameter: the first micro-batch's gradients converted by one
        ``_foreach_copy_`` (exactly ``.to(float32)``, signed zeros kept), later ones added by one
        ``_foreach_add_`` (float32 += bf16, accumulated in float32: exactly ``add_``)."""
        if not self.mixed:
            return
        pairs = [(p, m) for p, m in zip(self.params, self.master_params) if p.grad is not None]
        first = [(p, m) for p, m in pairs if m.grad is None]
        later = [(p, m) for p, m in pairs if m.grad is not None]
        if first:
            copies = [torch.empty_like(m, dtype=torch.float32) for _, m in first]
            torch._foreach_copy_(copies, [p.grad for p, _ in first])
            for (_, m), g in zip(first, copies):
                m.grad = g
        if later:
            torch._foreach_add_([m.grad for _, m in later], [p.grad for p, _ in later])
        for p, _ in pairs:
            p.grad = None

    @torch.no_grad()
    def _copy_master_to_compute(self) -> None:
        """Mixed precision: round the float32 masters into the compute weights (one pass, in place:
        tensors that alias the compute weights, e.g. an engine's CUDA graphs, stay valid)."""
        if self.mixed:
            torch._foreach_copy_(self.params, self.master_params)

    def state_dict(self) -> dict:
        """Optimizer state and step count (the model's weights are saved by the model).

        The optimizer state is the full (unsharded) one keyed by parameter name (``layers.0.qkv_proj``,
        the master model's ``named_parameters``), as ``torch.distributed.checkpoint.state_dict``'s
        ``get_optimizer_state_dict(full_state_dict=True)`` gives it: the same for one process and for
        any number of FSDP ranks, so a checkpoint resumes on another layout. Under FSDP it is a
        collective (every rank calls it; rank 0 gets the state, the others an empty dict).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optim = get_optimizer_state_dict(self.master_model, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if optim:  # hyperparameter tuples (betas) as lists: a loaded optimizer has lists, the same state saves the same
            optim["param_groups"] = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
                                     for g in optim["param_groups"]]
        return {"optimizer": optim, "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (into a Trainer built on a model with the saved weights); also
        takes the optimizer state keyed by parameter index that ``torch.optim`` saves (older checkpoints).
        Under FSDP every rank calls it with the full state and keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        optim = self._optimizer_state_by_name(state["optimizer"])
        set_optimizer_state_dict(self.master_model, self.optimizer, optim_state_dict=optim,
                                 options=StateDictOptions(full_state_dict=True))
        keep_implementation(self.optimizer)
        self.step_count = int(state["step_count"])
        self._copy_master_to_compute()

    def _optimizer_state_by_name(self, optim: dict) -> dict:
        """``optim`` keyed by parameter name: an index-keyed ``torch.optim`` state dict (parameters
        numbered in param-group order) is renamed through this optimizer's groups, which list the same
        parameters in the same order; a name-keyed one is returned as it is."""
        groups = optim.get("param_groups", [])
        if not groups or not all(isinstance(i, int) for g in groups for i in g["params"]):
            return optim
        names = {id(p): n for n, p in self.master_model.named_parameters()}
        mine = self.optimizer.param_groups
        if len(groups) != len(mine) or any(len(g["params"]) != len(m["params"]) for g, m in zip(groups, mine)):
            raise ValueError("the saved optimizer state does not match this model's parameter groups")
        rename = {i: names[id(p)] for g, m in zip(groups, mine) for i, p in zip(g["params"], m["params"])}
        return {"state": {rename[i]: v for i, v in optim["state"].items()},
                "param_groups": [dict(g, params=[rename[i] for i in g["params"]]) for g in groups]}

    def train(self, samples: Sequence[Sample], *, on_first_micro_step=None, phase=None) -> list[dict[str, float]]:
        """One rollout's training: :meth:`prepare`, then one :meth:`train_step` per global batch
        (``num_steps_per_rollout`` steps); returns each step's metrics.

        ``phase(name)`` (optional) gives a context manager entered around ``"log_prob"`` (prepare)
        and around ``"train"`` (the steps): the loop measures its phases with it.
        ``on_first_micro_step``: the first step's ``micro_step_hook`` (:meth:`train_step`).
        """
        gbs = self.args.global_batch_size or len(samples)
        if len(samples) % gbs:
            raise ValueError(f"{len(samples)} samples do not split into global batches of {gbs}")
        phase = phase or (lambda name: contextlib.nullcontext())
        with phase("log_prob"):
            self.prepare(samples)
        with phase("train"):
            return [self.train_step(samples[i:i + gbs], on_first_micro_step if i == 0 else None)
                    for i in range(0, len(samples), gbs)]


@register_trainer_backend("one-process")
def build_one_process_trainer(setup: TrainerSetup) -> Trainer:
    """``--train-backend fsdp`` on one actor rank: :class:`Trainer` on the whole model; its compute copy (bf16
    on CUDA) is what forward, backward, weight sync and an in-process engine see."""
    return Trainer(setup.model, setup.config.args, setup.ref_model, compute_dtype=setup.compute_dtype,
                   routing_replay=setup.config.moe.routing_replay)
