"""rlperf.model — a Qwen3-style decoder built only on rlperf.kernels ops.

``config``: model shapes (``ModelConfig``, presets). ``layer``: the functional decoder layer
(weights dataclass, RoPE table, prefill and decode forward) shared by the trainer, the rollout
engine and the layer-stack benchmark.
"""
from .config import PRESETS, ModelConfig, preset
from .layer import DecoderLayerWeights, RopeTable, decoder_layer_paged, decoder_layer_prefill, init_layer_weights

__all__ = [
    "PRESETS", "ModelConfig", "preset", "DecoderLayerWeights", "RopeTable", "decoder_layer_prefill",
    "decoder_layer_paged", "init_layer_weights",
]
