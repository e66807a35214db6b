"""FlashInfer's paged attention for the engine's fast mode (``rlperf serve --mode fast --attention-backend
flashinfer``), the attention SGLang runs by default.

Only fast mode uses it: in invariant mode the engine keeps rlperf's paged-attention kernel, whose bits
are the trainer's (a FlashInfer row depends on the batch's split-KV schedule). The engine's model calls
``attention(q, k_cache, v_cache)`` in place of :func:`rlperf.kernels.paged_attention` in every layer of
a step (``Qwen3ForCausalLM.forward_paged(..., attention=...)``), after one plan per step:

* :meth:`FlashInferAttention.plan_step` (an eager step): a decode-only batch (one query per sequence)
  plans ``BatchDecodeWithPagedKVCacheWrapper``, any other batch (prefill chunks, mixed)
  ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (FlashInfer aligns a sequence's
  ``qo_len`` queries to the end of its ``kv_len`` keys, as rlperf's kernel does);
* :meth:`FlashInferAttention.plan_graph` (a CUDA-graph replay of the decode bucket ``bs``): a decode
  wrapper of its own per bucket, made with ``use_cuda_graph=True`` and fixed page-table buffers
  (``bs + 1``, ``bs * max_pages``, ``bs`` int32), planned before the capture and before every replay;
  padding rows (the graphs' ``kv_len = 1`` over page 0) are planned as one-token sequences.

The page table reaches FlashInfer in its CSR form (:func:`paged_kv_layout`): rlperf's cache is
``[num_pages, page_size, Hkv, D]`` per layer for K and for V (FlashInfer's ``NHD`` layout, passed as
the ``(k_cache, v_cache)`` tuple); sequence ``b`` with ``kv_len`` tokens uses the first
``ceil(kv_len / page_size)`` pages of its row, the last holding ``(kv_len - 1) % page_size + 1``.
Tensor cores decode when ``Hq / Hkv >= 4``, as SGLang picks them. FlashInfer compiles each new kernel
with nvcc on first use (1-3 minutes, cached under ``~/.cache/flashinfer``): the server's warm-up pays it.
"""
from __future__ import annotations

import torch

from rlperf import kernels as K

WORKSPACE_BYTES = 128 << 20
"""FlashInfer's float workspace (split-KV partial results), shared by the engine's wrappers: they run
one after the other on one stream (the benches' anchors take one of this size per wrapper)."""
NOT_INSTALLED = "flashinfer not installed"
"""Why FlashInfer cannot run where ``import flashinfer`` fails for want of the package."""


class FlashInferUnavailable(RuntimeError):
    """``--attention-backend flashinfer`` cannot run here; the message says why (no CUDA, not installed,
    an import error)."""


def import_flashinfer():
    """The ``flashinfer`` module, or :class:`FlashInferUnavailable` naming why it cannot load."""
    try:
        import flashinfer
    except ModuleNotFoundError as exc:
        if exc.name == "flashinfer":
            raise FlashInferUnavailable(NOT_INSTALLED) from None
        raise FlashInferUnavailable(f"flashinfer cannot be imported: {exc}") from None
    except (ImportError, OSError, RuntimeError) as exc:
        raise FlashInferUnavailable(f"flashinfer cannot be imported: {exc}") from None
    return flashinfer


def for_this_mode(attention):
    """``attention`` where the current kernel mode uses it (fast mode), else None: invariant mode's
    attention is rlperf's kernel (module docstring). The engine's eager steps and its decode graphs ask."""
    return attention if attention is not None and K.mode() == "fast" else None


def check_serve_flags(mode: str, device: str) -> None:
    """``rlperf serve --attention-backend flashinfer``'s checks before anything starts: ValueError for
    a mode other than ``fast``, :class:`FlashInferUnavailable` without CUDA or FlashInfer."""
    if mode != "fast":
        raise ValueError(f"runs with --mode fast only (got --mode {mode}): invariant mode's attention is rlperf's "
                         "kernel, whose bits are the trainer's")
    cuda = torch.cuda.is_available() if device == "auto" else torch.device(device).type == "cuda"
    if not cuda:
        raise FlashInferUnavailable(f"FlashInfer attention runs on CUDA devices (--device {device}"
                                    f"{', no CUDA here' if device == 'auto' else ''})")
    import_flashinfer()


def paged_kv_layout(table: list[list[int]], kv_lens: list[int], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer's CSR description of rlperf's page table: ``(indptr [B + 1], indices [indptr[-1]],
    last_page_len [B])`` for sequences whose pages are ``table[b]`` (in order, possibly padded past the
    used ones) and whose lengths are ``kv_lens[b] >= 1`` tokens (module docstring)."""
    if len(table) != len(kv_lens):
        raise ValueError(f"{len(table)} page-table rows for {len(kv_lens)} sequences")
    indptr, indices, last = [0], [], []
    for b, (pages, n) in enumerate(zip(table, kv_lens)):
        used = -(-n // page_size)
        if n < 1 or used > len(pages):
            raise ValueError(f"sequence {b}: kv_len {n} needs {used} page(s) of {page_size}, its row holds {len(pages)}")
        indices.extend(pages[:used])
        indptr.append(indptr[-1] + used)
        last.append((n - 1) % page_size + 1)
    return indptr, indices, last


class FlashInferAttention:
    """The engine's FlashInfer wrappers and the plan of the current step (module docstring).

    ``cfg``: the model config (heads, head_dim); ``max_pages``: the decode graphs' page-table width (their
    per-bucket wrappers are made on first use; 0: no graph plans); ``fi``: the flashinfer module
    (default: imported here; tests pass a stand-in)."""

    def __init__(self, cfg, page_size: int, dtype: torch.dtype, device, max_pages: int = 0, fi=None):
        device = torch.device(device)
        if fi is None:
            if device.type != "cuda":
                raise FlashInferUnavailable(f"FlashInfer attention runs on CUDA devices, not {device}")
            fi = import_flashinfer()
        self.fi, self.device, self.dtype, self.page_size, self.max_pages = fi, device, dtype, page_size, max_pages
        self.heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.tensor_cores = cfg.num_attention_heads // cfg.num_key_value_heads >= 4
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = fi.decode.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                   use_tensor_cores=self.tensor_cores)
        self.prefill = fi.prefill.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.graph_decode: dict[int, object] = {}
        self.active = None

    def _int32(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _plan_decode(self, wrapper, table, kv_lens) -> None:
        indptr, indices, last = paged_kv_layout(table, kv_lens, self.page_size)
        hq, hkv, d = self.heads
        wrapper.plan(self._int32(indptr), self._int32(indices), self._int32(last), hq, hkv, d, self.page_size,
                     q_data_type=self.dtype, kv_data_type=self.dtype)
        self.active = wrapper

    def plan_step(self, table: list[list[int]], cu_seqlens_q: list[int], kv_lens: list[int]) -> None:
        """Plan an eager step: ``table`` (each sequence's pages), ``cu_seqlens_q [B + 1]`` (its queries
        are the last ``cu[b + 1] - cu[b]`` of its ``kv_lens[b]`` tokens)."""
        if cu_seqlens_q[-1] == len(kv_lens):  # one query per sequence: a decode step
            self._plan_decode(self.decode, table, kv_lens)
            return
        indptr, indices, last = paged_kv_layout(table, kv_lens, self.page_size)
        hq, hkv, d = self.heads
        self.prefill.plan(self._int32(cu_seqlens_q), self._int32(indptr), self._int32(indices), self._int32(last),
                          hq, hkv, d, self.page_size, causal=True, q_data_type=self.dtype, kv_data_type=self.dtype)
        self.active = self.prefill

    def plan_graph(self, bs: int, table: list[list[int]], kv_lens: list[int]) -> None:
        """Plan bucket ``bs``'s graph wrapper for a decode step of ``len(kv_lens) <= bs`` sequences; the
        rows up to ``bs`` are padding (one token on page 0, as the decode graphs pad)."""
        wrapper = self.graph_decode.get(bs)
        if wrapper is None:
            if self.max_pages <= 0:
                raise ValueError("FlashInferAttention was made without max_pages: it has no graph buffers")
            z = dict(dtype=torch.int32, device=self.device)
            wrapper = self.graph_decode[bs] = self.fi.decode.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, **z),
                paged_kv_indices_buffer=torch.zeros(bs * self.max_pages, **z),
                paged_kv_last_page_len_buffer=torch.zeros(bs, **z))
        pad = bs - len(kv_lens)
        if pad < 0:
            raise ValueError(f"{len(kv_lens)} sequences do not fit the graph bucket {bs}")
        self._plan_decode(wrapper, list(table) + [[0]] * pad, list(kv_lens) + [1] * pad)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``[T, Hq, D]`` attention of the planned step's queries ``q [T, Hq, D]`` over one layer's cache."""
        if self.active is None:
            raise RuntimeError("FlashInferAttention: no plan for this step (plan_step or plan_graph first)")
        return self.active.run(q, (k_cache, v_cache))
