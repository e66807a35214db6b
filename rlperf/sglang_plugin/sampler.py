"""SGLang's sampler, rlperf's way: seeded batch-invariant draws and the trainer's log-prob of each draw.

For each sampled row b (SGLang passes the rows' logits ``[B, V]`` float32 and, from rlperf's model,
their final hidden states ``[B, H]``):

* the token is :func:`rlperf.kernels.sample` of the logits with the request's temperature, top-p,
  top-k, its ``sampling_seed`` and the counter ``position + 1`` — the index of the token being drawn,
  as rlperf's engine counts it — so a request's tokens depend on its seed and its tokens only, never on
  the batch (SGLang's deterministic mode gives every request without a seed the seed 42: send one seed
  per sample, or n samples of one prompt come out identical); ``min_p`` masks the logits below
  ``max + T log(min_p)`` first (a per-row rule, batch-invariant);
* its log-prob is the trainer's: ``model.token_logprobs(hidden, token, T)``
  (:func:`rlperf.kernels.fused_logprob`, or the vocabulary tree in tree mode, over the TP group's
  vocabulary slices at ``--tp-size`` N) under
  ``softmax(logits / T)`` before top-k / top-p, one call per temperature present (a row's bits do not
  depend on the other rows of the call).

Greedy requests: SGLang stores a request with temperature 0 as ``top_k = 1`` (and temperature 1); those
rows are drawn as rlperf's greedy rule (temperature 0 to :func:`rlperf.kernels.sample`: the argmax,
lowest index on ties — rlperf's engine's greedy tokens), and a batch of greedy rows only needs no
filter, so its step makes no host sync. The request temperatures the log-prob kernel takes are read
to the host once per batch composition (:func:`host_temperatures`), not at every step.

Top log-probs and token-id log-probs, when a request asks for them, are SGLang's own processing of
``log_softmax(logits / T)``; the sampled token's log-prob stays the exact one above.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch
from sglang.srt.layers.logprob_processor import OutputLogprobProcessor
from sglang.srt.layers.sampler import Sampler
from torch import nn

from rlperf import kernels as K

from .contract import PluginError

_MODEL: weakref.ReferenceType | None = None


def bind_model(model) -> None:
    """Make ``model`` (an :class:`rlperf.model.qwen3.Qwen3ForCausalLM`) the one this process's sampler
    takes log-probs with: SGLang builds the sampler apart from the model, one model per worker process."""
    global _MODEL
    _MODEL = weakref.ref(model)


def bound_model():
    model = _MODEL() if _MODEL is not None else None
    if model is None:
        raise PluginError("rlperf's sampler runs with rlperf's model classes (--attention-backend rlperf); "
                          "no rlperf model was built in this process")
    return model


def request_temperature(stored: float) -> float:
    """The temperature a request sent, from the float32 SGLang keeps it in: the shortest decimal that
    rounds to that float32 (``0.699999988`` -> ``0.7``). The trainer divides by the user's value, so the
    log-prob kernel must get that value, not its float32 rounding; a temperature of up to 7 significant
    digits comes back exactly."""
    return float(str(np.float32(stored)))


_HOST_TEMPERATURES: tuple | None = None  # (weakref of the tensor, its version, its request temperatures)


def host_temperatures(temperatures: torch.Tensor) -> list[float]:
    """The request temperatures (:func:`request_temperature`) of the rows of SGLang's ``temperatures``
    tensor, copied to the host once for as long as that tensor object is unchanged: SGLang builds a new
    tensor whenever the batch's requests change and keeps it for every decode step in between, so a
    steady decode batch makes no host sync here (a sync would stall SGLang's overlapped scheduling)."""
    global _HOST_TEMPERATURES
    cached = _HOST_TEMPERATURES
    if cached is not None and cached[0]() is temperatures and cached[1] == temperatures._version:
        return cached[2]
    values = [request_temperature(t) for t in temperatures.reshape(-1).tolist()]
    _HOST_TEMPERATURES = (weakref.ref(temperatures), temperatures._version, values)
    return values


def apply_min_p(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the logits whose probability under ``softmax(logits / T)`` is below ``min_p`` times
    the row's largest: ``(logit - max) / T < log(min_p)``. ``logits [B, V]``, ``temperatures [B]``,
    ``min_ps [B]`` (0 keeps every token)."""
    top = logits.max(dim=-1, keepdim=True).values
    floor = torch.log(min_ps.clamp_min(1e-30)).unsqueeze(-1) * temperatures.unsqueeze(-1)
    keep = (logits - top >= floor) | (min_ps <= 0).unsqueeze(-1)
    return logits.masked_fill(~keep, float("-inf"))


class RlperfSampler(Sampler):
    """The sampler of an engine with ``--attention-backend rlperf`` (module docstring)."""

    def __init__(self):
        nn.Module.__init__(self)  # not Sampler.__init__: the ranks draw the same tokens without a sync (same logits, seeds)
        self.output_logprob_processor = OutputLogprobProcessor()

    def forward(self, logits_output, sampling_info, return_logprob: bool, top_logprobs_nums, token_ids_logprobs,
                positions: torch.Tensor):
        logits = self._preprocess_logits(logits_output.next_token_logits, sampling_info)
        hidden = logits_output.hidden_states
        if hidden is None or hidden.shape[0] != logits.shape[0]:
            raise PluginError("rlperf's sampler needs the sampled rows' hidden states from rlperf's model")
        B = logits.shape[0]
        stored = sampling_info.temperatures
        temperatures = stored.reshape(-1)
        if sampling_info.need_min_p_sampling:
            logits = apply_min_p(logits, temperatures, sampling_info.min_ps)
        seeds = sampling_info.sampling_seed
        if seeds is None:  # not deterministic mode: a fresh seed per row and step (TP rank 0's on every rank)
            seeds = _same_on_every_rank(torch.randint(0, 1 << 62, (B,), dtype=torch.int64, device=logits.device))
        counters = positions.to(torch.int64) + 1  # the index of the token being drawn
        top_ks = sampling_info.top_ks
        if sampling_info.is_all_greedy:  # every row top_k <= 1: the argmax, which no filter changes
            draw_t, filtered = torch.zeros_like(temperatures), False
        else:
            draw_t = torch.where(top_ks == 1, 0.0, temperatures) if sampling_info.is_any_greedy else temperatures
            filtered = sampling_info.need_top_p_sampling or sampling_info.need_top_k_sampling
        tokens = K.sample(logits, draw_t, sampling_info.top_ps, top_ks, seeds, counters, check_values=False,
                          filtered=filtered)
        if return_logprob:
            logprobs = self._token_logprobs(hidden, tokens, stored)
            wants_more = (any(x > 0 for x in top_logprobs_nums or [])
                          or any(x is not None for x in token_ids_logprobs or []))
            if wants_more:
                full = torch.log_softmax(logits.float() / temperatures.clamp_min(1e-6).unsqueeze(-1), dim=-1)
                result = self.output_logprob_processor.compute_logprobs(full, top_logprobs_nums, token_ids_logprobs,
                                                                       tokens)
                result.token_logprobs = logprobs
                result.write_output_to(logits_output)
            else:
                logits_output.next_token_logprobs = logprobs
        return tokens

    @staticmethod
    def _token_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """``temperatures``: SGLang's tensor itself (``[B, 1]`` float32), the key of :func:`host_temperatures`."""
        model = bound_model()
        # the kernel takes one temperature per call, the request's own value (request_temperature)
        temps = host_temperatures(temperatures)
        groups = sorted(set(temps))
        if len(groups) == 1:
            t = groups[0]
            return model.token_logprobs(hidden, tokens, t if t > 0 else 1.0)
        out = torch.empty(tokens.shape[0], dtype=torch.float32, device=hidden.device)
        for t in groups:
            rows = torch.tensor([i for i, x in enumerate(temps) if x == t], device=hidden.device)
            out[rows] = model.token_logprobs(hidden[rows], tokens[rows], t if t > 0 else 1.0)
        return out


def _same_on_every_rank(seeds: torch.Tensor) -> torch.Tensor:
    """``seeds`` of the model's tensor-parallel rank 0 on every rank (the ranks hold the same logits, so
    with the same seeds they draw the same tokens, as SGLang's workers must)."""
    group = getattr(bound_model(), "tp_group", None)
    if group is None:
        return seeds
    import torch.distributed as dist

    dist.broadcast(seeds, src=dist.get_global_rank(group, 0), group=group)
    return seeds


__all__ = ["RlperfSampler", "apply_min_p", "bind_model", "bound_model", "host_temperatures", "request_temperature"]
