"""SGLang attention backend ``rlperf``: rlperf's invariant paged attention over SGLang's KV pool.

SGLang keeps a layer's K (and V) as one buffer ``[slots, Hkv, D]``; with ``--page-size P`` its
allocator hands out whole pages of P consecutive slots, and ``req_to_token[r, p]`` is the slot of token
p of request r. With ``P = PAGE_SIZE`` (rlperf's KV block, 128) that buffer viewed as ``[slots / P, P,
Hkv, D]`` is rlperf's paged cache, and page ``j`` of request r is ``req_to_token[r, j * P] // P``. Each
step's metadata (:class:`StepMetadata`) is what :func:`rlperf.kernels.paged_attention` takes:

* ``page_table [B, max_pages] int32`` — the pages of each request in order;
* ``cu_seqlens_q [B + 1] int32`` — the new tokens of each request (decode: one each; extend: SGLang's
  ``extend_seq_lens``, after any prefix the radix cache supplied);
* ``kv_lens [B] int32`` — cached + new tokens (SGLang's ``seq_lens``).

Because rlperf's kernel gives a query row the same bits in a full prefill, a chunk after a cached
prefix and a decode step, SGLang's chunked prefill and radix-cache prefix reuse keep the bits of the
trainer's full-sequence forward.

Decode steps replay CUDA graphs: :meth:`RlperfAttnBackend.init_cuda_graph_state` allocates the
metadata buffers once ([max_bs, pages of the longest context]), and
:meth:`RlperfAttnBackend.init_forward_metadata_out_graph` refills them before capture and before each
replay (the kernel reads only the pages below a request's ``kv_len``, so the table's width does not
matter). Padded graph rows have ``seq_len`` 1 (:meth:`get_cuda_graph_seq_len_fill_value`) and write
their K/V to SGLang's padding slot.

rlperf's model classes (:mod:`rlperf.sglang_plugin.models`) read the metadata and the cache views
(:meth:`kv_cache`) and run rlperf's layer, which stores K/V in the same launch as the q/k norm and
RoPE. :meth:`forward_extend` and :meth:`forward_decode` serve a model that calls SGLang's
``RadixAttention`` instead: they store K/V, then run the same kernel.
"""
from __future__ import annotations

import dataclasses

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from rlperf import kernels as K
from rlperf.kernels.attention import PAGE_SIZE

from .contract import BACKEND_NAME, PluginError


@dataclasses.dataclass
class StepMetadata:
    """One forward's paged-attention inputs (module docstring): ``page_table [B, max_pages]``,
    ``cu_seqlens_q [B + 1]``, ``kv_lens [B]``, all int32 on the device."""

    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor


def page_table_of(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_pages: int) -> torch.Tensor:
    """``[B, max_pages] int32``: page ``j`` of each request, ``req_to_token[r, j * PAGE_SIZE] // PAGE_SIZE``."""
    slots = req_to_token[req_pool_indices.long(), : max_pages * PAGE_SIZE : PAGE_SIZE]
    return torch.div(slots, PAGE_SIZE, rounding_mode="floor").to(torch.int32)


class RlperfAttnBackend(AttentionBackend):
    """The ``rlperf`` attention backend (module docstring). ``model_runner``: SGLang's ``ModelRunner``
    (its ``req_to_token_pool``, ``token_to_kv_pool``, ``page_size`` and ``device``)."""

    needs_cpu_seq_lens = True

    def __init__(self, model_runner):
        super().__init__()
        page_size = getattr(model_runner, "page_size", None)
        if page_size is None:
            page_size = model_runner.server_args.page_size
        if page_size != PAGE_SIZE:
            raise PluginError(f"--attention-backend {BACKEND_NAME} needs --page-size {PAGE_SIZE}; got {page_size}")
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        # pages of the longest request the pool can hold: the width of the decode graphs' page table
        self.max_pages = -(-self.req_to_token.shape[1] // PAGE_SIZE)
        self.forward_metadata: StepMetadata | None = None
        self._arange = torch.arange(0, 1, dtype=torch.int32, device=self.device)
        self._graph: StepMetadata | None = None

    # ---- the KV pool as rlperf's paged cache ---------------------------------------------------
    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s (k_cache, v_cache), each ``[pages, PAGE_SIZE, Hkv, D]``: views of SGLang's buffers."""
        k, v = self.token_to_kv_pool.get_kv_buffer(layer_id)
        return (k.view(-1, PAGE_SIZE, *k.shape[1:]), v.view(-1, PAGE_SIZE, *v.shape[1:]))

    def _cu_arange(self, n: int) -> torch.Tensor:
        if self._arange.numel() < n:
            self._arange = torch.arange(0, max(n, 2 * self._arange.numel()), dtype=torch.int32, device=self.device)
        return self._arange[:n]

    # ---- eager steps -------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if not (mode.is_decode() or mode.is_extend()) or forward_batch.spec_info is not None:
            raise PluginError(f"--attention-backend {BACKEND_NAME} runs decode and extend steps; got {mode.name}")
        bs = forward_batch.batch_size
        if mode.is_decode():
            cu = self._cu_arange(bs + 1)
        else:
            cu = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
            torch.cumsum(forward_batch.extend_seq_lens, 0, out=cu[1:])
        seq_lens_cpu = forward_batch.seq_lens_cpu
        longest = int(seq_lens_cpu.max()) if seq_lens_cpu is not None else self.max_pages * PAGE_SIZE
        max_pages = max(1, -(-longest // PAGE_SIZE))
        self.forward_metadata = StepMetadata(
            page_table_of(self.req_to_token, forward_batch.req_pool_indices, max_pages), cu,
            forward_batch.seq_lens.to(torch.int32))

    # ---- decode CUDA graphs ------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph = StepMetadata(
            torch.zeros(max_bs, self.max_pages, dtype=torch.int32, device=self.device),
            torch.arange(0, max_bs + 1, dtype=torch.int32, device=self.device),
            torch.ones(max_bs, dtype=torch.int32, device=self.device))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        if self._graph is None:  # eager (the base class routes init_forward_metadata here otherwise)
            self.init_forward_metadata(forward_batch)
            return
        if not forward_batch.forward_mode.is_decode_or_idle() or forward_batch.spec_info is not None:
            raise PluginError(f"--attention-backend {BACKEND_NAME} captures decode steps only; got "
                              f"{forward_batch.forward_mode.name}")
        bs = forward_batch.batch_size
        g = self._graph
        g.page_table[:bs].copy_(page_table_of(self.req_to_token, forward_batch.req_pool_indices[:bs], self.max_pages))
        g.kv_lens[:bs].copy_(forward_batch.seq_lens[:bs])
        self.forward_metadata = StepMetadata(g.page_table[:bs], g.cu_seqlens_q[: bs + 1], g.kv_lens[:bs])

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---- RadixAttention callers ----------------------------------------------------------------
    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache: bool):
        k_cache, v_cache = self.kv_cache(layer.layer_id)
        if save_kv_cache and k is not None:
            K.write_kv_cache(k.view(-1, layer.tp_k_head_num, layer.qk_head_dim),
                             v.view(-1, layer.tp_v_head_num, layer.v_head_dim), k_cache, v_cache,
                             forward_batch.out_cache_loc.to(torch.int64))
        m = self.forward_metadata
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = K.paged_attention(q, k_cache, v_cache, m.page_table, m.cu_seqlens_q, m.kv_lens, layer.scaling)
        return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self) -> bool:
        return True
