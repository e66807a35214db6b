"""What the first step hands to the gates: :class:`FirstStepRecord`.

The loop produces it (:func:`rlperf.loop.first_step`: one rollout and one train step, each phase
measured by :class:`rlperf.telemetry.PhaseMeter`, plus the worst-case probe of
:mod:`rlperf.loop.probe`); the gates (``rlperf.gates``) read only this record, so they can be tested
on hand-made records and run on any backend that can fill it. The record lives with its producer:
the gates import it from here, the loop never imports the gates.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the record's type names only: the gates' flags load without torch
    from rlperf.train.sample import Sample

PHASES = ("rollout", "log_prob", "train", "weight_sync")
"""Phases whose peak memory the oom_headroom gate checks, in step order."""


@dataclasses.dataclass
class PhaseMemory:
    """Peak memory of one phase, in bytes, of the kind named by :attr:`FirstStepRecord.memory_kind`."""

    phase: str
    peak_bytes: int
    tokens: int | None = None
    """Tokens of the micro-batch measured, where known (the worst-case probe sets it)."""


SGLANG_KIND = "sglang_static"
""":attr:`EngineMemory.kind` of a real SGLang server: ``peak_bytes`` is its static budget (weights + KV cache +
CUDA graphs, ``internal_states[0].memory_usage`` in GiB), which SGLang sized itself to ``--mem-fraction-static``
of its GPU; it reports no capacity, so the oom_headroom gate lists it without checking it when it has a GPU of its
own, and subtracts it from the trainer's limit when it shares the trainer's GPU (``--colocate``)."""
SGLANG_STATIC_PARTS = ("weight", "kvcache", "graph")


def _gib(part) -> float:
    """One ``memory_usage`` part in GiB: a number, or (SGLang 0.5.17's ``graph``) a mapping of its
    phases (decode, prefill, ...) to GiB, summed; absent: 0."""
    if isinstance(part, dict):
        return sum(_gib(v) for v in part.values())
    return float(part or 0.0)


@dataclasses.dataclass
class EngineMemory:
    """One rollout engine's memory after the first step's rollout and weight sync, as the engine reports
    it (``/get_server_info``: ``internal_states[0]["memory"]``, :meth:`rlperf.rollout.server.RolloutServer.memory`).

    ``url``: the engine (a worker the router lists). ``kind``: ``"cuda"`` or ``"cpu_rss"``, as
    :attr:`FirstStepRecord.memory_kind`; ``capacity_bytes``: its own device's memory (CPU: the host's);
    ``peak_bytes``: its peak since it started (None: the engine did not report its memory);
    ``kv_pool_bytes``: its KV cache's page pools; ``reserved_bytes``: CUDA's caching allocator (rlperf
    serve on CUDA). ``fraction``: its ``--mem-fraction-static`` as ``/get_server_info`` reports it (or, when
    it reports none, the run's flag). ``colocated``: it shares the trainer's GPU (``--colocate``), so the
    oom_headroom gate subtracts its static share (:func:`static_share`) from the trainer's limit.
    """

    url: str
    kind: str | None
    capacity_bytes: int | None
    peak_bytes: int | None
    current_bytes: int | None = None
    kv_pool_bytes: int | None = None
    device: str | None = None
    reserved_bytes: int | None = None
    fraction: float | None = None
    colocated: bool = False

    @classmethod
    def from_server_info(cls, url: str, info) -> EngineMemory:
        """From a ``/get_server_info`` reply; an engine that reports no memory (an SGLang server) gets
        ``peak_bytes`` None, which the oom_headroom gate reports as not measured."""
        fraction = info.get("mem_fraction_static") if isinstance(info, dict) else None
        fraction = float(fraction) if isinstance(fraction, (int, float)) and 0 < fraction <= 1 else None
        states = info.get("internal_states") if isinstance(info, dict) else None
        mem = states[0].get("memory") if states and isinstance(states[0], dict) else None
        usage = states[0].get("memory_usage") if states and isinstance(states[0], dict) else None
        if not isinstance(mem, dict) and isinstance(usage, dict):
            # a real SGLang server: the GiB its weights, KV cache and CUDA graphs hold (a static budget it
            # sized to --mem-fraction-static of its GPU), no peak and no capacity
            static = sum(_gib(usage.get(k)) for k in SGLANG_STATIC_PARTS)
            return cls(url, SGLANG_KIND, None, int(static * (1 << 30)), kv_pool_bytes=int(float(usage.get("kvcache") or 0)
                                                                                           * (1 << 30)), fraction=fraction)
        if not isinstance(mem, dict):
            return cls(url, None, None, None, fraction=fraction)
        return cls(url, mem.get("kind"), mem.get("capacity_bytes"), mem.get("peak_bytes"), mem.get("current_bytes"),
                   mem.get("kv_pool_bytes"), mem.get("device"), mem.get("reserved_bytes"), fraction)


def static_share(e: EngineMemory, capacity_bytes: int) -> tuple[int | None, str]:
    """What a colocated engine ``e`` holds of the GPU it shares with the trainer (``capacity_bytes``), and
    where the number comes from: an SGLang server's reported static budget (weights + KV cache + graphs);
    an rlperf serve process's reported peak or CUDA reservation, whichever is larger; where the engine
    reports nothing usable, its ``fraction`` x capacity (said so); (None, why) when neither is known."""
    if e.kind == SGLANG_KIND and e.peak_bytes:
        return int(e.peak_bytes), "reported: weights + KV cache + graphs (/get_server_info memory_usage)"
    reported = [v for v in (e.peak_bytes, e.reserved_bytes) if isinstance(v, int) and v > 0]
    if e.kind != SGLANG_KIND and reported:
        return max(reported), "reported: its process's peak / CUDA reservation (/get_server_info memory)"
    if e.fraction:
        return int(e.fraction * capacity_bytes), (f"configured: it reported no memory, so its --mem-fraction-static "
                                                  f"{e.fraction:g} x capacity")
    return None, "it reported no memory and no --mem-fraction-static"


@dataclasses.dataclass
class FirstStepRecord:
    """One rollout + one train step, as the gates see it.

    ``samples``: the step's :class:`rlperf.train.Sample` objects with ``rollout_log_probs`` (from the
    rollout engine, as the rollout returned them: read them with ``rollout_log_probs_tensor()``),
    ``log_probs`` (the actor recomputed before training), ``ref_log_probs`` (the frozen reference)
    and ``reward`` filled, the log-probs [response_length] float32; ``loss_mask_tensor()`` gives the mask.
    ``first_micro_step``: metrics of the first micro-step with slime's names (``train/ppo_kl``,
    ``train/pg_clipfrac``, ``train/loss``, ``train/grad_norm``, ...). ``step_metrics``: the whole
    step's metrics. ``phases``: measured peak per phase (:data:`PHASES`); ``probe``: the peak of a
    worst-case probe (the largest micro-batch the run can see), if one ran. ``capacity_bytes``: the
    device's memory, or ``--memory-limit`` on CPU. ``memory_kind``: ``"cuda"`` (allocator peaks) or
    ``"cpu_rss"`` (process resident set). ``true_on_policy``: ``--true-on-policy-mode`` was on.
    With several data-parallel ranks (``ranks``) each phase's peak and the probe's are the worst
    rank's. ``engines``: with rollout engines of their own (``--rollout-num-gpus``), each engine's
    memory (:class:`EngineMemory`), checked against its own capacity; with engine processes on the
    trainer's GPU (``--colocate``: SGLang's, or rlperf serve workers behind ``--sglang-router-ip``), each
    one's memory with ``colocated`` set, its static share subtracted from the trainer's limit; empty
    otherwise (the in-process engine's memory is the trainer process's own, in the phases' peaks). On an MoE model
    the samples also carry ``rollout_routed_experts`` (the first step's rollout asks for them).
    """

    samples: list[Sample]
    first_micro_step: dict[str, float]
    step_metrics: dict[str, float]
    phases: list[PhaseMemory]
    capacity_bytes: int | None
    memory_kind: str
    probe: PhaseMemory | None = None
    true_on_policy: bool = False
    sglang_numerics: str | None = None
    """``--rollout-backend sglang``: the engines' ``--sglang-numerics`` (``rlperf``: rlperf's kernels through rlperf's
    SGLang plugin, held to exactly 0 in true-on-policy mode like rlperf's own engines; ``sglang``: SGLang's own
    kernels); None for rlperf's engines. The logprob_abs_diff gate names it."""
    config: dict = dataclasses.field(default_factory=dict)
    """The run's arguments (for the report, and for the gates' hints: max_tokens_per_gpu ...)."""
    engines: list[EngineMemory] = dataclasses.field(default_factory=list)
    ranks: int = 1
    """Data-parallel actor ranks the phases' peaks are the worst of."""
    train_routed_experts: list | None = None
    """MoE models: the trainer's own routing of every sample (its routers, before the step's update;
    [L_i - 1, MoE layers, k] int32 per sample, the layout of ``Sample.rollout_routed_experts``), what
    the routing_agreement gate compares with the rollout's; None for a dense model (no such gate)."""
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Wall seconds of the first step's stages, in order: ``setup`` (the model, its reference copy, the
    trainer and the rollout engines), ``step`` (the initial weight sync, the rollout, the train step
    and its weight sync), ``probe`` (the worst-case memory probe). The gate report carries them."""
    setup_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """``setup`` split, in order (:attr:`rlperf.loop.runner.Run.setup_seconds`): ``model`` (the policy
    model built on its device, random init or loaded, and the tokenizer), ``data`` (the prompts and the
    reward), ``trainer`` (the embedded task's format warm-up, the reference copy, the trainer and its
    optimizer, a ``--load`` state), ``engines`` (the rollout client: an in-process engine with its KV
    cache, or engine processes started and healthy); the rest of ``setup`` is parsing and device
    set-up."""
