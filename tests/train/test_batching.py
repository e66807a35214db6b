"""Packing under --max-tokens-per-gpu, micro-batch layout, and response log-probs through fused_logprob."""
import random

import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels.reference.logprob import token_logprobs
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import Sample, compute_log_probs, micro_batch_log_probs, pack_micro_batches, partition
from rlperf.train.batching import HostCopies, make_micro_batch

CFG = preset("tiny")


def _samples(lengths, responses, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, CFG.vocab_size, (n,), generator=g), r, reward=float(i % 2))
            for i, (n, r) in enumerate(zip(lengths, responses))]


@pytest.mark.parametrize("cap", [33, 64, 127, 500])
def test_packing_respects_the_token_cap_and_loses_no_sample(cap):
    rng = random.Random(cap)
    lengths = [rng.randint(1, 33) for _ in range(41)]
    groups = partition(lengths, max_tokens_per_gpu=cap)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert g == sorted(g) and sum(lengths[i] for i in g) <= cap
    assert len(groups) >= -(-sum(lengths) // cap)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    if cap == 500:
        assert len(groups) == 2  # 41 samples of <= 33 tokens: first-fit decreasing fills the first bin


def test_packing_finds_the_tight_fit_and_fixed_micro_batches_keep_order():
    assert partition([5, 5, 5, 5, 3, 7], max_tokens_per_gpu=10) == [[0, 1], [2, 3], [4, 5]]
    assert partition([4, 9, 2, 8, 1], micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="sample 2 has 12 tokens > --max-tokens-per-gpu 11"):
        partition([3, 4, 12], max_tokens_per_gpu=11)


def test_micro_batch_layout_and_no_token_lost():
    samples = _samples([9, 2, 17, 33], [4, 1, 16, 7])
    mbs = pack_micro_batches(samples, max_tokens_per_gpu=40)
    assert sum(mb.num_tokens for mb in mbs) == sum(s.total_length for s in samples)
    for mb in mbs:
        assert mb.num_tokens <= 40
        assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens[-1] == mb.num_tokens
        assert torch.equal(mb.input_ids[mb.logit_rows + 1], mb.targets)  # row p - 1 predicts token p
        for k, i in enumerate(mb.indices):
            s, start = samples[i], int(mb.cu_seqlens[k])
            assert torch.equal(mb.input_ids[start:start + s.total_length], s.tokens)
            assert torch.equal(mb.positions[start:start + s.total_length], torch.arange(s.total_length))
        assert torch.equal(mb.targets, torch.cat([samples[i].tokens[-samples[i].response_length:] for i in mb.indices]))


def test_sample_validation():
    with pytest.raises(ValueError, match="0 < response_length < L"):
        Sample(torch.arange(4), 4).validate()
    with pytest.raises(ValueError, match="0 < response_length < L"):
        pack_micro_batches([Sample([5, 6, 7], 0)])  # a pending sample (no response) does not train
    with pytest.raises(ValueError, match=r"loss_mask must have shape \[2\]"):
        Sample(torch.arange(4), 2, loss_mask=torch.ones(3)).validate()
    with pytest.raises(ValueError, match=r"rollout_log_probs must have shape \[2\]"):
        pack_micro_batches([Sample([1, 2, 3], 2, rollout_log_probs=[-0.5])])
    s = Sample([1, 2, 3], 2, rollout_log_probs=[-0.5, -1.0])
    s.validate()
    assert s.loss_mask_tensor().tolist() == [1.0, 1.0] and s.rollout_log_probs_tensor().dtype == torch.float32
    assert s.token_ids().dtype == torch.int64 and (s.total_length, s.prompt_length) == (3, 1)


def test_sample_round_trips_through_json():
    import json

    s = Sample([1, 2, 3], 2, group_index=0, index=1, prompt="p", response="ab", label="b", reward=0.5,
               rollout_log_probs=[-0.1, -1e-8], loss_mask=[1, 0], status=Sample.Status.TRUNCATED, metadata={"k": 1})
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.to_dict() == s.to_dict() and back.status is Sample.Status.TRUNCATED
    assert Sample.Status.of_finish_reason("stop") is Sample.Status.COMPLETED
    s.log_probs = torch.zeros(2)  # the trainer's fields are not rollout data
    assert "log_probs" not in s.to_dict()


def test_response_log_probs_match_full_logits_and_do_not_depend_on_packing():
    model = Qwen3ForCausalLM.random(CFG, seed=1, std=0.1)
    samples = _samples([7, 1 + 1, 33, 12], [3, 1, 20, 11], seed=2)
    with K.use_backend("reference"), torch.no_grad():
        packed, packed_ent = compute_log_probs(model, samples, temperature=0.7, max_tokens_per_gpu=64, with_entropy=True)
        alone = compute_log_probs(model, samples, temperature=0.7, micro_batch_size=1)
        for i, s in enumerate(samples):
            # independent path: the sample alone, full [L, V] logits, float64 log-softmax
            mb = make_micro_batch(samples, [i])
            hidden = model.forward_packed(mb.input_ids, mb.positions, mb.cu_seqlens)
            logits = hidden.double() @ model.head_weight.double().t()
            L, R = s.total_length, s.response_length
            want, want_ent = token_logprobs(logits[L - R - 1:L - 1], s.tokens[L - R:], 0.7, True)
            torch.testing.assert_close(packed[i], want, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(packed_ent[i], want_ent, atol=1e-5, rtol=1e-5)
            assert torch.equal(packed[i], alone[i]), i  # batch invariance: packing never changes the bits
            assert (packed[i] <= 0).all() and packed[i].shape == (R,)


def test_host_copies_give_each_sample_its_own_slice_even_when_the_output_buffer_is_reused():
    """A CUDA graph replays into the same output buffer: the copy kept at :meth:`HostCopies.add` must
    not change when the buffer does, and each sample gets its own storage (pickled alone)."""
    buffer = torch.arange(7, dtype=torch.float16)
    copies = HostCopies()
    copies.add([3, 0], [4, 3], buffer)  # micro-batch 1: samples 3 (4 tokens) and 0 (3 tokens)
    buffer.fill_(-1)  # the next replay overwrites the buffer
    copies.add([1], [5], torch.linspace(0, 1, 5, dtype=torch.bfloat16))
    got = dict(copies.per_sample())
    assert sorted(got) == [0, 1, 3]
    assert torch.equal(got[3], torch.tensor([0.0, 1, 2, 3])) and torch.equal(got[0], torch.tensor([4.0, 5, 6]))
    assert torch.equal(got[1], torch.linspace(0, 1, 5, dtype=torch.bfloat16).float())
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in got.values())
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 3
    assert got[3].untyped_storage().nbytes() == 4 * 4
    assert HostCopies().per_sample() == []


def test_micro_batch_log_probs_are_differentiable_on_the_reference_backend():
    model = Qwen3ForCausalLM.random(CFG, seed=3)
    samples = _samples([5, 9], [2, 4], seed=4)
    mb = pack_micro_batches(samples, max_tokens_per_gpu=32)[0]
    with K.use_backend("reference"):
        logp, ent = micro_batch_log_probs(model, mb, with_entropy=True)
        (logp.sum() + ent.sum()).backward()
    assert logp.shape == ent.shape == (6,)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.gpu
def test_gpu_bf16_response_log_probs_are_packing_invariant_and_equal_with_grad():
    import dataclasses

    from rlperf.train import TrainArgs, frozen_copy, policy_loss

    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    model = Qwen3ForCausalLM.random(cfg, seed=7, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(8)
    samples = [Sample(torch.randint(0, cfg.vocab_size, (n,), generator=g), r)
               for n, r in [(40, 20), (300, 150), (513, 400), (129, 1), (7, 6)]]
    with K.use_mode("invariant"):
        packed = compute_log_probs(model, samples, max_tokens_per_gpu=700)
        alone = compute_log_probs(model, samples, micro_batch_size=1)
        ref = compute_log_probs(frozen_copy(model), samples, micro_batch_size=2)
        for i in range(len(samples)):
            assert torch.equal(packed[i], alone[i]) and torch.equal(packed[i], ref[i]), i
            assert (packed[i] <= 0).all()
        # the training forward (grad on: fused_logprob's autograd path) gives the same bits
        mb = pack_micro_batches(samples, max_tokens_per_gpu=1100, device="cuda")[0]
        logp, ent = micro_batch_log_probs(model, mb, with_entropy=True)
        old = torch.cat([packed[i] for i in mb.indices]).cuda()
        assert torch.equal(logp.detach(), old)
        args = TrainArgs(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
        masks = [samples[i].loss_mask_tensor().cuda() for i in mb.indices]
        loss, m = policy_loss(args, logp, ent, old, torch.ones_like(old), masks, mb.response_lengths,
                              ref_log_probs=torch.cat([ref[i] for i in mb.indices]).cuda(), rollout_log_probs=old)
        for key in ("ppo_kl", "pg_clipfrac", "kl_loss", "train_rollout_logprob_abs_diff"):
            assert float(m[key]) == 0.0, key
        loss.backward()  # reaches the lm head through fused_logprob's backward
        assert model.head_weight.grad is not None and torch.isfinite(model.head_weight.grad).all()


@pytest.mark.gpu
def test_gpu_bf16_8192_token_micro_batch_log_probs_and_backward_fit_at_the_0_6b_shape():
    """``--max-tokens-per-gpu 8192`` at the qwen3-0.6b shape in bf16, true on-policy (the trainer's one
    log-prob path, the one the engine uses): the worst-case micro-batch of 16 x 512 tokens, 8176 of them
    response tokens. Without grad (old / ref log-probs) and with grad (the train step), the log-prob adds
    under 64 MiB to the peak of the model's forward alone, nowhere near the 8192 x V float32 logits
    (4.98 GB) an unfused log-prob holds; the backward fits and holds no [N, V] float32 either."""
    from rlperf.loop.probe import probe_samples
    from rlperf.train import TrainArgs

    MiB = 2**20
    cfg = preset("qwen3-0.6b")
    logits_bytes = 8192 * cfg.vocab_size * 4
    model = Qwen3ForCausalLM.random(cfg, seed=9, dtype=torch.bfloat16, device="cuda")
    samples = probe_samples(TrainArgs(use_dynamic_batch_size=True, max_tokens_per_gpu=8192), 512, cfg.vocab_size)
    (mb,) = pack_micro_batches(samples, max_tokens_per_gpu=8192, device="cuda")
    assert mb.num_tokens == 8192 and mb.targets.numel() == 8176

    def peak_over_baseline(fn):
        """(fn(), CUDA peak allocated during fn minus what was allocated before it)."""
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    def forward():
        return model.forward_packed(mb.input_ids, mb.positions, mb.cu_seqlens)

    peaks = {}
    with K.use_mode("invariant"):
        with torch.no_grad():
            forward()  # compile and warm, so the measured calls allocate what they always do
            micro_batch_log_probs(model, mb, 1.0)
            hidden, peaks["forward, no grad"] = peak_over_baseline(forward)
            del hidden
            old, peaks["log-prob, no grad"] = peak_over_baseline(lambda: micro_batch_log_probs(model, mb, 1.0))
        hidden, peaks["forward, grad"] = peak_over_baseline(forward)
        del hidden
        (logp, ent), peaks["log-prob, grad"] = peak_over_baseline(
            lambda: micro_batch_log_probs(model, mb, 1.0, with_entropy=True))
        assert torch.equal(logp.detach(), old)  # the train step sees the old log-probs' bits
        loss = -torch.exp(logp - old).sum() - 0.01 * ent.sum()  # the policy loss's shape
        _, peaks["backward"] = peak_over_baseline(loss.backward)
    print({k: f"{v / MiB:.0f} MiB" for k, v in peaks.items()}, f"[8192, V] float32: {logits_bytes / MiB:.0f} MiB")
    assert peaks["log-prob, no grad"] - peaks["forward, no grad"] < 64 * MiB
    assert peaks["log-prob, grad"] - peaks["forward, grad"] < 64 * MiB
    assert peaks["log-prob, no grad"] < logits_bytes // 4
    assert peaks["backward"] < logits_bytes
    assert model.head_weight.grad is not None and torch.isfinite(model.head_weight.grad).all()
