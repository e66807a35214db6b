"""The megatron trainer backend: :class:`MegatronTrainer`, :class:`rlperf.train.Trainer`'s methods over
megatron-core's tensor, pipeline and data parallelism.

Layout (``world = TP x PP x DP``, :class:`rlperf.train.megatron.runtime.ParallelLayout`): each rank
holds its pipeline stage's layers and its tensor-parallel shards (:mod:`.model`). Every rank holds
every sample of the rollout (the loop's contract, as with FSDP); data-parallel replica ``d`` computes
the samples ``d, d + DP, ...`` (log-probs all-gathered over the replicas, a global batch's share
trained by each, gradients summed over them).

Per micro-batch (pipeline: one stage after the other; the first stage embeds, the last computes the
loss): the stage's forward runs on the previous stage's output (``send``/``recv`` of [T, 1, H]), the
last stage's loss is divided by the global batch's sample (or loss-token) count as in one process,
and the backward sends each stage's input gradient back. Stages run their micro-batches one after
the other (no interleaving: a correct schedule, not a fast one).

TP invariance: the model's reductions are the fixed trees of ``rlperf.kernels.tree_reduce``, and the
gradient norm is too: each parameter's squared norm is a tree over its leaves' squared norms (the
tensor-parallel shards of one parameter are whole leaves; :func:`leaf_square_sums`, a few launches for
every parameter), then the parameters' values are added on the host in the model's Hugging Face order
on every rank. So log-probs, loss, gradients, grad norm and the AdamW update are the same
bits at TP=1, TP=2 and PP=2.

Distributed optimizer (``distributed_optimizer``, ``--use-distributed-optimizer``): the AdamW moments
are sharded over the data-parallel replicas (:class:`rlperf.train.megatron.optimizer.DistributedAdamW`),
each replica updates its chunk of every parameter and the chunks are all-gathered; the same bits as
the unsharded AdamW, and checkpoints hold the whole moments under Hugging Face names either way.

Mixed precision: with a ``compute_dtype`` lower than the model's float32, the trainer keeps float32
master copies of this rank's parameters (AdamW runs on them) and rounds them into the model after each
step; each micro-batch's compute-dtype gradients are accumulated into float32 master gradients.

CUDA graphs (``cuda_graph_buckets``; one rank, tree numerics, CUDA): each micro-batch is padded to its
token-count bucket and its forward and backward replay graphs captured per bucket, as the fsdp trainer's
(:mod:`rlperf.train.cuda_graph`); the tied head's gradient, which the backward keeps apart
(``head_grad``), is one more static output (:class:`_TiedHeadGrad`). Padding moves no bit of the tree
step (the norms' weight gradients included: ``tree_reduce.token_parallel_rmsnorm``), so a graphed step
has the eager step's bits. ``--cuda-graph-buckets auto`` (the loop's default) turns them on at one rank,
as for the fsdp trainer.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlperf.kernels.tree_reduce import tree_sum

from ..adamw import adamw, keep_implementation, step_state
from ..batching import HostCopies, MicroBatch, loss_inputs, make_micro_batch, partition
from ..losses import policy_loss
from ..sample import Sample
from ..trainer import Trainer
from .model import MegatronCausalLM


def _leaf_views(t: torch.Tensor, local: int, dim: int | None) -> list[torch.Tensor]:
    """This rank's tree leaves of a gradient, each flat and contiguous: ``local`` equal blocks along its
    split dimension ``dim`` (None: the whole tensor, one leaf). A leaf is the same block of the full
    gradient on every layout, laid out the same (row-major in its own shape): blocks along dim 0 are
    views, blocks along another dimension are copied out in one call per parameter. Leaves that do not
    start on a 16-byte boundary are copied apart (fresh allocations do): the multi-tensor norm's vector
    loads depend on where a leaf starts, which must not depend on the layout."""
    if dim is None:
        leaves = [t.reshape(-1)]
    else:
        blocks = t.unflatten(dim, (local, -1)).movedim(dim, 0).contiguous()
        leaves = list(blocks.reshape(local, -1).unbind(0))
    if any(x.data_ptr() % 16 for x in leaves):
        leaves = [x.clone() for x in leaves]
    return leaves


def leaf_square_sums(grads: Sequence[torch.Tensor], dims: Sequence[int | None], leaves: int, tp_group) -> torch.Tensor:
    """Per parameter, the squared norm of its full gradient [P] float32 from this rank's shards, the same
    bits on every tensor-parallel layout, in a few launches for all parameters:

    * each leaf's squared norm ``n_j ** 2`` (``torch._foreach_norm`` over every leaf of every parameter:
      one multi-tensor call; a leaf's norm depends on the leaf alone, not on the list it is in);
    * a split parameter's leaves added in the tree's order (this rank's ``L / TP`` leaves, then the
      ranks' nodes, all-gathered once for every parameter, in the top levels); a replicated one (``dim``
      None, the same on every rank) is its one leaf.
    """
    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    local = leaves // size
    flat: list[torch.Tensor] = []
    starts: list[int] = []  # where each parameter's leaves begin in ``flat``
    for g, dim in zip(grads, dims):
        starts.append(len(flat))
        flat.extend(_leaf_views(g.float(), local, dim))
    if not flat:
        return torch.zeros(0, dtype=torch.float32)
    squares = torch.stack(torch._foreach_norm(flat))
    squares = squares * squares
    out = torch.empty(len(grads), dtype=torch.float32, device=squares.device)
    split = [i for i, d in enumerate(dims) if d is not None]
    whole = [i for i, d in enumerate(dims) if d is None]
    if whole:
        out[torch.tensor(whole, device=out.device)] = squares[torch.tensor([starts[i] for i in whole],
                                                                           device=squares.device)]
    if split:
        leaf = torch.tensor([[starts[i] + j for i in split] for j in range(local)], device=squares.device)
        nodes = tree_sum(squares[leaf])  # [local, P_split]: the leaves' tree, a level at a time
        if size > 1:
            ranks = [torch.empty_like(nodes) for _ in range(size)]
            dist.all_gather(ranks, nodes.contiguous(), group=tp_group)
            nodes = tree_sum(torch.stack(ranks))  # the ranks' nodes in the tree's top levels
        out[torch.tensor(split, device=out.device)] = nodes
    return out


def graph_log_probs(model: MegatronCausalLM, mb: MicroBatch, temperature: float, with_entropy: bool = False):
    """The micro-batch's log-probs (and entropy) through the whole model (one stage): what a graph captures
    and :meth:`MegatronTrainer.forward_log_probs` runs."""
    hidden = model.forward_hidden(mb.input_ids, mb.cu_seqlens)
    return model.log_probs(hidden, mb.logit_rows, mb.targets, temperature, with_entropy)


class _TiedHeadGrad:
    """The tied head's gradient (``model.head_grad``, set by the backward) as a graph's side output
    (:class:`rlperf.train.cuda_graph.BackwardSide`): a replay's static value is accumulated into
    ``head_grad`` as the eager backward accumulates it (the first micro-batch's a copy, later ones added)."""

    def __init__(self, model: MegatronCausalLM):
        self.model = model

    def stash(self):
        value, self.model.head_grad = self.model.head_grad, None
        return value

    def restore(self, value) -> None:
        self.model.head_grad = value

    def deliver(self, static: torch.Tensor) -> None:
        kept = self.model.head_grad
        self.model.head_grad = static.clone() if kept is None else kept + static


class MegatronTrainer(Trainer):
    """:class:`rlperf.train.Trainer` on a :class:`rlperf.train.megatron.model.MegatronCausalLM`
    (module docstring); every rank of the default process group builds one with the same samples.

    ``model``: this rank's stage and shards, loaded (float32 masters, or the compute dtype itself);
    ``ref_model``: another ``MegatronCausalLM`` with the reference weights (or None);
    ``compute_dtype``: bf16 on CUDA (module docstring); ``distributed_optimizer``: AdamW's moments
    sharded over the data-parallel group (module docstring).
    """

    def __init__(self, model: MegatronCausalLM, args, ref_model: MegatronCausalLM | None = None,
                 compute_dtype: torch.dtype | None = None, distributed_optimizer: bool = False):
        from megatron.core import parallel_state as ps

        args.validate()
        if (args.use_kl_loss or args.kl_coef != 0) and ref_model is None:
            raise ValueError("--use-kl-loss / --kl-coef need a reference model (--ref-load)")
        self.args, self.ref_model = args, ref_model
        self.model = model
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.tp = model.tp
        model_dtype = next(model.parameters()).dtype
        if compute_dtype is not None and compute_dtype != model_dtype:
            if model_dtype != torch.float32:
                raise ValueError(f"mixed precision needs float32 master weights, the model is {model_dtype}")
            model.to(compute_dtype)
            self.mixed = True
        else:
            self.mixed = False
        if ref_model is not None:
            if self.mixed:
                ref_model.to(compute_dtype)
            for p in ref_model.parameters():
                p.requires_grad_(False)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if self.mixed:
            self.master_params = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        else:
            self.master_params = self.params
        self.master_model = model
        masters = list(zip(self.param_names, self.master_params))
        groups = [{"params": [p for n, p in masters if p.dim() > 1], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in masters if p.dim() <= 1], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.distributed_optimizer = distributed_optimizer
        if distributed_optimizer:
            from .optimizer import DistributedAdamW

            self.optimizer = DistributedAdamW(groups, args.lr, (args.adam_beta1, args.adam_beta2), args.adam_eps,
                                              self.dp_group if self.dp_size > 1 else None)
        else:
            self.optimizer = adamw(groups, args.lr, (args.adam_beta1, args.adam_beta2), args.adam_eps)
        self.step_count = 0
        self._norm_keys = self._grad_norm_keys()
        self.graphs = self._micro_batch_graphs() if args.cuda_graph_buckets else None
        self.grad_bucket_bytes = 256 << 20
        """Bytes of float32 gradients summed over the data-parallel replicas per all-gather (the bits do
        not depend on it)."""

    def _micro_batch_graphs(self):
        """The actor's :class:`rlperf.train.cuda_graph.MicroBatchGraphs` (module docstring): one rank, the
        tree numerics, a CUDA device; ValueError naming the flag otherwise."""
        from ..cuda_graph import FLAG, MicroBatchGraphs

        if self.pp_size != 1 or self.tp.size != 1 or self.dp_size != 1:
            raise ValueError(f"{FLAG} with the megatron backend: one rank only (got TP={self.tp.size}, "
                             f"PP={self.pp_size}, DP={self.dp_size})")
        if self.model.plain:
            raise ValueError(f"{FLAG} with the megatron backend: the tree numerics only (padding keeps their bits)")
        side = _TiedHeadGrad(self.model) if self.model.cfg.tie_word_embeddings else None
        return MicroBatchGraphs(self.model, self.args.cuda_graph_buckets, self.args.rollout_temperature,
                                log_probs_fn=graph_log_probs, backward_side=side)

    # ---- placement ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _shard(self, n: int) -> list[int]:
        return list(range(self.dp_rank, n, self.dp_size))

    def _micro_batches_of(self, samples: Sequence[Sample], indices: list[int]) -> list[MicroBatch]:
        for s in samples:
            s.validate()
        packing = self._packing()
        groups = partition([samples[i].total_length for i in indices], packing.get("max_tokens_per_gpu"),
                           packing.get("micro_batch_size"))
        counts = [len(partition([samples[i].total_length for i in self._shard_of(len(samples), r)],
                                packing.get("max_tokens_per_gpu"), packing.get("micro_batch_size")))
                  for r in range(self.dp_size)]
        mbs = [make_micro_batch(samples, [indices[j] for j in g], self.device) for g in groups]
        # every replica runs as many micro-batches (the pipeline's send/recv pair up per micro-batch)
        while len(mbs) < max(counts):
            mbs.append(None)
        return mbs

    def _shard_of(self, n: int, replica: int) -> list[int]:
        return list(range(replica, n, self.dp_size))

    # ---- forward through the pipeline ------------------------------------------------------------
    def _stage_forward(self, model: MegatronCausalLM, mb: MicroBatch, grad: bool):
        """This stage's forward of ``mb``; returns (stage input or None, stage output)."""
        from megatron.core import parallel_state as ps

        inp = None
        if not model.first_stage:
            inp = torch.empty((model.stage_tokens(mb.num_tokens), 1, model.cfg.hidden_size),
                              dtype=next(model.parameters()).dtype, device=self.device)
            dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank())
            if grad:
                inp.requires_grad_()
            model.set_input_tensor(inp)
        out = model.forward_hidden(mb.input_ids, mb.cu_seqlens)
        if not model.last_stage:
            dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return inp, out

    def _stage_backward(self, model: MegatronCausalLM, inp, out, loss=None) -> None:
        from megatron.core import parallel_state as ps

        if model.last_stage:
            loss.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
        if not model.first_stage:
            dist.send(inp.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())

    @torch.no_grad()
    def sample_log_probs(self, model, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Every sample's response log-probs ([R_i] float32, CPU) under ``model`` (the actor or the
        reference): this replica's share through the pipeline, then gathered (last stage -> the other
        stages, replicas -> each other)."""
        copies = HostCopies()  # one copy to the host after the last micro-batch
        for mb in self._micro_batches_of(samples, self._shard(len(samples))):
            if mb is None:
                continue
            if self.graphs is not None and model is self.model:  # the actor's log-prob graph of the bucket
                copies.add(mb.indices, mb.response_lengths, self.graphs.log_probs(mb))
                continue
            _, out = self._stage_forward(model, mb, grad=False)
            if model.last_stage:
                lp = model.log_probs(out, mb.logit_rows, mb.targets, self.args.rollout_temperature)
                copies.add(mb.indices, mb.response_lengths, lp)
        mine = copies.per_sample()
        if self.pp_size > 1:
            box = [mine]
            dist.broadcast_object_list(box, group_src=self.pp_size - 1, group=self.pp_group)
            mine = box[0]
        gathered = [mine]
        if self.dp_size > 1:
            gathered = [None] * self.dp_size
            dist.all_gather_object(gathered, mine, group=self.dp_group)
        out: list[torch.Tensor | None] = [None] * len(samples)
        for part in gathered:
            for i, lp in part:
                out[i] = lp
        return out

    def forward_log_probs(self, mb: MicroBatch, with_entropy: bool = False):
        """Log-probs (and entropy) of a micro-batch under the actor, with grad (one pipeline stage: the
        whole model)."""
        if self.pp_size != 1:
            raise RuntimeError("forward_log_probs runs the whole model: one pipeline stage only")
        return graph_log_probs(self.model, mb, self.args.rollout_temperature, with_entropy)

    def probe_step(self, mb: MicroBatch, loss_of) -> None:
        """One forward and backward of ``mb`` through the pipeline (every rank calls it: the stages
        exchange activations and their gradients), the loss ``loss_of(log_probs, entropy)`` on the last
        stage: what the first-step gates' memory probe runs at any PP size. Leaves gradients in the
        parameters' ``.grad`` (the probe saves and restores them)."""
        inp, out = self._stage_forward(self.model, mb, grad=True)
        loss = None
        if self.model.last_stage:
            log_probs, entropy = self.model.log_probs(out, mb.logit_rows, mb.targets, self.args.rollout_temperature,
                                                      True)
            loss = loss_of(log_probs, entropy)
        self._stage_backward(self.model, inp, out, loss)
        self.model.head_grad = None

    # ---- one optimizer step -----------------------------------------------------------------------
    def train_step(self, samples: Sequence[Sample], micro_step_hook=None) -> dict[str, float]:
        """One optimizer step over the global batch ``samples`` (prepared); the metrics of
        :meth:`rlperf.train.Trainer.train_step`, the same on every rank."""
        a = self.args
        if not samples:
            raise ValueError("train_step needs at least one sample")
        for i, s in enumerate(samples):
            if s.log_probs is None or s.advantages is None:
                raise ValueError(f"sample {i} has no log_probs / advantages: call Trainer.prepare first")
        with_rollout = all(s.rollout_log_probs is not None for s in samples)
        if a.use_tis and not with_rollout:
            raise ValueError("--use-tis needs rollout_log_probs on every sample")
        denom = (max(float(sum(s.loss_mask_tensor().sum() for s in samples)), 1.0) if a.calculate_per_token_loss
                 else float(len(samples)))
        dev = self.device
        model = self.model
        model.train()
        for p in self.params:
            p.grad = None
        for m in self.master_params:
            m.grad = None
        model.head_grad = None
        totals: dict[str, torch.Tensor] = {}
        first = None  # (the first micro-batch's metric tensors, their count) on the last stage
        mbs = self._micro_batches_of(samples, self._shard(len(samples)))
        for mb in mbs:
            if mb is None:
                continue
            li = None
            if model.last_stage:  # the loss inputs go to the device before the forward is queued (no host wait)
                li = loss_inputs([samples[i] for i in mb.indices], dev, with_rollout=with_rollout,
                                 with_ref=a.use_kl_loss, per_token=a.calculate_per_token_loss)
            if self.graphs is not None:  # one rank: the bucket's forward graph now, its backward graph below
                inp = out = None
                log_probs, entropy = self.graphs.log_probs_with_grad(mb)
            else:
                inp, out = self._stage_forward(model, mb, grad=True)
            loss = None
            if model.last_stage:
                if self.graphs is None:
                    log_probs, entropy = model.log_probs(out, mb.logit_rows, mb.targets, a.rollout_temperature, True)
                if a.entropy_coef == 0:
                    entropy = entropy.detach()
                loss, metrics = policy_loss(a, log_probs, entropy, li.old_log_probs, li.advantages, li.masks,
                                            mb.response_lengths, ref_log_probs=li.ref_log_probs,
                                            rollout_log_probs=li.rollout_log_probs)
                loss = loss / denom
                if first is None:  # read after the step's launches (a read here would wait for the forward)
                    first = ({k: v.detach() for k, v in metrics.items()}, li.count)
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + v.detach() / denom
            if self.graphs is not None:
                loss.backward()
            else:
                self._stage_backward(model, inp, out, loss)
            self._accumulate_master_grads()
        totals = self._reduce_metrics(totals)
        if micro_step_hook is not None:
            first_metrics = None if first is None else {
                f"train/{k}": float(v) / max(first[1], 1.0) for k, v in first[0].items()}
            micro_step_hook(self._from_last_stage(first_metrics))
        self._combine_tied_head()
        self._sum_data_parallel_grads()
        for n, m in zip(self.param_names, self.master_params):
            if m.grad is None:
                m.grad = torch.zeros_like(m)  # a replica without samples (or a tied copy unused here)
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
    def _combine_tied_head(self) -> None:
        """Tied embeddings: the weight's gradient is (embedding part) + (head part), added in that order
        on every stage that holds a copy (first and last; exchanged between them when PP > 1)."""
        if not self.model.cfg.tie_word_embeddings:
            return
        copies = [m for n, m in zip(self.param_names, self.master_params)
                  if "word_embeddings" in n or "output_layer" in n]
        if not copies:
            return
        (m,) = copies
        emb = m.grad if self.model.first_stage and m.grad is not None else torch.zeros_like(m, dtype=torch.float32)
        head = self.model.head_grad if self.model.head_grad is not None else torch.zeros_like(emb)
        if self.pp_size > 1:
            from megatron.core import parallel_state as ps

            group = ps.get_embedding_group()
            mine = (emb if self.model.first_stage else head).contiguous()
            both = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(both, mine, group=group)
            emb, head = both[0], both[-1]
        m.grad = (emb + head).to(m.dtype)
        self.model.head_grad = None

    def _from_last_stage(self, obj):
        if self.pp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group_src=self.pp_size - 1, group=self.pp_group)
        return box[0]

    def _reduce_metrics(self, sums: dict) -> dict:
        """Metric sums of the global batch: summed over the data-parallel replicas (a fixed order:
        all-gathered, then added in replica order), sent from the last stage to the others."""
        if self.model.last_stage and self.dp_size > 1:
            keys = sorted(sums)
            mine = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32, device=self.device) for k in keys])
            parts = [torch.empty_like(mine) for _ in range(self.dp_size)]
            dist.all_gather(parts, mine, group=self.dp_group)
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            sums = dict(zip(keys, total.unbind()))
        sums = {k: float(v) for k, v in sums.items()}
        return self._from_last_stage(sums)

    @torch.no_grad()
    def _sum_data_parallel_grads(self) -> None:
        """Sum the replicas' float32 gradients in replica order: every gradient flattened into one
        buffer, all-gathered once, the replicas' buffers added in replica order (element-wise: the bits
        of a per-parameter sum in the same order), :attr:`grad_bucket_bytes` of gradients at a time."""
        if self.dp_size == 1:
            return
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for m in self.master_params:
            bucket.append(m)
            size += m.numel() * 4  # float32 gradients
            if size >= self.grad_bucket_bytes:
                self._sum_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._sum_bucket(bucket)

    def _sum_bucket(self, masters: list) -> None:
        grads = [m.grad if m.grad is not None else torch.zeros_like(m) for m in masters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        parts = [torch.empty_like(flat) for _ in range(self.dp_size)]
        dist.all_gather(parts, flat, group=self.dp_group)
        total = parts[0]
        for p in parts[1:]:
            total += p
        for m, g in zip(masters, total.split([g.numel() for g in grads])):
            m.grad = g.view_as(m)

    def _grad_norm_keys(self) -> list[tuple[str, int | None]]:
        """(HF-order key, split dim) per parameter: the order the squared sums are added in."""
        keys = []
        for name, p in zip(self.param_names, self.params):
            dim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
            if "word_embeddings" in name or "output_layer" in name:
                dim = 0  # vocabulary rows: the tree's vocabulary leaves
            keys.append((name, dim))
        return keys

    def _global_param_name(self, name: str) -> str:
        """A name that is the same for a parameter whatever stage holds it (the global layer index)."""
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            parts[i + 1] = str(int(parts[i + 1]) + self.model.layer_offset)
        return ".".join(parts)

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global grad norm (TP-, PP- and DP-invariant: module docstring), gradients scaled by
        ``max_norm / norm`` when it is larger (as ``clip_grad_norm_``). Every parameter's squared norm
        comes from :func:`leaf_square_sums` (a few launches, one copy to the host), then they are added
        on the host in the stage-independent order."""
        counted = [i for i, (name, _) in enumerate(self._norm_keys)
                   # the last stage's copy of the tied embedding: counted once, on the first stage
                   if not ("output_layer" in name and self.model.cfg.tie_word_embeddings)]
        values = leaf_square_sums([self.master_params[i].grad for i in counted],
                                  [self._norm_keys[i][1] for i in counted], self.model.leaves, self.tp.group)
        values = values.cpu().tolist()
        sums = {self._global_param_name(self._norm_keys[i][0]): v for i, v in zip(counted, values)}
        if self.pp_size > 1:
            every = [None] * self.pp_size
            dist.all_gather_object(every, sums, group=self.pp_group)
            sums = {k: v for d in every for k, v in d.items()}
        total = torch.zeros((), dtype=torch.float32)
        for key in _global_order(sums):
            total = total + torch.tensor(sums[key], dtype=torch.float32)
        norm = float(total.sqrt())
        if math.isfinite(norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            torch._foreach_mul_([m.grad for m in self.master_params], scale)
        return norm

    # ---- weights out ------------------------------------------------------------------------------
    def iter_hf_weights(self, dtype: torch.dtype | None = None, bucket_bytes: int = 512 << 20):
        """The actor's full weights under HF names, bucket by bucket (a collective over every rank)."""
        return self.model.iter_hf_weights(dtype, bucket_bytes)

    def compute_weights(self, bucket_bytes: int = 512 << 20):
        """The full compute weights under HF names, gathered from the TP shards and PP stages bucket by
        bucket (:meth:`iter_hf_weights`): what weight sync sends. A collective: every rank walks it to
        its end, and every rank gets every tensor."""
        return self.iter_hf_weights(None, bucket_bytes)

    def iter_hf_grads(self, bucket_bytes: int = 512 << 20):
        """The last step's float32 gradients (after clipping) under HF names, gathered like the weights
        (a collective). With tied embeddings, ``model.embed_tokens.weight`` holds the tied sum."""
        master_of = {id(p): m for p, m in zip(self.params, self.master_params)}
        return self.model.iter_hf_weights(torch.float32, bucket_bytes, select=lambda p: master_of[id(p)].grad)

    def _master_of(self) -> dict[int, torch.Tensor]:
        return {id(p): m for p, m in zip(self.params, self.master_params)}

    @torch.no_grad()
    def gather_model(self, bucket_bytes: int = 512 << 20):
        """A collective: on rank 0 a CPU ``Qwen3ForCausalLM`` with the full float32 master weights (what
        a consolidated checkpoint writes), on the other ranks None."""
        from rlperf.model.qwen3 import Qwen3ForCausalLM

        master_of = self._master_of()
        copy = Qwen3ForCausalLM(self.model.cfg, torch.float32, "cpu") if dist.get_rank() == 0 else None
        targets = copy.hf_state_dict() if copy is not None else {}
        for name, full in self.model.iter_hf_weights(torch.float32, bucket_bytes, select=lambda p: master_of[id(p)]):
            if copy is not None:
                targets[name].copy_(full)
        return copy

    _MOMENTS = ("exp_avg", "exp_avg_sq")

    def state_dict(self, bucket_bytes: int = 512 << 20) -> dict:
        """A collective: the AdamW state as full float32 tensors under Hugging Face names (gathered like
        the weights), the hyperparameters and the step count — the same for every layout, so a
        checkpoint resumes at another TP / PP size (or in the fsdp backend's names). Rank 0 gets it, the
        other ranks an empty ``optimizer``."""
        master_of = self._master_of()
        moments: dict[str, dict[str, torch.Tensor]] = {}
        for key in self._MOMENTS:
            def pick(p, key=key):
                return self._moment(master_of[id(p)], key)

            got = {n: t.cpu().clone() for n, t in self.model.iter_hf_weights(torch.float32, bucket_bytes, select=pick)}
            if dist.get_rank() == 0:
                moments[key] = got
        step = self._adam_step()
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        optim = {"format": "hf-names", "moments": moments, "step": step, "param_groups": groups} \
            if dist.get_rank() == 0 else {}
        return {"optimizer": optim, "step_count": self.step_count}

    def _moment(self, master: torch.Tensor, key: str) -> torch.Tensor:
        """AdamW's whole moment ``key`` of a master parameter (zeros before the first step); with the
        distributed optimizer a collective over the data-parallel group."""
        if self.distributed_optimizer:
            return self.optimizer.full_moment(master, key)
        st = self.optimizer.state.get(master, {})
        return st[key] if key in st else torch.zeros_like(master, dtype=torch.float32)

    def _adam_step(self) -> float | None:
        if self.distributed_optimizer:
            return self.optimizer.step_count()
        for st in self.optimizer.state.values():
            if "step" in st:
                return float(st["step"])
        return None

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (every rank calls it with the full state and keeps its shards; the
        model must already hold the saved weights)."""
        optim = state["optimizer"]
        if optim.get("format") != "hf-names":
            raise ValueError("the saved optimizer state is not the megatron backend's (HF-named AdamW moments)")
        if optim["step"] is not None:
            shards = {key: self.model.hf_shards(optim["moments"][key]) for key in self._MOMENTS}
            master_of = self._master_of()
            for i, (param, avg) in enumerate(shards["exp_avg"]):
                _, avg_sq = shards["exp_avg_sq"][i]
                m = master_of.get(id(param))
                if m is None:
                    continue
                if self.distributed_optimizer:
                    self.optimizer.set_state(m, optim["step"], avg, avg_sq)
                    continue
                self.optimizer.state[m] = {
                    "step": step_state(self.optimizer, optim["step"], m),
                    "exp_avg": avg.to(dtype=torch.float32, device=m.device).clone(),
                    "exp_avg_sq": avg_sq.to(dtype=torch.float32, device=m.device).clone()}
        for g, saved in zip(self.optimizer.param_groups, optim["param_groups"]):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
        keep_implementation(self.optimizer)
        self.step_count = int(state["step_count"])
        self._copy_master_to_compute()


def _global_order(sums: dict[str, float]) -> list[str]:
    """Parameter keys in a stage-independent order: embedding first, then layers by global index, then
    the rest by name."""
    def key(name: str):
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            return (1, int(parts[i + 1]), ".".join(parts[i + 2:]))
        return (0 if "embedding" in name else 2, 0, name)

    return sorted(sums, key=key)
