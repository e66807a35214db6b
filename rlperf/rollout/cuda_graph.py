"""Engine steps replayed from CUDA graphs: decode steps padded to a few batch sizes (:class:`DecodeGraphs`,
SGLang's ``--cuda-graph-max-bs``) and steps with prefill chunks padded to token buckets
(:class:`PrefillGraphs`, ``--cuda-graph-max-prefill-tokens``; its own docstring). Both capture through
:func:`capture`. The rest of this docstring is the decode graphs'.

Why: a decode step of a 28-layer model is some 400 small kernel launches issued from Python; at
batch 1-64 that host time is larger than the memory-bound work itself. Capturing
``hidden = forward_paged(...)`` and ``logits(hidden)`` once per batch-size bucket and replaying it
removes the launch and dispatch cost; only the inputs are copied into static buffers per step. Both
are static outputs: the logits for sampling, the final hidden rows for the sampled tokens' log-probs
(``fused_logprob``, run after the replay: one launch per temperature group, and the temperature is
a launch argument a graph would freeze).

Bits: the graph replays the same kernels with the same launch configs as the eager step. A batch of
B decodes runs padded to its bucket size Bp >= B; a padding row has ``slot = -1`` (its K/V are not
written), ``kv_len = 1`` over page 0 (it reads one finite cached value, never writes) and its
outputs are dropped. Every op is row-invariant, so the B real rows get the bits of the eager,
unpadded step (tests/rollout/test_engine.py checks the padded path on CPU; the GPU test compares
replayed graphs against the eager engine).

Modes: graphs are kept per (mode, bucket) — a graph replays the kernels of the mode it was captured
in, so a mode switch captures anew rather than replaying the other mode's kernels. Both modes
capture: fast mode's decode is cuBLAS plus rlperf's paged-decode kernel, with no host sync.

Attention: rlperf's paged-decode kernel, or in fast mode with ``attention`` (the engine's FlashInfer
backend, ``rlperf.rollout.flashinfer_attention``) a FlashInfer decode wrapper per bucket, planned
before the capture and before every replay (FlashInfer's graph mode: the plan writes the page-table
buffers the captured kernels read).

Failures: a capture that raises (an op that cannot be captured, memory the graph's pool cannot get) is
logged and recorded in the graphs' ``failed`` (``Engine.graph_failures``, the server's
``cuda_graph_failures``), and that key's steps run eagerly over the same padded buffers, with the same bits
(:func:`rlperf.graph_capture.capture_or_fall_back`); it is not captured again.

Limits: pure decode steps only (a step with a prefill chunk runs eagerly or from a prefill graph), batches
up to ``max_bs``. On a CPU
device nothing is captured: the padded static-buffer path runs eagerly (that is what the CPU
tests exercise).
"""
from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch

from rlperf import kernels as K
from rlperf.graph_capture import capture_or_fall_back, capturing

from .flashinfer_attention import for_this_mode

DEFAULT_MAX_BS = 256
"""``--cuda-graph-max-bs`` on a CUDA device when not given: ``rlperf serve`` and the loop's in-process engine."""


def default_max_bs(device) -> int:
    """:data:`DEFAULT_MAX_BS` on a CUDA device, 0 (eager, nothing to capture) elsewhere."""
    return DEFAULT_MAX_BS if torch.device(device).type == "cuda" else 0


BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture(forward, pool=None):
    """``(graph, out, pool)``: ``out = forward()`` captured in a CUDA graph whose memory comes from ``pool``
    (None: a new private pool; returned, for the next capture to share). ``forward`` runs twice on a side
    stream first, so every kernel is compiled and warm outside the capture. A capture that raises leaves the
    stream and the allocator as they were (:func:`rlperf.graph_capture.capturing`) and re-raises.

    Python's cyclic garbage collector stays off during the capture: an engine dropped earlier (engines hold
    reference cycles) would otherwise be collected at any allocation inside it, and destroying its graphs
    or freeing its pinned buffers there invalidates the capture (measured: the GPU test of two engines in
    a row failed so). It collects first instead, which also returns their memory before this graph's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    graph = torch.cuda.CUDAGraph()
    try:
        with capturing(graph, pool):
            out = forward()
    finally:
        if collecting:
            gc.enable()
    return graph, out, graph.pool()


class DecodeGraphs:
    """Static buffers and one captured graph per batch-size bucket (captured on first use, or all at
    once by :meth:`capture_all`)."""

    def __init__(self, model, kv_layers, max_bs: int, max_pages: int, attention=None, logits_wanted=None):
        """``logits_wanted``: a function saying whether a step now needs the [B, V] logits (each graph is
        captured with them or without, the engine's ``fused_sampling`` leaves them out); None: always."""
        if max_bs <= 0:
            raise ValueError(f"max_bs must be positive, got {max_bs}")
        self.model, self.kv_layers = model, kv_layers
        self.attention = attention  # FlashInferAttention (fast mode only), or None
        self.logits_wanted = logits_wanted or (lambda: True)
        self.buckets = sorted({b for b in BUCKETS if b < max_bs} | {max_bs})
        self.max_bs, self.max_pages = max_bs, max_pages
        dev = model.device
        self.capture = dev.type == "cuda"
        i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
        # the step's inputs live in two device buffers (int64 rows ids, pos, slots, kv_lens; the int32
        # page table) filled from pinned host staging by one asynchronous copy each (run()); the
        # graphs read views of them
        self.rows = torch.zeros(4, max_bs, **i64)
        self.ids, self.pos, self.slots, self.kv_lens64 = self.rows.unbind(0)
        self.table = torch.zeros(max_bs, max_pages, **i32)
        self.kv_lens = torch.ones(max_bs, **i32)
        self.slots.fill_(-1)
        self.kv_lens64.fill_(1)
        self.cu = torch.arange(max_bs + 1, **i32)
        pinned = self.capture
        self._host_rows = torch.empty(4, max_bs, dtype=torch.int64, pin_memory=pinned)
        self._host_table = torch.zeros(max_bs, max_pages, dtype=torch.int32, pin_memory=pinned)
        self._copied = None  # CUDA event: the last step's staging copies are done
        # (mode, bucket, with logits) -> the graph and its outputs (hidden, logits or None)
        self.graphs: dict[tuple[str, int, bool], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.failed: dict[tuple[str, int, bool], str] = {}  # keys whose capture raised (the error): run eagerly
        self._pool = None

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def _forward(self, bs: int, logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.model
        self.kv_lens[:bs].copy_(self.kv_lens64[:bs])  # int64 staging row -> the kernels' int32 (captured)
        hidden = m.forward_paged(self.ids[:bs], self.pos[:bs], self.kv_layers, self.slots[:bs], self.table[:bs],
                                 self.cu[: bs + 1], self.kv_lens[:bs], attention=for_this_mode(self.attention))
        return hidden, (m.logits(hidden) if logits else None)

    def _key(self, bs: int) -> tuple[str, int, bool]:
        return K.mode(), bs, bool(self.logits_wanted())

    def _capture(self, bs: int) -> bool:
        """Capture bucket ``bs``'s graph for the current key; False when the capture failed
        (:func:`rlperf.graph_capture.capture_or_fall_back`)."""
        attention = for_this_mode(self.attention)
        if attention is not None:  # captured over padding rows' plan (capture_all's inputs)
            attention.plan_graph(bs, [], [])
        key = self._key(bs)

        def once():
            graph, out, self._pool = capture(lambda: self._forward(bs, key[2]), self._pool)
            self.graphs[key] = (graph, out)

        return capture_or_fall_back(self.failed, key, "decode step", once)

    def capture_all(self) -> int:
        """Capture every bucket's graph for the current mode now (``rlperf serve``'s warm-up), so no
        request pays a capture; returns how many were captured. On a CPU device: nothing to capture.

        Every row of these captures is a padding row (``slot = -1``, ``kv_len = 1`` over page 0), so
        the eager passes before each capture write no K/V. A bucket whose capture fails is left to run
        eagerly (:attr:`failed`) and not counted.
        """
        if not self.capture:
            return 0
        self.ids.zero_()
        self.pos.zero_()
        self.slots.fill_(-1)
        self.table.zero_()
        self.kv_lens64.fill_(1)
        todo = [bs for bs in self.buckets if self._key(bs) not in self.graphs and self._key(bs) not in self.failed]
        # largest first: the shared pool is sized once by the biggest graph
        return sum(self._capture(bs) for bs in reversed(todo))

    def run(self, ids: list[int] | torch.Tensor, pos: list[int], slots: list[int], table: list[list[int]],
            kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden [B, H], logits [B, V] float32)`` of a decode step of B = len(ids) sequences (one new
        token each): the final hidden rows (after the final norm) and their lm-head logits (None where
        ``logits_wanted()`` says the step does without them). ``ids``: a
        list, or an int64 tensor [B] on the model's device (the previous step's sampled tokens, copied
        on the device: the engine's overlap, ``rlperf.rollout.engine``).

        The results are views of static buffers: read them before the next call (kernels queued on the
        same stream before the next call read what this call wrote).
        """
        B = len(ids)
        on_device = isinstance(ids, torch.Tensor)
        bs = self.bucket(B)
        if bs is None:
            raise ValueError(f"decode graphs take 1..{self.max_bs} sequences, got {B}")
        pad = bs - B
        width = max(len(r) for r in table)
        if width > self.max_pages:
            raise ValueError(f"a sequence holds {width} pages; the graphs were sized for {self.max_pages}")
        # pinned staging -> device, one asynchronous copy per buffer; the staging is reused only after
        # the previous step's copies are done (their event), never while the GPU may still read it
        if self._copied is not None:
            self._copied.synchronize()
        self._host_rows[:, :bs] = torch.tensor([[0] * bs if on_device else ids + [0] * pad, pos + [0] * pad,
                                                slots + [-1] * pad, kv_lens + [1] * pad], dtype=torch.int64)
        # only the columns this step can read are written: a row reads its first cdiv(kv_len, P) <= width
        # entries (a padding row its first, page 0), so what earlier steps left past `width` is never
        # read. Zeroing the whole [bs, max_pages] staging every step cost 2.6 ms of a 10.3 ms B = 256
        # step (H200 host, cProfile); the device copy below stays one contiguous copy of the buffer.
        self._host_table[:bs, :width] = torch.tensor([r + [0] * (width - len(r)) for r in table] + [[0] * width] * pad,
                                                     dtype=torch.int32)
        self.rows.copy_(self._host_rows, non_blocking=True)  # whole buffers: contiguous, a few KiB
        self.table.copy_(self._host_table, non_blocking=True)
        if on_device:
            self.ids[:B].copy_(ids)  # after the staging copy, which wrote zeros there
        if self.capture:
            self._copied = torch.cuda.Event()
            self._copied.record()
        attention = for_this_mode(self.attention)
        if attention is not None:
            attention.plan_graph(bs, table, kv_lens)
        key = self._key(bs)
        if key not in self.graphs and self.capture and key not in self.failed:
            self._capture(bs)
            if attention is not None:  # the capture planned padding rows: this step's plan again
                attention.plan_graph(bs, table, kv_lens)
        if key not in self.graphs:  # a CPU device, or a failed capture: the padded step, eagerly
            hidden, logits = self._forward(bs, key[2])
            return hidden[:B], (None if logits is None else logits[:B])
        graph, (hidden, logits) = self.graphs[key]
        graph.replay()
        return hidden[:B], (None if logits is None else logits[:B])


# ---- steps with prefill chunks ------------------------------------------------------------------

MIN_PREFILL_BUCKET = 64
"""The smallest token bucket of :class:`PrefillGraphs`: a shorter step runs padded to it."""

DEFAULT_PREFILL_CHUNK = 8192
"""The prefill tokens a step is taken to hold when chunking is off (``chunked_prefill_size <= 0``), for
:func:`default_max_prefill_tokens`; a longer step then runs eagerly."""


def default_max_prefill_tokens(device, chunked_prefill_size: int, max_running_requests: int) -> int:
    """``--cuda-graph-max-prefill-tokens`` when not given: on a CUDA device the most tokens a step can
    hold, a prefill chunk plus one decode row per other running request (``chunked_prefill_size``, or
    :data:`DEFAULT_PREFILL_CHUNK` without chunking, + ``max_running_requests``); 0 (eager) elsewhere."""
    if torch.device(device).type != "cuda":
        return 0
    chunk = chunked_prefill_size if chunked_prefill_size > 0 else DEFAULT_PREFILL_CHUNK
    return chunk + max_running_requests


PDL_MAX_TOKENS = 1024
"""Steps of more tokens than this launch their kernels plainly, without programmatic dependent launch
(:func:`step_launches`). PDL shortens the gaps between the short kernels of a decode step (1.02-1.13x
faster on an H200, docs/kernels.md), but a prefill's kernels run several waves each, and there it costs:
replaying each token bucket's graph with and without PDL (H200, 2026-11-30), plain launches took 1.02x
PDL's time at 512 tokens, 1.00x at 1,024, 0.89x at 2,048 and 0.82x at 8,192 (18.36 against 22.35 ms)."""


def step_launches(num_tokens: int):
    """The launches of an engine step of ``num_tokens`` tokens: plain launches (PDL switched off for the
    block, process-wide) above :data:`PDL_MAX_TOKENS`; otherwise the process's switch as it is."""
    return K.use_programmatic_launch(False) if num_tokens > PDL_MAX_TOKENS else contextlib.nullcontext()


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to ``max_tokens``: the powers of two from :data:`MIN_PREFILL_BUCKET` and the
    midpoints 1.5x each (a step pads at most 50%, one of more than 64 tokens at most 33%), then
    ``max_tokens`` itself."""
    out, b = [], MIN_PREFILL_BUCKET
    while b < max_tokens:
        out.append(b)
        if b + b // 2 < max_tokens:
            out.append(b + b // 2)
        b *= 2
    return out + [max_tokens]


def prefill_seq_slots(num_seqs: int, max_slots: int) -> int:
    """Sequence slots of a graph for ``num_seqs`` sequences plus the padding sequence: the next power of
    two >= ``num_seqs + 1``, at least 8, at most ``max_slots``. Each slot costs every attention launch a
    program per KV head (an empty one exits at once) and the page table a row, hence powers of two rather
    than one size for all."""
    slots = 8
    while slots < num_seqs + 1:
        slots *= 2
    return min(slots, max_slots)


class PrefillGraphs:
    """Engine steps that carry prefill chunks (any step the decode graphs do not take), replayed from CUDA
    graphs padded to token buckets (:func:`prefill_buckets`), one graph per (kernel mode, bucket, sequence
    slots), captured on first use.

    Why: an eager step launches ~9 kernels a layer from Python, ~100 us of host time each (the op's
    checks and Triton's launch path). For a 28-layer model that is ~25 ms a step whatever its size, longer
    than the GPU's work for a prefill of 16 x 512 tokens (bench/BENCHMARKS.md). A replay is one launch.

    What a graph computes: ``model.forward_paged`` over ``bucket`` tokens in ``slots`` sequences, the final
    hidden rows [bucket, H] as its static output. :meth:`run` returns the rows the step samples from
    (gathered after the replay by an index staged with the inputs: no host sync), for the engine's lm head
    and sampler (a few launches over a few rows, queued while the graph runs).

    Padding: the step's T tokens of S sequences, then ``bucket - T`` padding tokens as one more sequence
    (``slot = -1``: their K/V are not stored; ``kv_len`` = their count over page 0, so they attend to
    finite cached values and never write), then empty sequences up to ``slots`` (no query: their programs
    exit at once). In invariant mode every kernel is row invariant (``rlperf.kernels``) and attention reads
    only a sequence's own pages, so the T real rows get the bits of the eager, unpadded step; padding rows
    are dropped. Fast mode promises no such bits: its cuBLAS products (above ``FAST_MODE_KERNEL_ROWS`` rows)
    may pick another kernel for the padded row count, so a replayed fast step can differ from the eager one
    in the last bits. tests/rollout/test_engine.py checks the padded path on CPU, where it runs eagerly
    (nothing is captured); the GPU tests compare replayed steps with eager ones.

    Launches: a bucket above :data:`PDL_MAX_TOKENS` is captured with plain launches (:func:`step_launches`).

    Limits: no routing record, no FlashInfer plan (the engine checks both), steps of at most ``max_tokens``
    tokens (longer ones run eagerly). Both kernel modes: on CUDA a fast-mode step's ops are kernels and
    cuBLAS products that read no length on the host (its paged attention is rlperf's kernel there, and a MoE
    block is ``torch._grouped_mm`` in bf16 or the kernels: ``kernels/moe.py``).
    Memory: the graphs share one private pool, sized by the largest captured bucket (about one eager step's
    activations).
    """

    def __init__(self, model, kv_layers, max_tokens: int, max_seqs: int, max_pages: int):
        if max_tokens <= 0 or max_seqs <= 0:
            raise ValueError(f"max_tokens and max_seqs must be positive, got {max_tokens} and {max_seqs}")
        self.model, self.kv_layers = model, kv_layers
        self.buckets = prefill_buckets(max_tokens)
        # the table is wide enough for a sequence's pages and for the padding sequence's (up to a bucket of
        # tokens over page 0): a short context must not limit the padding
        self.page_size = kv_layers[0][0].shape[1]
        self.max_tokens, self.max_pages = max_tokens, max(max_pages, -(-max_tokens // self.page_size))
        self.max_slots = prefill_seq_slots(max_seqs, 1 << 30)
        dev = model.device
        self.capture = dev.type == "cuda"
        # the step's inputs: int64 rows (ids, positions, slots) [3, max_tokens]; int32 sequences [3, max_slots
        # + 1]: cu_seqlens [slots + 1], kv_lens [slots], the sampled rows; the int32 page table [max_slots,
        # max_pages]; each filled from pinned host staging (written through numpy views: a list of 8k ints
        # goes in 3x faster than through torch.tensor) by one asynchronous copy; the graphs read views of them
        self.rows = torch.zeros(3, max_tokens, dtype=torch.int64, device=dev)
        self.seqs = torch.zeros(3, self.max_slots + 1, dtype=torch.int32, device=dev)
        self.table = torch.zeros(self.max_slots, self.max_pages, dtype=torch.int32, device=dev)
        pinned = self.capture
        self._host_rows = torch.zeros(3, max_tokens, dtype=torch.int64, pin_memory=pinned)
        self._host_seqs = torch.zeros(3, self.max_slots + 1, dtype=torch.int32, pin_memory=pinned)
        self._host_table = torch.zeros(self.max_slots, self.max_pages, dtype=torch.int32, pin_memory=pinned)
        self._rows_np, self._seqs_np = self._host_rows.numpy(), self._host_seqs.numpy()
        self._copied = None  # CUDA event: the last step's staging copies are done
        self.graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: dict[tuple[str, int, int], str] = {}  # keys whose capture raised (the error): run eagerly
        self._pool = None

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def takes(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a step of ``num_tokens`` tokens in ``num_seqs`` sequences fits a graph."""
        return num_tokens <= self.max_tokens and num_seqs < self.max_slots

    def _forward(self, bucket: int, slots: int) -> torch.Tensor:
        ids, pos, slot_mapping = self.rows[:, :bucket].unbind(0)
        cu, kv_lens = self.seqs[0, : slots + 1], self.seqs[1, :slots]
        return self.model.forward_paged(ids, pos, self.kv_layers, slot_mapping, self.table[:slots], cu, kv_lens)

    def run(self, chunks: list[tuple[list[int], int, list[int]]], sample_rows: list[int]) -> torch.Tensor:
        """Final hidden rows [R, H] (after the final norm) at ``sample_rows`` (R of them, indices into the
        step's T tokens) of an engine step over S = len(chunks) sequences. ``chunks``: per sequence, in the
        step's order, (its new token ids [n], the position of the first, its KV pages): the sequence's
        queries are positions ``start .. start + n - 1``, its ``kv_len`` is ``start + n`` and token ``p``
        sits in slot ``pages[p // P] * P + p % P``. A new tensor; the step's other rows stay in the graph's
        static buffer.
        """
        S, R = len(chunks), len(sample_rows)
        T = sum(len(c[0]) for c in chunks)
        bucket = self.bucket(T)
        if bucket is None or not self.takes(T, S):
            raise ValueError(f"prefill graphs take up to {self.max_tokens} tokens in {self.max_slots - 1} "
                             f"sequences, got {T} in {S}")
        nslots, pad = prefill_seq_slots(S, self.max_slots), bucket - T
        P = self.page_size
        width = max(max(len(c[2]) for c in chunks), -(-pad // P))  # the padding sequence reads cdiv(pad, P) pages
        if width > self.max_pages:
            raise ValueError(f"a sequence holds {width} pages; the graphs were sized for {self.max_pages}")
        # pinned staging -> device; the staging is reused only after the previous step's copies are done
        if self._copied is not None:
            self._copied.synchronize()
        rows, seqs = self._rows_np, self._seqs_np
        # a chunk's rows as numpy segments; one-token rows (decodes) gathered into one indexed write
        singles: list[list[int]] = [[], [], [], []]  # row, id, position, slot
        off = 0
        for b, (tokens, start, pages) in enumerate(chunks):
            n = len(tokens)
            if n == 1:
                for col, v in zip(singles, (off, tokens[0], start, pages[start // P] * P + start % P)):
                    col.append(v)
            else:
                p = np.arange(start, start + n)
                rows[0, off:off + n] = tokens
                rows[1, off:off + n] = p
                rows[2, off:off + n] = np.asarray(pages, dtype=np.int64)[p // P] * P + p % P
            seqs[0, b] = off
            seqs[1, b] = start + n
            off += n
        if singles[0]:
            rows[:, singles[0]] = singles[1:]
        rows[:2, T:bucket] = 0
        rows[2, T:bucket] = -1
        seqs[0, S: nslots + 1] = [T] + [bucket] * (nslots - S)  # the padding sequence, then empty ones
        seqs[1, S] = pad
        seqs[1, S + 1: nslots] = 0
        seqs[2, :R] = sample_rows
        # only the columns this step can read are written (a sequence reads its first cdiv(kv_len, P)
        # entries, at most `width`), as in DecodeGraphs.run; the padding sequence's row is page 0
        self._host_table[:nslots, :width] = torch.tensor(
            [c[2] + [0] * (width - len(c[2])) for c in chunks] + [[0] * width] * (nslots - S), dtype=torch.int32)
        self.rows.copy_(self._host_rows, non_blocking=True)
        self.seqs.copy_(self._host_seqs, non_blocking=True)
        self.table[:nslots].copy_(self._host_table[:nslots], non_blocking=True)  # contiguous rows
        key = (K.mode(), bucket, nslots)
        if self.capture:
            self._copied = torch.cuda.Event()
            self._copied.record()
            if key not in self.graphs and key not in self.failed:
                def once():
                    graph, out, self._pool = capture(lambda: self._forward(bucket, nslots), self._pool)
                    self.graphs[key] = (graph, out)

                with step_launches(bucket):
                    capture_or_fall_back(self.failed, key, "prefill step", once)
        if key in self.graphs:
            graph, hidden = self.graphs[key]
            graph.replay()
        else:  # a CPU device, or a failed capture: the padded step, eagerly
            with step_launches(bucket):
                hidden = self._forward(bucket, nslots)
        return hidden[self.seqs[2, :R]]
