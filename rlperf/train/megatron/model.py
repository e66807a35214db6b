"""A megatron-core ``GPTModel`` from :class:`rlperf.model.ModelConfig`, Hugging Face names in and out.

:func:`build_gpt_model` makes this rank's part of the model (its pipeline stage's layers, its tensor-
parallel shards) with :func:`rlperf.train.megatron.layers.decoder_layer_spec` and rlperf's RMSNorm as
the final norm; megatron's ``VocabParallelEmbedding`` and output layer hold V/TP rows each (tied to the
embedding when ``tie_word_embeddings``). :class:`MegatronCausalLM` wraps it with the packed forward
and the vocabulary-parallel tree log-prob.

Names: every parameter maps to the Hugging Face tensors rlperf's own model uses
(``model.layers.{i}.self_attn.q_proj.weight``...): :meth:`MegatronCausalLM.load_hf_tensors` takes this
rank's shards from full HF tensors; :meth:`MegatronCausalLM.iter_hf_weights` gathers full HF tensors
from the shards of every TP rank and pipeline stage, one bucket at a time, in
``Qwen3ForCausalLM.hf_state_dict()``'s order (a collective, the contract of
``rlperf.train.fsdp.iter_full_params``).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from rlperf import kernels as K
from rlperf.kernels.tree_reduce import TREE_LEAVES, gather_tokens, scatter_tokens, tree_logprob
from rlperf.model.config import ModelConfig

from .layers import (TensorParallel, decoder_layer_spec, leaf_blocked_rows, parts_from_leaf_blocked,
                     positions_from_cu_seqlens, rmsnorm_class)
from .runtime import cpu_device_queries


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation, slime's (Megatron's) flags."""

    granularity: str | None = None
    """``--recompute-granularity``: ``full`` (whole layers) or ``selective``; None: off."""
    method: str | None = None
    """``--recompute-method``: ``uniform`` or ``block`` (with ``full``)."""
    num_layers: int | None = None
    """``--recompute-num-layers``."""

    def check(self) -> None:
        if self.granularity not in (None, "full", "selective"):
            raise ValueError(f"--recompute-granularity {self.granularity!r}: choose full or selective")
        if self.granularity == "selective":
            raise ValueError("--recompute-granularity selective: rlperf's layer spec has no selectively "
                             "recomputed submodule (its attention saves no [L, L] scores); use full")
        if self.granularity == "full" and not torch.cuda.is_available():
            raise ValueError("--recompute-granularity full needs CUDA (megatron's activation checkpointing "
                             "saves and restores CUDA RNG states)")
        if self.granularity == "full":
            if self.method not in ("uniform", "block"):
                raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
            if not self.num_layers or self.num_layers < 1:
                raise ValueError("--recompute-granularity full needs --recompute-num-layers >= 1")
        elif self.method is not None or self.num_layers is not None:
            raise ValueError("--recompute-method / --recompute-num-layers need --recompute-granularity full")


def transformer_config(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int,
                       recompute: RecomputeConfig = RecomputeConfig()):
    """megatron's ``TransformerConfig`` for a Qwen3-style ``cfg``: GQA, SwiGLU, RMSNorm with q/k norm,
    no biases, no dropout (RL log-probs are deterministic)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute.check()
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim, layernorm_epsilon=cfg.rms_norm_eps, normalization="RMSNorm", qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=True, perform_initialization=False,
        recompute_granularity=recompute.granularity, recompute_method=recompute.method,
        recompute_num_layers=recompute.num_layers,
    )


@functools.lru_cache(maxsize=None)
def _packed_tokens_class(base: type) -> type:
    """megatron's ``PackedSeqParams`` with one more field, ``positions`` [T] int64: each packed token's
    position in its sequence, computed once per forward (:meth:`MegatronCausalLM.forward_hidden`) for
    every layer's q/k RoPE instead of once per layer (five launches a layer)."""
    return dataclasses.make_dataclass("PackedTokens", [("positions", torch.Tensor, dataclasses.field(default=None))],
                                      bases=(base,))


class _HeadGradTap(torch.autograd.Function):
    """The tied lm head's weight: forward the weight itself; backward keeps the head's gradient apart
    (``owner.head_grad``, float32) instead of adding it into the embedding's, so that the tied gradient
    is ``embedding part + head part`` in every pipeline layout (the two parts live on different stages
    when PP > 1)."""

    @staticmethod
    def forward(ctx, weight, owner):
        ctx.owner = owner
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, g):
        owner = ctx.owner
        owner.head_grad = g.float() if owner.head_grad is None else owner.head_grad + g.float()
        return None, None


class MegatronCausalLM(nn.Module):
    """This rank's stage of a megatron ``GPTModel`` on rlperf's kernels (module docstring).

    ``gpt``: the ``GPTModel``; ``cfg``: the shapes; ``leaves``: the reduction tree's leaf count;
    ``sequence_parallel``: the decoder's activations hold this rank's ``T / TP`` tokens (the embedding
    is scattered, the last stage gathers before the log-prob).

    Under sequence parallelism a packed micro-batch of ``T`` tokens is padded to ``T_pad``
    (:meth:`padded_tokens`; the padding: token 0, a sequence of its own, never read by the loss), so
    that every rank's share is a whole number of the norm gradient's row blocks; padding moves no bit.
    """

    def __init__(self, gpt, cfg: ModelConfig, leaves: int, plain: bool = False, sequence_parallel: bool = False):
        super().__init__()
        self.gpt, self.cfg, self.leaves, self.plain = gpt, cfg, leaves, plain
        self.tp = TensorParallel.current(leaves, sequence_parallel)
        self.sequence_parallel = self.tp.sequence_parallel
        from megatron.core import parallel_state as ps

        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.first_stage, self.last_stage = gpt.pre_process, gpt.post_process
        self.head_grad: torch.Tensor | None = None  # tied head's gradient, kept apart (_HeadGradTap)
        # global index of this stage's first layer
        self.layer_offset = self.gpt.decoder.layers[0].layer_number - 1 if len(self.gpt.decoder.layers) else 0

    # ---- forward -----------------------------------------------------------------------------------
    def set_input_tensor(self, hidden: torch.Tensor | None) -> None:
        """The previous stage's output [T, 1, H] (pipeline stages after the first)."""
        self.gpt.set_input_tensor(hidden)

    def padded_tokens(self, num_tokens: int) -> int:
        """``T_pad``: in tree mode under sequence parallelism ``num_tokens`` rounded up so that each of the TP
        ranks holds a whole number of the norm gradient's row blocks (``rlperf.kernels.norm.rmsnorm_grad_rows``);
        otherwise ``num_tokens`` as is. Padding changes no bit of a real token's log-prob nor of any gradient
        (the tree mode's sums over tokens add the padding's zeros in fixed blocks), so layouts that pad
        differently still agree bit for bit."""
        if self.plain or not self.sequence_parallel:
            return num_tokens
        from rlperf.kernels.norm import rmsnorm_grad_rows

        unit = self.tp.size * rmsnorm_grad_rows(self.cfg.hidden_size)
        return -(-num_tokens // unit) * unit

    def stage_tokens(self, num_tokens: int) -> int:
        """Rows of the activations a stage sends to the next for a micro-batch of ``num_tokens``:
        ``T_pad``, or this rank's ``T_pad / TP`` under sequence parallelism."""
        t = self.padded_tokens(num_tokens)
        return t // self.tp.size if self.sequence_parallel else t

    def forward_hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """This stage's output for packed ``input_ids`` [T] with sequence offsets ``cu_seqlens`` [B+1]:
        on the last stage the final-norm hidden states [T_pad, 1, H] (rows past T are padding), on the
        others the activations [:meth:`stage_tokens`, 1, H] the next stage takes."""
        from megatron.core.packed_seq_params import PackedSeqParams

        t = input_ids.shape[0]
        pad = self.padded_tokens(t) - t
        cu = cu_seqlens.to(torch.int32)
        if pad:  # the padding is a sequence of its own: no real token attends to it
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            cu = torch.cat([cu, torch.full((1,), t + pad, dtype=cu.dtype, device=cu.device)])  # no host copy
        # max_seqlen: the token count, a bound known on the host (rlperf's attention reads cu_seqlens on the
        # device and no layer here reads it; the longest sequence itself would be a device-to-host wait)
        psp = _packed_tokens_class(PackedSeqParams)(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=t + pad, max_seqlen_kv=t + pad,
            positions=positions_from_cu_seqlens(cu, t + pad))
        hidden = None
        group = self.tp.token_group
        if self.first_stage:
            hidden = self.gpt.embedding(input_ids=input_ids[None], position_ids=None)
            if group is not None:
                hidden = scatter_tokens(hidden, group)
        with cpu_device_queries():
            out = self.gpt.decoder(hidden_states=hidden, attention_mask=None, packed_seq_params=psp)
        if self.last_stage and group is not None:
            out = gather_tokens(out, group)
        return out

    @property
    def head_weight(self) -> torch.Tensor:
        """This rank's lm-head rows [V / TP, H] (the embedding's when tied); last stage only."""
        if self.gpt.share_embeddings_and_output_weights:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight

    def log_probs(self, hidden: torch.Tensor, logit_rows: torch.Tensor, targets: torch.Tensor, temperature: float,
                  with_entropy: bool = False):
        """Log-probs (and entropy) [R] float32 of ``targets`` from the rows ``logit_rows`` of the last
        stage's hidden [T, 1, H]: the vocabulary-parallel tree (Megatron's all-reduce order when ``plain``)."""
        h = hidden.reshape(hidden.shape[0], -1)
        head = self.head_weight
        if self.plain:  # Megatron's order: rank statistics all-reduced (rlperf.kernels.fused_logprob's tp_group)
            return K.fused_logprob(h[logit_rows], head, targets, temperature, return_entropy=with_entropy,
                                   tp_group=self.tp.group)
        if self.cfg.tie_word_embeddings and torch.is_grad_enabled() and head.requires_grad:
            head = _HeadGradTap.apply(head, self)
        return tree_logprob(h[logit_rows], head, targets, temperature, return_entropy=with_entropy,
                            leaves=self.leaves, group=self.tp.group)

    # ---- Hugging Face names --------------------------------------------------------------------------
    def _layer_entries(self, local: int) -> list[tuple[str, nn.Parameter, str, tuple]]:
        """(HF base name, parameter, kind, info) of local layer ``local``; kind: ``replicated``,
        ``columns`` (split on dim 1), ``blocked`` (leaf-blocked parts; info = the parts' HF names and rows)."""
        layer = self.gpt.decoder.layers[local]
        g = self.layer_offset + local
        p = f"model.layers.{g}."
        c = self.cfg
        att, mlp = layer.self_attention, layer.mlp
        return [
            (p + "input_layernorm.weight", layer.input_layernorm.weight, "replicated", ()),
            (p + "post_attention_layernorm.weight", layer.pre_mlp_layernorm.weight, "replicated", ()),
            ("qkv", att.linear_qkv.weight, "blocked",
             ((p + "self_attn.q_proj.weight", c.q_size), (p + "self_attn.k_proj.weight", c.kv_size),
              (p + "self_attn.v_proj.weight", c.kv_size))),
            (p + "self_attn.q_norm.weight", att.core_attention.q_norm, "replicated", ()),
            (p + "self_attn.k_norm.weight", att.core_attention.k_norm, "replicated", ()),
            (p + "self_attn.o_proj.weight", att.linear_proj.weight, "columns", ()),
            ("gate_up", mlp.linear_fc1.weight, "blocked",
             ((p + "mlp.gate_proj.weight", c.intermediate_size), (p + "mlp.up_proj.weight", c.intermediate_size))),
            (p + "mlp.down_proj.weight", mlp.linear_fc2.weight, "columns", ()),
        ]

    def _entries(self) -> list[tuple[str, nn.Parameter | None, str, tuple]]:
        """This stage's parameters with their HF names, in ``hf_state_dict()`` order (head entries first)."""
        out = []
        if self.first_stage:
            out.append(("model.embed_tokens.weight", self.gpt.embedding.word_embeddings.weight, "rows", ()))
        if self.last_stage:
            out.append(("model.norm.weight", self.gpt.decoder.final_layernorm.weight, "replicated", ()))
            if not self.cfg.tie_word_embeddings:
                out.append(("lm_head.weight", self.gpt.output_layer.weight, "rows", ()))
        for local in range(len(self.gpt.decoder.layers)):
            out += self._layer_entries(local)
        return out

    def hf_shards(self, tensors: dict[str, torch.Tensor]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, this rank's shard) for every parameter of this stage, cut out of full HF-named
        tensors (every name this stage needs must be there; others are ignored). With tied embeddings on
        a pipeline's last stage, the output layer's copy of the embedding takes ``model.embed_tokens.weight``."""
        tp = self.tp
        entries = self._entries()
        if self.last_stage and not self.first_stage and self.cfg.tie_word_embeddings:
            entries.append(("model.embed_tokens.weight", self.gpt.output_layer.weight, "rows", ()))
        out = []
        for name, param, kind, info in entries:
            if kind == "blocked":
                missing = [n for n, _ in info if n not in tensors]
                if missing:
                    raise ValueError(f"missing HF tensors {missing}")
                src = leaf_blocked_rows([tensors[n] for n, _ in info], self.leaves, tp.size, tp.rank)
            else:
                if name not in tensors:
                    raise ValueError(f"missing HF tensor {name}")
                full = tensors[name]
                if kind == "rows":
                    n = full.shape[0] // tp.size
                    src = full[tp.rank * n:(tp.rank + 1) * n]
                elif kind == "columns":
                    n = full.shape[1] // tp.size
                    src = full[:, tp.rank * n:(tp.rank + 1) * n]
                else:
                    src = full
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(f"{name}: this rank's shard has shape {tuple(src.shape)}, the model expects "
                                 f"{tuple(param.shape)}")
            out.append((param, src))
        return out

    @torch.no_grad()
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shards out of full HF-named tensors (:meth:`hf_shards`)."""
        for param, src in self.hf_shards(tensors):
            param.copy_(src.to(dtype=param.dtype, device=param.device))

    def _gather_tp(self, param: torch.Tensor, kind: str, dtype, select) -> torch.Tensor:
        t = select(param).detach()
        t = t.to(dtype) if dtype is not None else t
        if kind == "replicated" or self.tp.size == 1:
            return t.clone() if kind != "replicated" and self.tp.size == 1 else t
        parts = [torch.empty_like(t) for _ in range(self.tp.size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=1 if kind == "columns" else 0)

    def _full_tensors(self, entry, dtype, select) -> list[tuple[str, torch.Tensor]]:
        name, param, kind, info = entry
        full = self._gather_tp(param, kind, dtype, select)
        if kind == "blocked":
            return list(zip([n for n, _ in info], parts_from_leaf_blocked(full, [r for _, r in info], self.leaves)))
        return [(name, full)]

    def hf_layout(self) -> list[tuple[str, tuple[int, ...], int]]:
        """Every HF tensor of the whole model: (name, shape, pipeline stage holding it), in
        ``Qwen3ForCausalLM.hf_state_dict()``'s order. The same list on every rank."""
        from rlperf.model.qwen3 import Qwen3ForCausalLM, hf_views

        meta = Qwen3ForCausalLM(self.cfg, device="meta")
        counts = _layers_per_stage(self.cfg.num_hidden_layers, self.pp_size)
        first_layer = [sum(counts[:s]) for s in range(self.pp_size)]
        out = []
        params = dict(meta.named_parameters())
        for pname in meta.hf_param_order():
            if pname.startswith("layers."):
                i = int(pname.split(".")[1])
                stage = max(s for s in range(self.pp_size) if first_layer[s] <= i)
            elif pname == "embed_tokens":
                stage = 0
            else:
                stage = self.pp_size - 1
            for hf_name, t in hf_views(self.cfg, pname, params[pname]):
                out.append((hf_name, tuple(t.shape), stage))
        return out

    def iter_hf_weights(self, dtype: torch.dtype | None = None, bucket_bytes: int = 512 << 20,
                        select=None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` for the whole model, in ``hf_state_dict()`` order, gathered over the
        tensor-parallel ranks and broadcast from the stage that holds it, one bucket (at most
        ``bucket_bytes``, a larger tensor alone) at a time. A collective over the default group: every
        rank iterates to the end; every rank gets every tensor (rank 0 typically consumes them).
        ``select(parameter)`` (optional) names the tensor gathered in the parameter's place (its float32
        master, its gradient, an AdamW moment): the same layout and names."""
        select = select or (lambda p: p)
        mine: dict[str, tuple] = {}
        for entry in self._entries():
            names = [n for n, _ in entry[3]] if entry[2] == "blocked" else [entry[0]]
            for n in names:
                mine[n] = entry
        layout = self.hf_layout()
        dtype_of = next(self.gpt.parameters()).dtype
        out_dtype = dtype or dtype_of
        bucket, size = [], 0

        def flush(bucket):
            produced: dict[str, torch.Tensor] = {}
            for name, shape, stage in bucket:
                if stage == self.pp_rank and name not in produced:
                    produced.update(self._full_tensors(mine[name], out_dtype, select))
            result = []
            for name, shape, stage in bucket:
                if self.pp_size > 1:
                    t = produced[name].contiguous() if stage == self.pp_rank else torch.empty(
                        shape, dtype=out_dtype, device=_device(self))
                    from megatron.core import parallel_state as ps

                    src = ps.get_pipeline_model_parallel_group()
                    dist.broadcast(t, group_src=stage, group=src)
                    result.append((name, t))
                else:
                    result.append((name, produced[name]))
            return result

        for name, shape, stage in layout:
            nbytes = int(torch.Size(shape).numel()) * out_dtype.itemsize
            if bucket and size + nbytes > bucket_bytes:
                yield from flush(bucket)
                bucket, size = [], 0
            bucket.append((name, shape, stage))
            size += nbytes
        if bucket:
            yield from flush(bucket)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _layers_per_stage(num_layers: int, pp: int) -> list[int]:
    if num_layers % pp:
        raise ValueError(f"{num_layers} layers do not split evenly over --pipeline-model-parallel-size {pp}")
    return [num_layers // pp] * pp


def build_gpt_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, leaves: int = TREE_LEAVES,
                    recompute: RecomputeConfig = RecomputeConfig(),
                    device: str | torch.device = "cpu", plain: bool = False,
                    sequence_parallel: bool = False) -> MegatronCausalLM:
    """This rank's stage of the model (megatron's process groups must exist:
    :func:`rlperf.train.megatron.runtime.initialize_model_parallel`). Parameters are uninitialised:
    load them with :meth:`MegatronCausalLM.load_hf_tensors`. ``plain``: Megatron's all-reduce order
    instead of the trees (not TP-invariant; the benchmark's anchor). ``sequence_parallel``: the
    activations between the tensor-parallel layers are split over the tokens (``--sequence-parallel``;
    a no-op at TP=1). rlperf's layers do the split themselves (megatron's ``sequence_parallel`` config
    stays off: its embedding would reduce-scatter in the ranks' order, and gloo has no reduce-scatter)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    counts = _layers_per_stage(cfg.num_hidden_layers, pp)
    if cfg.vocab_size % (leaves):
        raise ValueError(f"vocab_size {cfg.vocab_size} does not split into {leaves} tree leaves")
    config = transformer_config(cfg, dtype, tp, pp, recompute)
    sequence_parallel = sequence_parallel and tp > 1
    layer = decoder_layer_spec(leaves, cfg.rope_theta, cfg.max_position_embeddings, plain, sequence_parallel)
    stage = ps.get_pipeline_model_parallel_rank()
    # the final norm as a class: megatron-core 0.16 builds it through build_module, 0.19 calls it
    block = TransformerBlockSubmodules(layer_specs=[layer] * counts[stage],
                                       layer_norm=rmsnorm_class(None if plain else leaves, sequence_parallel))
    with cpu_device_queries():
        gpt = GPTModel(config, block, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                       pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                       share_embeddings_and_output_weights=cfg.tie_word_embeddings, position_embedding_type="none")
    gpt.to(device)
    return MegatronCausalLM(gpt, cfg, leaves, plain, sequence_parallel)
