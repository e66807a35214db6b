"""The ``ModuleSpec`` submodules of the megatron backend: rlperf's kernels in tensor-parallel layers.

megatron-core's ``TransformerLayer`` keeps its structure (pre-norm, self-attention, bias-dropout-add,
pre-MLP norm, MLP, bias-dropout-add; dropout 0); what it builds inside comes from
:func:`decoder_layer_spec`:

=====================  ================================================================================
``input_layernorm``    :class:`RMSNorm` (``rlperf.kernels.rmsnorm``)
``self_attention``     :class:`TreeSelfAttention`: ``linear_qkv`` (:class:`TreeColumnParallelLinear`),
                       ``core_attention`` (:class:`QKNormRopeAttention`: q/k RMSNorm + RoPE in one
                       kernel, ``varlen_attention`` forward and backward), ``linear_proj``
                       (:class:`TreeRowParallelLinear`)
``pre_mlp_layernorm``  :class:`RMSNorm`
``mlp``                :class:`SwiGLUMLP`: ``linear_fc1`` (column), ``silu_mul``, ``linear_fc2`` (row)
=====================  ================================================================================

Every reduction that tensor parallelism splits is a fixed tree (``rlperf.kernels.tree_reduce``, ``S``
leaves, a multiple of the TP size): the row-parallel ``o_proj`` / ``down_proj`` sum their K in the
tree, the column-parallel layers' input gradients sum their N in it, and the q/k-norm weights'
gradients sum over the head blocks in it; the RMSNorm weights' gradients, sums over tokens, add the
norm kernel's partials over fixed row blocks once, gathered across the sequence-parallel ranks
(:class:`RMSNorm`). Hence a token's activations, log-probs and every gradient are the same bits at
every TP size, and equal to rlperf's own model run with ``reduction_leaves=S``.

Fused column-parallel weights (q/k/v, gate/up) are stored **leaf-blocked**: leaf ``c`` of ``S`` holds
rows ``[c n_i / S, (c + 1) n_i / S)`` of every part ``i`` one after the other, and TP rank ``r`` holds
leaves ``[r S / TP, (r + 1) S / TP)``. A rank's rows are then one contiguous range of the tree's
leaves, which the input-gradient tree needs (megatron's own layout puts gate then up on each rank,
whose leaf order would change with TP). :func:`leaf_blocked_rows` and :func:`parts_from_leaf_blocked`
convert from and to Hugging Face's part-after-part tensors.

Activations are megatron's ``[tokens, 1, hidden]`` (packed sequences, ``qkv_format='thd'``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from rlperf import kernels as K
from rlperf.kernels import tree_reduce as tree


# --------------------------------------------------------------------------------------------
# Tensor-parallel context and leaf-blocked weights
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group (``group`` None at TP=1), the tree's leaves and
    whether the activations between the tensor-parallel layers are split over the tokens
    (``--sequence-parallel``)."""

    size: int
    rank: int
    group: object
    leaves: int
    sequence_parallel: bool = False

    @classmethod
    def current(cls, leaves: int, sequence_parallel: bool = False) -> "TensorParallel":
        from megatron.core import parallel_state as ps

        size = ps.get_tensor_model_parallel_world_size()
        group = ps.get_tensor_model_parallel_group() if size > 1 else None
        if leaves % size:
            raise ValueError(f"--tensor-model-parallel-size {size} does not divide the {leaves} tree leaves")
        return cls(size, ps.get_tensor_model_parallel_rank(), group, leaves, sequence_parallel and size > 1)

    @property
    def token_group(self):
        """The group the tokens are split over (the tensor-parallel group under sequence parallelism),
        or None when every rank holds every token."""
        return self.group if self.sequence_parallel else None

    @property
    def local_leaves(self) -> int:
        return self.leaves // self.size


def leaf_blocked_rows(parts: list[torch.Tensor], leaves: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's rows of a fused weight in the leaf-blocked layout (module docstring): ``parts`` are
    the full tensors [n_i, K] (q, k, v or gate, up); returns [sum n_i / TP, K]."""
    for p in parts:
        if p.shape[0] % leaves:
            raise ValueError(f"a part of {p.shape[0]} rows does not split into {leaves} tree leaves")
    local = leaves // tp_size
    rows = []
    for c in range(tp_rank * local, (tp_rank + 1) * local):
        for p in parts:
            w = p.shape[0] // leaves
            rows.append(p[c * w:(c + 1) * w])
    return torch.cat(rows)


def parts_from_leaf_blocked(full: torch.Tensor, part_rows: list[int], leaves: int) -> list[torch.Tensor]:
    """Inverse of :func:`leaf_blocked_rows` over all ranks: ``full`` [sum n_i, K] (the ranks' rows in
    rank order) -> the parts [n_i, K]."""
    per_leaf = [n // leaves for n in part_rows]
    blocks = full.reshape(leaves, sum(per_leaf), *full.shape[1:])
    return [b.reshape(n, *full.shape[1:]) for b, n in zip(blocks.split(per_leaf, dim=1), part_rows)]


def _mark_tensor_parallel(param: nn.Parameter, dim: int) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, True, dim, 1)


# --------------------------------------------------------------------------------------------
# Plain numerics: Megatron's own reduction order (all-reduce of rank partials), the anchor that the
# tree is measured against. Batch-invariant per rank, not TP-invariant.
# --------------------------------------------------------------------------------------------


def _all_reduce(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size > 1:
        import torch.distributed as dist

        dist.all_reduce(t, group=tp.group)
    return t


class _PlainRowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, tp):
        ctx.save_for_backward(x, w)
        ctx.tp = tp
        return _all_reduce(K.linear(x, w), tp)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        return (g2 @ w).reshape(*g.shape[:-1], w.shape[1]), g2.T @ x.reshape(-1, x.shape[-1]), None


class _PlainColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, tp):
        ctx.save_for_backward(x, w)
        ctx.tp = tp
        return K.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dx = _all_reduce((g2 @ w).contiguous(), ctx.tp).reshape(*g.shape[:-1], w.shape[1])
        return dx, g2.T @ x.reshape(-1, x.shape[-1]), None


class _PlainReplicated(torch.autograd.Function):
    """A replicated weight whose per-rank gradient (a partial over this rank's heads) is all-reduced."""

    @staticmethod
    def forward(ctx, w, tp):
        ctx.tp = tp
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.contiguous(), ctx.tp), None


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``rlperf.kernels.rmsnorm`` over the last dim, megatron's norm constructor signature.

    Tree mode (``leaves`` set, :func:`rmsnorm_class`) under sequence parallelism: a rank holds a contiguous
    share of the tokens [T / TP, 1, H], and the weight's gradient — a sum over every token — is
    ``rlperf.kernels.tree_reduce.token_parallel_rmsnorm``'s: the kernel's partial sums over fixed blocks of
    rows, all-gathered in rank order and added once, the bits of one rank holding every token (the model
    pads T so that each share is a whole number of blocks, :meth:`MegatronCausalLM.padded_tokens`). Without
    sequence parallelism every rank holds every token: the plain kernel call, whose weight gradient is
    the same on every rank. Either way the gradient keeps its bits when more padding rows are appended
    (they add zero partials)."""

    leaves: int | None = None
    sequence_parallel: bool = False

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.tp = TensorParallel.current(self.leaves, self.sequence_parallel) if self.leaves else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.tp.token_group is None:
            return K.rmsnorm(x, self.weight, self.eps)
        return tree.token_parallel_rmsnorm(x, self.weight, self.eps, self.tp.token_group)


def rmsnorm_class(leaves: int | None, sequence_parallel: bool = False) -> type:
    """:class:`RMSNorm` in tree mode (``leaves`` set: its weight gradient gathered across the
    sequence-parallel ranks in the one-rank order; None: one kernel call, Megatron's plain order), as a
    class: megatron builds norms from a class and its constructor arguments."""
    if leaves is None:
        return RMSNorm
    return type(f"RMSNorm{leaves}{'SP' if sequence_parallel else ''}", (RMSNorm,),
                {"leaves": leaves, "sequence_parallel": sequence_parallel, "__module__": __name__})


class TreeColumnParallelLinear(nn.Module):
    """``y = x @ W_r.T`` with this rank's leaf-blocked rows ``W_r`` [sum(parts) / TP, K]
    (:func:`rlperf.kernels.tree_reduce.column_parallel_linear`); ``parts``: the fused parts' full row
    counts. Returns ``(y, None)`` (megatron's (output, bias))."""

    def __init__(self, input_size: int, parts: tuple[int, ...], config, tp: TensorParallel, plain: bool = False):
        super().__init__()
        self.parts, self.tp, self.plain = tuple(parts), tp, plain
        for n in parts:
            if n % tp.leaves:
                raise ValueError(f"a fused part of {n} rows does not split into {tp.leaves} tree leaves")
        self.weight = nn.Parameter(torch.empty(sum(parts) // tp.size, input_size, dtype=config.params_dtype))
        _mark_tensor_parallel(self.weight, 0)

    def forward(self, x):
        if self.plain:
            return _PlainColumnParallel.apply(x, self.weight, self.tp), None
        tp = self.tp
        return tree.column_parallel_linear(x, self.weight, tp.leaves, tp.group, tp.sequence_parallel), None

    def split_parts(self, y: torch.Tensor) -> list[torch.Tensor]:
        """The local output [..., sum(parts) / TP] as each part's local columns [..., n_i / TP], contiguous."""
        per_leaf = [n // self.tp.leaves for n in self.parts]
        blocks = y.reshape(*y.shape[:-1], self.tp.local_leaves, sum(per_leaf))
        return [b.reshape(*y.shape[:-1], self.tp.local_leaves * n) for b, n in zip(blocks.split(per_leaf, -1), per_leaf)]


class TreeRowParallelLinear(nn.Module):
    """``y = x_r @ W_r.T`` summed over the ranks' K slices in the fixed tree
    (:func:`rlperf.kernels.tree_reduce.row_parallel_linear`); W_r [N, K / TP]. Every rank gets all of y."""

    def __init__(self, input_size: int, output_size: int, config, tp: TensorParallel, plain: bool = False):
        super().__init__()
        self.tp, self.plain = tp, plain
        if input_size % tp.leaves:
            raise ValueError(f"K = {input_size} does not split into {tp.leaves} tree leaves")
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp.size, dtype=config.params_dtype))
        _mark_tensor_parallel(self.weight, 1)

    def forward(self, x):
        if self.plain:
            return _PlainRowParallel.apply(x, self.weight, self.tp), None
        tp = self.tp
        return tree.row_parallel_linear(x, self.weight, tp.leaves, tp.group, tp.sequence_parallel), None


def rope_table(head_dim: int, max_positions: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_positions, D/2] float32 computed in float64: ``rlperf.model.layer.RopeTable``'s."""
    from rlperf.model.layer import RopeTable

    table = RopeTable(head_dim, max_positions, theta, device or "cpu")
    return table.cos, table.sin


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each packed token within its sequence: [T] int64."""
    cu = cu_seqlens.to(torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


class QKNormRopeAttention(nn.Module):
    """Core attention: q/k RMSNorm + RoPE (``rmsnorm_rope``, per head block) then causal varlen
    attention (``varlen_attention``) over this rank's heads. ``q`` [T, 1, hq, D], ``k``/``v``
    [T, 1, hkv, D] -> [T, 1, hq D]. The norm weights ``q_norm``/``k_norm`` [D] are replicated; their
    gradients are added over the head blocks in the fixed tree (``block_replicas``)."""

    def __init__(self, config, tp: TensorParallel, rope_theta: float, max_positions: int, plain: bool = False):
        super().__init__()
        d = config.kv_channels
        self.tp, self.eps, self.head_dim, self.plain = tp, config.layernorm_epsilon, d, plain
        self.blocks = tree.head_blocks(config.num_attention_heads, config.num_query_groups, tp.leaves)
        if self.blocks % tp.size:
            raise ValueError(f"{config.num_query_groups} key-value heads cannot be split over "
                             f"--tensor-model-parallel-size {tp.size}")
        self.q_norm = nn.Parameter(torch.ones(d, dtype=config.params_dtype))
        self.k_norm = nn.Parameter(torch.ones(d, dtype=config.params_dtype))
        cos, sin = rope_table(d, max_positions, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        """Module moves and casts (the trainer's ``model.to(bf16)``) move the RoPE tables but leave them
        float32: ``rmsnorm_rope`` takes float32 ``[max_positions, D/2]`` tables, and a bf16 round trip
        would change the angles' bits."""
        cos, sin = self.rope_cos, self.rope_sin
        super()._apply(fn, recurse)
        device = self.rope_cos.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        return self

    def _norm_rope(self, x, weight, positions):
        if self.plain:  # one call over this rank's heads; the weight's gradient all-reduced
            w = _PlainReplicated.apply(weight, self.tp) if self.tp.size > 1 else weight
            return K.rmsnorm_rope(x, w, positions, self.rope_cos, self.rope_sin, self.eps)
        # each head block with its own replica of the weight, as a call over that block alone computes
        # it (one launch forward, one backward); the replicas' gradients add in the fixed tree
        replicas = tree.block_replicas(weight, self.blocks, self.tp.group)
        return K.rmsnorm_rope_blocks(x, replicas, positions, self.rope_cos, self.rope_sin, self.eps)

    def forward(self, q, k, v, cu_seqlens, positions=None):
        """q [T, 1, hq D], k, v [T, 1, hkv D], ``cu_seqlens`` [B+1]; ``positions`` [T] int64 (each token's
        position in its sequence; computed from ``cu_seqlens`` when None) -> [T, 1, hq D]."""
        t = q.shape[0]
        q, k, v = q.reshape(t, -1, self.head_dim), k.reshape(t, -1, self.head_dim), v.reshape(t, -1, self.head_dim)
        if positions is None:
            positions = positions_from_cu_seqlens(cu_seqlens, t)
        q = self._norm_rope(q, self.q_norm, positions)
        k = self._norm_rope(k, self.k_norm, positions)
        a = K.varlen_attention(q, k, v.contiguous(), cu_seqlens.to(torch.int32))
        return a.reshape(t, 1, -1)


@dataclasses.dataclass
class TreeSelfAttentionSubmodules:
    linear_qkv: type = TreeColumnParallelLinear
    core_attention: type = QKNormRopeAttention
    linear_proj: type = TreeRowParallelLinear


class TreeSelfAttention(nn.Module):
    """Self-attention of one layer: leaf-blocked q/k/v projection, :class:`QKNormRopeAttention`,
    row-parallel ``o_proj``. ``forward(hidden [T, 1, H], packed_seq_params=...)`` -> ``(out, None)``."""

    def __init__(self, config, submodules: TreeSelfAttentionSubmodules, layer_number: int, leaves: int,
                 rope_theta: float, max_positions: int, plain: bool = False, sequence_parallel: bool = False, **_):
        super().__init__()
        tp = TensorParallel.current(leaves, sequence_parallel)
        self.tp, self.config, self.layer_number = tp, config, layer_number
        q = config.num_attention_heads * config.kv_channels
        kv = config.num_query_groups * config.kv_channels
        self.linear_qkv = submodules.linear_qkv(config.hidden_size, (q, kv, kv), config, tp, plain)
        self.core_attention = submodules.core_attention(config, tp, rope_theta, max_positions, plain)
        self.linear_proj = submodules.linear_proj(q, config.hidden_size, config, tp, plain)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **_):
        if packed_seq_params is None:
            raise ValueError("the megatron backend runs packed sequences: pass packed_seq_params (cu_seqlens)")
        qkv, _ = self.linear_qkv(hidden_states)
        q, k, v = self.linear_qkv.split_parts(qkv)
        # the positions of the packed tokens, computed once per forward by the model (PackedTokens), not per layer
        a = self.core_attention(q, k, v, packed_seq_params.cu_seqlens_q, getattr(packed_seq_params, "positions", None))
        out, _ = self.linear_proj(a)
        return out, None


@dataclasses.dataclass
class SwiGLUMLPSubmodules:
    linear_fc1: type = TreeColumnParallelLinear
    linear_fc2: type = TreeRowParallelLinear


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: leaf-blocked gate/up (column), ``silu_mul``, down (row tree)."""

    def __init__(self, config, submodules: SwiGLUMLPSubmodules, leaves: int, plain: bool = False,
                 sequence_parallel: bool = False, **_):
        super().__init__()
        tp = TensorParallel.current(leaves, sequence_parallel)
        self.tp, self.config = tp, config
        i = config.ffn_hidden_size
        self.linear_fc1 = submodules.linear_fc1(config.hidden_size, (i, i), config, tp, plain)
        self.linear_fc2 = submodules.linear_fc2(i, config.hidden_size, config, tp, plain)

    def forward(self, hidden_states, **_):
        y, _ = self.linear_fc1(hidden_states)  # [..., L * 2 I/S]: per local leaf, its gate then its up columns
        lead = y.shape[:-1]
        # silu(gate) * up per leaf on a view ([..., L, 2 I/S] -> [..., L, I/S]): the gate's local column
        # order, with no split of y into gate and up nor a concatenation (element-wise: the same bits)
        act = K.silu_mul(y.reshape(*lead, self.tp.local_leaves, -1))
        out, _ = self.linear_fc2(act.reshape(*lead, -1))
        return out, None


def decoder_layer_spec(leaves: int, rope_theta: float, max_positions: int, plain: bool = False,
                       sequence_parallel: bool = False):
    """megatron's ``TransformerLayer`` with rlperf's submodules (module docstring). ``plain``: Megatron's
    own reduction order instead of the trees (rank partials all-reduced; not TP-invariant) — the
    anchor the trees' cost is measured against. ``sequence_parallel``: the layer's input and output
    [T / TP, 1, H] hold this rank's tokens (tree mode only; the norms work on them, the linear layers
    gather and reduce-scatter: ``rlperf.kernels.tree_reduce``)."""
    if plain and sequence_parallel:
        raise ValueError("--sequence-parallel is implemented in the tree mode only (not in the plain anchor)")
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    norm = rmsnorm_class(None if plain else leaves, sequence_parallel)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(module=TreeSelfAttention, submodules=TreeSelfAttentionSubmodules(),
                                      params=dict(leaves=leaves, rope_theta=rope_theta, max_positions=max_positions,
                                                  plain=plain, sequence_parallel=sequence_parallel)),
            self_attn_bda=get_bias_dropout_add,
            pre_cross_attn_layernorm=IdentityOp,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(module=SwiGLUMLP, submodules=SwiGLUMLPSubmodules(),
                           params=dict(leaves=leaves, plain=plain, sequence_parallel=sequence_parallel)),
            mlp_bda=get_bias_dropout_add,
        ),
    )
