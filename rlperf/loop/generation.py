"""The loop's rollout function: prompts -> generations with log-probs -> rewards, as :class:`rlperf.train.Sample`.

The default rollout function :func:`generate_rollout` has slime's signature
``fn(args, rollout_id, data_source, evaluation=False) -> list[Sample]``; ``--rollout-function-path``
replaces it. ``--custom-generate-function-path`` replaces only the per-sample generation:
``fn(args, sample, sampling_params) -> sample`` gets a pending sample (``tokens`` = the prompt's
ids, ``response_length`` 0, ``prompt``, ``label``, ``metadata``, ``index``, ``group_index``) and a
:class:`rlperf.rollout.engine.SamplingParams` (its ``seed`` is the sample's), and fills what slime's
generate functions fill: ``tokens`` (prompt + response ids), ``response_length``, ``response``,
``rollout_log_probs`` (one per response token), ``status`` and, if not every token trains,
``loss_mask``. ``--custom-rm-path`` (``fn(args, sample) -> float``) then rewards each sample.

Seeds: sample ``j`` of prompt ``i`` in rollout ``k`` is drawn with seed
:func:`sample_seed` ``(seed, k, i * n + j)``, so a rollout's tokens are a function of the weights and
these numbers only (deterministic runs, exact resume).

``--save-debug-rollout-data`` / ``--load-debug-rollout-data``: :func:`save_rollout_data` and
:func:`load_rollout_data`, one JSON object per sample (:meth:`rlperf.train.Sample.to_dict`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rlperf.rollout.engine import SamplingParams
from rlperf.train import Sample

from .config import RolloutConfig


@dataclasses.dataclass
class DataSource:
    """What a rollout function gets as ``data_source``: prompts, the client, tokenizer and reward."""

    dataset: object
    client: object
    """:class:`rlperf.loop.clients.EngineClient` or :class:`rlperf.loop.clients.RouterClient`."""
    tokenizer: object
    reward_fn: object
    custom_generate: object = None
    return_routed_experts: bool = False
    """MoE models: ask the engines for every token's routed experts (SGLang's ``return_routed_experts``)
    and keep them as ``Sample.rollout_routed_experts`` (routing replay, the routing-agreement gate)."""

    def prompts(self, rollout_id: int, size: int):
        return self.dataset.batch(rollout_id, size)


def sample_seed(seed: int, rollout_id: int, index: int) -> int:
    return (seed * 1_000_003 + rollout_id * 100_003 + index) % (1 << 62)


def sampling_params_for(args, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.rollout_max_response_len, temperature=args.rollout_temperature,
                          top_p=args.rollout_top_p, top_k=args.rollout_top_k, seed=seed)


def rollout_kv_tokens(rollout: RolloutConfig, records, tokenizer, page_size: int) -> int:
    """KV-cache tokens an in-process engine needs to hold one whole rollout at once: each of the
    ``rollout.batch_size x rollout.n_samples_per_prompt`` sequences at the longest prompt of ``records``
    plus ``rollout.max_response_len``, rounded up to whole pages. Sizing the cache by this (not by
    a fraction of the device) leaves the rest of the memory to training when the engine and the
    trainer share a device; nothing is ever retracted for lack of pages."""
    longest = max((len(tokenizer.encode(r.prompt)) for r in records), default=1)
    per_seq = -(-(longest + rollout.max_response_len) // page_size) * page_size
    return rollout.batch_size * rollout.n_samples_per_prompt * per_seq


def generate_rollout(args, rollout_id: int, data_source: DataSource, evaluation: bool = False) -> list[Sample]:
    """The default rollout: ``rollout_batch_size`` prompts x ``n_samples_per_prompt`` generations, rewarded."""
    n, tok = args.n_samples_per_prompt, data_source.tokenizer
    samples = []
    for g, rec in enumerate(data_source.prompts(rollout_id, args.rollout_batch_size)):
        ids = tok.encode(rec.prompt)
        for j in range(n):
            samples.append(Sample(list(ids), 0, group_index=g, index=g * n + j, prompt=rec.prompt, label=rec.label,
                                  metadata=dict(rec.metadata)))
    params = [sampling_params_for(args, sample_seed(args.seed, rollout_id, s.index)) for s in samples]
    if data_source.custom_generate is not None:
        samples = [data_source.custom_generate(args, s, sp) for s, sp in zip(samples, params)]
    else:
        routed = dict(return_routed_experts=True) if data_source.return_routed_experts else {}
        outs = data_source.client.generate([list(s.tokens) for s in samples], params, **routed)
        for s, out in zip(samples, outs):
            s.tokens = list(s.tokens) + out.output_ids
            s.response_length = len(out.output_ids)
            s.rollout_log_probs = out.output_logprobs
            s.response = out.text
            s.status = Sample.Status.of_finish_reason(out.finish_type)
            if routed:
                s.rollout_routed_experts = out.routed_experts  # None when the engine sent none: replay names the sample
    for s in samples:
        s.reward = float(data_source.reward_fn(args, s))
    return samples


def save_rollout_data(path, samples: list[Sample]) -> None:
    """``--save-debug-rollout-data``: one JSON object per sample (plain data, never a pickle)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in samples))
    tmp.replace(path)


def load_rollout_data(path) -> list[Sample]:
    """``--load-debug-rollout-data``: the samples :func:`save_rollout_data` wrote (same floats, bit for bit)."""
    with open(path) as f:
        return [Sample.from_dict(json.loads(line)) for line in f if line.strip()]
