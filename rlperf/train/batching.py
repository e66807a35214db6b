"""Packed varlen micro-batches of samples, and per-token log-probs of response tokens.

A :class:`rlperf.train.sample.Sample` is one prompt + response: ``tokens`` [L] (prompt then
response), ``response_length`` R (<= L - 1: the first response token needs a token before it), a
``loss_mask`` [R], the scalar ``reward``, and the rollout engine's ``rollout_log_probs`` [R]; the
trainer fills in ``log_probs`` (old actor), ``ref_log_probs`` and ``advantages``. Packing checks
each sample (:meth:`~rlperf.train.sample.Sample.validate`).

Response token j sits at position ``p = L - R + j``; its log-prob is read from the final hidden
state at ``p - 1`` with target ``tokens[p]``, through :func:`rlperf.kernels.fused_logprob` — only
the R rows that predict response tokens go into the lm head, never the prompt rows.

Packing (slime's ``--use-dynamic-batch-size --max-tokens-per-gpu``): first-fit decreasing by
length into as few micro-batches as fit under the token cap (each holds at most
``max_tokens_per_gpu`` tokens; a longer sample is an error); the samples of a micro-batch keep
their input order. Without dynamic batching, consecutive runs of ``micro_batch_size`` samples.
Because the kernels are batch invariant, a token's log-prob bits do not depend on the packing.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch

from rlperf import kernels as K
from rlperf.model.moe import RoutingReplayError, RoutingTrace

from .sample import Sample


@dataclasses.dataclass
class MicroBatch:
    """Packed varlen input of some samples (indices into the caller's list, in order).

    ``input_ids`` / ``positions`` [T] with T = sum of total lengths, ``cu_seqlens`` [B+1] int32,
    ``logit_rows`` [sum R_i] int64 (the hidden row predicting each response token), ``targets``
    [sum R_i] int64 (the response tokens), ``response_lengths`` [B]; ``routed_experts`` [T, L, k]
    (routing replay: the experts every MoE layer must route each token to) or None.
    """

    indices: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    logit_rows: torch.Tensor
    targets: torch.Tensor
    response_lengths: list[int]
    routed_experts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device) -> "MicroBatch":
        moved = dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in
                                             ("input_ids", "positions", "cu_seqlens", "logit_rows", "targets")})
        if self.routed_experts is not None:
            moved.routed_experts = self.routed_experts.to(device)
        return moved


def partition(lengths: Sequence[int], max_tokens_per_gpu: int | None = None,
              micro_batch_size: int | None = None) -> list[list[int]]:
    """Index groups: first-fit decreasing under ``max_tokens_per_gpu``, else runs of ``micro_batch_size``."""
    lengths = [int(n) for n in lengths]
    if max_tokens_per_gpu is None:
        size = micro_batch_size or 1
        return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
    for i, n in enumerate(lengths):
        if n > max_tokens_per_gpu:
            raise ValueError(f"sample {i} has {n} tokens > --max-tokens-per-gpu {max_tokens_per_gpu}; raise "
                             f"--max-tokens-per-gpu or lower --rollout-max-response-len")
    bins: list[list[int]] = []
    room: list[int] = []
    # stable sort: equal lengths keep input order, so the packing is a function of the lengths only
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b in range(len(bins)):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens_per_gpu - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def replayed_routing(sample: Sample, index: int) -> torch.Tensor:
    """[L, layers, k] int32: the sample's ``rollout_routed_experts`` for its L - 1 forwarded tokens,
    plus a row for the last token, which predicts nothing (causal attention: no later token reads
    it), so any experts do: it repeats the row before. :class:`RoutingReplayError` naming the sample
    when the routing is missing or does not cover its tokens."""
    routed = sample.rollout_routed_experts
    if routed is None:
        raise RoutingReplayError(f"sample {index}: rollout routing replay needs the rollout's routed experts and this "
                                 f"sample has none (generate with return_routed_experts: "
                                 f"meta_info['routed_experts'] -> Sample.rollout_routed_experts)")
    routed = torch.as_tensor(routed).to(torch.int32)
    n = sample.total_length - 1
    if routed.dim() != 3 or routed.shape[0] != n or n < 1:
        raise RoutingReplayError(f"sample {index}: routed experts of shape {tuple(routed.shape)} do not cover its "
                                 f"{sample.total_length} tokens (expected [{n}, MoE layers, top_k]: all but the last)")
    return torch.cat([routed, routed[-1:]])


def make_micro_batch(samples: Sequence[Sample], indices: Sequence[int], device=None,
                     replay_routing: bool = False) -> MicroBatch:
    """Pack ``samples[indices]`` into one varlen micro-batch (tensors on ``device``); with
    ``replay_routing`` the samples' rollout routing goes along (:func:`replayed_routing`)."""
    ids, pos, rows, tgts, cu, rl = [], [], [], [], [0], []
    for i in indices:
        s = samples[i]
        tokens = s.token_ids()
        L, R = tokens.numel(), s.response_length
        ids.append(tokens)
        pos.append(torch.arange(L))
        rows.append(torch.arange(cu[-1] + L - R - 1, cu[-1] + L - 1))
        tgts.append(tokens[L - R:])
        cu.append(cu[-1] + L)
        rl.append(R)
    routed = torch.cat([replayed_routing(samples[i], i) for i in indices]) if replay_routing else None
    mb = MicroBatch(list(indices), torch.cat(ids), torch.cat(pos), torch.tensor(cu, dtype=torch.int32),
                    torch.cat(rows), torch.cat(tgts), rl, routed)
    return mb.to(device) if device is not None else mb


def pad_micro_batch(mb: MicroBatch, num_tokens: int, num_seqs: int | None = None,
                    num_rows: int | None = None) -> MicroBatch:
    """``mb`` padded with masked tokens to fixed shapes (what a CUDA graph per token-count bucket needs).

    * tokens: ``num_tokens - T`` pad tokens (id 0, positions 0, 1, ...) appended as **one more
      sequence**, so causal attention keeps them apart from every real sequence and their hidden
      rows stay finite (a pad row's zero gradient times a finite activation adds exactly 0 to a
      weight gradient; an unwritten row could hold NaN, and 0 * NaN is NaN);
    * ``cu_seqlens``: then repeated ``num_tokens`` entries (empty sequences) up to ``num_seqs + 1``
      entries, so its shape does not depend on how many samples the micro-batch holds;
    * ``logit_rows`` / ``targets``: ``num_rows`` (default ``num_tokens``) entries, the extra ones
      reading row ``num_tokens - 1`` (a pad token, or the last real token, which predicts nothing)
      with target 0. Their log-probs are not the caller's: it keeps the first ``sum R_i``.

    ``indices`` and ``response_lengths`` stay as they were. Because every kernel is batch
    invariant, a real token's log-prob and every gradient of a loss on the real log-probs have the
    same bits as without padding (``tests/train/test_padding.py``). ValueError naming the shape
    when ``mb`` does not fit; routing replay (``routed_experts``) is not padded and is refused.
    """
    T, seqs, rows = mb.num_tokens, mb.cu_seqlens.numel() - 1, mb.logit_rows.numel()
    pad = num_tokens - T
    num_seqs = seqs + (pad > 0) if num_seqs is None else num_seqs
    num_rows = num_tokens if num_rows is None else num_rows
    if pad < 0:
        raise ValueError(f"a micro-batch of {T} tokens does not fit a bucket of {num_tokens} tokens")
    if num_seqs < seqs + (pad > 0):
        raise ValueError(f"{seqs} sequences{' + 1 of padding' if pad else ''} do not fit {num_seqs} sequence slots")
    if num_rows < rows:
        raise ValueError(f"{rows} logit rows do not fit {num_rows} rows")
    if mb.routed_experts is not None:
        raise ValueError("routing replay (routed_experts) is not supported on padded micro-batches")
    dev = mb.input_ids.device
    cu = torch.full((num_seqs + 1,), num_tokens, dtype=mb.cu_seqlens.dtype, device=dev)
    cu[:seqs + 1] = mb.cu_seqlens
    return MicroBatch(
        list(mb.indices),
        torch.cat([mb.input_ids, torch.zeros(pad, dtype=mb.input_ids.dtype, device=dev)]),
        torch.cat([mb.positions, torch.arange(pad, dtype=mb.positions.dtype, device=dev)]),
        cu,
        torch.cat([mb.logit_rows, torch.full((num_rows - rows,), num_tokens - 1, dtype=mb.logit_rows.dtype,
                                             device=dev)]),
        torch.cat([mb.targets, torch.zeros(num_rows - rows, dtype=mb.targets.dtype, device=dev)]),
        list(mb.response_lengths))


def pack_micro_batches(samples: Sequence[Sample], max_tokens_per_gpu: int | None = None,
                       micro_batch_size: int | None = None, device=None, replay_routing: bool = False
                       ) -> list[MicroBatch]:
    """Micro-batches covering every sample once (see :func:`partition`); each sample is checked first."""
    for s in samples:
        s.validate()
    groups = partition([s.total_length for s in samples], max_tokens_per_gpu, micro_batch_size)
    return [make_micro_batch(samples, g, device, replay_routing) for g in groups]


def micro_batch_log_probs(model, mb: MicroBatch, temperature: float = 1.0, with_entropy: bool = False,
                          routing: RoutingTrace | None = None):
    """Log-probs [sum R_i] float32 (and entropy) of the micro-batch's response tokens, in sample order.

    ``fused_logprob(hidden[logit_rows], model.head_weight, targets, temperature)`` on the final hidden
    states ``hidden`` [T, H] of ``model.forward_packed(input_ids, positions, cu_seqlens)``: only the
    sum R_i rows that predict response tokens go into the lm head, and the kernel never materialises
    [sum R_i, V] float32 logits (``fast`` mode's stock path does). The rollout engine computes a sampled token's log-prob with the
    same call on the same hidden row (``rlperf.rollout.engine``), so with batch-invariant kernels the
    two agree bit for bit (``--true-on-policy-mode``).

    ``model`` needs ``forward_packed`` and ``head_weight`` [V, H]
    (:class:`rlperf.model.qwen3.Qwen3ForCausalLM`). Differentiable when grad is enabled and the kernel
    backend has backward passes (the reference backend on CPU; of the Triton kernels only
    ``fused_logprob`` has a backward so far).

    ``routing``: a :class:`RoutingTrace` the MoE layers record their experts into (ignored when the
    micro-batch carries ``routed_experts``: those are replayed).
    """
    if mb.routed_experts is not None:  # replay the rollout's experts
        routing = RoutingTrace(mb.routed_experts)
    hidden = model.forward_packed(mb.input_ids, mb.positions, mb.cu_seqlens, routing)
    if getattr(model, "reduction_leaves", None) is not None:  # the tensor-parallel-invariant tree (Qwen3ForCausalLM)
        return model.token_logprobs(hidden[mb.logit_rows], mb.targets, temperature, return_entropy=with_entropy)
    return K.fused_logprob(hidden[mb.logit_rows], model.head_weight, mb.targets, temperature,
                           return_entropy=with_entropy)


@torch.no_grad()
def compute_log_probs(model, samples: Sequence[Sample], temperature: float = 1.0,
                      max_tokens_per_gpu: int | None = None, micro_batch_size: int | None = None,
                      with_entropy: bool = False, replay_routing: bool = False,
                      micro_batch_pass: Callable | None = None):
    """Per-sample log-probs (list of [R_i] float32, on CPU) without grad, e.g. old or reference log-probs.

    ``micro_batch_pass(mb, with_entropy)`` computes one packed micro-batch's log-probs [sum R_i] (and
    entropy); default :func:`micro_batch_log_probs` of ``model`` (a CUDA-graph replay passes its own)."""
    logps: list[torch.Tensor | None] = [None] * len(samples)
    ents: list[torch.Tensor | None] = [None] * len(samples)
    if micro_batch_pass is None:
        micro_batch_pass = functools.partial(micro_batch_log_probs, model, temperature=temperature)
    lp_parts, ent_parts = HostCopies(), HostCopies()
    for mb in pack_micro_batches(samples, max_tokens_per_gpu, micro_batch_size, device=model.head_weight.device,
                                 replay_routing=replay_routing):
        out = micro_batch_pass(mb, with_entropy=with_entropy)
        lp, ent = out if with_entropy else (out, None)
        lp_parts.add(mb.indices, mb.response_lengths, lp)
        if with_entropy:
            ent_parts.add(mb.indices, mb.response_lengths, ent)
    for i, t in lp_parts.per_sample():
        logps[i] = t
    for i, t in ent_parts.per_sample():
        ents[i] = t
    return (logps, ents) if with_entropy else logps


@dataclasses.dataclass
class LossInputs:
    """One micro-batch's per-token inputs of the policy loss on the trainer's device, its samples'
    response tokens concatenated [sum R]: ``old_log_probs``, ``advantages``, ``ref_log_probs`` and
    ``rollout_log_probs`` (None where the loss does not use them), ``masks`` (one [R] view per sample),
    and ``count``, what the micro-batch's metrics average over (loss tokens with
    ``calculate_per_token_loss``, else samples; counted on the host)."""

    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    masks: list[torch.Tensor]
    ref_log_probs: torch.Tensor | None
    rollout_log_probs: torch.Tensor | None
    count: float


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for a GPU goes through pinned memory without blocking."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def loss_inputs(group: Sequence[Sample], device, *, with_rollout: bool, with_ref: bool,
                per_token: bool) -> LossInputs:
    """:class:`LossInputs` of the samples ``group``, copied to ``device`` without blocking the host.

    Call it before the micro-batch's forward is queued. A copy from pageable host memory waits until the
    GPU has run everything queued before it: issued after the forward (as it used to be), it held the
    host until the forward had run, so the backward's launches started only then and the GPU idled while
    they were issued. Pinned and non-blocking, the copies are queued like kernels. The values are the
    samples' own (no arithmetic), so no bit of the loss changes."""
    device = torch.device(device)
    masks = [s.loss_mask_tensor() for s in group]
    lengths = [m.shape[0] for m in masks]
    count = float(sum(m.sum() for m in masks)) if per_token else float(len(group))

    def flat(name):
        return _to_device(torch.cat([getattr(s, name) for s in group]), device)

    return LossInputs(
        old_log_probs=flat("log_probs"), advantages=flat("advantages"),
        masks=list(_to_device(torch.cat(masks), device).split(lengths)),
        ref_log_probs=flat("ref_log_probs") if with_ref else None,
        rollout_log_probs=(_to_device(torch.cat([s.rollout_log_probs_tensor() for s in group]), device)
                           if with_rollout else None),
        count=count)


class HostCopies:
    """Per-sample float32 CPU slices of a pass's micro-batch outputs, brought to the host in one copy.

    :meth:`add` keeps a float32 device copy of one micro-batch's values ``[sum lengths]`` (a copy: a
    CUDA graph's replay overwrites its output buffer); :meth:`per_sample` concatenates them, copies
    them to the host once and returns ``(sample index, [length] float32 CPU tensor)`` pairs, each its own
    storage. One synchronization per pass instead of one per micro-batch, so the host queues the next
    micro-batch while the GPU runs this one; the values are the same bits as a copy per micro-batch."""

    def __init__(self):
        self.parts: list[tuple[Sequence[int], Sequence[int], torch.Tensor]] = []

    def add(self, indices: Sequence[int], lengths: Sequence[int], values: torch.Tensor) -> None:
        self.parts.append((indices, lengths, values.detach().to(torch.float32, copy=True)))

    def per_sample(self) -> list[tuple[int, torch.Tensor]]:
        if not self.parts:
            return []
        flat = torch.cat([v for _, _, v in self.parts]).cpu()
        out, offset = [], 0
        for indices, lengths, _ in self.parts:
            for i, n in zip(indices, lengths):
                out.append((i, flat[offset:offset + n].clone()))
                offset += n
        return out


@torch.no_grad()
def compute_routed_experts(model, samples: Sequence[Sample], max_tokens_per_gpu: int | None = None,
                           micro_batch_size: int | None = None) -> list[torch.Tensor]:
    """The trainer's own routing of every sample (MoE models): [L_i - 1, MoE layers, k] int32 on the
    CPU per sample, the layout of ``Sample.rollout_routed_experts`` (every token but the last), from
    packed forwards that route by the model's routers: what the routing-agreement gate compares with
    the rollout's."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    for mb in pack_micro_batches(samples, max_tokens_per_gpu, micro_batch_size, device=model.head_weight.device):
        trace = RoutingTrace()
        model.forward_packed(mb.input_ids, mb.positions, mb.cu_seqlens, trace)
        experts = trace.experts().cpu()
        cu = mb.cu_seqlens.tolist()
        for j, i in enumerate(mb.indices):
            out[i] = experts[cu[j]:cu[j + 1] - 1]
    return out
