"""The data-parallel trainer: FSDP2 (``torch.distributed.fsdp.fully_shard``) around rlperf's model.

With ``W`` actor ranks in one ``torch.distributed`` process group (NCCL on CUDA, gloo on CPU; the
loop starts them, :mod:`rlperf.loop.placement`), :class:`FSDPTrainer` is :class:`rlperf.train.Trainer`
with parameters, gradients and AdamW state sharded over the ranks (FSDP2 shards every parameter
along dim 0, one group per decoder layer plus one for the embedding, final norm and lm head).

Every rank holds **every sample** of the rollout (the loop exchanges them); what each rank computes:

* ``prepare`` (old and reference log-probs): rank ``r`` computes the samples ``r, r + W, r + 2W, ...``
  of the rollout (:func:`dp_shard`) and the log-probs are all-gathered, so every rank has every
  sample's log-probs; the advantages (GRPO groups: all n samples of a prompt) are then computed on
  the whole rollout, on every rank, as in one process.
* ``train_step`` over a global batch of ``B`` samples (``B % W == 0``): rank ``r`` trains samples
  ``r, r + W, ...`` of it, packed into micro-batches under ``--max-tokens-per-gpu`` (or
  ``--micro-batch-size``). FSDP's collectives need the same number of forward/backward calls on every
  rank: every rank computes every rank's packing (the samples are known everywhere) and splits its
  own bins until it has as many micro-batches as the rank that needs most (:func:`equal_count_micro_batches`).

Loss normalisation (the DP gradient equals the one-process gradient of the whole global batch):
each micro-batch's loss is divided by the **global** batch's sample count (or loss-token count with
``--calculate-per-token-loss``), exactly as in one process, and FSDP's reduce-scatter **sums** the
ranks' gradients (gradient divide factor 1, sum reductions only), so
``grad = sum_r sum_{mb of r} d(loss_mb / denom) = d(sum_{i in batch} loss_i / denom)``. The metric
sums are all-reduced the same way (:meth:`FSDPTrainer.reduce_metric_sums`); the grad norm is the
norm of the full gradient (``clip_grad_norm_`` over DTensors).

Mixed precision (the one-process trainer's scheme, by FSDP2's means): the sharded float32 parameters
are the master weights and AdamW state; ``MixedPrecisionPolicy(param_dtype=compute_dtype,
reduce_dtype=float32)`` casts each shard to bf16 before the all-gather (the forward and backward run
on the same bf16 bits as the one-process compute copy: ``fp32 -> bf16`` rounds elementwise) and
reduce-scatters gradients in float32, accumulated in float32 across micro-batches. On the CPU
(float32) there is no cast.

When the shards are gathered (``--fsdp-gather``, :attr:`rlperf.train.TrainArgs.fsdp_gather`):

* ``micro-batch``, FSDP2's default: each decoder layer is all-gathered before its forward and again
  before its backward, and its gradients reduce-scattered after every micro-batch's backward. The
  least memory (one layer gathered at a time), and ``3 x layers`` collectives plus their copies per
  micro-batch.
* ``step``: every layer is gathered once per log-prob pass and once per optimizer step and stays
  gathered across its micro-batches; each micro-batch's gradient is added, unsharded, into a float32
  accumulator, and the sum is reduce-scattered once, after the last micro-batch
  (``set_requires_gradient_sync`` / ``set_reshard_after_backward`` on the last one only). Costs the
  full parameters in the compute dtype plus float32 gradients for the length of a step.
  ``grad = sum_r (sum_{mb of r} g_mb)`` either way; only the order of the float32 additions differs.
* ``auto`` (default): ``step`` when that cost is at most :data:`GATHERED_STEP_MEMORY_FRACTION` of the
  device's memory (the 0.6b shape on an 80 GB GPU), else ``micro-batch``. CPU: ``step``.

Weights leave the shards through :func:`iter_full_params` / :func:`iter_hf_weights`: full tensors
gathered bucket by bucket (never the whole model at once), for the in-process engines, a checkpoint
written by rank 0, or a broadcast to engines on other GPUs (``rlperf.sync``); their docstrings state
the contract.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .args import GATHERED_STEP_MEMORY_FRACTION
from .backend import TrainerSetup, describe_ranks, register_trainer_backend, shard_from_rank0
from .batching import HostCopies, MicroBatch, make_micro_batch, micro_batch_log_probs, partition
from .sample import Sample
from .trainer import Trainer

# The model's ops are out of place, so the views a layer returns are never modified in place (the
# case this FSDP2 warning is about); silence it once here instead of at every layer call.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def dp_shard(n: int, rank: int, world_size: int) -> list[int]:
    """Indices of the samples rank ``rank`` of ``world_size`` computes out of ``n``: ``rank, rank + W, ...``
    (strided, so prompt groups of different lengths spread over the ranks)."""
    return list(range(rank, n, world_size))


def equal_count_micro_batches(samples: Sequence[Sample], shards: Sequence[Sequence[int]], rank: int,
                              max_tokens_per_gpu: int | None = None, micro_batch_size: int | None = None,
                              device=None, replay_routing: bool = False) -> list[MicroBatch]:
    """Rank ``rank``'s micro-batches of ``samples[shards[rank]]``, as many as the rank that needs most
    (with ``replay_routing`` each carries its samples' rollout routing: :func:`make_micro_batch`).

    Each shard is packed with :func:`rlperf.train.batching.partition` (first-fit decreasing under
    ``max_tokens_per_gpu``, else runs of ``micro_batch_size``); ``n`` is the largest bin count over
    all shards (every rank computes the same ``n``, no communication). A rank with fewer bins splits
    its bin of most samples in two (halves, order kept) until it has ``n``: a split never exceeds the
    token cap, and since every shard has at least ``n`` samples (equal shard sizes) it always ends.
    The micro-batches' ``indices`` index ``samples``.
    """
    def bins(shard):
        return partition([samples[i].total_length for i in shard], max_tokens_per_gpu, micro_batch_size)

    count = max(len(bins(s)) for s in shards)
    mine = shards[rank]
    groups = bins(mine)
    while len(groups) < count:
        b = max(range(len(groups)), key=lambda j: (len(groups[j]), -j))
        if len(groups[b]) < 2:
            raise ValueError(f"rank {rank}: {len(mine)} samples cannot fill {count} micro-batches "
                             f"(the ranks' shards must have equal sizes)")
        g = groups.pop(b)
        groups[b:b] = [g[: len(g) // 2], g[len(g) // 2:]]
    for s in (samples[i] for i in mine):
        s.validate()
    return [make_micro_batch(samples, [mine[j] for j in g], device, replay_routing) for g in groups]




def gathered_step_bytes(model: nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Bytes a ``step``-gathered train step holds beyond the shards: every trainable parameter in full,
    in ``compute_dtype`` (default: its own), plus its float32 gradient accumulator."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            size = (compute_dtype or p.dtype).itemsize
            total += p.numel() * (size + 4)
    return total


def gather_once_per_step(mode: str, model: nn.Module, device: torch.device,
                         compute_dtype: torch.dtype | None = None) -> bool:
    """``--fsdp-gather`` resolved for ``model`` (full, before sharding) on ``device``: True for ``step``
    (module docstring)."""
    if mode != "auto":
        return mode == "step"
    if device.type != "cuda":
        return True
    capacity = torch.cuda.get_device_properties(device).total_memory
    return gathered_step_bytes(model, compute_dtype) <= GATHERED_STEP_MEMORY_FRACTION * capacity


class PackedLogProbs(nn.Module):
    """The FSDP root: ``forward(mb, temperature, with_entropy)`` = :func:`rlperf.train.micro_batch_log_probs`
    of the wrapped model. FSDP2 gathers parameters in module hooks, so the whole log-prob computation
    (embedding, layers, final norm, lm head) runs inside one ``forward``: the root's parameters
    (embedding, norm, lm head) are gathered around it, each decoder layer's around its own call."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, mb: MicroBatch, temperature: float, with_entropy: bool = False, routing=None):
        return micro_batch_log_probs(self.model, mb, temperature, with_entropy=with_entropy, routing=routing)


def shard_model(model: nn.Module, compute_dtype: torch.dtype | None = None) -> PackedLogProbs:
    """``fully_shard`` each decoder layer of ``model`` and a :class:`PackedLogProbs` root around it, on
    the default process group; returns the root. The parameters become DTensor shards in place
    (``model.named_parameters()`` keeps its names). ``compute_dtype`` (bf16 on CUDA): FSDP2's
    ``param_dtype``; gradients reduce in float32 and are summed over the ranks, not averaged (module
    docstring)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    master = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype if compute_dtype not in (None, master) else None,
                                  reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    root = fully_shard(PackedLogProbs(model), mp_policy=policy)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM, no pre/post scaling
    return root


def _reshard_all(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def iter_full_params(model: nn.Module, dtype: torch.dtype | None = None, bucket_bytes: int = 512 << 20,
                     root: nn.Module | None = None,
                     order: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter of ``model`` (``named_parameters`` names, in their
    order or in ``order``, a permutation of them), gathered from its FSDP shards one bucket at a time.

    Parameters are taken in order into buckets of at most ``bucket_bytes`` bytes (in ``dtype``; a larger
    parameter is a bucket alone); a bucket's shards are cast to ``dtype`` (None: kept), each gathered
    with ``DTensor.full_tensor()`` (an all-gather), then its tensors are yielded. A parameter that is not
    a DTensor (one process) is yielded as it is (``detach()``, no copy). Before the first gather every
    FSDP module under ``root`` (default ``model``) is resharded, so the float32 shards are what is read.

    Contract (a collective): **every rank of the process group iterates to the end, in the same
    order**, with no other collective in between; the tensors are the same on every rank. Rank 0 may
    consume them (copy into an engine, broadcast them to engines over NCCL, write a checkpoint) while
    the other ranks only advance the iterator (``for _ in it: pass``) to take part in the gathers. A
    yielded tensor stays valid only until the iterator moves past its bucket (the bucket is then freed):
    copy or send it before asking for the next bucket, and never write into it (without FSDP it is the
    live parameter). Peak extra memory: about one bucket of full tensors.
    """
    from torch.distributed.tensor import DTensor

    _reshard_all(root if root is not None else model)

    def gather(bucket):
        full = []
        for name, p in bucket:
            t = p.detach()
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
            if isinstance(t, DTensor):
                t = t.full_tensor()
            full.append((name, t))
        return full

    params = list(model.named_parameters())
    if order is not None:
        by_name = dict(params)
        if sorted(order) != sorted(by_name):
            raise ValueError("iter_full_params: order must list every parameter of the model once")
        params = [(name, by_name[name]) for name in order]
    bucket, size = [], 0
    for name, p in params:
        nbytes = p.numel() * (dtype or p.dtype).itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield from gather(bucket)
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    if bucket:
        yield from gather(bucket)


def iter_hf_weights(model: nn.Module, dtype: torch.dtype | None = None, bucket_bytes: int = 512 << 20,
                    root: nn.Module | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_full_params` of a :class:`rlperf.model.qwen3.Qwen3ForCausalLM` under Hugging Face names
    (fused q/k/v and gate/up become row views, :func:`rlperf.model.qwen3.hf_views`) and in
    ``hf_state_dict()``'s order (:meth:`~rlperf.model.qwen3.Qwen3ForCausalLM.hf_param_order`): what an
    engine loads (``/update_weights_from_distributed`` names), flattened into the buckets a broadcast of
    ``hf_state_dict()`` would send (same bucket checksums). Same collective contract."""
    from rlperf.model.qwen3 import hf_views

    for name, full in iter_full_params(model, dtype, bucket_bytes, root, order=model.hf_param_order()):
        yield from hf_views(model.cfg, name, full)


class FSDPTrainer(Trainer):
    """:class:`rlperf.train.Trainer` over FSDP2 shards (module docstring); every rank of the default
    process group builds one and calls the same methods with the same samples.

    ``model``: the full float32 model (the same weights on every rank: :func:`rlperf.train.backend.start_from_rank0`);
    it is sharded in place and stays :attr:`master_model` (= :attr:`model`; DTensor parameters).
    ``compute_dtype``: FSDP2's ``param_dtype`` (bf16 on CUDA). ``ref_model``: sharded the same way.
    """

    def __init__(self, model: nn.Module, args, ref_model: nn.Module | None = None,
                 compute_dtype: torch.dtype | None = None, routing_replay: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("FSDPTrainer needs an initialised torch.distributed process group")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.compute_dtype = compute_dtype
        if ref_model is not None:
            for p in ref_model.parameters():
                p.requires_grad_(False)
        self.gather_once_per_step = gather_once_per_step(args.fsdp_gather, model, next(model.parameters()).device,
                                                         compute_dtype)
        self.module = shard_model(model, compute_dtype)
        self.ref_module = shard_model(ref_model, compute_dtype) if ref_model is not None else None
        if self.gather_once_per_step:  # layers stay gathered from their first forward to an explicit reshard
            for root in (self.module, self.ref_module):
                if root is not None:
                    root.set_reshard_after_forward(False)
        # the shards are the masters: the base trainer keeps no second copy (no compute_dtype there)
        super().__init__(model, args, ref_model, routing_replay=routing_replay)

    @property
    def device(self) -> torch.device:
        from torch.distributed.tensor import DTensor

        w = self.model.head_weight
        return (w.to_local() if isinstance(w, DTensor) else w).device

    def _shards(self, n: int) -> list[list[int]]:
        return [dp_shard(n, r, self.world_size) for r in range(self.world_size)]

    def _micro_batches_of(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        packing = self._packing()
        return equal_count_micro_batches(samples, self._shards(len(samples)), self.rank, device=self.device,
                                         max_tokens_per_gpu=packing.get("max_tokens_per_gpu"),
                                         micro_batch_size=packing.get("micro_batch_size"),
                                         replay_routing=self.routing_replay)

    @torch.no_grad()
    def sample_log_probs(self, model: nn.Module, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """This rank's share of the samples through the sharded ``model``, then all-gathered: every rank
        returns every sample's log-probs (the same bits as one process: a sample's log-probs do not
        depend on its micro-batch, the kernels are batch invariant)."""
        root = self.module if model is self.model else self.ref_module
        mine = HostCopies()  # one copy to the host after the last micro-batch, not one per micro-batch
        for mb in self._micro_batches_of(samples):
            mine.add(mb.indices, mb.response_lengths, root(mb, self.args.rollout_temperature))
        _reshard_all(root)  # a forward without backward leaves the root (and, gathered per step, every layer) gathered
        return self._gather_by_index(mine.per_sample(), len(samples))

    @torch.no_grad()
    def train_routed_experts(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """This rank's share routed by the sharded actor's routers (recorded through the root, which
        gathers the shards), then all-gathered: every rank returns every sample's routing."""
        from rlperf.model.moe import RoutingTrace

        packing = self._packing()
        mine: list[tuple[int, torch.Tensor]] = []
        for mb in equal_count_micro_batches(samples, self._shards(len(samples)), self.rank, device=self.device,
                                            max_tokens_per_gpu=packing.get("max_tokens_per_gpu"),
                                            micro_batch_size=packing.get("micro_batch_size")):
            trace = RoutingTrace()
            self.module(mb, self.args.rollout_temperature, routing=trace)
            experts, cu = trace.experts().cpu(), mb.cu_seqlens.tolist()
            mine += [(i, experts[cu[j]:cu[j + 1] - 1]) for j, i in enumerate(mb.indices)]
        _reshard_all(self.module)
        return self._gather_by_index(mine, len(samples))

    def _gather_by_index(self, mine: list[tuple[int, torch.Tensor]], n: int) -> list[torch.Tensor]:
        """Every rank's ``(sample index, tensor)`` pairs, all-gathered into one list of ``n`` by index."""
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        out: list[torch.Tensor | None] = [None] * n
        for part in gathered:
            for i, t in part:
                out[i] = t
        return out

    def micro_batches(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """This rank's micro-batches of the global batch ``samples``: its strided shard, as many as every rank's."""
        return self._micro_batches_of(samples)

    def forward_log_probs(self, mb: MicroBatch, with_entropy: bool = False):
        return self.module(mb, self.args.rollout_temperature, with_entropy)

    def before_micro_batch(self, index: int, count: int) -> None:
        """Gathered per step (module docstring): gradients stay unsharded and the layers gathered until the
        last micro-batch, whose backward reduce-scatters the float32 sum and reshards."""
        if self.gather_once_per_step:
            last = index == count - 1
            self.module.set_requires_gradient_sync(last)
            self.module.set_reshard_after_backward(last)

    def reduce_metric_sums(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum the ranks' metric sums (one all-reduce of all of them): the global batch's."""
        keys = sorted(sums)
        if not keys:
            return sums
        flat = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32, device=self.device) for k in keys])
        dist.all_reduce(flat)
        return dict(zip(keys, flat.unbind()))

    def clip_grad_norm(self, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(self.master_params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def iter_hf_weights(self, dtype: torch.dtype | None = None, bucket_bytes: int = 512 << 20):
        """The actor's full weights under HF names, bucket by bucket (:func:`iter_hf_weights`; a collective)."""
        return iter_hf_weights(self.master_model, dtype, bucket_bytes, root=self.module)

    def compute_weights(self, bucket_bytes: int = 512 << 20):
        """The full compute weights (``compute_dtype``) under HF names, gathered bucket by bucket
        (:meth:`iter_hf_weights`; a collective: every rank walks it to its end)."""
        return self.iter_hf_weights(self.compute_dtype, bucket_bytes)

    def iter_full_params(self, dtype: torch.dtype | None = None, bucket_bytes: int = 512 << 20):
        """The actor's full parameters, bucket by bucket (:func:`iter_full_params`; a collective)."""
        return iter_full_params(self.master_model, dtype, bucket_bytes, root=self.module)

    @torch.no_grad()
    def gather_model(self, bucket_bytes: int = 512 << 20) -> nn.Module | None:
        """A collective: on rank 0 a CPU copy of the actor with the full float32 master weights (what
        a consolidated checkpoint writes), on the other ranks None. Rank 0 holds the whole model in host
        memory; the device never holds more than a bucket beyond the shards."""
        copy = type(self.master_model)(self.master_model.cfg, torch.float32, "cpu") if self.rank == 0 else None
        params = dict(copy.named_parameters()) if copy is not None else {}
        for name, full in self.iter_full_params(torch.float32, bucket_bytes):
            if copy is not None:
                params[name].copy_(full)
        return copy

    def describe(self) -> str:
        return describe_ranks(self.world_size)


@register_trainer_backend("fsdp")
def build_fsdp_trainer(setup: TrainerSetup) -> FSDPTrainer:
    """``--train-backend fsdp`` on several actor ranks: every rank starts from rank 0's weights, then
    :class:`FSDPTrainer` shards them (its shards are the float32 masters). Its ``engine_model`` is the rank's
    full engine copy in the compute dtype (loaded from the gathered shards at every sync), or, with the
    engines elsewhere, the sharded master model."""
    return shard_from_rank0(setup, lambda: FSDPTrainer(setup.model, setup.config.args, setup.ref_model,
                                                       compute_dtype=setup.compute_dtype,
                                                       routing_replay=setup.config.moe.routing_replay))
