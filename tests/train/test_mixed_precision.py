"""Mixed precision in the trainer (Megatron's scheme): float32 masters, low-precision compute weights,
float32 gradient accumulation and AdamW state, master -> compute copy after each step. On the CPU the
reference backend runs in bf16, so the split is checked here; the GPU tests check the loop."""

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import Sample, TrainArgs, Trainer

CFG = preset("tiny")
LENGTHS = [(6, 3), (9, 5), (4, 1), (13, 7), (8, 2), (11, 6)]


@pytest.fixture(autouse=True)
def _reference_backend():
    with K.use_backend("reference"):
        yield


def _samples(seed=0, rewards=(1.0, 0.0, 0.0, 1.0, 1.0, 0.0)):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, CFG.vocab_size, (n,), generator=g), r, reward=rew)
            for (n, r), rew in zip(LENGTHS, rewards)]


def _args(**kw):
    return TrainArgs(**{"advantage_estimator": "grpo", "n_samples_per_prompt": 3, "micro_batch_size": 2, "lr": 1e-3,
                        **kw})


def _model(seed=0):
    return Qwen3ForCausalLM.random(CFG, seed=seed, std=0.05)


def test_float32_keeps_one_set_of_weights():
    model = _model()
    for dtype in (None, torch.float32):
        t = Trainer(model, _args(), compute_dtype=dtype)
        assert not t.mixed and t.model is model and t.master_model is model
        assert all(p is m for p, m in zip(t.params, t.master_params))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_weights_are_the_rounded_masters_before_and_after_a_step(dtype):
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    t = Trainer(model, _args(), compute_dtype=dtype)
    assert t.mixed and t.master_model is model and t.model is not model
    assert all(p.dtype == dtype for p in t.model.parameters())
    assert all(m.dtype == torch.float32 for m in t.master_params)
    for p, m in zip(t.params, t.master_params):
        assert torch.equal(p, m.to(dtype))
    t.train(_samples())
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "the step did not update the float32 masters"
    for p, m in zip(t.params, t.master_params):
        assert torch.equal(p, m.detach().to(dtype)), "compute weights are not the masters rounded after the step"
        assert p.grad is None and m.grad is not None and m.grad.dtype == torch.float32
    state = t.optimizer.state_dict()["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32
                         for s in state.values())
    # AdamW runs on the masters, not on the compute copies
    opt_params = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(m) for m in t.master_params}


def test_gradients_accumulate_in_float32_across_micro_batches(monkeypatch):
    # clip_grad 0: the masters' grads are exactly the float32 sum of the micro-batches' bf16 grads
    t = Trainer(_model(), _args(micro_batch_size=2, clip_grad=0.0), compute_dtype=torch.bfloat16)
    seen = []
    original = Trainer._accumulate_master_grads

    def record(self):
        seen.append([None if p.grad is None else p.grad.clone() for p in self.params])
        original(self)

    monkeypatch.setattr(Trainer, "_accumulate_master_grads", record)
    monkeypatch.setattr(t.optimizer, "step", lambda: None)  # keep the weights: only the grads matter here
    samples = _samples()
    t.prepare(samples)
    t.train_step(samples)
    assert len(seen) == 3  # 6 samples, 2 per micro-batch
    assert all(g.dtype == torch.bfloat16 for mb in seen for g in mb if g is not None)
    for i, m in enumerate(t.master_params):
        grads = [mb[i] for mb in seen if mb[i] is not None]
        expected = grads[0].float()
        for g in grads[1:]:
            expected = expected + g.float()
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, expected)
        assert t.params[i].grad is None


def test_accumulate_adds_low_precision_grads_in_float32():
    t = Trainer(_model(), _args(), compute_dtype=torch.bfloat16)
    p, m = t.params[0], t.master_params[0]
    small = torch.full_like(p, 2.0 ** -9)  # 1 + 2^-9 rounds to 1 in bf16 (8 bits of mantissa), not in float32
    p.grad = torch.ones_like(p)
    t._accumulate_master_grads()
    assert p.grad is None and m.grad.dtype == torch.float32
    p.grad = small
    t._accumulate_master_grads()
    assert torch.all(m.grad == 1.0 + 2.0 ** -9)
    assert torch.all((torch.ones_like(p) + small) == 1.0), "the bf16 sum would have lost it"


def test_accumulate_keeps_signed_zeros_and_skips_missing_grads():
    """The multi-tensor accumulation gives the per-parameter ``.to(float32)`` then ``add_`` bits, the sign
    of a first micro-batch's -0.0 included (a zero-filled master gradient would make it +0.0)."""
    t = Trainer(_model(), _args(), compute_dtype=torch.bfloat16)
    (p0, p1), (m0, m1) = t.params[:2], t.master_params[:2]
    first = torch.full_like(p0, -0.0)
    first.view(-1)[::3] = -2.0 ** -20  # below bf16's float32 sum resolution with later terms: exact anyway
    p0.grad = first.clone()
    t._accumulate_master_grads()
    assert m1.grad is None, "a parameter without a gradient gets none"
    assert torch.equal(torch.signbit(m0.grad), torch.signbit(first.float())) and torch.equal(m0.grad, first.float())
    later = torch.full_like(p0, 0.0)
    p0.grad, p1.grad = later.clone(), torch.ones_like(p1)
    t._accumulate_master_grads()
    expected = first.float()
    expected.add_(later)
    assert torch.equal(torch.signbit(m0.grad), torch.signbit(expected)) and torch.equal(m0.grad, expected)
    assert torch.equal(m1.grad, torch.ones_like(m1)) and p0.grad is None and p1.grad is None


def test_resume_from_float32_masters_is_exact():
    samples = [_samples(0), _samples(1, rewards=(0.0, 1.0, 1.0, 0.0, 1.0, 0.0))]
    straight = Trainer(_model(), _args(), compute_dtype=torch.bfloat16)
    for s in samples:
        straight.train(s)
    first = Trainer(_model(), _args(), compute_dtype=torch.bfloat16)
    first.train(_samples(0))
    # what a checkpoint holds: the float32 masters (save_pretrained of master_model) and the trainer state
    saved = {k: v.detach().clone() for k, v in first.master_model.hf_state_dict().items()}
    state = first.state_dict()
    loaded = _model(seed=5)
    loaded.load_hf_state_dict(saved)
    resumed = Trainer(loaded, _args(), compute_dtype=torch.bfloat16)
    resumed.load_state_dict(state)
    resumed.train(samples[1])
    for a, b in zip(straight.master_params, resumed.master_params):
        assert torch.equal(a, b)
    for a, b in zip(straight.params, resumed.params):
        assert torch.equal(a, b)


def test_reference_model_runs_in_the_compute_dtype():
    from rlperf.train import frozen_copy

    model = _model()
    ref = frozen_copy(model)
    t = Trainer(model, _args(use_kl_loss=True, kl_loss_coef=0.1), ref_model=ref, compute_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in t.ref_model.parameters())
    (m,) = t.train(_samples())
    assert m["train/kl_loss"] == 0.0  # step 0: the bf16 actor equals the bf16 reference bit for bit


def test_mixed_precision_needs_float32_masters():
    with pytest.raises(ValueError, match="float32 master"):
        Trainer(_model().to(torch.float16), _args(), compute_dtype=torch.bfloat16)
