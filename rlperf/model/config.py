"""Qwen3-style model shapes (dense Qwen3 and Qwen3-MoE), with Hugging Face ``config.json`` field names.

:func:`read_hf_config` reads a checkpoint's ``config.json`` as written by transformers 4 (top-level
``rope_theta``, legacy ``rope_scaling``, ``torch_dtype``) or transformers 5 (``rope_parameters``,
``dtype``, ``null`` for fields it moved) and refuses, with a ``ValueError`` naming the field, any
setting this model does not implement (scaled RoPE, sliding-window layers, ...) instead of
ignoring it and computing different logits. Light to import (no torch).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Qwen3-style decoder (field names as in HF ``Qwen3Config`` / ``Qwen3MoeConfig``).

    ``num_experts`` 0 is the dense Qwen3. Otherwise layer i's MLP is a sparse expert block (router
    [E, H], E experts of intermediate size ``moe_intermediate_size``, top ``num_experts_per_tok``,
    weights renormalised when ``norm_topk_prob``) unless i is in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0``, where it is the dense MLP of ``intermediate_size``
    (:meth:`is_moe_layer`, the rule of transformers' ``Qwen3MoeDecoderLayer``).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.num_experts < 0:
            raise ValueError(f"num_experts={self.num_experts} must be >= 0 (0: a dense model)")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                                 f"{self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be positive")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
            bad = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_hidden_layers)]
            if bad:
                raise ValueError(f"mlp_only_layers {bad} are not layer indices in [0, {self.num_hidden_layers})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is the sparse expert block (class docstring)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        """The indices of the sparse expert layers, in order (empty for a dense model)."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def num_parameters(self) -> int:
        """Parameters of the model these shapes build (:class:`rlperf.model.qwen3.Qwen3ForCausalLM`),
        counted without building it: what a run's memory is estimated from before it allocates."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * self.head_dim + 2 * h
        dense = 3 * self.intermediate_size * h
        sparse = self.num_experts * h + self.num_experts * 3 * self.moe_intermediate_size * h
        layers = sum(attention + (sparse if self.is_moe_layer(i) else dense) for i in range(self.num_hidden_layers))
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + embeddings + h


_QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)

PRESETS: dict[str, ModelConfig] = {
    # small enough to train on 2 CPU cores; the embedded default of `rlperf train`
    "tiny": ModelConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024),
    "qwen3-0.6b": ModelConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-4b": ModelConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-8b": ModelConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    # Qwen3-MoE: the tiny one trains on 2 CPU cores (8 experts, top-2; layer 1 sparse, layer 0 dense
    # through mlp_only_layers, so both MLP kinds run)
    "qwen3-moe-tiny": ModelConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                  mlp_only_layers=(0,)),
    # Qwen3-30B-A3B (128 experts, top-8; 30.5B parameters, 3.3B active) and the same layer shape cut
    # to 2 layers (1.9B parameters: trainer with float32 masters + AdamW and an engine on one GPU)
    "qwen3-30b-a3b": ModelConfig(**_QWEN3_30B_A3B),
    "qwen3-30b-a3b-2l": ModelConfig(**{**_QWEN3_30B_A3B, "num_hidden_layers": 2}),
}


def preset(name: str) -> ModelConfig:
    """The preset called ``name`` (``tiny``, ``qwen3-0.6b``, ``qwen3-4b``, ``qwen3-8b``, ``qwen3-moe-tiny``,
    ``qwen3-30b-a3b``, ``qwen3-30b-a3b-2l``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}") from None


# ---- Hugging Face config.json ----------------------------------------------------------------------
HF_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_HF_DTYPE = "bfloat16"  # the dtype of a checkpoint whose config.json names none
SUPPORTED_ROPE = ("rlperf implements only rope_type 'default' (plain RoPE with one rope_theta; "
                  "rope_scaling null or {'rope_type': 'default'})")


REDUCTION_LEAVES_KEY = "rlperf_reduction_leaves"
"""The ``config.json`` key that names the leaf count S of the tensor-parallel-invariant tree numerics
(``rlperf.kernels.tree_reduce``; the model's ``reduction_leaves``) an engine loading the folder must compute
with: what rlperf's loop writes into the model folder it saves for SGLang engines when its trainer computes
in the tree (the megatron backend), and what rlperf's SGLang plugin reads. Absent: the plain numerics."""


def reduction_leaves_from_hf_dict(raw: dict, where: str = "config.json") -> int | None:
    """The tree leaf count a parsed ``config.json`` names (:data:`REDUCTION_LEAVES_KEY`), or None when it
    names none; ValueError (naming ``where``) for a value that is not a power of two >= 1."""
    value = raw.get(REDUCTION_LEAVES_KEY)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{where}: {REDUCTION_LEAVES_KEY} must be a power of two >= 1 (the trainer's tree leaf "
                         f"count, 8 by default), got {value!r}")
    return value


def check_tensor_parallel(cfg: ModelConfig, leaves: int | None, tp_size: int) -> None:
    """ValueError (one line) unless ``cfg`` computes in the tree of ``leaves`` leaves split over ``tp_size``
    tensor-parallel ranks the way the megatron trainer backend splits it: q/k/v heads and gate/up rows by
    rank, ``o_proj`` / ``down_proj`` K slices whose tree nodes are whole leaves, the vocabulary in rank
    slices of whole leaves. ``tp_size`` 1 checks the tree alone. ``leaves`` None: plain numerics, split
    as :class:`rlperf.model.qwen3.Qwen3ForCausalLM` splits them (the heads and the dense layers' gate/up
    rows by rank: ``tp_size`` must divide both head counts and ``intermediate_size``)."""
    if leaves is None:  # plain numerics: heads and intermediate rows by rank, row products after a gather
        if tp_size > 1:
            dense = len(cfg.moe_layers) < cfg.num_hidden_layers
            for what, n in (("query heads", cfg.num_attention_heads), ("key-value heads", cfg.num_key_value_heads),
                            ("intermediate_size", cfg.intermediate_size if dense else 0)):
                if n % tp_size:
                    raise ValueError(f"{tp_size} tensor-parallel ranks do not divide the {n} {what}")
        return
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"the tree leaf count must be a power of two >= 1, got {leaves}")
    if tp_size < 1 or leaves % tp_size:
        raise ValueError(f"{tp_size} tensor-parallel ranks do not divide the tree's {leaves} leaves")
    if tp_size > 1 and cfg.num_experts:
        raise ValueError(f"an MoE model runs at tensor-parallel size 1 (rlperf's trainers have no MoE tensor "
                         f"parallelism to match), got {tp_size}")
    blocks = min(leaves, cfg.num_key_value_heads)
    if (blocks & (blocks - 1) or cfg.num_key_value_heads % blocks or cfg.num_attention_heads % blocks
            or blocks % tp_size):
        raise ValueError(f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} key-value heads do not split "
                         f"into {blocks} head blocks over {tp_size} tensor-parallel ranks")
    dense = len(cfg.moe_layers) < cfg.num_hidden_layers
    for what, n in (("the query width (heads x head_dim)", cfg.q_size), ("the key-value width", cfg.kv_size),
                    ("intermediate_size", cfg.intermediate_size if dense else 0), ("vocab_size", cfg.vocab_size)):
        if n % leaves:
            raise ValueError(f"{what} {n} does not split into the tree's {leaves} leaves")


def read_hf_config(path: str | Path, has_lm_head: bool | None = None) -> tuple[ModelConfig, str]:
    """The :class:`ModelConfig` and the saved dtype name of an HF ``config.json`` (a file or its directory).

    FileNotFoundError without the file; ValueError for a malformed or unsupported config (the message
    names the file, the field and the value)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a checkpoint directory needs config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return config_from_hf_dict(raw, str(path), has_lm_head)


def config_from_hf_dict(raw: dict, where: str = "config.json",
                        has_lm_head: bool | None = None) -> tuple[ModelConfig, str]:
    """:class:`ModelConfig` and dtype name from a parsed HF ``config.json`` (transformers 4 or 5 layout).

    A ``null`` field counts as absent. Without ``tie_word_embeddings``, ``has_lm_head`` (whether the
    checkpoint holds ``lm_head.weight``) decides; when that is unknown too the result is untied,
    transformers' ``Qwen3Config`` default.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    present = {k: v for k, v in raw.items() if v is not None}
    if "num_experts" not in present and "num_local_experts" in present:
        # transformers 5's Qwen3MoeConfig keeps the expert count as num_local_experts (to_dict and saved files)
        present["num_experts"] = present["num_local_experts"]
    if present.get("model_type") == "qwen3_moe":  # transformers' Qwen3MoeConfig defaults for absent fields
        present = {**QWEN3_MOE_DEFAULTS, **present}
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"rope_theta"}
    kwargs = {k: present[k] for k in names if k in present}
    if "num_key_value_heads" not in kwargs and "num_attention_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # transformers: no GQA when absent
    if "head_dim" not in kwargs and "hidden_size" in kwargs and "num_attention_heads" in kwargs:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if "tie_word_embeddings" not in kwargs:
        kwargs["tie_word_embeddings"] = False if has_lm_head is None else not has_lm_head
    missing = [f.name for f in dataclasses.fields(ModelConfig)
               if f.default is dataclasses.MISSING and f.name not in kwargs]
    if missing:
        raise ValueError(f"{where}: missing (or null) fields {missing}")
    _check_supported(present, where)
    kwargs["rope_theta"] = _rope_theta(present, where)
    try:
        return ModelConfig(**kwargs), _dtype_name(present, where)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _rope_theta(raw: dict, where: str) -> float:
    """rope_theta from the top level (transformers 4), ``rope_parameters`` (5) or legacy ``rope_scaling``;
    every RoPE parameter set found must be plain RoPE and every theta given must agree."""
    found = []  # (field, theta)
    if "rope_theta" in raw:
        found.append(("rope_theta", raw["rope_theta"]))
    for field in ("rope_scaling", "rope_parameters"):
        if field not in raw:
            continue
        value = raw[field]
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {field} {value!r} is not supported: expected an object or null; "
                             f"{SUPPORTED_ROPE}")
        # transformers 5 may nest the parameters per layer type: {"full_attention": {...}, ...}
        nested = {k: v for k, v in value.items() if isinstance(v, dict)}
        groups = [(f"{field}.{k}", v) for k, v in nested.items()] if nested else [(field, value)]
        for name, params in groups:
            rope_type = params.get("rope_type") or params.get("type") or "default"
            if rope_type != "default":
                raise ValueError(f"{where}: {name} with rope_type {rope_type!r} is not supported "
                                 f"({name} = {json.dumps(params)}); {SUPPORTED_ROPE}")
            for key in ("mrope_section", "partial_rotary_factor"):
                if params.get(key) is not None and not (key == "partial_rotary_factor" and params[key] == 1):
                    raise ValueError(f"{where}: {name}.{key} = {params[key]!r} is not supported; {SUPPORTED_ROPE} "
                                     f"over the whole head_dim")
            if params.get("rope_theta") is not None:
                found.append((f"{name}.rope_theta", params["rope_theta"]))
    if not found:
        raise ValueError(f"{where}: no rope_theta (neither at the top level nor in rope_parameters or rope_scaling); "
                         f"transformers would assume 10000.0, rlperf's presets use {ModelConfig.rope_theta}: "
                         f"write the checkpoint's value into config.json")
    for name, theta in found:
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise ValueError(f"{where}: {name} = {theta!r} is not a positive number")
    if len({float(t) for _, t in found}) > 1:
        raise ValueError(f"{where}: conflicting RoPE bases: " + ", ".join(f"{n} = {t!r}" for n, t in found))
    return float(found[0][1])


QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
"""transformers' ``Qwen3MoeConfig`` defaults: a ``qwen3_moe`` config.json may leave these out."""

# Expert settings of other MoE families: each changes the computation and none is implemented.
_UNSUPPORTED_MOE_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                           "moe_layer_freq", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor")


def _check_supported(raw: dict, where: str) -> None:
    """Refuse settings that change the computation but that the model does not implement."""
    for field in _UNSUPPORTED_MOE_FIELDS:
        if raw.get(field) not in (None, 0, False):
            raise ValueError(f"{where}: {field} = {raw[field]!r} is not supported (rlperf implements Qwen3-MoE's "
                             f"expert block: routed experts only, no shared experts or grouped routing)")
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        if field in raw and (isinstance(raw[field], bool) or not isinstance(raw[field], int)):
            raise ValueError(f"{where}: {field} = {raw[field]!r} is not an integer")
    if "mlp_only_layers" in raw and not isinstance(raw["mlp_only_layers"], list):
        raise ValueError(f"{where}: mlp_only_layers = {raw['mlp_only_layers']!r} is not a list of layer indices")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (rlperf's MLP is SwiGLU: 'silu')")
    if raw.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias true is not supported (rlperf's attention projections have no bias)")
    prf = raw.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise ValueError(f"{where}: partial_rotary_factor = {prf!r} is not supported; {SUPPORTED_ROPE} over the "
                         f"whole head_dim")
    layer_types = raw.get("layer_types") if isinstance(raw.get("layer_types"), list) else None
    unknown = sorted({str(t) for t in layer_types or () if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ValueError(f"{where}: layer_types {unknown} are not supported (rlperf implements only "
                         f"'full_attention' layers)")
    # transformers' Qwen3: a layer attends through a window only with use_sliding_window true
    if raw.get("use_sliding_window") and raw.get("sliding_window") is not None:
        if layer_types is not None:
            sliding = "sliding_attention" in layer_types
        else:
            sliding = raw.get("num_hidden_layers", 0) > raw.get("max_window_layers", 28)
        if sliding:
            raise ValueError(f"{where}: use_sliding_window true with sliding_window {raw['sliding_window']} is not "
                             f"supported (rlperf implements only full attention)")


def _dtype_name(raw: dict, where: str) -> str:
    """The saved dtype: ``dtype`` (transformers 5) or ``torch_dtype`` (transformers 4), default bfloat16."""
    for field in ("dtype", "torch_dtype"):
        if field in raw:
            name = raw[field]
            name = name.removeprefix("torch.") if isinstance(name, str) else name
            if name not in HF_DTYPES:
                raise ValueError(f"{where}: {field} {raw[field]!r} is not supported; choose one of {list(HF_DTYPES)}")
            return name
    return DEFAULT_HF_DTYPE
