"""Padding a packed micro-batch with masked tokens up to a token-count bucket (what a CUDA graph per
bucket replays: :func:`rlperf.train.batching.pad_micro_batch`) changes no real token's log-prob and no
gradient, bit for bit: the trainer's forward/backward (``micro_batch_log_probs``) under the Triton
interpreter, fp32 and fp16, odd sizes, with and without extra empty sequence slots."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import Sample, micro_batch_log_probs, pack_micro_batches
from rlperf.train.batching import pad_micro_batch

CFG = preset("tiny")
LENGTHS = [(7, 3), (13, 6), (2, 1), (21, 10)]  # (total, response): 43 tokens, 20 response tokens


def _micro_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = [Sample(torch.randint(1, CFG.vocab_size, (n,), generator=g), r) for n, r in LENGTHS]
    (mb,) = pack_micro_batches(samples, max_tokens_per_gpu=64)
    return mb


def test_pad_micro_batch_layout_and_refusals():
    mb = _micro_batch()
    T, R, S = mb.num_tokens, mb.targets.numel(), mb.cu_seqlens.numel() - 1
    p = pad_micro_batch(mb, 64, num_seqs=40)
    assert p.num_tokens == 64 and p.logit_rows.numel() == 64 and p.targets.numel() == 64
    assert torch.equal(p.input_ids[:T], mb.input_ids) and (p.input_ids[T:] == 0).all()
    assert torch.equal(p.positions[T:], torch.arange(64 - T))  # the pad tokens are one more sequence
    assert torch.equal(p.cu_seqlens[:S + 1], mb.cu_seqlens) and p.cu_seqlens.dtype == torch.int32
    assert p.cu_seqlens.numel() == 41 and (p.cu_seqlens[S + 1:] == 64).all()  # then empty sequences
    assert torch.equal(p.logit_rows[:R], mb.logit_rows) and (p.logit_rows[R:] == 63).all()
    assert torch.equal(p.targets[:R], mb.targets) and (p.targets[R:] == 0).all()
    assert p.response_lengths == mb.response_lengths and p.indices == mb.indices
    same = pad_micro_batch(mb, T)  # no room to pad: the sequences stay, the rows still fill up
    assert same.cu_seqlens.numel() == S + 1 and same.logit_rows.numel() == T and (same.logit_rows[R:] == T - 1).all()
    with pytest.raises(ValueError, match="43 tokens does not fit a bucket of 42"):
        pad_micro_batch(mb, 42)
    with pytest.raises(ValueError, match="sequence slots"):
        pad_micro_batch(mb, 64, num_seqs=S)  # the pad sequence needs a slot too
    with pytest.raises(ValueError, match="logit rows"):
        pad_micro_batch(mb, 64, num_rows=R - 1)


def _log_probs_and_grads(model, mb):
    """Log-probs and entropy of the real response tokens, and every parameter's gradient of a loss
    on them only (the trainer's shape: a weighted sum of log-probs plus an entropy term)."""
    for p in model.parameters():
        p.grad = None
    logp, ent = micro_batch_log_probs(model, mb, 0.7, with_entropy=True)
    R = sum(mb.response_lengths)
    logp, ent = logp[:R], ent[:R]
    weights = torch.linspace(-1.0, 1.0, R, dtype=logp.dtype)
    ((logp * weights).sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype, pads", [(torch.float32, [(47, None), (64, 40)]), (torch.float16, [(64, 40)])])
def test_padding_changes_no_real_log_prob_nor_any_gradient(interpreter, one_thread, dtype, pads):
    model = Qwen3ForCausalLM.random(CFG, seed=1, dtype=dtype)
    mb = _micro_batch()
    with K.use_backend("interpreter"):
        want_logp, want_ent, want_grads = _log_probs_and_grads(model, mb)
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in want_grads.values())
        for num_tokens, num_seqs in pads:
            padded = pad_micro_batch(mb, num_tokens, num_seqs)
            logp, ent, grads = _log_probs_and_grads(model, padded)
            assert torch.equal(logp, want_logp) and torch.equal(ent, want_ent), (num_tokens, num_seqs)
            differ = [n for n in want_grads if not torch.equal(grads[n], want_grads[n])]
            assert not differ, f"padded to {num_tokens} tokens / {num_seqs} sequences: gradients differ in {differ}"
