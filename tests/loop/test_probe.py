"""The worst-case probe (the loop's, read by the oom_headroom gate): the largest micro-batch's shape, a
measured peak, and no trace left on the trainer."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.loop.probe import probe_samples, worst_case_probe
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import TrainArgs, Trainer

CFG = preset("tiny")


@pytest.mark.parametrize("kw,length,want", [
    (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=100), 33, [33, 33, 33]),  # a 1-token rest is no sample
    (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=101), 33, [33, 33, 33, 2]),
    (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=100), 100, [100]),
    (dict(micro_batch_size=3), 7, [7, 7, 7]),
])
def test_probe_samples_are_the_largest_micro_batch(kw, length, want):
    samples = probe_samples(TrainArgs(**kw), length, CFG.vocab_size)
    assert [s.total_length for s in samples] == want
    assert all(s.response_length == s.total_length - 1 for s in samples)
    assert all(int(s.tokens.max()) < CFG.vocab_size for s in samples)


def test_probe_samples_reject_a_sample_without_a_response_or_over_the_budget():
    with pytest.raises(ValueError, match="sample_length"):
        probe_samples(TrainArgs(), 1, CFG.vocab_size)
    with pytest.raises(ValueError, match="--max-tokens-per-gpu 100"):
        probe_samples(TrainArgs(use_dynamic_batch_size=True, max_tokens_per_gpu=100), 101, CFG.vocab_size)


def test_worst_case_probe_measures_and_leaves_the_trainer_as_it_was():
    with K.use_backend("reference"):
        model = Qwen3ForCausalLM.random(CFG, seed=0, std=0.05)
        trainer = Trainer(model, TrainArgs(use_dynamic_batch_size=True, max_tokens_per_gpu=64))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        params[0].grad = torch.full_like(params[0], 0.5)  # a gradient already there must come back unchanged
        model.eval()
        probe = worst_case_probe(trainer, sample_length=17)
    assert probe.phase == "train" and probe.tokens == 64 and probe.peak_bytes > 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.equal(params[0].grad, torch.full_like(params[0], 0.5))
    assert all(p.grad is None for p in params[1:])
    assert not model.training and trainer.optimizer.state_dict()["state"] == {}
