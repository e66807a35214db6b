"""The stand-in's ``load_plugins()``: with ``$FAKE_SGLANG_PLUGIN`` naming a plugin (the stand-in for
rlperf's installed entry point) that ``$SGLANG_PLUGINS`` lets through (SGLang's whitelist), it adds the
attention backend ``rlperf``, as rlperf's plugin does in SGLang; otherwise nothing is loaded."""
import os

from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices


def load_plugins():
    name = os.environ.get("FAKE_SGLANG_PLUGIN")
    allowed = [n.strip() for n in os.environ.get("SGLANG_PLUGINS", "").split(",") if n.strip()]
    if name and (not allowed or name in allowed) and "rlperf" not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices(["rlperf"])
