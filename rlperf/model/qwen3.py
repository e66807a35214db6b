"""A Qwen3-style causal LM on rlperf.kernels, with Hugging Face parameter names on disk.

In memory, q/k/v and gate/up projections are stored fused (one matmul launch each, and the same
launch shape on the training and the rollout side, which batch invariance needs: a matmul's tile
config is fixed per (dtype, N, K), so a fused and a split projection need not give equal bits).
On disk and in :meth:`Qwen3ForCausalLM.hf_state_dict` they carry HF's names
(``model.layers.{i}.self_attn.q_proj.weight`` ...), as views of the fused tensors.

Qwen3-MoE (``cfg.num_experts > 0``): a sparse layer holds ``router`` [E, H] and every expert's
gate/up and down stacked (``experts_gate_up`` [E, 2I, H], ``experts_down`` [E, H, I], what the
grouped GEMM reads); their HF names are transformers' ``mlp.gate.weight`` and
``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight``, again views.

Two forwards share every op:

* :meth:`forward_packed` — packed varlen sequences (training, reference log-probs);
* :meth:`forward_paged` — an engine step against the paged KV cache (chunked prefill, decode).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from rlperf import kernels as K
from rlperf.kernels.tree_reduce import all_gather, column_shard_matmul, group_size_rank, tree_logprob

from .config import REDUCTION_LEAVES_KEY, ModelConfig, check_tensor_parallel, read_hf_config
from .layer import DecoderLayerWeights, RopeTable, decoder_layer_paged, decoder_layer_prefill
from .moe import RoutingTrace
from .seeded_normal import fill_seeded_normal_

SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class DecoderLayer(nn.Module):
    """Parameters of layer ``index`` (fused layout; see :class:`DecoderLayerWeights` for shapes): a
    dense MLP, or the sparse expert block where ``cfg.is_moe_layer(index)``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, index: int = 0, tp_size: int = 1,
                 plain_tp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe and tp_size > 1 and not plain_tp:
            raise ValueError("a sparse (MoE) layer is not split over tensor-parallel ranks in the tree numerics")
        # tp_size > 1: this rank's shard (:func:`hf_shard`): 1 / tp_size of the heads, the gate/up rows
        # and (tree numerics) the o_proj / down_proj columns; plain tensor parallelism (``plain_tp``) keeps
        # o_proj, down_proj and a sparse layer's router and experts whole
        h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size // tp_size
        q, kv = cfg.q_size // tp_size, cfg.kv_size // tp_size
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = nn.Parameter(torch.ones(h, **kw))
        self.qkv_proj = nn.Parameter(torch.empty(q + 2 * kv, h, **kw))
        self.q_norm = nn.Parameter(torch.ones(d, **kw))
        self.k_norm = nn.Parameter(torch.ones(d, **kw))
        self.o_proj = nn.Parameter(torch.empty(h, cfg.q_size if plain_tp else q, **kw))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h, **kw))
        if self.is_moe:
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            self.router = nn.Parameter(torch.empty(e, h, **kw))
            self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * mi, h, **kw))
            self.experts_down = nn.Parameter(torch.empty(e, h, mi, **kw))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(2 * i, h, **kw))
            self.down_proj = nn.Parameter(torch.empty(h, cfg.intermediate_size if plain_tp else i, **kw))

    def weights(self) -> DecoderLayerWeights:
        return DecoderLayerWeights(**{f: getattr(self, f, None) for f in DecoderLayerWeights.__dataclass_fields__})

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RopeTable, positions: torch.Tensor,
                cu_seqlens: torch.Tensor, leaves: int | None = None,
                routing: RoutingTrace | None = None, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The training forward of this layer over packed sequences (:func:`decoder_layer_prefill`).

        :meth:`Qwen3ForCausalLM.forward_packed` calls each layer as a module (``layer(...)``), so
        module hooks run around it: FSDP2 (``fully_shard`` per layer, :mod:`rlperf.train.fsdp`)
        gathers the layer's parameters before it and frees them after.
        """
        return decoder_layer_prefill(hidden, residual, self.weights(), self.cfg, rope, positions, cu_seqlens, leaves, routing,
                                     tp_group)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3-style decoder: embedding, ``num_hidden_layers`` decoder layers, final RMSNorm, LM head.

    ``reduction_leaves`` (None by default): the tensor-parallel-invariant numerics. With S (a power
    of two, ``rlperf.kernels.tree_reduce.TREE_LEAVES`` = 8 by default) ``o_proj`` and ``down_proj``
    sum K in the fixed tree of S leaves, the q/k norm runs per head block, and :meth:`token_logprobs`
    combines S vocabulary slices in the tree: what the megatron trainer backend computes at any
    tensor-parallel size, so an engine on one GPU stays bit-equal to a TP=2 trainer. It changes this
    model's bits (not its math): trainer and engine must use the same setting. May be set after
    construction (an attribute; forwards read it per call).

    ``tp_group`` (a torch.distributed process group of TP ranks). Without ``reduction_leaves`` (plain
    tensor parallelism, ``plain_tp``; an engine's forward, no gradients): this process holds rank r's q/k/v
    heads and gate/up rows and everything else whole (:func:`hf_shard` with ``plain``), and every rank
    gets the one-process plain bits (``rlperf.model.layer._plain_tp_layer``). In tree mode this process holds
    rank r's shard of a tensor-parallel model, split as the megatron trainer backend splits it
    (:func:`hf_shard`: q/k/v heads, gate/up rows, ``o_proj`` / ``down_proj`` K slices, a vocabulary slice
    of the embedding and the LM head); every rank runs the forwards on the same tokens and gets the
    bits of the one-process model with the same ``reduction_leaves`` (the row-parallel products add the
    ranks' tree nodes, the embedding rows and the logits are gathered, :meth:`token_logprobs` is the
    vocabulary-parallel tree). :meth:`hf_state_dict` then holds this rank's shards. An SGLang engine at
    ``--tp-size`` N runs one per worker (``rlperf.sglang_plugin``).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 reduction_leaves: int | None = None, tp_group=None):
        super().__init__()
        self.cfg = cfg
        self.reduction_leaves = reduction_leaves
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size_rank(tp_group)
        self.plain_tp = self.tp_size > 1 and reduction_leaves is None
        if tp_group is not None:
            check_tensor_parallel(cfg, reduction_leaves, self.tp_size)
        kw = dict(dtype=dtype, device=device)
        vocab = cfg.vocab_size // (1 if self.plain_tp else self.tp_size)
        self.embed_tokens = nn.Parameter(torch.empty(vocab, cfg.hidden_size, **kw))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, n, self.tp_size, self.plain_tp)
                                    for n in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(vocab, cfg.hidden_size, **kw))
        self.rope = RopeTable(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, device)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() move the parameters; the RoPE tables (plain float32 tensors, not
        # parameters) follow them to the new device and keep their dtype
        super()._apply(fn, recurse)
        device = self.embed_tokens.device
        if self.rope.cos.device != device:
            self.rope.cos, self.rope.sin = self.rope.cos.to(device), self.rope.sin.to(device)
        return self

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype=torch.float32, device="cpu", std: float = 0.02,
               reduction_leaves: int | None = None, chunk: int | None = None):
        """Random init: approximately normal(0, std) matrices, unit norms; the same bits on any device.

        The parameters of two or more dimensions, numbered ``k = 0, 1, ...`` in ``named_parameters()``
        order, are filled on ``device`` by :func:`rlperf.model.seeded_normal.fill_seeded_normal_`: element
        ``i`` (flat, row-major) of matrix ``k`` is ``float32(S) * C`` with ``S`` the centred sum of four
        16-bit uniform integers hashed from ``(seed, k, i)`` (variance ``(65536**2 - 1) / 3``, ``|S| <= 131070``) and
        ``C = float32(std * sqrt(3 / (65536**2 - 1)))`` (the formula in full: that module's docstring),
        then cast to ``dtype``. Integer ops and one float32 multiply: CPU and CUDA give the same bits,
        with no host generator and no host-to-device copy. ``chunk``: elements computed per step (None:
        the device's default; every chunk size gives the same values). The values are not
        ``torch.randn``'s: the init that drew them from a CPU generator gave other weights for the same
        seed. The 1-D norm weights are ones."""
        model = cls(cfg, dtype, device, reduction_leaves)
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        for k, p in enumerate(matrices):
            fill_seeded_normal_(p.data, seed, k, std, chunk)
        return model

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head [V, H] (the embedding when tied)."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    # ---- forwards -----------------------------------------------------------------------------
    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                       routing: RoutingTrace | None = None) -> torch.Tensor:
        """Final hidden states [T, H] of packed sequences (input_ids [T], positions [T], cu_seqlens [B+1] int32).

        ``routing``: a :class:`RoutingTrace` whose MoE layers record (or replay) their experts; None
        for a dense model or when nobody asks."""
        hidden, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rope, positions, cu_seqlens, self.reduction_leaves, routing,
                                     self.tp_group)
        return K.add_rmsnorm(hidden, residual, self.norm, self.cfg.rms_norm_eps)[0]

    def forward_paged(self, input_ids, positions, kv_caches, slot_mapping, page_table, cu_seqlens_q, kv_lens,
                      routing: RoutingTrace | None = None, attention=None):
        """Final hidden states [T, H] of the new tokens of an engine step (see ``decoder_layer_paged``).

        ``kv_caches``: one (k_cache, v_cache) pair per layer, each [num_pages, PAGE_SIZE, Hkv, D];
        ``routing`` as in :meth:`forward_packed`; ``attention``: the step's planned attention in every
        layer (``decoder_layer_paged``), None for rlperf's kernel.
        """
        hidden, residual = self.embed(input_ids), None
        for layer, cache in zip(self.layers, kv_caches):
            hidden, residual = decoder_layer_paged(hidden, residual, layer.weights(), self.cfg, self.rope, positions,
                                                   cache, slot_mapping, page_table, cu_seqlens_q, kv_lens,
                                                   self.reduction_leaves, routing, attention, self.tp_group)
        return K.add_rmsnorm(hidden, residual, self.norm, self.cfg.rms_norm_eps)[0]

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                       return_entropy: bool = False):
        """Log-probs (and entropy) [N] float32 of ``targets`` from final hidden rows [N, H]: the one
        log-prob path of trainer and engine. ``K.fused_logprob``, or with ``reduction_leaves`` the
        vocabulary tree (``rlperf.kernels.tree_reduce.tree_logprob``)."""
        if self.reduction_leaves is None:
            return K.fused_logprob(hidden, self.head_weight, targets, temperature, return_entropy=return_entropy)
        return tree_logprob(hidden, self.head_weight, targets, temperature, return_entropy=return_entropy,
                            leaves=self.reduction_leaves, group=self.tp_group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [T, V] in float32 from final hidden states [T, H]. Under ``tp_group`` each rank
        computes its vocabulary slice in the whole head's tile config and the slices are concatenated:
        every rank holds the one-process logits, bit for bit."""
        if self.tp_group is None or self.plain_tp:
            return K.linear(hidden, self.head_weight, out_dtype=torch.float32)
        local = column_shard_matmul(hidden, self.head_weight, self.cfg.vocab_size, torch.float32)
        return torch.cat(all_gather(local, self.tp_group), dim=-1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows [T, H] of ``input_ids`` [T]. Under ``tp_group`` each rank looks up the ids of its
        vocabulary slice and every rank takes each row from its owner (a gather, not a sum: exact)."""
        if self.tp_group is None or self.plain_tp:
            return self.embed_tokens[input_ids]
        v = self.embed_tokens.shape[0]
        rows = self.embed_tokens[(input_ids - self.tp_rank * v).clamp(0, v - 1)]
        owner = torch.div(input_ids, v, rounding_mode="floor").clamp(0, self.tp_size - 1)
        every = torch.stack(all_gather(rows, self.tp_group))  # [TP, T, H]
        return every[owner, torch.arange(input_ids.shape[0], device=input_ids.device)]

    # ---- Hugging Face names -------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under HF Qwen3 names; fused tensors appear as row-slice views (:func:`hf_views`).

        Order: embedding, final norm, lm_head (untied), then per layer the two norms, q/k/v, q/k norms,
        o_proj, gate/up, down (the flattening order of weight sync and of ``sync/weights_checksum``).
        """
        params = dict(self.named_parameters())
        out = {}
        for name in self.hf_param_order():
            out.update(hf_views(self.cfg, name, params[name], self.tp_size))
        return out

    def hf_param_order(self) -> list[str]:
        """``named_parameters`` names in the order :meth:`hf_state_dict` lists their HF tensors (a sender
        that streams the weights in this order flattens them as ``hf_state_dict()`` does)."""
        names = ["embed_tokens", "norm"] + (["lm_head"] if self.lm_head is not None else [])
        return names + [f"layers.{n}.{f}" for n, layer in enumerate(self.layers)
                        for f in (_MOE_LAYER_HF_ORDER if layer.is_moe else _LAYER_HF_ORDER)]

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in (``lm_head.weight`` is ignored when tied). Names and shapes are checked."""
        targets = self.hf_state_dict()
        missing = sorted(set(targets) - set(tensors))
        unexpected = sorted(set(tensors) - set(targets) - ({"lm_head.weight"} if self.lm_head is None else set()))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model config: missing {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}")
        for name, dst in targets.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"checkpoint tensor {name}: shape {tuple(src.shape)}, model expects {tuple(dst.shape)}")
            dst.copy_(src.to(dtype=dst.dtype, device=dst.device))

    # ---- disk ---------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 4 << 30) -> None:
        """Write ``config.json`` and safetensors shards (+ index when more than one) under ``path``."""
        from safetensors.torch import save_file

        if self.tp_size > 1:
            raise ValueError("save_pretrained writes a whole model; this one holds a tensor-parallel rank's shards")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.hf_state_dict().items()}
        shards, current, size = [], {}, 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name], size = t, size + nbytes
        shards.append(current)
        if len(shards) == 1:
            save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for n, shard in enumerate(shards):
                fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(path / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (path / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                              "weight_map": weight_map}, indent=2))
        (path / CONFIG_FILE).write_text(json.dumps(config_to_hf(self.cfg, self.embed_tokens.dtype), indent=2))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype=None, device="cpu") -> "Qwen3ForCausalLM":
        """Load ``config.json`` and the safetensors weights (single file or sharded index) from ``path``."""
        path = Path(path)
        config_from_hf(path / CONFIG_FILE)  # an unsupported config is refused before any weight is read
        tensors = read_safetensors_dir(path)
        # without tie_word_embeddings in config.json the weights decide: tied when there is no lm_head.weight
        cfg, saved_dtype = config_from_hf(path / CONFIG_FILE, has_lm_head="lm_head.weight" in tensors)
        model = cls(cfg, dtype or saved_dtype, device)
        model.load_hf_state_dict(tensors)
        return model


_LAYER_HF_ORDER = ("input_layernorm", "post_attention_layernorm", "qkv_proj", "q_norm", "k_norm", "o_proj",
                   "gate_up_proj", "down_proj")
"""A layer's parameters in the order :meth:`Qwen3ForCausalLM.hf_state_dict` lists their HF names."""
_MOE_LAYER_HF_ORDER = _LAYER_HF_ORDER[:-2] + ("router", "experts_gate_up", "experts_down")
"""The same for a Qwen3-MoE sparse layer."""

_HF_LAYER_NAMES = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
                   "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm", "o_proj": "self_attn.o_proj",
                   "down_proj": "mlp.down_proj"}


def hf_views(cfg: ModelConfig, name: str, tensor: torch.Tensor, tp_size: int = 1) -> list[tuple[str, torch.Tensor]]:
    """The HF names and tensors of one in-memory parameter ``name`` (a ``named_parameters`` name of
    :class:`Qwen3ForCausalLM`) holding ``tensor`` (the parameter itself, or a full copy of it, e.g.
    gathered from FSDP shards): fused ``qkv_proj`` [(Hq + 2 Hkv) D, H] gives the q, k and v row
    slices, ``gate_up_proj`` [2I, H] the gate and up slices (views, no copy); every other parameter
    maps to one name. ``tp_size`` > 1: ``tensor`` is a tensor-parallel rank's shard (its parts are
    ``1 / tp_size`` of each, :func:`hf_shard`). ValueError for a name the model does not have.
    """
    top = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    if name in top:
        return [(top[name], tensor)]
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"{name!r} is not a parameter of Qwen3ForCausalLM")
    prefix, field = f"model.layers.{parts[1]}.", parts[2]
    q, kv, i = cfg.q_size // tp_size, cfg.kv_size // tp_size, cfg.intermediate_size // tp_size
    if field == "qkv_proj":
        return [(prefix + "self_attn.q_proj.weight", tensor[:q]), (prefix + "self_attn.k_proj.weight", tensor[q : q + kv]),
                (prefix + "self_attn.v_proj.weight", tensor[q + kv :])]
    if field == "gate_up_proj":
        return [(prefix + "mlp.gate_proj.weight", tensor[:i]), (prefix + "mlp.up_proj.weight", tensor[i:])]
    if field == "router":
        return [(prefix + "mlp.gate.weight", tensor)]
    if field == "experts_gate_up":  # [E, 2I, H]: expert j's gate rows, then its up rows
        mi = cfg.moe_intermediate_size
        return [pair for j in range(tensor.shape[0])
                for pair in ((f"{prefix}mlp.experts.{j}.gate_proj.weight", tensor[j, :mi]),
                             (f"{prefix}mlp.experts.{j}.up_proj.weight", tensor[j, mi:]))]
    if field == "experts_down":     # [E, H, I]
        return [(f"{prefix}mlp.experts.{j}.down_proj.weight", tensor[j]) for j in range(tensor.shape[0])]
    if field not in _HF_LAYER_NAMES:
        raise ValueError(f"{name!r} is not a parameter of Qwen3ForCausalLM")
    return [(prefix + _HF_LAYER_NAMES[field] + ".weight", tensor)]


_ROW_SHARDED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "mlp.gate_proj.weight", "mlp.up_proj.weight")
"""HF names (suffixes) of a layer's column-parallel weights: a rank holds a contiguous 1 / TP of their rows."""
_COLUMN_SHARDED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
"""HF names (suffixes) of a layer's row-parallel weights: a rank holds a contiguous 1 / TP of their columns (K)."""


def hf_shard_dim(name: str, plain: bool = False) -> int | None:
    """The dimension of HF tensor ``name`` that tensor parallelism splits (:func:`hf_shard`), None when
    every rank holds it whole (the norms; with ``plain``, everything but the q/k/v and gate/up rows)."""
    if name.endswith(_ROW_SHARDED):
        return 0
    if plain:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    if name.endswith(_COLUMN_SHARDED):
        return 1
    return None


def hf_shard(name: str, tensor: torch.Tensor, tp_size: int, tp_rank: int, plain: bool = False) -> torch.Tensor:
    """Rank ``tp_rank``'s part (a view) of the whole HF tensor ``name``, as the megatron trainer backend
    splits the model over ``tp_size`` ranks: contiguous ``1 / tp_size`` blocks of the q/k/v heads, of the
    gate/up rows and of the vocabulary (embedding, LM head); of K for ``o_proj`` / ``down_proj``; the
    norms whole. ``plain`` (plain tensor parallelism): the q/k/v heads and a dense layer's gate/up rows
    only, every other tensor whole. ValueError when the split dimension does not divide."""
    dim = hf_shard_dim(name, plain) if tp_size > 1 else None
    if dim is None:
        return tensor
    if tensor.dim() <= dim or tensor.shape[dim] % tp_size:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not split over {tp_size} tensor-parallel ranks "
                         f"along dim {dim}")
    n = tensor.shape[dim] // tp_size
    return tensor.narrow(dim, tp_rank * n, n)



def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: ``model.safetensors`` or the shards its index names."""
    from safetensors.torch import load_file

    index = path / SAFETENSORS_INDEX
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or {SAFETENSORS_INDEX}")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(path / f)))
    return tensors


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype, reduction_leaves: int | None = None) -> dict:
    """An HF ``Qwen3Config``-compatible dict (transformers 4 layout, which transformers 5 reads too);
    ``Qwen3MoeConfig`` for a model with experts. ``reduction_leaves``: also name the tree numerics an
    engine loading it must compute with (:data:`rlperf.model.config.REDUCTION_LEAVES_KEY`)."""
    d = dataclasses.asdict(cfg)
    if cfg.num_experts:
        d.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", mlp_only_layers=list(cfg.mlp_only_layers))
    else:
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                      "decoder_sparse_step", "mlp_only_layers"):
            d.pop(field)
        d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    d.update(hidden_act="silu", torch_dtype=str(dtype).removeprefix("torch."), attention_bias=False)
    if reduction_leaves is not None:
        d[REDUCTION_LEAVES_KEY] = reduction_leaves
    return d


def config_from_hf(path: Path, has_lm_head: bool | None = None) -> tuple[ModelConfig, torch.dtype]:
    """Read an HF ``config.json`` (transformers 4 or 5 layout) into a :class:`ModelConfig` and the saved dtype.

    ValueError for a setting the model does not implement (see :func:`rlperf.model.config.read_hf_config`).
    """
    cfg, dtype_name = read_hf_config(path, has_lm_head)
    return cfg, _DTYPES[dtype_name]
