"""SGLang's ``Qwen3ForCausalLM`` on rlperf's kernels: rlperf's engine step inside SGLang's model runner.

SGLang builds the model from the checkpoint's ``config.json`` (``__init__(config, quant_config,
prefix)``), fills it with :meth:`Qwen3ForCausalLM.load_weights` (its loader, ``--load-format dummy``,
and the weight-update endpoints ``/update_weights_from_distributed`` and ``/update_weights_from_tensor``
all go through it, with Hugging Face names), then calls :meth:`Qwen3ForCausalLM.forward` for every
step, eager or inside a captured decode graph.

The forward is :meth:`rlperf.model.qwen3.Qwen3ForCausalLM.forward_paged` — the function rlperf's own
engine runs — over SGLang's KV pool seen as rlperf's paged cache, with the step's page table, query and
KV lengths from the ``rlperf`` attention backend (:mod:`rlperf.sglang_plugin.attention`). It returns
SGLang's ``LogitsProcessorOutput`` for the sampled rows (each request's last new token):

* ``next_token_logits [B, V] float32`` — rlperf's batch-invariant LM-head product (``model.logits``),
  what rlperf's seeded sampler draws from;
* ``hidden_states [B, H]`` — those rows' final hidden states, from which the sampler
  (:mod:`rlperf.sglang_plugin.sampler`) takes the drawn token's log-prob with the trainer's fused
  kernel.

An engine started with ``--enable-return-routed-experts`` gets, for a MoE model, every token's experts
in every MoE layer (rlperf's batch-invariant routing, recorded in the forward, also inside the decode
graphs) through SGLang's capturer: ``meta_info["routed_experts"]``, what the trainer replays.

At ``--tp-size`` N (tree numerics, or plain numerics in plain tensor parallelism: :mod:`rlperf.sglang_plugin`)
the rlperf model is this worker's shard over SGLang's TP group
(:func:`rlperf.sglang_plugin.contract.tensor_parallel_group`), SGLang's KV pool holds this worker's
key-value heads, and ``next_token_logits`` are the whole vocabulary's (gathered in tree mode, whole on
every rank in plain mode): every rank samples the same token.

A request that asks for input-token log-probs (``logprob_start_len`` inside its prompt) gets them from
SGLang's own logits processor over the same hidden states, with rlperf's LM-head product; those are not
the training path's numbers (the trainer recomputes the response's log-probs only).
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from rlperf import kernels as K
from rlperf.kernels.tree_reduce import group_size_rank
from rlperf.model.config import config_from_hf_dict
from rlperf.model.moe import RoutingTrace
from rlperf.model.qwen3 import Qwen3ForCausalLM as RlperfQwen3
from rlperf.model.qwen3 import hf_shard, hf_shard_dim

from .. import contract
from ..contract import BACKEND_NAME, PluginError, active_server_args, uses_rlperf
from ..attention import RlperfAttnBackend

_ROTARY_BUFFER = "rotary_emb.inv_freq"


class _RlperfLogits:
    """An LM-head "quant method" for SGLang's logits processor: rlperf's product, float32 logits."""

    def apply(self, layer, x, bias=None):
        return K.linear(x, layer.weight, out_dtype=torch.float32)


class _Head(nn.Module):
    """The LM head as SGLang's logits processor wants it: ``weight`` [V, H] and a ``quant_method``."""

    def __init__(self, model: RlperfQwen3):
        super().__init__()
        self._model = weakref.ref(model)
        self.quant_method = _RlperfLogits()

    @property
    def weight(self) -> torch.Tensor:
        return self._model().head_weight


class Qwen3ForCausalLM(nn.Module):
    """rlperf's Qwen3 behind SGLang's model interface (module docstring).

    ``self.model`` is an :class:`rlperf.model.qwen3.Qwen3ForCausalLM` in the fused layout (q/k/v and
    gate/up one matrix each), in SGLang's model dtype on SGLang's device.
    """

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__()
        arch = type(self).__name__
        server_args = active_server_args()
        if server_args is not None and not uses_rlperf(server_args):
            raise PluginError(f"rlperf's {arch} (SGLANG_EXTERNAL_MODEL_PACKAGE) computes with rlperf's kernels: "
                              f"start the engine with --attention-backend {BACKEND_NAME}")
        if quant_config is not None:
            raise PluginError(f"rlperf's {arch} runs unquantized weights; got {type(quant_config).__name__}")
        where = f"the model's config.json ({arch})"
        cfg, _ = config_from_hf_dict(config.to_dict(), where)
        self.config = config
        self.quant_config = None
        self.cfg = cfg
        group = contract.tensor_parallel_group()
        self.tp_size, self.tp_rank = group_size_rank(group)
        leaves = contract.tree_leaves_of(config.to_dict(), self.tp_size, where)
        dtype, device = torch.get_default_dtype(), torch.get_default_device()
        # SGLang builds models under `with torch.device(target)`; rlperf's RoPE tables are computed on
        # the CPU (float64, then float32) and moved, as the trainer's are: the same bits on every device
        with torch.device("cpu"):
            self.model = RlperfQwen3(cfg, dtype, device, reduction_leaves=leaves, tp_group=group)
        self._hf_targets: dict[str, torch.Tensor] | None = None
        self._logits_processor = None
        from ..sampler import bind_model

        bind_model(self.model)

    # ---- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """Copy HF-named ``(name, tensor)`` pairs into the fused parameters (slices of q/k/v and gate/up).

        At ``--tp-size`` N every worker gets the whole tensors (SGLang's loader and both weight-update
        endpoints hand each rank all of them) and keeps its shard (:func:`rlperf.model.qwen3.hf_shard`).
        ``lm_head.weight`` of a tied model and RoPE's ``inv_freq`` buffers are skipped; any other name the
        model does not have, or a wrong shape, is a :class:`PluginError` naming it (a weight update
        never drops a tensor silently)."""
        if self._hf_targets is None:
            self._hf_targets = self.model.hf_state_dict()
        targets = self._hf_targets
        for name, tensor in weights:
            dst = targets.get(name)
            if dst is None:
                if name.endswith(_ROTARY_BUFFER) or (name == "lm_head.weight" and self.model.lm_head is None):
                    continue
                raise PluginError(f"rlperf's {type(self).__name__} has no weight {name!r}")
            whole = list(dst.shape)
            plain = self.model.plain_tp
            dim = hf_shard_dim(name, plain) if self.tp_size > 1 else None
            if dim is not None:
                whole[dim] *= self.tp_size
            if list(tensor.shape) != whole:
                raise PluginError(f"weight {name!r}: shape {tuple(tensor.shape)}, the model expects {tuple(whole)}")
            dst.copy_(hf_shard(name, tensor, self.tp_size, self.tp_rank, plain).to(device=dst.device, dtype=dst.dtype))

    def get_input_embeddings(self) -> torch.Tensor:
        return self.model.embed_tokens

    @property
    def start_layer(self) -> int:
        return 0

    @property
    def end_layer(self) -> int:
        return self.cfg.num_hidden_layers

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, input_embeds=None,
                get_embedding: bool = False, pp_proxy_tensors=None, **kwargs):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.model_executor.forward_context import get_attn_backend

        if input_embeds is not None or get_embedding:
            raise PluginError(f"rlperf's {type(self).__name__} generates from token ids (no input_embeds, no "
                              f"embedding requests)")
        backend = get_attn_backend()  # the runner's, set around every forward (SGLang's forward context)
        if not isinstance(backend, RlperfAttnBackend):
            raise PluginError(f"rlperf's {type(self).__name__} needs --attention-backend {BACKEND_NAME}; the engine "
                              f"runs {type(backend).__name__}")
        meta = backend.forward_metadata
        caches = [backend.kv_cache(i) for i in range(self.cfg.num_hidden_layers)]
        capturer = _experts_capturer() if self.cfg.moe_layers else None
        routing = RoutingTrace() if capturer is not None else None
        hidden = self.model.forward_paged(input_ids, positions.to(torch.int64), caches,
                                          forward_batch.out_cache_loc.to(torch.int64), meta.page_table,
                                          meta.cu_seqlens_q, meta.kv_lens, routing)
        if routing is not None:  # --enable-return-routed-experts: every MoE layer's [T, k] experts to SGLang
            for layer_id, experts in zip(self.cfg.moe_layers, routing.recorded):
                capturer.capture(layer_id=layer_id, topk_indices=experts)
        if forward_batch.forward_mode.is_decode_or_idle():
            last = hidden
        else:  # each request's last new token (a chunk that ends mid-prompt samples a token SGLang drops)
            last = hidden[meta.cu_seqlens_q[1:].long() - 1]
        out = LogitsProcessorOutput(next_token_logits=self.model.logits(last), hidden_states=last)
        if _wants_input_logprobs(forward_batch):
            out = self._with_input_logprobs(input_ids, hidden, forward_batch, out)
        return out

    def _with_input_logprobs(self, input_ids, hidden, forward_batch, out):
        """SGLang's logits processor for the input-token log-probs of this extend step (module docstring);
        the sampled rows' logits and hidden states stay rlperf's."""
        from sglang.srt.layers.logits_processor import LogitsProcessor

        if self._logits_processor is None:
            self._logits_processor = LogitsProcessor(self.config)
        full = self._logits_processor(input_ids, hidden, _Head(self.model), forward_batch)
        full.next_token_logits, full.hidden_states = out.next_token_logits, out.hidden_states
        return full


def _experts_capturer():
    """SGLang's routed-experts capturer (an engine started with ``--enable-return-routed-experts``), or None."""
    try:
        from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

        return get_global_experts_capturer()
    except Exception:  # no runtime resources in this process: nothing captures
        return None


def _wants_input_logprobs(forward_batch) -> bool:
    if not forward_batch.return_logprob or forward_batch.forward_mode.is_decode_or_idle():
        return False
    starts, lens = forward_batch.extend_logprob_start_lens_cpu, forward_batch.extend_seq_lens_cpu
    return bool(starts) and any(s < n for s, n in zip(starts, lens))


EntryClass = Qwen3ForCausalLM
