"""The four first-step gates, each a function ``FirstStepRecord, GateOptions -> GateResult``.

* :func:`kl_zero` — step 0: actor log-probs == reference log-probs bit for bit (KL exactly 0), and the
  first micro-step's ``train/ppo_kl`` and ``train/pg_clipfrac`` exactly 0 (the old log-probs and the
  training forward come from the same weights, so any difference is a non-invariant kernel path:
  packing, batch size or a different reduction order).
* :func:`logprob_abs_diff` — mean over loss-masked response tokens of ``|log_probs - rollout_log_probs|``
  (slime's ``train/train_rollout_logprob_abs_diff``): exactly 0 with ``--true-on-policy-mode``, at
  most ``--logprob-abs-diff-threshold`` otherwise.
* :func:`oom_headroom` — every phase's peak and the worst-case probe under ``(1 - headroom) x capacity``
  (several ranks: the worst rank's), and every rollout engine of the run's own under the same share of
  its own capacity.
* :func:`sanity` — finite losses, rewards and grad norm; every log-prob finite and ``<= 0``.

MoE runs add :func:`routing_agreement` (samples and the trainer's own routing in, a verdict out):
the share of (token, MoE layer) pairs the rollout and the trainer route to the same experts, 1.0
exactly with ``--true-on-policy-mode`` (batch-invariant routing). It runs after the four, as
``routing_agreement_gate``, whenever the first step's model has experts (:func:`gates_for`).

Messages name the first offender (sample, token position, token id, both values) so a failure
can be acted on without rerunning under a debugger.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from rlperf.loop.record import PHASES, SGLANG_KIND, FirstStepRecord, static_share

from .memory import format_bytes

DEFAULT_OOM_HEADROOM = 0.10
"""Fraction of capacity kept free: a first step at 90% leaves no room for longer samples later."""
DEFAULT_LOGPROB_ABS_DIFF_THRESHOLD = 0.05
SGLANG_NUMERICS_NAMES = {
    "rlperf": "SGLang engines, --sglang-numerics rlperf (rlperf's kernels through rlperf's SGLang plugin)",
    "sglang": "SGLang engines, --sglang-numerics sglang (SGLang's own kernels)",
}
"""How the logprob_abs_diff gate names the rollout's numerics (``FirstStepRecord.sglang_numerics``)."""
"""Outside true-on-policy mode: bf16 rollout engines and trainers typically differ by ~1e-2 per token
on average; 0.05 flags a mismatched model, tokenizer or temperature, not kernel rounding."""

OOM_REMEDIES = (
    "lower --max-tokens-per-gpu",
    "spread the trainer over more GPUs",
    "lower --sglang-mem-fraction-static (the in-process engine's share of the device; servers: --mem-fraction-static)",
)
"""The order of remedies for an out-of-memory first step (slime's: smaller micro-batches, more model
parallelism, a smaller engine share); :func:`oom_remedies` names, for the second, only what the run's layout
can take (context parallelism is not implemented, so it is never advised)."""


def oom_remedies(config: dict) -> list[str]:
    """:data:`OOM_REMEDIES` for a run of arguments ``config`` (``FirstStepRecord.config``), each with the flag
    that works in its layout and the flag's current value."""
    remedies = list(OOM_REMEDIES)
    if config.get("max_tokens_per_gpu"):
        remedies[0] += f" (now {config['max_tokens_per_gpu']})"
    if config.get("train_backend") == "megatron":
        remedies[1] = (f"split the model over more GPUs: --tensor-model-parallel-size (now "
                       f"{config.get('tensor_model_parallel_size', 1)}) or --pipeline-model-parallel-size (now "
                       f"{config.get('pipeline_model_parallel_size', 1)})")
    else:
        remedies[1] = (f"shard the trainer over more GPUs: --actor-num-gpus-per-node (now "
                       f"{config.get('actor_num_gpus_per_node', 1)}; FSDP2 splits weights, gradients and Adam state)")
    return remedies
ENGINE_OOM_REMEDIES = (
    "lower --sglang-mem-fraction-static (on a GPU the engine's KV pool takes that share of its memory, less the weights)",
    "lower --sglang-cuda-graph-max-bs (fewer decode batch sizes captured)",
)
"""What to try when a rollout engine's own peak is over the limit: its KV pool and CUDA graphs are what it sizes."""


@dataclasses.dataclass
class GateOptions:
    """Thresholds of the gates (the ``rlperf gate`` flags)."""

    oom_headroom: float = DEFAULT_OOM_HEADROOM
    """``--oom-headroom``: each peak must stay under ``(1 - oom_headroom) * capacity``; in [0, 1)."""
    logprob_abs_diff_threshold: float = DEFAULT_LOGPROB_ABS_DIFF_THRESHOLD
    """``--logprob-abs-diff-threshold``: the most mean |train - rollout| log-prob allowed outside true-on-policy mode."""

    def __post_init__(self):
        if not 0.0 <= self.oom_headroom < 1.0:
            raise ValueError(f"--oom-headroom must be in [0, 1), got {self.oom_headroom}")
        if not self.logprob_abs_diff_threshold >= 0.0:  # also rejects NaN
            raise ValueError(f"--logprob-abs-diff-threshold must be >= 0, got {self.logprob_abs_diff_threshold}")


@dataclasses.dataclass
class GateResult:
    """One gate's verdict.

    ``measured``: the values the verdict rests on (JSON-serializable); ``threshold``: what they were
    held to, in words or as a number; ``message``: the verdict, naming the first offender on failure;
    ``hint``: what to try when it failed (empty when it passed).
    """

    name: str
    passed: bool
    measured: dict
    threshold: object
    message: str
    hint: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _fmt(v: float) -> str:
    """A float with enough digits to show a one-ulp float32 difference."""
    return f"{v:.9g}"


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first element where ``a`` and ``b`` differ bit for bit (NaN == NaN only if same bits)."""
    import torch

    same = a.view(torch.int32) == b.view(torch.int32)
    if bool(same.all()):
        return None
    return int((~same).nonzero()[0])


def _token(record: FirstStepRecord, i: int, t: int) -> str:
    """``sample i, response token t (position p, id x)``: position in the full sequence, for the report."""
    s = record.samples[i]
    pos = s.total_length - s.response_length + t
    return f"sample {i}, response token {t} (position {pos}, token id {int(s.tokens[pos])})"


def kl_zero(record: FirstStepRecord, options: GateOptions | None = None) -> GateResult:
    """Step 0: ``log_probs`` == ``ref_log_probs`` bit for bit on every response token, and the first
    micro-step's ``train/ppo_kl`` == ``train/pg_clipfrac`` == 0 exactly.

    Samples without ``ref_log_probs`` (no reference model: neither ``--use-kl-loss`` nor ``--kl-coef``)
    are reported and only the two metrics are checked for them.
    """
    import torch

    name = "kl_zero"
    hint_ref = ("the actor and the reference must run the same weights through the same batch-invariant path: load "
                "the reference from the actor's checkpoint (--ref-load = --load at step 0), compute both with the "
                "same packing (--max-tokens-per-gpu, --micro-batch-size) on the invariant kernels (not the fast mode)")
    hint_train = ("the old log-probs (no grad) and the training forward must be bit-identical at step 0: use the "
                  "same micro-batch packing for both and the invariant kernels; a differing backward path or "
                  "autocast around only one of them breaks this")
    n_tokens = n_diff = 0
    max_abs = 0.0
    first = None
    without_ref = []
    for i, s in enumerate(record.samples):
        if s.log_probs is None:
            return GateResult(name, False, {"sample": i}, "exactly 0",
                              f"sample {i} has no log_probs: the actor's recomputed log-probs were not filled",
                              "fill Sample.log_probs (Trainer.prepare) before the gates run")
        if s.ref_log_probs is None:
            without_ref.append(i)
            continue
        a = s.log_probs.float().contiguous()
        b = s.ref_log_probs.float().contiguous()
        n_tokens += a.numel()
        diff = a.view(torch.int32) != b.view(torch.int32)
        n_diff += int(diff.sum())
        if bool(diff.any()):
            max_abs = max(max_abs, float((a.double() - b.double()).abs().nan_to_num(math.inf).max()))
            if first is None:
                t = _first_diff(a, b)
                first = (i, t, float(a[t]), float(b[t]))
    ppo_kl = record.first_micro_step.get("train/ppo_kl")
    clipfrac = record.first_micro_step.get("train/pg_clipfrac")
    measured = {"tokens_compared": n_tokens, "tokens_differing": n_diff, "max_abs_diff": max_abs,
                "train/ppo_kl": ppo_kl, "train/pg_clipfrac": clipfrac, "samples_without_ref": len(without_ref)}
    threshold = "bit-identical log-probs; train/ppo_kl == train/pg_clipfrac == 0"
    if first is not None:
        i, t, lp, ref = first
        return GateResult(name, False, measured, threshold,
                          f"log_probs differ from ref_log_probs at {_token(record, i, t)}: actor {_fmt(lp)} vs "
                          f"reference {_fmt(ref)} ({n_diff} of {n_tokens} tokens differ, max |diff| {max_abs:.3g})",
                          hint_ref)
    for key, value in (("train/ppo_kl", ppo_kl), ("train/pg_clipfrac", clipfrac)):
        if value is None:
            return GateResult(name, False, measured, threshold,
                              f"{key} missing from the first micro-step's metrics",
                              "the loop must record the first micro-step's metrics with slime's names")
        if value != 0.0:  # NaN fails here too
            return GateResult(name, False, measured, threshold,
                              f"{key} of the first micro-step is {value!r}, not exactly 0", hint_train)
    note = ""
    if without_ref:
        note = f"; {len(without_ref)} sample(s) without a reference (no --use-kl-loss / --kl-coef): metrics only"
    return GateResult(name, True, measured, threshold,
                      f"{n_tokens} response tokens bit-identical to the reference; ppo_kl and pg_clipfrac exactly 0{note}")


def logprob_abs_diff(record: FirstStepRecord, options: GateOptions | None = None) -> GateResult:
    """Mean over loss-masked response tokens (all samples) of ``|log_probs - rollout_log_probs|``.

    Must be exactly 0 with ``record.true_on_policy`` (``--true-on-policy-mode``), else at most
    ``options.logprob_abs_diff_threshold``; the same with SGLang engines of either ``--sglang-numerics``
    (``record.sglang_numerics``, which the message names: ``sglang``, SGLang's own kernels, is about 0.03 apart
    and fails true-on-policy mode, with a hint to ``rlperf``). With true-on-policy mode, the trainer's own
    ``train/train_rollout_logprob_abs_diff`` (when recorded) must be exactly 0 as well. The report
    names the worst token: sample, response position, token id, both values, and measures
    ``kl_rollout_train``: KL(rollout || train) per loss token, estimated from the rollout's own tokens
    with ``d = rollout - train`` as ``mean(exp(-d) - 1 + d)`` (k3: non-negative, 0 only where they agree).
    """
    import torch

    options = options or GateOptions()
    name = "logprob_abs_diff"
    limit = 0.0 if record.true_on_policy else options.logprob_abs_diff_threshold
    numerics = record.sglang_numerics
    threshold = (f"exactly 0 (true-on-policy mode{f', --sglang-numerics {numerics}' if numerics else ''})"
                 if record.true_on_policy else limit)
    named = f"; rollout: {SGLANG_NUMERICS_NAMES.get(numerics, numerics)}" if numerics else ""
    total = kl = 0.0
    count = 0
    worst = None  # (abs diff, sample, token, train, rollout)
    for i, s in enumerate(record.samples):
        if s.log_probs is None or s.rollout_log_probs is None:
            missing = "log_probs" if s.log_probs is None else "rollout_log_probs"
            return GateResult(name, False, {"sample": i}, threshold, f"sample {i} has no {missing}",
                              "the rollout must return per-token log-probs (return_logprob) and the trainer "
                              "must recompute them before the gates run")
        mask = s.loss_mask_tensor() > 0
        rollout = s.rollout_log_probs_tensor()
        delta = rollout.double() - s.log_probs.double()  # log(p_rollout / p_train) of the sampled token
        d = delta.abs()
        d = torch.where(mask, d.nan_to_num(math.inf), torch.zeros_like(d))  # a NaN is the worst token
        total += float(d.sum())
        # KL(rollout || train) estimated from the rollout's own samples (the k3 estimator: >= 0 per token)
        k3 = torch.expm1(-delta) + delta
        kl += float(torch.where(mask, k3.nan_to_num(math.inf), torch.zeros_like(k3)).sum())
        count += int(mask.sum())
        if bool(mask.any()):
            t = int(d.argmax())
            if worst is None or float(d[t]) > worst[0]:
                worst = (float(d[t]), i, t, float(s.log_probs[t]), float(rollout[t]))
    mean = total / count if count else 0.0
    metric = record.step_metrics.get("train/train_rollout_logprob_abs_diff",
                                     record.first_micro_step.get("train/train_rollout_logprob_abs_diff"))
    kl_mean = kl / count if count else 0.0
    measured = {"mean_abs_diff": mean, "loss_tokens": count, "train/train_rollout_logprob_abs_diff": metric,
                "max_abs_diff": worst[0] if worst else 0.0, "kl_rollout_train": kl_mean}
    where = ""
    if worst is not None and worst[0] > 0:
        where = (f"worst at {_token(record, worst[1], worst[2])}: train {_fmt(worst[3])} vs rollout "
                 f"{_fmt(worst[4])}")
    if count == 0:
        return GateResult(name, False, measured, threshold, "no loss-masked response token to compare" + named,
                          "every sample's loss_mask is 0: check the rollout's loss masks")
    if record.true_on_policy:
        hint = ("true-on-policy needs the rollout engine and the trainer to run the same batch-invariant kernels "
                "(same dtype, same attention and log-softmax reductions, same temperature); a difference means "
                "one side took a fast path or a different sampling temperature")
        if numerics == "sglang":
            hint = ("--sglang-numerics sglang runs SGLang's own kernels, which do not compute rlperf's bits (about "
                    "0.03 nats per token apart): --sglang-numerics rlperf runs rlperf's kernels in the SGLang engines "
                    "(exactly 0), or leave out --true-on-policy-mode to gate at --logprob-abs-diff-threshold")
        elif numerics == "rlperf":
            hint = ("--sglang-numerics rlperf: the SGLang engines must compute with rlperf's kernels through rlperf's "
                    "SGLang plugin; check in their logs (OUTPUT_DIR/engines) that the plugin loaded and served "
                    "--attention-backend rlperf, and that they run the trainer's dtype and --rollout-temperature; "
                    + hint)
        if mean != 0.0:
            return GateResult(name, False, measured, threshold,
                              f"mean |train - rollout| log-prob is {mean:.3g}, not exactly 0 (KL(rollout||train) "
                              f"{kl_mean:.3g} per token); {where}{named}", hint)
        if metric is not None and metric != 0.0:
            return GateResult(name, False, measured, threshold,
                              f"the trainer's train/train_rollout_logprob_abs_diff is {metric!r}, not exactly 0 "
                              f"(the record's log-probs agree: the training forward differs from the recompute)"
                              f"{named}", hint)
        return GateResult(name, True, measured, threshold,
                          f"{count} loss tokens: train and rollout log-probs identical{named}")
    if not mean <= limit:
        exact = " (with --rollout-backend sglang: --sglang-numerics rlperf)" if numerics else ""
        return GateResult(name, False, measured, threshold,
                          f"mean |train - rollout| log-prob {mean:.4g} > {limit:g} (KL(rollout||train) "
                          f"{kl_mean:.4g} per token); {where}{named}",
                          "check that rollout and trainer load the same weights (weight sync), the same tokenizer "
                          "and chat template, and the same --rollout-temperature; --true-on-policy-mode makes "
                          f"the difference exactly 0{exact}")
    return GateResult(name, True, measured, threshold,
                      f"mean |train - rollout| log-prob {mean:.4g} <= {limit:g} over {count} loss tokens"
                      + (f"; {where}" if where else "") + named)


def oom_headroom(record: FirstStepRecord, options: GateOptions | None = None) -> GateResult:
    """Every phase of :data:`PHASES` measured, and each peak (and the worst-case probe, if one ran)
    ``<= (1 - options.oom_headroom) * record.capacity_bytes``; then every rollout engine of the run's own
    (``record.engines``) at most the same share of its own capacity.

    Engines on the trainer's GPU (``colocated``: ``--colocate`` with SGLang's engine or rlperf serve
    workers) are not checked on their own: each one's static share (:func:`rlperf.loop.record.static_share`,
    as it reports it, else its ``--mem-fraction-static`` x capacity) comes off the trainer's limit, which
    becomes ``(1 - headroom) * capacity - shares``; the message names both numbers.

    ``capacity_bytes`` is the device's memory (``memory_kind == "cuda"``) or ``--memory-limit``
    against the process RSS (``"cpu_rss"``); with several ranks the peaks are the worst rank's. A
    failure names the first phase over the limit, in step order, and gives slime's OOM remedies in
    order, or else the first engine over its limit (its URL) and what sizes an engine. A pass names the
    highest peak relative to its capacity, of the trainer and the engines alike.
    """
    options = options or GateOptions()
    name = "oom_headroom"
    peaks = {p.phase: int(p.peak_bytes) for p in record.phases}
    if record.probe is not None:
        peaks[f"probe:{record.probe.phase}"] = int(record.probe.peak_bytes)
    measured = {"memory_kind": record.memory_kind, "capacity_bytes": record.capacity_bytes,
                "headroom": options.oom_headroom, "peaks_bytes": peaks,
                "probe_tokens": record.probe.tokens if record.probe is not None else None}
    if record.ranks > 1:
        measured["ranks"] = record.ranks  # the peaks are the worst rank's
    colocated = [e for e in record.engines if e.colocated]  # on the trainer's GPU: their share comes off its limit
    engines = [e for e in record.engines if not e.colocated]
    if engines:
        measured["engines"] = [_engine_measured(e, options.oom_headroom) for e in engines]
    if record.capacity_bytes is None or record.capacity_bytes <= 0:
        return GateResult(name, False, measured, None,
                          f"no capacity to check {record.memory_kind} peaks against",
                          "on the CPU pass --memory-limit (e.g. 8GiB); on a GPU the loop must record the device's memory")
    base = int((1.0 - options.oom_headroom) * record.capacity_bytes)
    limit, shared = base, ""
    if colocated:
        shares = [(e, *static_share(e, record.capacity_bytes)) for e in colocated]
        measured["colocated_engines"] = [{"url": e.url, "kind": e.kind, "static_share_bytes": b, "source": src,
                                          "fraction": e.fraction} for e, b, src in shares]
        unknown = [(e, src) for e, b, src in shares if b is None]
        if unknown:
            e, src = unknown[0]
            return GateResult(name, False, measured, None,
                              f"colocated engine {e.url} shares the trainer's GPU but {src}: cannot vouch for the "
                              f"trainer's limit", "give --sglang-mem-fraction-static (the engine's share of the GPU)")
        share = sum(b for _, b, _ in shares)
        limit = base - share
        measured["colocated_share_bytes"] = share
        each = ", ".join(f"{e.url} {format_bytes(b)} ({src.split(':')[0]})" for e, b, src in shares)
        shared = (f" - {format_bytes(share)} held by {len(shares)} colocated engine{'s' if len(shares) > 1 else ''} "
                  f"on the same GPU: {each}")
    measured["limit_bytes"] = limit
    threshold = (f"<= {format_bytes(limit)} ((1 - {options.oom_headroom:g}) x {format_bytes(record.capacity_bytes)}"
                 f"{shared})")
    if engines:
        threshold += f"; each engine <= (1 - {options.oom_headroom:g}) x its own capacity"
    missing = [p for p in PHASES if p not in peaks]
    if missing:
        return GateResult(name, False, measured, threshold,
                          f"phase(s) {', '.join(missing)} not measured: cannot vouch for their peak",
                          "the loop must measure every phase with rlperf.telemetry.PhaseMeter")
    hint = "in order: " + "; ".join(f"{k + 1}. {r}" for k, r in enumerate(oom_remedies(record.config)))
    order = [p for p in PHASES] + [p for p in peaks if p not in PHASES]  # step order, then extras and the probe
    for phase in order:
        peak = peaks[phase]
        if peak > limit:
            frac = peak / record.capacity_bytes
            if phase.startswith("probe:") and record.probe.tokens:
                phase = f"{phase} (worst-case micro-batch of {record.probe.tokens} tokens)"
            ranks = f" on the worst of {record.ranks} ranks" if record.ranks > 1 else ""
            if colocated:
                alone = f"; the trainer alone would fit under {format_bytes(base)}" if peak <= base else ""
                return GateResult(name, False, measured, threshold,
                                  f"phase {phase}: trainer peak {format_bytes(peak)}{ranks} ({frac:.1%} of "
                                  f"{format_bytes(record.capacity_bytes)} {record.memory_kind}) exceeds "
                                  f"{format_bytes(limit)} = {format_bytes(base)} (headroom {options.oom_headroom:g})"
                                  f"{shared}{alone}", hint)
            return GateResult(name, False, measured, threshold,
                              f"phase {phase}: peak {format_bytes(peak)}{ranks} ({frac:.1%} of "
                              f"{format_bytes(record.capacity_bytes)} {record.memory_kind}) exceeds {format_bytes(limit)} "
                              f"(headroom {options.oom_headroom:g})", hint)
    sglang = [e for e in engines if e.kind == SGLANG_KIND]  # on GPUs of their own they size themselves: listed, not checked
    own = [m for e, m in zip(engines, measured.get("engines", [])) if e.kind != SGLANG_KIND]
    engines = [e for e in engines if e.kind != SGLANG_KIND]
    for e, m in zip(engines, own):
        if e.peak_bytes is None or not e.capacity_bytes or e.capacity_bytes <= 0:
            what = "did not report its memory" if e.peak_bytes is None else "reported no capacity"
            return GateResult(name, False, measured, threshold,
                              f"engine {e.url} {what} (/get_server_info internal_states[0].memory): "
                              f"cannot vouch for its peak", "the run's engines must be rlperf serve processes")
        if e.peak_bytes > m["limit_bytes"]:
            kv = f"; its KV pool is {format_bytes(e.kv_pool_bytes)}" if e.kv_pool_bytes is not None else ""
            return GateResult(name, False, measured, threshold,
                              f"engine {e.url}: peak {format_bytes(e.peak_bytes)} ({m['fraction']:.1%} of "
                              f"{format_bytes(e.capacity_bytes)} {e.kind}) exceeds {format_bytes(m['limit_bytes'])} "
                              f"(headroom {options.oom_headroom:g}){kv}",
                              "in order: " + "; ".join(f"{k + 1}. {r}" for k, r in enumerate(ENGINE_OOM_REMEDIES)))
    # the worst relative to its own capacity: the trainer's phases share one, each engine has its own
    trainer_label = "trainer " if engines else ""
    candidates = [(trainer_label + phase, peak, record.capacity_bytes) for phase, peak in peaks.items()]
    candidates += [(f"engine {e.url}", e.peak_bytes, e.capacity_bytes) for e in engines]
    worst, peak, cap = max(candidates, key=lambda c: c[1] / c[2])
    measured["worst"] = {"name": worst, "peak_bytes": peak, "capacity_bytes": cap, "fraction": peak / cap}
    of = ""
    if engines:
        trainer = f"the trainer ({record.ranks} ranks)" if record.ranks > 1 else "the trainer"
        of = f", the worst of {trainer} and {len(engines)} engine{'s' if len(engines) > 1 else ''}"
    elif record.ranks > 1:
        of = f", the worst of {record.ranks} ranks"
    # without a probe the verdict covers this step's batch only, not the longest batch the run can see
    probe_note = "" if record.probe is not None else "; no worst-case probe ran"
    if sglang:
        probe_note += (f"; {len(sglang)} SGLang engine(s) hold a static {', '.join(format_bytes(e.peak_bytes) for e in sglang)} "
                       f"(weights + KV cache + graphs, sized by their --mem-fraction-static): not checked")
    if colocated:
        probe_note += f"; trainer limit {format_bytes(limit)} = {format_bytes(base)}{shared}"
    return GateResult(name, True, measured, threshold,
                      f"highest peak {worst} {format_bytes(peak)} = {peak / cap:.1%} of {format_bytes(cap)}{of}{probe_note}")


def _engine_measured(e, headroom: float) -> dict:
    """One engine's line of the oom_headroom report: what it reported, and its limit and share of capacity."""
    out = {"url": e.url, "kind": e.kind, "device": e.device, "capacity_bytes": e.capacity_bytes,
           "peak_bytes": e.peak_bytes, "current_bytes": e.current_bytes, "kv_pool_bytes": e.kv_pool_bytes}
    if e.capacity_bytes and e.capacity_bytes > 0:
        out["limit_bytes"] = int((1.0 - headroom) * e.capacity_bytes)
        if e.peak_bytes is not None:
            out["fraction"] = e.peak_bytes / e.capacity_bytes
    return out


def sanity(record: FirstStepRecord, options: GateOptions | None = None) -> GateResult:
    """Finite losses (metrics whose name contains ``loss``), rewards and ``train/grad_norm``; every
    recorded log-prob (``log_probs``, ``rollout_log_probs``, ``ref_log_probs``) finite and ``<= 0``."""
    import torch

    name = "sanity"
    threshold = "finite losses, rewards, grad norm; log-probs finite and <= 0"
    fail_hint = {
        "loss": "a non-finite loss: look for log(0) (a -inf log-prob), an empty loss mask or a bf16 overflow; "
                "try fp32 logits for the log-softmax",
        "reward": "the reward function returned a non-finite value: check --custom-rm-path on this sample",
        "grad": "a non-finite grad norm (the update was skipped): lower --lr, check the loss, keep --clip-grad on",
        "logprob": "a log-prob must be finite and <= 0: a positive value means an unnormalized softmax, a temperature "
                   "mismatch or a wrong token index",
    }
    for source, metrics in (("first micro-step", record.first_micro_step), ("step", record.step_metrics)):
        for key, value in metrics.items():
            if "loss" in key and not math.isfinite(value):
                return GateResult(name, False, {key: value}, threshold, f"{key} of the {source} is {value!r}",
                                  fail_hint["loss"])
    if not any("loss" in k for k in record.first_micro_step) and not any("loss" in k for k in record.step_metrics):
        return GateResult(name, False, {}, threshold, "no loss metric recorded (train/loss ...)",
                          "the loop must record the train step's metrics")
    grad = record.step_metrics.get("train/grad_norm", record.first_micro_step.get("train/grad_norm"))
    if grad is None or not math.isfinite(grad):
        return GateResult(name, False, {"train/grad_norm": grad}, threshold,
                          "train/grad_norm missing" if grad is None else f"train/grad_norm is {grad!r}",
                          fail_hint["grad"])
    n_lp = 0
    for i, s in enumerate(record.samples):
        if not math.isfinite(s.reward):
            return GateResult(name, False, {"sample": i, "reward": s.reward}, threshold,
                              f"sample {i} reward is {s.reward!r}", fail_hint["reward"])
        for field, v in (("log_probs", s.log_probs), ("rollout_log_probs", s.rollout_log_probs_tensor()),
                         ("ref_log_probs", s.ref_log_probs)):
            if v is None:
                continue
            n_lp += v.numel()
            bad = ~torch.isfinite(v) | (v > 0)
            if bool(bad.any()):
                t = int(bad.nonzero()[0])
                return GateResult(name, False, {"sample": i, "field": field, "value": float(v[t])}, threshold,
                                  f"{field} at {_token(record, i, t)} is {_fmt(float(v[t]))}", fail_hint["logprob"])
    rewards = [s.reward for s in record.samples]
    measured = {"train/grad_norm": grad, "log_probs_checked": n_lp,
                "reward_mean": sum(rewards) / len(rewards) if rewards else None}
    return GateResult(name, True, measured, threshold,
                      f"losses, {len(rewards)} rewards and grad norm {grad:.4g} finite; {n_lp} log-probs in (-inf, 0]")


GATES = {"kl_zero": kl_zero, "logprob_abs_diff": logprob_abs_diff, "oom_headroom": oom_headroom, "sanity": sanity}
"""Every gate, in the order they run and are reported."""


DEFAULT_MIN_ROUTING_AGREEMENT = 0.99
"""Outside true-on-policy mode: the least share of (token, MoE layer) pairs routed alike by the rollout
and the trainer; bf16 near-ties flip a few routing decisions, a mismatched model flips most."""


def routing_agreement(samples, train_routed_experts, true_on_policy: bool,
                      min_agreement: float = DEFAULT_MIN_ROUTING_AGREEMENT) -> GateResult:
    """Rollout vs training routing of an MoE model, gate-style.

    ``samples``: each with ``rollout_routed_experts`` [L_i - 1, MoE layers, k] (the engine's
    ``routed_experts``); ``train_routed_experts``: the trainer's routing of the same tokens, same
    layout (:func:`rlperf.train.compute_routed_experts`). Agreement = share of (token, layer) pairs
    whose expert sets are equal. Passes at exactly 1.0 with ``true_on_policy``, else at least
    ``min_agreement``. Missing or mis-shaped routing fails naming the sample, never raises.
    """
    import torch

    name = "routing_agreement"
    threshold = "exactly 1.0 (true-on-policy mode)" if true_on_policy else min_agreement
    if len(train_routed_experts) != len(samples):
        return GateResult(name, False, {"samples": len(samples), "train": len(train_routed_experts)}, threshold,
                          f"{len(samples)} samples but the trainer's routing of {len(train_routed_experts)}",
                          "compute the trainer's routing of the same samples (rlperf.train.compute_routed_experts)")
    same = total = 0
    first = None  # (sample, token, layer, rollout experts, train experts)
    for i, (s, train) in enumerate(zip(samples, train_routed_experts)):
        rollout = s.rollout_routed_experts
        if rollout is None or train is None:
            side = "rollout" if rollout is None else "trainer"
            return GateResult(name, False, {"sample": i}, threshold, f"sample {i} has no {side} routed experts",
                              "generate with return_routed_experts (meta_info['routed_experts'] -> "
                              "Sample.rollout_routed_experts) on an MoE model")
        rollout = torch.as_tensor(rollout)
        if tuple(rollout.shape) != tuple(train.shape):
            return GateResult(name, False, {"sample": i, "rollout_shape": list(rollout.shape),
                                            "train_shape": list(train.shape)}, threshold,
                              f"sample {i}: rollout routing {list(rollout.shape)} and training routing "
                              f"{list(train.shape)} cover different tokens or layers",
                              "both sides must run the same model (layers, top-k) on the same tokens")
        a, b = torch.sort(rollout.long(), -1).values, torch.sort(train.long(), -1).values
        eq = (a == b).all(-1)
        same += int(eq.sum())
        total += eq.numel()
        if first is None and not bool(eq.all()):
            t, layer = (int(v) for v in (~eq).nonzero()[0])
            first = (i, t, layer, a[t, layer].tolist(), b[t, layer].tolist())
    share = same / total if total else 1.0
    measured = {"agreement": share, "token_layers": total, "routed_alike": same}
    where = (f"; first difference at sample {first[0]}, token {first[1]}, MoE layer {first[2]}: rollout "
             f"{first[3]} vs train {first[4]}") if first else ""
    limit = 1.0 if true_on_policy else min_agreement
    if share < limit:
        return GateResult(name, False, measured, threshold, f"routing agreement {share:.6f} < {limit:g}{where}",
                          "the rollout and the trainer route differently: run both on the batch-invariant kernels "
                          "(--true-on-policy-mode) or replay the rollout's routing (--use-rollout-routing-replay)")
    return GateResult(name, True, measured, threshold, f"{total} token-layers routed alike by rollout and trainer"
                      if share == 1.0 else f"routing agreement {share:.6f} >= {limit:g}{where}")


def routing_agreement_gate(record: FirstStepRecord, options: GateOptions) -> GateResult:
    """:func:`routing_agreement` on a first step (its samples' rollout routing against
    ``record.train_routed_experts``): the gate the first step runs on MoE models (:data:`MOE_GATES`)."""
    return routing_agreement(record.samples, record.train_routed_experts or [], record.true_on_policy)


MOE_GATES = {"routing_agreement": routing_agreement_gate}
"""The gates added after :data:`GATES` when the first step ran an MoE model (its record has
``train_routed_experts``)."""


def gates_for(record: FirstStepRecord, gates: dict) -> dict:
    """``gates``, plus :data:`MOE_GATES` when ``record`` is an MoE model's first step."""
    return {**gates, **MOE_GATES} if record.train_routed_experts is not None else dict(gates)
