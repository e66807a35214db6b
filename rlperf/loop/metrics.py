"""A run's metrics: what each rollout's line holds, the file it goes to and the line printed per step.

``OUTPUT_DIR/metrics.jsonl`` holds one JSON object per rollout, with slime's names: ``rollout/*``
(raw_reward, response_length, log_probs, ref_log_probs, rollout_log_probs, total_tokens; with
``--use-fault-tolerance`` the engines restarted), ``train/*`` (the trainer's, averaged over the rollout's
optimizer steps), ``perf/*`` (rollout_time, log_prob_time, train_time, update_weights_time, step_time,
tokens_per_sec, longest_sample_tokens_per_sec), ``memory/{phase}_peak_bytes`` with ``memory/kind``
(:class:`rlperf.telemetry.PhaseMeter`) and ``sync/weights_checksum``. docs/ARCHITECTURE.md lists them.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

METRICS_FILE = "metrics.jsonl"
PHASE_TIMES = (("train", "perf/train_time"), ("log_prob", "perf/log_prob_time"),
               ("weight_sync", "perf/update_weights_time"))
"""Each measured phase whose wall time a line holds, and its key."""


def mean_over_tokens(tensors) -> float:
    """The mean of the tokens of every tensor that is not None (float64), NaN without any."""
    ts = [t for t in tensors if t is not None]
    return float(torch.cat(ts).double().mean()) if ts else float("nan")


def rollout_metrics(samples, rollout_time: float) -> dict:
    """The rollout's rewards and lengths (``rollout_time``: its wall time, for the longest sample's rate)."""
    rewards = [s.reward for s in samples]
    lengths = [s.response_length for s in samples]
    return {"rollout/raw_reward": sum(rewards) / len(rewards),
            "rollout/response_length": sum(lengths) / len(lengths),
            "perf/longest_sample_tokens_per_sec": max(lengths) / rollout_time if rollout_time > 0 else 0.0}


def train_metrics(steps: list[dict], samples) -> dict:
    """The trainer's metrics averaged over the rollout's optimizer ``steps``, and the prepared ``samples``'
    log-prob means (actor, rollout, reference when computed)."""
    m = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
    m["rollout/log_probs"] = mean_over_tokens(s.log_probs for s in samples)
    m["rollout/rollout_log_probs"] = mean_over_tokens(s.rollout_log_probs_tensor() for s in samples)
    if any(s.ref_log_probs is not None for s in samples):
        m["rollout/ref_log_probs"] = mean_over_tokens(s.ref_log_probs for s in samples)
    return m


def fault_metrics(events) -> dict:
    """``--use-fault-tolerance``: the engines restarted since the previous line (restarted, synced and back in
    the router during this step): ``rollout/engine_restarts`` (how many), ``rollout/engines_restarted`` (their
    indices, comma-separated) and ``rollout/engine_out_s`` (the longest time one was out of service, from the
    failure found to back in the router). Empty without restarts."""
    if not events:
        return {}
    return {"rollout/engine_restarts": len(events),
            "rollout/engines_restarted": ",".join(str(e.engine) for e in events),
            "rollout/engine_out_s": max(e.out_s for e in events)}


def step_metrics(samples, rollout_time: float, step_time: float, times: dict, peaks: dict, memory_kind: str) -> dict:
    """The step's times, throughput and memory: ``step_time`` is rollout (or waiting for the overlapped one)
    + train + weight sync; ``times`` and ``peaks`` are the meter's per phase (peaks: the worst rank's)."""
    tokens = sum(s.total_length for s in samples)
    m = {"perf/rollout_time": rollout_time, "perf/step_time": step_time, "rollout/total_tokens": tokens,
         "perf/tokens_per_sec": tokens / step_time}
    m.update({key: times[phase] for phase, key in PHASE_TIMES if phase in times})
    m.update({f"memory/{phase}_peak_bytes": peak for phase, peak in peaks.items()})
    m["memory/kind"] = memory_kind
    return m


def open_metrics(path: Path, resume_from: int | None):
    """``metrics.jsonl`` opened for the run's lines. A fresh run (``resume_from`` None) starts it empty;
    a run resuming from the checkpoint of iteration ``resume_from`` keeps only the lines of rollouts
    before it: lines a killed run wrote after its last checkpoint (and a torn last line) go, so every
    rollout is in the file exactly once."""
    if resume_from is None:
        return open(path, "w")
    if path.exists():
        kept, dropped = [], 0
        for line in path.read_text().splitlines():
            try:
                rid = json.loads(line).get("rollout_id")
            except (ValueError, AttributeError):
                rid = None
            if isinstance(rid, int) and rid < resume_from:
                kept.append(line + "\n")
            elif line.strip():
                dropped += 1
        if dropped:
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            print(f"rlperf train: {path}: dropped {dropped} line(s) of rollouts >= {resume_from} (written after "
                  f"the checkpoint this run resumes from)", file=sys.stderr)
    return open(path, "a")


def isatty(stream) -> bool:
    """Whether ``stream`` is a terminal (False for a stream without ``isatty`` or a closed one)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def summary_line(m: dict, total: int) -> str:
    """The one line printed per step: reward, loss, clip fraction, KL, grad norm, abs diff and phase times."""
    def f(key, fmt="{:.4f}"):
        v = m.get(key)
        return "-" if v is None else fmt.format(v)

    return (f"rollout {m['rollout_id'] + 1}/{total} | reward {f('rollout/raw_reward', '{:.3f}')} | "
            f"loss {f('train/loss')} | pg_clipfrac {f('train/pg_clipfrac', '{:.3f}')} | ppo_kl {f('train/ppo_kl', '{:.2e}')}"
            f" | grad_norm {f('train/grad_norm', '{:.3f}')} | abs_diff {f('train/train_rollout_logprob_abs_diff', '{:.2e}')}"
            f" | rollout {f('perf/rollout_time', '{:.2f}')}s train {f('perf/train_time', '{:.2f}')}s "
            f"sync {f('perf/update_weights_time', '{:.3f}')}s")
