"""rlperf inside SGLang: a general plugin that makes an unmodified SGLang engine compute rlperf's bits.

SGLang (0.5.17) loads every setuptools entry point of the group ``sglang.srt.plugins`` (restricted by
the ``SGLANG_PLUGINS`` whitelist when that is set) before it builds its ``ServerArgs``, and again in
every scheduler / tensor-parallel worker process. rlperf declares one, ``rlperf =
rlperf.sglang_plugin:register``. :func:`register` adds an attention backend named ``rlperf``; an engine
started with it::

    python -m sglang.launch_server --model-path DIR --attention-backend rlperf --page-size 128 \\
        --enable-deterministic-inference

keeps SGLang's HTTP API, scheduler, radix cache, chunked prefill, decode CUDA graphs, router and
weight-update endpoints, and computes with rlperf's kernels:

* the model: ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` of :mod:`rlperf.sglang_plugin.models`, the
  layer math of rlperf's engine (:meth:`rlperf.model.qwen3.Qwen3ForCausalLM.forward_paged`) over
  SGLang's KV pool, viewed as rlperf's paged cache (pages of ``PAGE_SIZE`` tokens: why
  ``--page-size 128``);
* attention: :class:`rlperf.sglang_plugin.attention.RlperfAttnBackend` (the page table, query and KV
  lengths of each step, for eager steps and for the captured decode graphs);
* the sampler: :class:`rlperf.sglang_plugin.sampler.RlperfSampler`, rlperf's seeded sampling
  (``sampling_seed``, counter = the token's position) and the trainer's fused log-prob of the drawn
  token from the final hidden state.

So the log-probs SGLang returns are, bit for bit, those ``rlperf``'s trainer computes for the same
tokens (true on-policy), and a request's tokens do not depend on the batch it ran in.

Nothing changes for an engine started with another attention backend: the model registry and the
sampler are redirected only when the server's attention backend is ``rlperf``. An engine asking for
``rlperf`` with something the plugin does not support (another SGLang version, another model
architecture, another page size, pipeline or data parallelism, speculative decoding, a quantized KV
cache) stops at start with one line that names it (:class:`PluginError`); there is no silent fallback
to SGLang's kernels.

Tensor parallelism (``--tp-size N``) runs rlperf's tensor-parallel-invariant **tree numerics**, the
megatron trainer backend's: the model's ``config.json`` names the tree's leaf count S
(``"rlperf_reduction_leaves": 8``, which ``rlperf train`` writes into the folder it saves for its
engines); each worker holds its shard of the model (:class:`rlperf.model.qwen3.Qwen3ForCausalLM` with
SGLang's TP group) and every rank gets the bits of one GPU computing the same tree — equal to the
trainer's at TP=1, TP=2 (+SP) and PP=2. With that key and ``--tp-size 1`` the engine computes the tree
on one GPU. Without it, ``--tp-size`` > 1 runs **plain tensor parallelism**: rlperf's plain numerics (the
fsdp trainer's, one GPU's bits) with the q/k/v heads and the gate/up rows split over the ranks and the
row-parallel products run whole after an all-gather (:func:`rlperf.model.layer._plain_tp_layer`); MoE
layers run whole on every rank. MoE models run in the tree at ``--tp-size 1`` only (rlperf's trainers
have no MoE tensor parallelism in the tree to match).

``SGLANG_EXTERNAL_MODEL_PACKAGE=rlperf.sglang_plugin.models`` registers the two model classes the
other way SGLang offers; they still need ``--attention-backend rlperf`` (they say so otherwise).
"""
from __future__ import annotations

import logging

from .contract import (BACKEND_NAME, SUPPORTED_ARCHITECTURES, SUPPORTED_SGLANG_VERSIONS, PluginError,
                       active_server_args, check_sglang_version, tree_leaves_of, uses_rlperf)

logger = logging.getLogger(__name__)
_registered = False

__all__ = ["BACKEND_NAME", "SUPPORTED_ARCHITECTURES", "SUPPORTED_SGLANG_VERSIONS", "PluginError",
           "check_server_args", "check_sglang_version", "register", "uses_rlperf"]

def register() -> None:
    """The ``sglang.srt.plugins`` entry point: make ``--attention-backend rlperf`` known in this process.

    Idempotent (SGLang calls it once per process; the tests may call it again)."""
    global _registered
    if _registered:
        return
    import sglang
    from sglang.srt import server_args as sa
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for extend, choices in ((sa.add_attention_backend_choices, sa.ATTENTION_BACKEND_CHOICES),
                            (sa.add_deterministic_attention_backend_choices, sa.DETERMINISTIC_ATTENTION_BACKEND_CHOICES),
                            # prefill, chunked prefill and decode give the same bits: prefix reuse keeps them
                            (sa.add_radix_supported_deterministic_attention_backend_choices,
                             sa.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND)):
        if BACKEND_NAME not in choices:
            extend([BACKEND_NAME])

    @register_attention_backend(BACKEND_NAME)
    def _create_rlperf_backend(runner):
        from .attention import RlperfAttnBackend

        return RlperfAttnBackend(runner)

    HookRegistry.register("sglang.srt.server_args.ServerArgs.__post_init__", _after_server_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.models.registry._ModelRegistry.resolve_model_cls", _resolve_model_cls,
                          HookType.AROUND)
    HookRegistry.register("sglang.srt.layers.sampler.create_sampler", _create_sampler, HookType.AROUND)
    _registered = True
    logger.info("rlperf SGLang plugin registered (sglang %s): --attention-backend %s", sglang.__version__,
                BACKEND_NAME)


def check_server_args(server_args) -> None:
    """The checks an engine with ``--attention-backend rlperf`` must pass: :class:`PluginError`, one line.

    Also turns SGLang's prefill CUDA graphs off for it: they capture the extend forward in segments
    around each attention call, which the rlperf model (one call per layer, not ``RadixAttention``)
    does not have; decode steps still replay CUDA graphs."""
    import sglang
    from rlperf.kernels.attention import PAGE_SIZE

    check_sglang_version(sglang.__version__)
    if server_args.page_size != PAGE_SIZE:
        raise PluginError(f"--attention-backend {BACKEND_NAME} needs --page-size {PAGE_SIZE} (rlperf's KV block); "
                          f"got --page-size {server_args.page_size}")
    for flag, value, ok in (("--pp-size", server_args.pp_size, 1), ("--dp-size", server_args.dp_size, 1)):
        if value != ok:
            raise PluginError(f"--attention-backend {BACKEND_NAME} runs at {flag} 1 for now; got {flag} {value}")
    if server_args.speculative_algorithm is not None:
        raise PluginError(f"--attention-backend {BACKEND_NAME} does not run speculative decoding "
                          f"(--speculative-algorithm {server_args.speculative_algorithm})")
    if server_args.kv_cache_dtype not in ("auto", None):
        raise PluginError(f"--attention-backend {BACKEND_NAME} keeps the KV cache in the model's dtype; "
                          f"got --kv-cache-dtype {server_args.kv_cache_dtype}")
    try:
        hf_config = server_args.get_model_config().hf_config
        archs = hf_config.architectures or []
    except Exception as exc:  # SGLang reports an unreadable model itself; nothing to add here
        logger.debug("rlperf plugin: model config not readable yet (%s)", exc)
        hf_config, archs = None, []
    if archs and not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise PluginError(f"--attention-backend {BACKEND_NAME} supports {', '.join(SUPPORTED_ARCHITECTURES)}; "
                          f"the model at {server_args.model_path} is {', '.join(archs)}")
    if hf_config is not None:  # the tree numerics and the --tp-size split, checked before any worker starts
        tree_leaves_of(hf_config.to_dict(), server_args.tp_size, f"{server_args.model_path}/config.json")
    elif server_args.tp_size > 1:
        raise PluginError(f"--attention-backend {BACKEND_NAME} at --tp-size {server_args.tp_size} needs the model's "
                          f"config.json (its shapes, and rlperf_reduction_leaves for the tree numerics); "
                          f"{server_args.model_path} has none readable")
    from sglang.srt.model_executor.cuda_graph_config import Backend

    config = getattr(server_args, "cuda_graph_config", None)
    if config is not None and config.prefill.backend != Backend.DISABLED:
        logger.info("rlperf plugin: prefill CUDA graphs off (decode CUDA graphs stay on)")
        config.prefill.backend = Backend.DISABLED


def _after_server_args(result, server_args, *args, **kwargs):
    if uses_rlperf(server_args):
        check_server_args(server_args)
    return result


def _resolve_model_cls(original, registry, architectures, *args, **kwargs):
    server_args = active_server_args()
    if server_args is None or not uses_rlperf(server_args):
        return original(registry, architectures, *args, **kwargs)
    from . import models

    archs = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for arch in archs:
        if arch in models.ENTRY_CLASSES:
            return models.ENTRY_CLASSES[arch], arch
    raise PluginError(f"--attention-backend {BACKEND_NAME} supports {', '.join(SUPPORTED_ARCHITECTURES)}; "
                      f"this model is {', '.join(archs) or 'of no architecture'}")


def _create_sampler(original, *args, **kwargs):
    server_args = active_server_args()
    if server_args is None or not uses_rlperf(server_args):
        return original(*args, **kwargs)
    from .sampler import RlperfSampler

    return RlperfSampler()
