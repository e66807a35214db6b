"""Hand-built FirstStepRecords for the gate tests: a healthy one, and helpers to break it one way at a time."""
import torch

from rlperf.gates import PHASES, EngineMemory, FirstStepRecord, PhaseMemory
from rlperf.train import Sample

GiB = 2**30
SHAPES = [(7, 3), (12, 5), (33, 1), (40, 33)]  # (total length, response length): odd sizes, a 1-token response


def healthy_record(true_on_policy=True, noise=0.0, seed=0) -> FirstStepRecord:
    """Actor == reference bit for bit, rollout == actor (+ ``noise`` uniform in [0, noise) when not
    true-on-policy), finite metrics, every phase at most 5 GiB of 16 GiB."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (n, r) in enumerate(SHAPES):
        lp = -5 * torch.rand(r, generator=g) - 1e-3
        mask = torch.ones(r)
        if r > 3:
            mask[1] = 0  # a masked token in the middle (a tool's output)
        rollout = lp - noise * torch.rand(r, generator=g) if noise else lp.clone()
        samples.append(Sample(torch.randint(0, 1000, (n,), generator=g), r, reward=float(i % 2), loss_mask=mask,
                              rollout_log_probs=rollout, log_probs=lp.clone(), ref_log_probs=lp.clone()))
    first = {"train/loss": -0.25, "train/pg_loss": -0.25, "train/ppo_kl": 0.0, "train/pg_clipfrac": 0.0,
             "train/kl_loss": 0.0, "train/grad_norm": 0.75, "train/train_rollout_logprob_abs_diff": 0.0}
    step = dict(first)
    if noise:
        first.pop("train/train_rollout_logprob_abs_diff")
        step.pop("train/train_rollout_logprob_abs_diff")
    phases = [PhaseMemory(p, (k + 2) * GiB) for k, p in enumerate(PHASES)]  # 2, 3, 4, 5 GiB
    return FirstStepRecord(samples, first, step, phases, capacity_bytes=16 * GiB, memory_kind="cuda",
                           probe=PhaseMemory("train", 6 * GiB), true_on_policy=true_on_policy,
                           config={"max_tokens_per_gpu": 4096})


ENGINE_URLS = ["http://127.0.0.1:40001", "http://127.0.0.1:40002"]


def layout_record(engine_peaks_gib=(20, 30), ranks=2) -> FirstStepRecord:
    """:func:`healthy_record` of a run on ``ranks`` data-parallel ranks (its peaks the worst rank's) with
    two engines of its own on 80 GiB GPUs (:data:`ENGINE_URLS`), of the given peaks (a 16 GiB KV pool each)."""
    record = healthy_record()
    record.ranks = ranks
    record.engines = [EngineMemory(url, "cuda", 80 * GiB, int(peak * GiB), current_bytes=int(peak * GiB) - GiB,
                                   kv_pool_bytes=16 * GiB, device="cuda:0")
                      for url, peak in zip(ENGINE_URLS, engine_peaks_gib)]
    return record


def next_float(x: float) -> float:
    """The float32 one ulp above ``x`` (the smallest possible change)."""
    t = torch.tensor([x], dtype=torch.float32)
    return float(torch.nextafter(t, torch.tensor([1e30])))
