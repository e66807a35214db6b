"""Trainer: step-0 exact zeros, loss normalization across micro-batches, AdamW + clipping on the tiny model."""

import pytest
import torch
from torch import nn

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import Sample, TrainArgs, Trainer, compute_log_probs, frozen_copy

CFG = preset("tiny")
LENGTHS = [(6, 3), (9, 5), (4, 1), (13, 7), (8, 2), (11, 6)]  # (total, response): 2 prompts x 3 samples


@pytest.fixture(autouse=True)
def _reference_backend():
    with K.use_backend("reference"):  # differentiable on CPU (the Triton kernels lack backward passes)
        yield


def _samples(seed=0, rewards=(1.0, 0.0, 0.0, 1.0, 1.0, 0.0)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for (n, r), rew in zip(LENGTHS, rewards):
        mask = torch.ones(r)
        if r > 3:
            mask[1] = 0  # a masked token in the middle (e.g. a tool's output)
        out.append(Sample(torch.randint(0, CFG.vocab_size, (n,), generator=g), r, reward=rew, loss_mask=mask))
    return out


def _model(seed=0):
    return Qwen3ForCausalLM.random(CFG, seed=seed, std=0.05)


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "low_var_kl"])
def test_step_zero_with_actor_equal_to_reference_gives_exact_zeros(estimator, kl_type):
    model = _model()
    samples = _samples()
    for s, lp in zip(samples, compute_log_probs(frozen_copy(model), samples)):
        s.rollout_log_probs = lp  # a true-on-policy rollout: the same kernels computed these
    args = TrainArgs(advantage_estimator=estimator, n_samples_per_prompt=3, use_kl_loss=True, kl_loss_coef=0.1,
                     kl_loss_type=kl_type, use_dynamic_batch_size=True, max_tokens_per_gpu=24)
    (m,) = Trainer(model, args, ref_model=frozen_copy(model)).train(samples)
    for key in ("train/ppo_kl", "train/pg_clipfrac", "train/kl_loss", "train/train_rollout_logprob_abs_diff"):
        assert m[key] == 0.0, key
    assert m["train/grad_norm"] > 0 and m["train/entropy_loss"] > 0
    expected = {"train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/kl_loss",
                "train/entropy_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff"}
    assert expected <= set(m)


@pytest.mark.parametrize("per_token", [False, True])
def test_step_loss_is_normalized_over_the_global_batch(per_token):
    # reinforce_plus_plus with gamma < 1: advantages vary per token, so the two reductions differ
    args = TrainArgs(advantage_estimator="reinforce_plus_plus", gamma=0.5, calculate_per_token_loss=per_token,
                     micro_batch_size=2)
    trainer = Trainer(_model(), args)
    samples = _samples()
    trainer.prepare(samples)
    m = trainer.train_step(samples)
    # ratio == 1 at the first step: pg_loss = -reduce(A)
    if per_token:
        want = -sum(float((s.advantages * s.loss_mask).sum()) for s in samples) / sum(float(s.loss_mask.sum()) for s in samples)
    else:
        want = -sum(float((s.advantages * s.loss_mask).sum() / s.loss_mask.sum()) for s in samples) / len(samples)
    assert m["train/pg_loss"] == pytest.approx(want, rel=1e-6)
    other = -sum(float((s.advantages * s.loss_mask).sum()) for s in samples) / sum(float(s.loss_mask.sum()) for s in samples)
    if not per_token:
        assert abs(want - other) > 1e-3  # the case tells the reductions apart


@pytest.mark.parametrize("per_token", [False, True])
def test_step_does_not_depend_on_the_packing(per_token):
    results = []
    for packing in (dict(micro_batch_size=1), dict(use_dynamic_batch_size=True, max_tokens_per_gpu=30),
                    dict(micro_batch_size=6)):
        model = _model()
        args = TrainArgs(n_samples_per_prompt=3, calculate_per_token_loss=per_token, lr=1e-2, entropy_coef=0.01,
                         **packing)
        (m,) = Trainer(model, args).train(_samples())
        # gradients, not updated weights: Adam's first step is ~lr * sign(g), which turns float32
        # summation-order noise on near-zero gradients into visible weight differences
        results.append((m, torch.cat([p.grad.flatten() for p in model.parameters()])))
    (m0, p0), rest = results[0], results[1:]
    for m, p in rest:
        for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
            assert m[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
        torch.testing.assert_close(p, p0, atol=1e-6 * m0["train/grad_norm"], rtol=1e-4)


def test_optimizer_steps_reduce_the_loss_on_a_fixed_batch_down_to_the_clip_floor():
    args = TrainArgs(n_samples_per_prompt=3, lr=2e-4, eps_clip=0.2, eps_clip_high=0.28, micro_batch_size=3)
    trainer = Trainer(_model(), args)
    samples = _samples()
    trainer.prepare(samples)  # old log-probs and advantages fixed: the PPO surrogate of this batch
    metrics = [trainer.train_step(samples) for _ in range(6)]
    losses = [m["train/loss"] for m in metrics]
    assert losses[0] == pytest.approx(0.0, abs=1e-7)  # ratio 1, group-centered advantages
    assert all(b <= a + 1e-7 for a, b in zip(losses, losses[1:])) and losses[1] < losses[0] - 0.05, losses
    # once every ratio is past its clip bound the surrogate is flat: -(1 + 0.28) A for A > 0, -(1 - 0.2) A for A < 0
    adv = [float(s.advantages[0]) for s in samples]
    floor = sum(-(1.28 if a > 0 else 0.8) * a for a in adv) / len(adv)
    assert losses[-1] == pytest.approx(floor, rel=1e-3) and metrics[-1]["train/pg_clipfrac"] > 0.9
    assert trainer.step_count == 6


def test_entropy_bonus_raises_entropy_when_advantages_are_zero():
    args = TrainArgs(n_samples_per_prompt=3, entropy_coef=1.0, lr=5e-3, micro_batch_size=6)
    trainer = Trainer(_model(), args)
    samples = _samples(rewards=(1.0,) * 6)  # equal rewards in each group: every advantage is exactly 0
    trainer.prepare(samples)
    assert all(torch.equal(s.advantages, torch.zeros_like(s.advantages)) for s in samples)
    ent = [trainer.train_step(samples)["train/entropy_loss"] for _ in range(4)]
    assert ent[-1] > ent[0], ent


def test_several_steps_per_rollout_keep_the_old_log_probs():
    args = TrainArgs(n_samples_per_prompt=3, global_batch_size=3, lr=1e-2, micro_batch_size=3)
    first, second = Trainer(_model(), args).train(_samples())
    assert first["train/ppo_kl"] == 0.0 and second["train/ppo_kl"] != 0.0  # the actor moved after step 1


def test_grad_clipping_reports_the_norm_before_clipping():
    for clip in (1e-3, 0.0):
        trainer = Trainer(_model(), TrainArgs(n_samples_per_prompt=3, clip_grad=clip, micro_batch_size=6))
        (m,) = trainer.train(_samples())
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.params])).item()
        if clip:
            assert m["train/grad_norm"] > 10 * clip and after == pytest.approx(clip, rel=1e-3)
        else:
            assert after == pytest.approx(m["train/grad_norm"], rel=1e-5)


def test_train_rollout_logprob_abs_diff_and_tis():
    samples = _samples()
    model = _model()
    exact = compute_log_probs(model, samples)
    for i, (s, lp) in enumerate(zip(samples, exact)):
        s.rollout_log_probs = lp + (0.25 if i % 2 else -0.25)  # a mismatched rollout engine
    args = TrainArgs(n_samples_per_prompt=3, use_tis=True, tis_clip=1.1, micro_batch_size=2)
    (m,) = Trainer(model, args).train(samples)
    assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx(0.25, rel=1e-5)
    assert m["train/tis"] == pytest.approx((2.718281828 ** 0.25 + 2.718281828 ** -0.25) / 2, rel=1e-5)
    assert m["train/tis_clipfrac"] == pytest.approx(0.5, rel=1e-6)  # exp(+0.25) > 1.1 is clipped


def test_clear_errors():
    with pytest.raises(ValueError, match="need a reference model"):
        Trainer(_model(), TrainArgs(use_kl_loss=True, kl_loss_coef=0.1))
    trainer = Trainer(_model(), TrainArgs())
    with pytest.raises(ValueError, match="call Trainer.prepare first"):
        trainer.train_step(_samples())
    with pytest.raises(ValueError, match="use-tis needs rollout_log_probs"):
        Trainer(_model(), TrainArgs(use_tis=True, n_samples_per_prompt=3)).train(_samples())
    with pytest.raises(ValueError, match="6 samples do not split into global batches of 4"):
        Trainer(_model(), TrainArgs(global_batch_size=4)).train(_samples())
    with pytest.raises(ValueError, match="max-tokens-per-gpu"):
        TrainArgs(use_dynamic_batch_size=True)
    model = _model()
    model.unused = nn.Parameter(torch.zeros(3))  # a parameter the loss never reaches
    with pytest.raises(RuntimeError, match=r"no gradient reached \['unused'\]"):
        Trainer(model, TrainArgs(n_samples_per_prompt=3, micro_batch_size=6)).train(_samples())


def test_a_non_finite_gradient_skips_the_update_and_reports_it():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, TrainArgs(n_samples_per_prompt=3, micro_batch_size=6, lr=1e-2))
    samples = _samples()
    trainer.prepare(samples)
    samples[1].advantages[0] = float("nan")
    m = trainer.train_step(samples)
    assert m["train/grad_norm"] != m["train/grad_norm"]  # NaN: what the sanity gate looks at
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_no_weight_decay_on_one_dimensional_parameters():
    model = _model()
    trainer = Trainer(model, TrainArgs(weight_decay=0.1))
    decay = {id(p): g["weight_decay"] for g in trainer.optimizer.param_groups for p in g["params"]}
    assert len(decay) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert decay[id(p)] == (0.1 if p.dim() > 1 else 0.0), name


def test_runs_are_deterministic_and_resume_continues_bit_for_bit(tmp_path):
    args = TrainArgs(n_samples_per_prompt=3, lr=1e-3, use_kl_loss=True, kl_loss_coef=0.05, micro_batch_size=2)

    def run(model, trainer, steps):
        return [trainer.train(_samples(seed=k))[0] for k in steps]

    model_a = _model()
    a = Trainer(model_a, args, ref_model=frozen_copy(model_a))
    full = run(model_a, a, range(3))
    model_b = _model()
    b = Trainer(model_b, args, ref_model=frozen_copy(model_b))
    assert run(model_b, b, range(3)) == full  # same seed, same metrics, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(model_a.parameters(), model_b.parameters()))

    model_c = _model()
    ref = frozen_copy(model_c)
    c = Trainer(model_c, args, ref_model=ref)
    run(model_c, c, range(2))
    torch.save({"model": model_c.state_dict(), "trainer": c.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    model_d = _model(seed=9)  # other weights, overwritten by the checkpoint
    model_d.load_state_dict(saved["model"])
    d = Trainer(model_d, args, ref_model=ref)
    d.load_state_dict(saved["trainer"])
    assert d.step_count == 2 and run(model_d, d, [2]) == full[2:]
    assert all(torch.equal(x, y) for x, y in zip(model_a.parameters(), model_d.parameters()))
