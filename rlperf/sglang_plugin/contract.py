"""The names and checks every part of the SGLang plugin shares (imports nothing of the plugin)."""
from __future__ import annotations

BACKEND_NAME = "rlperf"
"""The ``--attention-backend`` value that turns rlperf's numerics on."""
SUPPORTED_SGLANG_VERSIONS = ("0.5.17",)
"""SGLang releases whose internals (model runner, attention backend and sampler contracts) the plugin
is written and tested against."""
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class PluginError(ValueError):
    """An engine asked for rlperf's numerics with something the plugin does not support."""


def check_sglang_version(version: str) -> None:
    """:class:`PluginError` unless ``version`` is one the plugin supports."""
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise PluginError(f"rlperf's SGLang plugin supports sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)}; "
                          f"this is sglang {version}: install sglang=={SUPPORTED_SGLANG_VERSIONS[-1]} or pick "
                          f"another --attention-backend")


def uses_rlperf(server_args) -> bool:
    """Whether an SGLang ``ServerArgs`` selects rlperf's numerics (any of its attention backends)."""
    names = (getattr(server_args, "attention_backend", None), getattr(server_args, "prefill_attention_backend", None),
             getattr(server_args, "decode_attention_backend", None))
    return BACKEND_NAME in names


def active_server_args():
    """This process's ``ServerArgs`` (a scheduler / worker process has one), or None."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:
        return None
