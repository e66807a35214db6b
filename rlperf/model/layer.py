"""The Qwen3 decoder layer as functions over rlperf.kernels ops.

One body, two ways to attend:

* :func:`decoder_layer_prefill` — packed varlen sequences (``cu_seqlens``), no KV cache: the
  training forward.
* :func:`decoder_layer_paged` — the engine's step: writes the new tokens' K/V into the paged
  cache, then attends over the cache (chunked prefill and decode are the same call).

Layer (HF ``Qwen3DecoderLayer`` order), per token, T tokens, hidden size H::

    x, r  = add_rmsnorm(h, r, w.input_layernorm)            # r = h + r; x = rmsnorm(r)
    q,k,v = split(linear(x, w.qkv_proj))                    # [T,Hq,D], [T,Hkv,D], [T,Hkv,D]
    q, k  = rope(rmsnorm(q, w.q_norm)), rope(rmsnorm(k, w.k_norm))  # fused: K.rmsnorm_rope
    a     = attention(q, k, v)                              # causal, GQA
    x, r  = add_rmsnorm(linear(a, w.o_proj), r, w.post_attention_layernorm)
    h     = linear(silu_mul(linear(x, w.gate_up_proj)), w.down_proj)     # dense MLP, or
    h     = sparse_moe_block(x, w.router, w.experts_gate_up, w.experts_down)  # Qwen3-MoE layers
    return h, r

``leaves`` (None, or the tree's leaf count S: the model's ``reduction_leaves``) selects the
**tensor-parallel-invariant** numerics: ``o_proj`` and ``down_proj`` sum their K in the fixed tree of
``rlperf.kernels.tree_reduce`` and the q/k norm runs per head block, exactly as the megatron trainer
backend computes them at any TP size (``rlperf/train/megatron/layers.py``), so its log-probs equal
this model's bit for bit.

Every op is batch-invariant in ``invariant`` mode and attention gives the same bits in prefill,
chunked prefill and decode, so a token's output never depends on how it was batched.
"""
from __future__ import annotations

import dataclasses

import torch

from rlperf import kernels as K
from rlperf.kernels import tree_reduce

from .config import ModelConfig
from .moe import RoutingTrace, sparse_moe_block


@dataclasses.dataclass
class DecoderLayerWeights:
    """One layer's parameters; q/k/v and gate/up are stored fused so each is one matmul launch.

    Shapes (H hidden, D head_dim, I intermediate): ``input_layernorm`` [H], ``qkv_proj``
    [(Hq + 2 Hkv) D, H] (rows: q, then k, then v), ``q_norm``/``k_norm`` [D], ``o_proj`` [H, Hq D],
    ``post_attention_layernorm`` [H], ``gate_up_proj`` [2I, H] (rows: gate, then up), ``down_proj`` [H, I].
    A Qwen3-MoE sparse layer has no dense MLP (``gate_up_proj``/``down_proj`` None) but ``router``
    [E, H], ``experts_gate_up`` [E, 2I', H] (per expert: gate rows, then up) and ``experts_down``
    [E, H, I'], I' = ``moe_intermediate_size``.
    """

    input_layernorm: torch.Tensor
    qkv_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_attention_layernorm: torch.Tensor
    gate_up_proj: torch.Tensor | None
    down_proj: torch.Tensor | None
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    expert_parallel: object = None
    """An :class:`rlperf.model.expert_parallel.ExpertParallel` when the experts are this rank's share
    ([E/W, ...]) of an expert-parallel group; None: all E experts here."""


def init_layer_weights(cfg: ModelConfig, dtype: torch.dtype, device, generator: torch.Generator | None = None,
                       std: float = 0.02, index: int = 0) -> DecoderLayerWeights:
    """Random weights (normal(0, std) matrices, unit norms) for layer ``index`` of ``cfg``."""

    def normal(*shape):
        return (torch.randn(*shape, generator=generator, dtype=torch.float32) * std).to(dtype=dtype, device=device)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.is_moe_layer(index):
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        mlp = dict(gate_up_proj=None, down_proj=None, router=normal(e, h), experts_gate_up=normal(e, 2 * i, h),
                   experts_down=normal(e, h, i))
    else:
        mlp = dict(gate_up_proj=normal(2 * cfg.intermediate_size, h), down_proj=normal(h, cfg.intermediate_size))
    return DecoderLayerWeights(
        input_layernorm=ones(h),
        qkv_proj=normal(cfg.q_size + 2 * cfg.kv_size, h),
        q_norm=ones(d),
        k_norm=ones(d),
        o_proj=normal(h, cfg.q_size),
        post_attention_layernorm=ones(h),
        **mlp,
    )


class RopeTable:
    """Rotary embedding with a cos/sin table [max_positions, D/2] in float32, computed once in float64.

    The layer passes ``cos``/``sin`` to :func:`rlperf.kernels.rmsnorm_rope` (q/k norm and rotation
    in one kernel). ``apply(x [T, heads, D], positions [T])`` is the same rotation as plain torch
    (HF ``rotate_half`` convention): ``out = [x1 cos - x2 sin, x2 cos + x1 sin]`` in float32, rounded
    once to x's dtype — the unfused formula, kept for comparisons and benchmarks. Looking the angle up
    in a table (rather than calling sin/cos per batch) keeps a token's bits independent of the batch.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().to(torch.float32).to(device)
        self.sin = angles.sin().to(torch.float32).to(device)
        self.max_positions = max_positions

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Positions are validated where requests enter (the engine, the data loader), not here:
        # a check here would be a host-device sync per layer and would break CUDA-graph capture.
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.to(x.dtype)


def _norm_rope(x, weight, positions, rope: RopeTable, eps: float, blocks: int | None):
    """q/k RMSNorm + RoPE of x [T, heads, D]: one kernel call, or in tree mode each head block as a call
    over that block alone computes it (:func:`rlperf.kernels.rmsnorm_rope_blocks`, still one launch). Tree
    mode here is the engine's copy (no weight gradient); the megatron trainer, which trains in the tree,
    adds its blocks' weight gradients in the tree through ``block_replicas``."""
    if blocks is None or blocks == 1:
        return K.rmsnorm_rope(x, weight, positions, rope.cos, rope.sin, eps)
    return K.rmsnorm_rope_blocks(x, weight[None].expand(blocks, -1), positions, rope.cos, rope.sin, eps)


def _row_linear(x, w, leaves: int | None, tp_group=None):
    """A row-parallel-able projection (o_proj, down_proj): the plain kernel, or K summed in the fixed tree
    (this rank's K slice under ``tp_group``, the ranks' tree nodes added in the tree's top levels)."""
    if leaves is None:
        return K.linear(x, w)
    return tree_reduce.row_parallel_linear(x, w, leaves, tp_group)


def _column_linear(x, w, leaves: int | None, tp_group=None):
    """A column-parallel-able projection (q/k/v, gate/up): the plain kernel, or under ``tp_group`` this
    rank's rows in the tile config of the whole layer (each column the bits it has at TP=1)."""
    if tp_group is None:
        return K.linear(x, w)
    return tree_reduce.column_parallel_linear(x, w, leaves, tp_group)


def _layer(hidden, residual, w: DecoderLayerWeights, cfg: ModelConfig, rope: RopeTable, positions, attend,
           leaves: int | None = None, routing: RoutingTrace | None = None, kv_store=None, tp_group=None):
    """One decoder layer; ``attend(q, k, v)`` -> [T, heads, D]. ``kv_store``: (k_cache, v_cache,
    slot_mapping) of the engine's paged step: q's and k's norm + RoPE run in one launch that also
    stores k and v into the cache (:func:`rlperf.kernels.rmsnorm_rope_store_kv`, the bits of the
    separate calls) and ``attend`` gets ``k = v = None``; None: ``attend`` gets k and v.

    ``tp_group``: ``w`` is this rank's shard of a tensor-parallel layer (``rlperf.model.qwen3.hf_shard``):
    q/k/v heads and gate/up rows of rank r are its contiguous ``1 / TP`` of each part. Tree mode
    (``leaves``): ``o_proj`` / ``down_proj`` hold its K slice, attention runs on its heads and the
    row-parallel products add the ranks' tree nodes, so every rank returns the TP=1 tree's bits. Plain
    mode (``leaves`` None, :func:`_plain_tp_layer`): the row-parallel products run whole after a gather,
    so every rank returns the one-process plain bits."""
    tp, _ = tree_reduce.group_size_rank(tp_group)
    if tp > 1 and leaves is None:
        return _plain_tp_layer(hidden, residual, w, cfg, rope, positions, attend, routing, tp_group)
    t = hidden.shape[0]
    if tp > 1 and w.router is not None:
        raise ValueError("a tensor-parallel layer in the tree numerics (reduction_leaves) is a dense layer")
    heads, kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
    q_size, kv_size = heads * cfg.head_dim, kv_heads * cfg.head_dim
    blocks = None if leaves is None else tree_reduce.head_blocks(cfg.num_attention_heads, cfg.num_key_value_heads,
                                                                 leaves) // tp
    if residual is None:
        x, residual = K.rmsnorm(hidden, w.input_layernorm, cfg.rms_norm_eps), hidden
    else:
        x, residual = K.add_rmsnorm(hidden, residual, w.input_layernorm, cfg.rms_norm_eps)
    qkv = _column_linear(x, w.qkv_proj, leaves, tp_group)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(t, heads, cfg.head_dim)
    k = k.reshape(t, kv_heads, cfg.head_dim)
    v = v.reshape(t, kv_heads, cfg.head_dim)
    # q/k norm and RoPE read the strided views of qkv in place; the prefill (trainer) and the paged
    # step (engine) run the same kernel programs, so they agree bit for bit
    if kv_store is not None and blocks is None:  # Q, and K/V into the cache: one launch
        q = K.rmsnorm_rope_store_kv(q, w.q_norm, k, w.k_norm, positions, rope.cos, rope.sin, cfg.rms_norm_eps,
                                    v, *kv_store)
        k = v = None
    else:
        q = _norm_rope(q, w.q_norm, positions, rope, cfg.rms_norm_eps, blocks)
        k = _norm_rope(k, w.k_norm, positions, rope, cfg.rms_norm_eps, blocks)
    a = attend(q, k, v)
    x, residual = K.add_rmsnorm(_row_linear(a.reshape(t, q_size), w.o_proj, leaves, tp_group), residual,
                                w.post_attention_layernorm, cfg.rms_norm_eps)
    if w.router is not None:
        return sparse_moe_block(x, w.router, w.experts_gate_up, w.experts_down, cfg, routing,
                                w.expert_parallel), residual
    if tp_group is None:
        gated = K.linear_silu_mul(x, w.gate_up_proj)
    else:  # this rank's [gate | up] rows: silu_mul of the rounded product, as linear_silu_mul computes it
        gated = K.silu_mul(_column_linear(x, w.gate_up_proj, leaves, tp_group))
    return _row_linear(gated, w.down_proj, leaves, tp_group), residual


def _plain_tp_layer(hidden, residual, w: DecoderLayerWeights, cfg: ModelConfig, rope: RopeTable, positions, attend,
                    routing, tp_group):
    """:func:`_layer` in plain tensor parallelism: every rank holds the whole ``hidden`` and returns the
    one-process plain layer's bits. The rank's q/k/v rows and (dense) gate/up rows are multiplied in the
    whole product's tile config (``column_shard_matmul``: each column its unsplit bits); the q/k heads are
    gathered and normalized and rotated whole (the kernel's tile follows the head count), this rank's
    heads kept; attention runs on them (an engine step stores this rank's key-value heads in its cache); the
    attention output and the SwiGLU output are gathered (copies, no sums) and ``o_proj`` / ``down_proj``
    run whole; a sparse layer runs whole on every rank. Per dense layer three all-gathers (q and k together; two
    in a sparse layer), no reductions."""
    t = hidden.shape[0]
    tp, rank = tree_reduce.group_size_rank(tp_group)
    heads, kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
    q_size, kv_size = heads * cfg.head_dim, kv_heads * cfg.head_dim
    if residual is None:
        x, residual = K.rmsnorm(hidden, w.input_layernorm, cfg.rms_norm_eps), hidden
    else:
        x, residual = K.add_rmsnorm(hidden, residual, w.input_layernorm, cfg.rms_norm_eps)
    qkv = tree_reduce.column_shard_matmul(x, w.qkv_proj, cfg.q_size + 2 * cfg.kv_size)
    # every rank's q and k columns in one gather, then the unsplit [T, heads, D] of each, heads in rank order
    qk = tree_reduce.all_gather(qkv[:, :q_size + kv_size], tp_group)
    q_all = torch.cat([part[:, :q_size] for part in qk], dim=-1).reshape(t, cfg.num_attention_heads, cfg.head_dim)
    k_all = torch.cat([part[:, q_size:] for part in qk], dim=-1).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
    q = _norm_rope(q_all, w.q_norm, positions, rope, cfg.rms_norm_eps, None)[:, rank * heads:(rank + 1) * heads]
    k = _norm_rope(k_all, w.k_norm, positions, rope, cfg.rms_norm_eps, None)[:, rank * kv_heads:(rank + 1) * kv_heads]
    v = qkv[:, q_size + kv_size:].reshape(t, kv_heads, cfg.head_dim)
    a = attend(q, k, v)
    a = torch.cat(tree_reduce.all_gather(a.reshape(t, q_size), tp_group), dim=-1)
    x, residual = K.add_rmsnorm(K.linear(a, w.o_proj), residual, w.post_attention_layernorm, cfg.rms_norm_eps)
    if w.router is not None:
        return sparse_moe_block(x, w.router, w.experts_gate_up, w.experts_down, cfg, routing,
                                w.expert_parallel), residual
    gated = K.silu_mul(tree_reduce.column_shard_matmul(x, w.gate_up_proj, 2 * cfg.intermediate_size))
    gated = torch.cat(tree_reduce.all_gather(gated, tp_group), dim=-1)
    return K.linear(gated, w.down_proj), residual


def decoder_layer_prefill(hidden, residual, w, cfg, rope, positions, cu_seqlens, leaves: int | None = None,
                          routing=None, tp_group=None):
    """Training forward of one layer over packed sequences.

    hidden [T, H]; residual [T, H] or None (first layer); positions [T] int64 (position within its
    sequence); cu_seqlens [B+1] int32; routing: a :class:`RoutingTrace` (MoE layers record or
    replay their experts) or None; tp_group: ``w`` is this rank's shard (:func:`_layer`). Returns
    (hidden_out [T, H], residual [T, H]).
    """
    return _layer(hidden, residual, w, cfg, rope, positions,
                  lambda q, k, v: K.varlen_attention(q, k, v, cu_seqlens), leaves, routing, tp_group=tp_group)


def decoder_layer_paged(hidden, residual, w, cfg, rope, positions, kv_cache, slot_mapping, page_table,
                        cu_seqlens_q, kv_lens, leaves: int | None = None, routing=None, attention=None,
                        tp_group=None):
    """Engine step of one layer: store the new tokens' K/V in the paged cache, attend over it.

    hidden [T, H] (the new tokens of B sequences, packed); positions [T]; kv_cache (k_cache,
    v_cache), each [num_pages, PAGE_SIZE, Hkv, D]; slot_mapping [T] int64; page_table [B, max_pages]
    int32; cu_seqlens_q [B+1] int32; kv_lens [B] int32 (cached + new tokens). A decode step is
    one new token per sequence; a chunked prefill is a chunk per sequence. ``attention(q, k_cache,
    v_cache)``: the step's planned attention in place of :func:`rlperf.kernels.paged_attention` over
    the same batch (the engine's FlashInfer backend, ``rlperf.rollout.flashinfer_attention``); None:
    the kernel. ``tp_group``: ``w`` is this rank's shard and ``kv_cache`` holds this rank's key-value
    heads (:func:`_layer`).
    """
    k_cache, v_cache = kv_cache

    def attend(q, k, v):
        if k is not None:  # not stored with k's norm + RoPE already (tree mode's per-head-block calls)
            K.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        if attention is not None:
            return attention(q, k_cache, v_cache)
        return K.paged_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, kv_lens)

    return _layer(hidden, residual, w, cfg, rope, positions, attend, leaves, routing,
                  kv_store=(k_cache, v_cache, slot_mapping), tp_group=tp_group)
