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


def tensor_parallel_group():
    """This worker's tensor-parallel process group: SGLang's ``get_tp_group().device_group`` at ``--tp-size``
    > 1, None at 1 or where SGLang made no groups (a model built outside an engine). The one place the
    plugin looks the group up (its tests put a gloo group of their own processes here)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    try:
        coordinator = get_tp_group()
    except AssertionError:  # no model-parallel groups in this process
        return None
    return coordinator.device_group if coordinator.world_size > 1 else None


def tree_leaves_of(hf_config: dict, tp_size: int, where: str) -> int | None:
    """The tree leaf count the engine computes with (``rlperf_reduction_leaves`` in the model's
    ``config.json``, :data:`rlperf.model.config.REDUCTION_LEAVES_KEY`; None: rlperf's plain numerics, at
    ``--tp-size`` > 1 in plain tensor parallelism), checked against the model's shapes and ``tp_size``:
    :class:`PluginError`, one line, for a value or a layout that cannot run."""
    from rlperf.model.config import REDUCTION_LEAVES_KEY, check_tensor_parallel, config_from_hf_dict, \
        reduction_leaves_from_hf_dict

    try:
        leaves = reduction_leaves_from_hf_dict(hf_config, where)
    except ValueError as exc:
        raise PluginError(str(exc)) from None
    if leaves is None and tp_size == 1:
        return None
    cfg, _ = config_from_hf_dict(hf_config, where)
    try:
        check_tensor_parallel(cfg, leaves, tp_size)
    except ValueError as exc:
        how = f"with {REDUCTION_LEAVES_KEY} {leaves}" if leaves is not None else "in plain numerics"
        raise PluginError(f"--attention-backend {BACKEND_NAME} at --tp-size {tp_size} {how}: {exc}") from None
    return leaves

