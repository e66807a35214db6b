"""The worst-case probe of the ``oom_headroom`` gate: one training forward + backward at the largest
micro-batch the run can see, measured like a phase (:class:`rlperf.telemetry.PhaseMeter`).

The loop runs it after the first step (:func:`rlperf.loop.first_step`) and puts its peak in
:attr:`rlperf.loop.record.FirstStepRecord.probe`; the gate only compares that number with the capacity.

The first step's batch is whatever the rollout happened to produce; a run OOMs later, on the
longest samples. The largest micro-batch is:

* with ``--use-dynamic-batch-size``: ``max_tokens_per_gpu`` tokens, filled with samples of
  ``sample_length`` tokens (the longest possible: prompt + ``--rollout-max-response-len``) and the
  rest (the trainer refuses a sample longer than the budget, so that is a usage error here too);
* otherwise ``micro_batch_size`` samples of ``sample_length`` tokens.

Every token but the first of each sample is a response token: the most log-prob rows, so the
largest logits / log-prob workspace. The probe runs the trainer's own log-prob path with grad and a
backward of a loss of the same shape as the policy loss, then puts the gradients back as they were:
no weight, optimizer state or gradient changes. What it does not include: the optimizer's states
(allocated by the first step, so already in the ``train`` phase's peak).
"""
from __future__ import annotations

import torch

from rlperf.telemetry import PhaseMeter

from .record import PhaseMemory


def probe_samples(args, sample_length: int, vocab_size: int, seed: int = 0) -> list:
    """The worst-case micro-batch's samples (see the module docstring) for ``args`` (:class:`rlperf.train.TrainArgs`)."""
    from rlperf.train import Sample

    if sample_length < 2:
        raise ValueError(f"probe: sample_length must be >= 2 (a prompt token and a response token), got {sample_length}")
    if args.use_dynamic_batch_size:
        budget = int(args.max_tokens_per_gpu)
        if sample_length > budget:
            raise ValueError(f"probe: the longest sample ({sample_length} tokens) exceeds --max-tokens-per-gpu {budget}; "
                             f"raise --max-tokens-per-gpu or lower --rollout-max-response-len")
        lengths = [sample_length] * (budget // sample_length)
        rest = budget - sum(lengths)
        if rest >= 2:
            lengths.append(rest)
    else:
        lengths = [sample_length] * args.micro_batch_size
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        r = n - 1
        out.append(Sample(torch.randint(0, vocab_size, (n,), generator=g), r, log_probs=torch.full((r,), -1.0),
                          advantages=torch.ones(r)))
    return out


def worst_case_probe(trainer, sample_length: int, phase: str = "train") -> PhaseMemory:
    """Peak memory of one forward + backward of ``trainer`` (:class:`rlperf.train.backend.TrainerBackend`) on the
    worst-case micro-batch; ``PhaseMemory(phase, peak_bytes, tokens)``. Weights, gradients and the
    optimizer are left as they were (gradients are saved and restored)."""
    from rlperf.train import pack_micro_batches

    a = trainer.args
    model = trainer.model
    samples = probe_samples(a, sample_length, model.cfg.vocab_size)
    # one micro-batch by construction: all samples in one group
    (mb,) = pack_micro_batches(samples, None, len(samples), device=trainer.device)
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    was_training = model.training
    for p in params:
        p.grad = None
    model.train()
    try:
        with PhaseMeter(trainer.device).phase(phase) as m:
            def loss_of(log_probs, entropy):
                # a loss of the policy loss's shape: per-token ratio against the old log-probs, times advantages
                old = torch.full_like(log_probs, -1.0)
                return -(torch.exp(log_probs - old)).sum() - a.entropy_coef * entropy.sum()

            trainer.probe_step(mb, loss_of)  # the trainer's own path (FSDP: its root; megatron: its stages)
    finally:
        for p, gr in zip(params, saved):
            p.grad = gr
        model.train(was_training)
    return PhaseMemory(phase, m.peak_bytes, tokens=int(mb.input_ids.numel()))
