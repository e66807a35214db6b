"""The first-step gates' hook: one rollout and one train step of a run, then the worst-case memory probe,
recorded as a :class:`rlperf.loop.record.FirstStepRecord` (the gates import this hook and the record from
the loop, never the reverse).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .args import UsageError, memory_limit
from .data_parallel import errors_end_the_ranks, max_over_ranks
from .metrics import rollout_metrics
from .probe import worst_case_probe
from .record import PHASES, EngineMemory, FirstStepRecord, PhaseMemory
from .runner import Run, resolve

SECRET_FLAGS = ("sglang_api_key",)
"""Flags no record, report or log of the run may show."""


def first_step(args=None):
    """One rollout and one train step (no checkpoint), then the worst-case memory probe, as the gates' record.

    ``args``: argv list (``rlperf train`` flags) or a parsed namespace. The reference model is
    ``--ref-load``, else a frozen copy of the actor at step 0, and reference log-probs are always
    computed. Returns :class:`rlperf.loop.record.FirstStepRecord`.
    """
    ns = resolve(args)
    ta = ns.train_args
    if not (ta.use_kl_loss or ta.kl_coef):
        # the trainer computes reference log-probs (and builds the reference, a frozen copy of the
        # actor) only when the loss needs them: this step's trainer asks for a KL loss of
        # coefficient 0, which leaves the loss as it is; ns.train_args stays untouched
        ta = dataclasses.replace(ta, use_kl_loss=True, kl_loss_coef=0.0)
    t_setup = time.perf_counter()
    # on several ranks the gates cannot report an error: the other ranks wait in a collective
    with errors_end_the_ranks("the first step failed", keep=(UsageError,)):
        run = Run(ns, train_args=ta)
    setup_seconds = time.perf_counter() - t_setup
    try:
        with errors_end_the_ranks("the first step failed"):
            record = _first_step_record(run, ns)
            record.stage_seconds = {"setup": setup_seconds, **record.stage_seconds}
            record.setup_seconds = dict(run.setup_seconds)
            return record
    finally:
        run.close()


def _first_step_record(run: Run, ns) -> FirstStepRecord:
    first: dict = {}
    moe = bool(run.model.cfg.moe_layers)
    if moe:  # the routing_agreement gate compares the rollout's routing with the trainer's
        run.data_source.return_routed_experts = True
    t_step = time.perf_counter()
    run.sync(-1)
    run.meter.reset()
    samples, rollout_time = run.rollout(0)
    train_routed = None
    if moe:  # the trainer's own routers, on the weights the rollout ran (before this step's update)
        with run.kernels():
            train_routed = run.trainer.train_routed_experts(samples)
    m = rollout_metrics(samples, rollout_time)
    m.update(run.train(0, samples, on_first_micro_step=first.update))
    run.sync(0)
    engines = engine_memory(run)  # after the rollout and the weight sync: each engine's peak so far
    # worst case: the longest prompt of this step plus a full-length response, packed as densely as
    # the run packs (max_tokens_per_gpu or micro_batch_size samples); weights and grads untouched
    longest_prompt = max(s.prompt_length for s in run.last_train_samples)
    t_probe = time.perf_counter()
    with run.kernels():
        probe = worst_case_probe(run.trainer, longest_prompt + int(run.config.rollout.max_response_len))
    stages = {"step": t_probe - t_step, "probe": time.perf_counter() - t_probe}
    peaks = run.phase_peaks()  # data parallel: the worst rank's
    probe.peak_bytes = max_over_ranks({"probe": probe.peak_bytes})["probe"]
    if run.timeline is not None:
        run.timeline.save()
    cap = None
    if run.device.type == "cuda":
        cap = torch.cuda.get_device_properties(run.device).total_memory
    elif memory_limit(ns):
        cap = int(memory_limit(ns))
    config = {k: v for k, v in vars(ns).items()  # the gates' reports show it: never the API key
              if isinstance(v, (str, int, float, bool, type(None))) and k not in SECRET_FLAGS}
    return FirstStepRecord(
        samples=run.last_train_samples, first_micro_step=first, step_metrics=m,
        phases=[PhaseMemory(p, peaks[p]) for p in PHASES],
        capacity_bytes=cap, memory_kind=run.meter.kind, probe=probe, true_on_policy=run.config.true_on_policy,
        sglang_numerics=run.config.rollout.sglang.numerics if run.config.rollout.sglang is not None else None,
        config=config, engines=engines, ranks=run.world_size, train_routed_experts=train_routed,
        stage_seconds=stages)


def engine_memory(run: Run) -> list[EngineMemory]:
    """With engines of the run's own (``--rollout-num-gpus``): each one's memory as it reports it
    (:meth:`rlperf.loop.clients.RouterClient.engine_memory`; on several ranks rank 0 asks and every rank
    gets the answer, so every rank's gates check the same record). With engine processes on the trainer's
    GPU (``--colocate``: SGLang's engine, or rlperf serve workers behind ``--sglang-router-ip``): each one's,
    marked ``colocated`` (its fraction, where it reports none, the run's ``--sglang-mem-fraction-static``),
    for the oom_headroom gate to subtract from the trainer's limit. Else nothing: the in-process engine
    lives in the trainer's process, its memory in the phases' peaks."""
    r = run.config.rollout
    if r.disaggregated:
        return run.client.engine_memory()
    if not r.colocate or not hasattr(run.client, "engine_memory"):
        return []
    engines = run.client.engine_memory()
    for e in engines:
        e.colocated = True
        if e.fraction is None:
            e.fraction = r.mem_fraction_static
    return engines
