"""Qwen3-style model shapes, with Hugging Face ``config.json`` field names."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Qwen3-style decoder (field names as in HF ``Qwen3Config``)."""

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

    def __post_init__(self):
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
}


def preset(name: str) -> ModelConfig:
    """The preset called ``name`` (``tiny``, ``qwen3-0.6b``, ``qwen3-4b``, ``qwen3-8b``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}") from None
