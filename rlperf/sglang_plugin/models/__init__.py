"""rlperf's model classes for SGLang, by architecture name.

SGLang's model registry imports every module of a package named by ``SGLANG_EXTERNAL_MODEL_PACKAGE`` and
registers each module's ``EntryClass`` under its class name, replacing SGLang's own; the plugin's
registry hook (:mod:`rlperf.sglang_plugin`) looks classes up in :data:`ENTRY_CLASSES` instead.
"""
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

ENTRY_CLASSES = {cls.__name__: cls for cls in (Qwen3ForCausalLM, Qwen3MoeForCausalLM)}

__all__ = ["ENTRY_CLASSES", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
