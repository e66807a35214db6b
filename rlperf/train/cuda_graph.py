"""Packed micro-batches replayed from CUDA graphs, padded to a few token-count buckets (``--cuda-graph-buckets``).

Why: a train micro-step of a 28-layer model is some 950 kernel launches issued from Python (the
forward's launchers, autograd's glue, the backward's launchers); at a few thousand tokens that host
time is larger than the GPU work. Capturing the step once per bucket and replaying it leaves one
launch call per graph.

What is captured, per (kernel mode, bucket, sequence slots), on first use:

* **log-prob pass** (no grad, :meth:`MicroBatchGraphs.log_probs`): ``micro_batch_log_probs`` on
  static input buffers -> static log-probs (and entropy) ``[bucket]``;
* **train micro-step** (:meth:`MicroBatchGraphs.log_probs_with_grad`): a forward graph (the same
  call with grad on) and a backward graph, ``torch.autograd.grad`` of (log-probs, entropy) with
  static upstream gradients to every trainable parameter (through leaves that alias them:
  :class:`_LogProbsThrough`) -> static parameter gradients. The policy
  loss runs eagerly between the two replays on the first ``sum R_i`` log-probs. An autograd
  function (:class:`_ReplayedLogProbs`) joins them: its forward replays the forward graph, its
  backward copies the upstream gradient into the static buffer (zeros on the padding rows),
  replays the backward graph and hands autograd a **copy** of each gradient (the static buffers
  are overwritten by the next replay, and autograd may keep the tensor it is given as ``.grad``),
  made by one multi-tensor multiply by 1 (a few launches for every parameter, exact).

Padding (:func:`rlperf.train.batching.pad_micro_batch`): a micro-batch of T tokens in S sequences
goes into the smallest bucket >= T: masked pad tokens as one more sequence, ``cu_seqlens`` filled
with empty sequences up to :func:`seq_slots` entries (the next power of two >= S + 1, at most
``bucket // 2 + 1``), logit rows and targets padded to ``bucket`` rows. Graphs are keyed by
(bucket, slots): the buffers' shapes are a function of the key alone, and every kernel reads
``cu_seqlens`` on the device (no host sync: the varlen attention launch sizes its grid from the
token count and the slot count), so the step can be captured.

Bits: a replay runs the kernels and launch configs of the eager step on the padded micro-batch.
Padding changes no real row's log-prob (every kernel is row invariant) and adds only exact zeros to
the gradients' sums over tokens (a pad row's gradient is exactly zero, and in invariant mode every
sum over tokens runs in blocks fixed independently of the token count: ``rlperf.kernels.gemm``'s
``weight_grad``, the norms' backward partials, the lm head's vocabulary chunks). So a graphed step
equals the eager step on the unpadded micro-batch bit for bit: log-probs, gradients and the
optimizer's update (``tests/train/test_padding.py`` on CPU; ``tests/train/test_cuda_graph_train.py``
on the GPU: replay against eager, padded against unpadded, whole optimizer steps). Fast mode's
backward is cuBLAS, whose kernel choice follows the token count: there the bits may differ.

Memory: the graphs of one :class:`MicroBatchGraphs` share one private memory pool. The trainer
replays a bucket's forward and backward graphs back to back (never another graph between them),
so a later capture may reuse memory an earlier graph freed. Each bucket's train graphs keep one
set of parameter gradients (the compute dtype) as static outputs.

Failures: a capture that raises (an op that cannot be captured, memory the graphs' pool cannot get) is
logged once, naming the key and ``--cuda-graph-buckets none``, and recorded in :attr:`MicroBatchGraphs.failed`
(:func:`rlperf.graph_capture.capture_or_fall_back`); that key's passes and micro-steps then run eagerly on
the padded micro-batch: the same kernels on the same rows, so the replay's bits, without the launch savings.
The key is not captured again. What the failed capture reserved in the pool stays reserved.

Limits: CUDA only (the constructor refuses other devices); one process (the data-parallel trainer
does not use it); dense models without routing replay (the loop checks the flags).

Other models (the megatron trainer's :class:`rlperf.train.megatron.model.MegatronCausalLM` at one rank):
``log_probs_fn`` is the micro-batch's log-prob call, and ``backward_side`` a :class:`BackwardSide` for a
gradient the model's backward keeps apart from the parameters' (the tied head's ``head_grad``): captured as
one more static output and handed back after each backward replay as the eager backward would have.

Default: ``--cuda-graph-buckets auto`` turns graphs on wherever those limits allow and micro-batches
are packed (``--use-dynamic-batch-size``), with the buckets of
:func:`rlperf.train.args.auto_cuda_graph_buckets` (the rule and why); ``none`` keeps every step eager.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from rlperf import kernels as K
from rlperf.flags import check_token_buckets
from rlperf.graph_capture import capture_or_fall_back, capturing

from .batching import MicroBatch, micro_batch_log_probs, pad_micro_batch

FLAG = "--cuda-graph-buckets"
FALL_BACK_HINT = f"{FLAG} none keeps every step eager"
"""What a failed capture's warning adds: the flag that turns the graphs off."""


MIN_SEQ_SLOTS = 8


def seq_slots(bucket: int, num_seqs: int | None = None) -> int:
    """Sequence slots of a graph's ``cu_seqlens``: the next power of two >= ``num_seqs + 1`` (the
    micro-batch's sequences and the pad sequence), at least :data:`MIN_SEQ_SLOTS`, at most
    ``bucket // 2 + 1`` (every sample has >= 2 tokens, plus the pad sequence), which is also what
    ``num_seqs=None`` gives. Why not always the most: the varlen attention kernels launch one
    program per (token block + sequence slot), and each empty slot's program still runs (it finds
    no rows and exits); thousands of them per launch would cost more than the launches graphs save."""
    most = bucket // 2 + 1
    if num_seqs is None:
        return most
    slots = MIN_SEQ_SLOTS
    while slots < num_seqs + 1:
        slots *= 2
    return min(slots, most)


class BackwardSide(Protocol):
    """A gradient a model's backward stores outside the parameters' ``.grad`` (a Python side effect, which
    a graph replay does not repeat). ``stash()`` takes the value the trainer has accumulated so far (and
    clears it, so the capture's backward writes a fresh one); ``restore(value)`` puts it back;
    ``deliver(static)`` adds a backward replay's static output as the eager backward would have."""

    def stash(self) -> torch.Tensor | None: ...

    def restore(self, value: torch.Tensor | None) -> None: ...

    def deliver(self, static: torch.Tensor) -> None: ...


@dataclasses.dataclass
class _TrainGraph:
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    log_probs: torch.Tensor        # [bucket] float32, static output of forward
    entropy: torch.Tensor          # [bucket] float32
    grad_log_probs: torch.Tensor   # [bucket] static upstream gradients (input of backward)
    grad_entropy: torch.Tensor
    grads: tuple                   # per trainable parameter: its static gradient, or None (unused)
    side: BackwardSide | None = None
    side_grad: torch.Tensor | None = None  # the backward's static output for ``side``


class _ReplayedLogProbs(torch.autograd.Function):
    """Forward: replay the forward graph, return copies of the first ``num_rows`` log-probs and
    entropies. Backward: load the upstream gradients (zeros past ``num_rows``), replay the backward
    graph, return copies of the parameters' gradients."""

    @staticmethod
    def forward(ctx, entry: _TrainGraph, num_rows: int, *params):
        entry.forward.replay()
        ctx.entry, ctx.num_rows = entry, num_rows
        return entry.log_probs[:num_rows].clone(), entry.entropy[:num_rows].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        e, n = ctx.entry, ctx.num_rows
        for static, g in ((e.grad_log_probs, grad_log_probs), (e.grad_entropy, grad_entropy)):
            static[:n].copy_(g)
            static[n:].zero_()
        e.backward.replay()
        if e.side is not None:
            e.side.deliver(e.side_grad)
        # copies in a few multi-tensor launches (x * 1 is x, bit for bit), not one clone per parameter
        present = [g for g in e.grads if g is not None]
        copies = iter(torch._foreach_mul(present, 1.0)) if present else iter(())
        return (None, None, *(None if g is None else next(copies) for g in e.grads))


class MicroBatchGraphs:
    """Static input buffers and the captured graphs of one model (module docstring).

    ``model``: a :class:`rlperf.model.qwen3.Qwen3ForCausalLM` on a CUDA device (its weights are
    read in place: the trainer's in-place weight updates reach the graphs); ``buckets``: token
    counts (:func:`rlperf.flags.check_token_buckets`); ``temperature``: the log-probs' temperature (a launch argument
    the graphs freeze); ``log_probs_fn(model, mb, temperature, with_entropy)``: the micro-batch's
    log-probs (default :func:`rlperf.train.batching.micro_batch_log_probs`); ``backward_side``: see
    :class:`BackwardSide` (module docstring)."""

    def __init__(self, model, buckets: Sequence[int], temperature: float, log_probs_fn=None,
                 backward_side: BackwardSide | None = None):
        dev = model.head_weight.device
        if dev.type != "cuda":
            raise ValueError(f"{FLAG} replays CUDA graphs: it needs a CUDA device, the model is on {dev}")
        self.model, self.buckets, self.temperature = model, check_token_buckets(buckets), float(temperature)
        self.log_probs_fn = log_probs_fn or micro_batch_log_probs
        self.backward_side = backward_side
        top = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids, self.positions = torch.zeros(top, **i64), torch.zeros(top, **i64)
        self.logit_rows, self.targets = torch.zeros(top, **i64), torch.zeros(top, **i64)
        self.cu_seqlens = torch.zeros(seq_slots(top) + 1, dtype=torch.int32, device=dev)
        self.log_prob_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.train_graphs: dict[tuple, _TrainGraph] = {}
        self.failed: dict[tuple, str] = {}  # keys (of either kind) whose capture raised -> the error: run eagerly
        self._pool = None

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket >= ``num_tokens``; ValueError naming :data:`FLAG` when none is."""
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"a micro-batch of {num_tokens} tokens exceeds the largest {FLAG} bucket "
                         f"({self.buckets[-1]}): add a larger bucket or lower --max-tokens-per-gpu")

    def shape_of(self, mb: MicroBatch) -> tuple[int, int]:
        """(bucket, sequence slots) of ``mb``: what its graphs are keyed by and it is padded to."""
        bucket = self.bucket(mb.num_tokens)
        return bucket, seq_slots(bucket, mb.cu_seqlens.numel() - 1)

    def _static(self, bucket: int, slots: int) -> MicroBatch:
        return MicroBatch([], self.input_ids[:bucket], self.positions[:bucket], self.cu_seqlens[:slots + 1],
                          self.logit_rows[:bucket], self.targets[:bucket], [])

    def _load(self, mb: MicroBatch) -> tuple[tuple[int, int], MicroBatch, MicroBatch]:
        """Pad ``mb`` to its shape and copy it into the static buffers; ((bucket, slots), the padded
        micro-batch (fresh tensors: what a failed key's eager step runs on), the static view)."""
        bucket, slots = self.shape_of(mb)
        padded = pad_micro_batch(mb.to(self.input_ids.device), bucket, slots)
        static = self._static(bucket, slots)
        for name in ("input_ids", "positions", "cu_seqlens", "logit_rows", "targets"):
            getattr(static, name).copy_(getattr(padded, name))
        return (bucket, slots), padded, static

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @staticmethod
    def _warm_up(body, times: int = 2) -> None:
        """``body()`` run ``times`` times on a side stream before a capture (Triton compilation,
        allocator growth), the current stream waiting for it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(times):
                body()
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self, body):
        """``body()`` warmed up (:meth:`_warm_up`), then captured into a new graph in the shared pool;
        (graph, what the captured call returned)."""
        self._warm_up(body)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            out = body()
        self._pool = graph.pool()
        return graph, out

    @torch.no_grad()
    def log_probs(self, mb: MicroBatch, with_entropy: bool = False):
        """``micro_batch_log_probs(model, mb, temperature, with_entropy)`` without grad, replayed (eagerly on
        the padded micro-batch where the key's capture failed): log-probs [sum R_i] float32 (and entropy),
        fresh tensors."""
        shape, padded, static = self._load(mb)
        key = (K.mode(), *shape, with_entropy)
        if key not in self.log_prob_graphs and key not in self.failed:
            def once():
                self.log_prob_graphs[key] = self._capture(
                    lambda: self.log_probs_fn(self.model, static, self.temperature, with_entropy=with_entropy))

            capture_or_fall_back(self.failed, key, "log-prob pass", once, FALL_BACK_HINT)
        if key in self.log_prob_graphs:
            graph, out = self.log_prob_graphs[key]
            graph.replay()
        else:
            out = self.log_probs_fn(self.model, padded, self.temperature, with_entropy=with_entropy)
        n = sum(mb.response_lengths)
        if with_entropy:
            return out[0][:n].clone(), out[1][:n].clone()
        return out[:n].clone()

    def log_probs_with_grad(self, mb: MicroBatch):
        """(log-probs, entropy) [sum R_i] float32 of ``mb`` with grad to every trainable parameter:
        the forward graph now, the backward graph when autograd reaches them. Where the key's capture
        failed: the eager forward on the padded micro-batch, and autograd's own backward."""
        shape, padded, static = self._load(mb)
        key = (K.mode(), *shape)
        if key not in self.train_graphs and key not in self.failed:
            def once():
                self.train_graphs[key] = self._capture_train(static)

            capture_or_fall_back(self.failed, key, "train micro-step", once, FALL_BACK_HINT)
        n = sum(mb.response_lengths)
        if key in self.train_graphs:
            return _ReplayedLogProbs.apply(self.train_graphs[key], n, *self._params())
        log_probs, entropy = self.log_probs_fn(self.model, padded, self.temperature, with_entropy=True)
        return log_probs[:n], entropy[:n]

    def _capture_train(self, static: MicroBatch) -> _TrainGraph:
        bucket = static.num_tokens
        f32 = dict(dtype=torch.float32, device=self.input_ids.device)
        grad_log_probs, grad_entropy = torch.zeros(bucket, **f32), torch.zeros(bucket, **f32)
        log_probs_of = _LogProbsThrough(self.model, static, self.temperature, self.log_probs_fn)
        side = self.backward_side
        kept = side.stash() if side is not None else None  # the trainer's value so far: not the warm-up's

        def forward(leaves):
            return log_probs_of(leaves)

        def backward(outs, leaves):
            return torch.autograd.grad(outs, leaves, (grad_log_probs, grad_entropy), allow_unused=True)

        def step():
            leaves = log_probs_of.fresh_leaves()
            return backward(forward(leaves), leaves)

        try:
            with torch.enable_grad():
                self._warm_up(step)  # the forward and the backward kernels
                torch.cuda.synchronize()
                if side is not None:
                    side.stash()  # what the warm-up's backwards wrote: dropped
                leaves = log_probs_of.fresh_leaves()  # their gradient accumulators are made during the capture
                fwd = torch.cuda.CUDAGraph()
                with capturing(fwd, self._pool):
                    outs = forward(leaves)
                self._pool = fwd.pool()
                bwd = torch.cuda.CUDAGraph()
                with capturing(bwd, self._pool):
                    grads = backward(outs, leaves)
        except BaseException:
            if side is not None:
                side.restore(kept)  # the trainer's value, for the eager step that runs instead
            raise
        side_grad = None
        if side is not None:
            side_grad = side.stash()  # the capture's backward wrote it: the static output
            side.restore(kept)
        log_probs, entropy = (o.detach() for o in outs)
        return _TrainGraph(fwd, bwd, log_probs, entropy, grad_log_probs, grad_entropy, tuple(grads), side, side_grad)


class _LogProbsThrough(torch.nn.Module):
    """``log_probs_fn(model, static, temperature, with_entropy=True)`` with the trainable
    parameters replaced by given leaf tensors that alias their storage (``torch.func.functional_call``).

    Why not the parameters themselves: autograd keeps one gradient accumulator per parameter, made on
    the stream current when the parameter first entered a graph (an eager step: the default stream)
    and kept alive by any graph still referenced, such as a caller's log-probs of an earlier micro-batch.
    A backward captured through such an accumulator makes the default (legacy) stream wait on the
    capture, which invalidates it (cudaErrorStreamCaptureImplicit). Fresh leaves made for the capture
    get their accumulators on the capture stream; they share the parameters' storage, so the graphs
    still read the weights the optimizer updates in place."""

    def __init__(self, model, static: MicroBatch, temperature: float, log_probs_fn=None):
        super().__init__()
        self.model, self.static, self.temperature = model, static, temperature
        self.log_probs_fn = log_probs_fn or micro_batch_log_probs
        self.names = [f"model.{n}" for n, p in model.named_parameters() if p.requires_grad]

    def fresh_leaves(self) -> list[torch.Tensor]:
        """A new leaf per trainable parameter: same storage, ``requires_grad``, no autograd history."""
        return [p.detach().requires_grad_() for p in self.model.parameters() if p.requires_grad]

    def forward(self, leaves: Sequence[torch.Tensor] | None = None):
        if leaves is None:
            return self.log_probs_fn(self.model, self.static, self.temperature, with_entropy=True)
        return torch.func.functional_call(self, dict(zip(self.names, leaves)), ())
