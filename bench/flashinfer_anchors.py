"""FlashInfer as an anchor of the attention and sampling benches (the library SGLang uses by default).

FlashInfer is optional and JIT-compiled: ``import flashinfer`` happens only when a bench builds its
workload (:func:`flashinfer_or_reason`), and its first call of each new kernel compiles it with the
machine's nvcc (1-3 minutes, cached under ``~/.cache/flashinfer``), which the benches' warm-up absorbs.
Where it is missing, the benches keep a row whose anchor says :data:`NOT_INSTALLED`.

Anchors (same inputs as rlperf's rows, bf16, Qwen3-8B-like heads Hq=32, Hkv=8, D=128):

* :func:`ragged_prefill` — ``BatchPrefillWithRaggedKVCacheWrapper`` (NHD), causal, on the packed
  ``[B*L, H, D]`` tokens with ``qo_indptr = kv_indptr = cu_seqlens``;
* :func:`paged_decode` — ``BatchDecodeWithPagedKVCacheWrapper`` (NHD) on rlperf's own paged cache
  ``[num_pages, page_size, Hkv, D]``, its page table in CSR form as the engine's FlashInfer backend
  plans it (:func:`rlperf.rollout.flashinfer_attention.paged_kv_layout`); tensor cores when
  Hq / Hkv >= 4, as SGLang picks them;
* :func:`top_k_top_p_sampling` — ``top_k_top_p_sampling_from_probs`` (``top_k_first``,
  ``deterministic=True``) on ``softmax(logits / T)``, or ``top_p_sampling_from_probs`` /
  ``sampling_from_probs`` when top-k (top-p) is off; the probabilities are computed inside the timed call,
  as rlperf's sampler starts from logits too.
"""
from __future__ import annotations

from typing import Callable

import torch

from rlperf.rollout.flashinfer_attention import (NOT_INSTALLED, WORKSPACE_BYTES, FlashInferUnavailable, import_flashinfer,
                                                 paged_kv_layout)

def flashinfer_or_reason():
    """``(flashinfer, None)``, or ``(None, why)``: :data:`NOT_INSTALLED`, or the import error of an
    installed FlashInfer that cannot load here (no CUDA, a missing ``apache-tvm-ffi``)."""
    try:
        return import_flashinfer(), None
    except FlashInferUnavailable as exc:
        return None, str(exc)


def _workspace(device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def ragged_prefill(fi, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> Callable:
    """A call of FlashInfer's causal prefill over packed sequences: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``,
    ``cu_seqlens [B + 1]`` int32; returns ``[T, Hq, D]`` (planned once, here)."""
    wrapper = fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), "NHD")
    cu = cu_seqlens.to(torch.int32)
    wrapper.plan(cu, cu, q.shape[1], k.shape[1], q.shape[2], causal=True, q_data_type=q.dtype, kv_data_type=k.dtype)
    return lambda: wrapper.run(q, k, v)


def paged_decode(fi, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 kv_lens: torch.Tensor) -> Callable:
    """A call of FlashInfer's batch decode on a paged cache: ``q [B, Hq, D]``, ``k_cache, v_cache
    [num_pages, page_size, Hkv, D]``, ``page_table [B, pages_per_seq]`` (sequence b's pages in order),
    ``kv_lens [B]``; returns ``[B, Hq, D]``."""
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    # the engine's own CSR form of the page table (its FlashInfer backend plans with the same)
    indptr, indices, last = (torch.tensor(x, dtype=torch.int32, device=q.device)
                             for x in paged_kv_layout(page_table.tolist(), kv_lens.tolist(), page))
    wrapper = fi.decode.BatchDecodeWithPagedKVCacheWrapper(_workspace(q.device), "NHD",
                                                           use_tensor_cores=q.shape[1] // hkv >= 4)
    wrapper.plan(indptr, indices, last, q.shape[1], hkv, d, page, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
    return lambda: wrapper.run(q, (k_cache, v_cache))


def top_k_top_p_sampling(fi, logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                         seed: int = 0) -> Callable:
    """A call that samples one token per row of ``logits [B, V]`` with FlashInfer: probabilities
    ``softmax(logits / temperature)`` in float32, then top-k (``top_k`` > 0) and top-p (``top_p`` < 1)
    rejection sampling; returns ``[B]`` int32 token ids."""
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    s = fi.sampling

    def probs():
        return torch.softmax(logits.float() / temperature, dim=-1)

    if top_k > 0:
        return lambda: s.top_k_top_p_sampling_from_probs(probs(), top_k, top_p, filter_apply_order="top_k_first",
                                                         deterministic=True, generator=gen)
    if top_p < 1.0:
        return lambda: s.top_p_sampling_from_probs(probs(), top_p, deterministic=True, generator=gen)
    return lambda: s.sampling_from_probs(probs(), deterministic=True, generator=gen)
