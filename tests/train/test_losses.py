"""Policy loss, KL estimators, TIS and the per-sample / per-token reductions against float64 hand loops."""
import math

import pytest
import torch

from rlperf.train import TrainArgs, compute_approx_kl, compute_policy_loss, policy_loss

LENGTHS = [1, 7, 3, 12, 5]


def _batch(seed=0, spread=0.3):
    """Flat float64 per-token inputs over LENGTHS, masks with zeros (sample 2 fully masked out)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(n, generator=g, dtype=torch.float64) * spread
    ref = old + torch.randn(n, generator=g, dtype=torch.float64) * spread
    rollout = old + torch.randn(n, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    ent = torch.rand(n, generator=g, dtype=torch.float64) * 2
    masks = [(torch.rand(k, generator=g) > 0.25).double() for k in LENGTHS]
    masks[2][:] = 0
    masks[0][:] = 1
    return old, new, ref, rollout, adv, ent, masks


def _reduce(values, masks, per_token):
    """Hand reduction of a python list of per-token floats."""
    out, pos = 0.0, 0
    for m in masks:
        m = m.tolist()
        part = sum(v * w for v, w in zip(values[pos:pos + len(m)], m))
        out += part if per_token else part / max(sum(m), 1)
        pos += len(m)
    return out


def _hand_pg(old, new, adv, lo, hi):
    losses, clipped = [], []
    for o, n, a in zip(old.tolist(), new.tolist(), adv.tolist()):
        ratio = math.exp(n - o)
        l1, l2 = -ratio * a, -min(max(ratio, 1 - lo), 1 + hi) * a
        losses.append(max(l1, l2))
        clipped.append(1.0 if l2 > l1 else 0.0)
    return losses, clipped


# --- KL estimators -----------------------------------------------------------------------------

def test_kl_estimators_expectations_under_the_actor_match_the_true_kl():
    g = torch.Generator().manual_seed(5)
    logp = torch.log_softmax(torch.randn(37, generator=g, dtype=torch.float64) * 0.5, 0)  # actor over 37 tokens
    logq = torch.log_softmax(torch.randn(37, generator=g, dtype=torch.float64) * 0.5, 0)  # reference
    assert compute_approx_kl(logp, logq, "k3").max() < 10  # low_var_kl's clamp stays out of this case
    p = logp.exp()
    true_kl = float((p * (logp - logq)).sum())
    assert true_kl > 0.05
    for kind in ("k1", "k3", "low_var_kl"):  # unbiased: exact expectation over every token
        expectation = float((p * compute_approx_kl(logp, logq, kind)).sum())
        assert expectation == pytest.approx(true_kl, rel=1e-12, abs=1e-12), kind
    k2 = float((p * compute_approx_kl(logp, logq, "k2")).sum())
    assert k2 > 0 and k2 != pytest.approx(true_kl, rel=1e-3)  # k2 is biased


def test_kl_estimator_signs_values_and_clamp():
    log_ratio = torch.tensor([-30.0, -3.0, -0.5, 0.0, 1e-4, 0.7, 4.0, 40.0], dtype=torch.float64)
    zeros = torch.zeros_like(log_ratio)
    k1 = compute_approx_kl(log_ratio, zeros, "k1")
    assert torch.equal(k1, log_ratio) and (k1 < 0).any()
    k2 = compute_approx_kl(log_ratio, zeros, "k2")
    torch.testing.assert_close(k2, log_ratio ** 2 / 2, rtol=0, atol=0)
    k3 = compute_approx_kl(log_ratio, zeros, "k3")
    want = torch.tensor([math.exp(-x) - 1 + x for x in log_ratio.tolist()], dtype=torch.float64)
    torch.testing.assert_close(k3, want, rtol=1e-12, atol=1e-15)
    low = compute_approx_kl(log_ratio, zeros, "low_var_kl")
    assert (k2 >= 0).all() and (k3 >= 0).all() and (low >= 0).all()
    assert low.max() == 10.0 and k3.max() > 1e12  # the reference far likelier than the actor: clamped
    torch.testing.assert_close(low, k3.clamp(max=10.0), rtol=0, atol=0)
    same = torch.tensor([-0.3, -2.0])
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        assert torch.equal(compute_approx_kl(same, same.clone(), kind), torch.zeros(2)), kind


def test_unknown_kl_type_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown kl_loss_type 'k4'"):
        compute_approx_kl(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="kl-loss-type 'kl'.*low_var_kl"):
        TrainArgs(kl_loss_type="kl")


# --- policy loss ---------------------------------------------------------------------------------

@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_clipped_policy_loss_matches_hand_loop(lo, hi):
    old, new, _, _, adv, _, _ = _batch(spread=0.5)
    pg, clipped = compute_policy_loss(old - new, adv, lo, hi)
    want_pg, want_clip = _hand_pg(old, new, adv, lo, hi)
    torch.testing.assert_close(pg, torch.tensor(want_pg, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    assert clipped.tolist() == want_clip
    assert 0 < sum(want_clip) < len(want_clip)  # the case has both clipped and unclipped tokens


@pytest.mark.parametrize("per_token", [False, True])
def test_policy_loss_total_and_metrics_match_hand_computation(per_token):
    old, new, ref, rollout, adv, ent, masks = _batch()
    args = TrainArgs(eps_clip=0.2, eps_clip_high=0.28, use_kl_loss=True, kl_loss_coef=0.07, kl_loss_type="low_var_kl",
                     entropy_coef=0.01, calculate_per_token_loss=per_token)
    loss, m = policy_loss(args, new, ent, old, adv, masks, LENGTHS, ref_log_probs=ref, rollout_log_probs=rollout)
    pg, clipped = _hand_pg(old, new, adv, 0.2, 0.28)
    kl = [math.exp(r - n) - 1 - (r - n) for n, r in zip(new.tolist(), ref.tolist())]
    red = lambda v: _reduce(v, masks, per_token)  # noqa: E731
    want = dict(pg_loss=red(pg), pg_clipfrac=red(clipped), ppo_kl=red((old - new).tolist()),
                entropy_loss=red(ent.tolist()), kl_loss=red(kl),
                train_rollout_logprob_abs_diff=red((old - rollout).abs().tolist()))
    want["loss"] = want["pg_loss"] - 0.01 * want["entropy_loss"] + 0.07 * want["kl_loss"]
    assert set(m) == set(want)
    for k, v in want.items():
        assert float(m[k]) == pytest.approx(v, rel=1e-10, abs=1e-12), k
    assert float(loss) == pytest.approx(want["loss"], rel=1e-10)


def test_per_token_and_per_sample_reductions_weight_samples_differently():
    # two samples: 1 token with advantage 1, 9 tokens with advantage 0; ratio 1 -> pg = -A
    lengths, masks = [1, 9], [torch.ones(1, dtype=torch.float64), torch.ones(9, dtype=torch.float64)]
    lp = torch.full((10,), -1.0, dtype=torch.float64)
    adv = torch.tensor([1.0] + [0.0] * 9, dtype=torch.float64)
    ent = torch.zeros(10, dtype=torch.float64)
    per_sample, _ = policy_loss(TrainArgs(), lp, ent, lp.clone(), adv, masks, lengths)
    per_token, _ = policy_loss(TrainArgs(calculate_per_token_loss=True), lp, ent, lp.clone(), adv, masks, lengths)
    assert float(per_sample) / 2 == -0.5   # mean over samples of per-sample means
    assert float(per_token) / 10 == -0.1   # mean over tokens


def test_on_policy_ratio_gives_exact_zero_kl_and_clipfrac():
    old, _, _, _, adv, ent, masks = _batch()
    args = TrainArgs(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1")
    for estimator in ("grpo", "gspo"):
        args.advantage_estimator = estimator
        _, m = policy_loss(args, old.clone(), ent, old, adv, masks, LENGTHS, ref_log_probs=old.clone(),
                           rollout_log_probs=old.clone())
        for k in ("ppo_kl", "pg_clipfrac", "kl_loss", "train_rollout_logprob_abs_diff"):
            assert float(m[k]) == 0.0, (estimator, k)
        assert float(m["pg_loss"]) == pytest.approx(_reduce((-adv).tolist(), masks, False), rel=1e-12)


def test_gspo_uses_the_sequence_ratio_and_its_gradient_spreads_over_loss_tokens():
    old, new, _, _, _, ent, masks = _batch(spread=0.05)
    adv = torch.cat([torch.full((n,), a, dtype=torch.float64) for n, a in zip(LENGTHS, [0.5, -1.0, 2.0, 1.5, -0.3])])
    new = new.clone().requires_grad_(True)
    args = TrainArgs(advantage_estimator="gspo", eps_clip=10.0)  # no clipping: check the raw gradient
    loss, m = policy_loss(args, new, ent, old, adv, masks, LENGTHS)
    loss.backward()
    pos, want_loss, want_kl = 0, 0.0, 0.0
    for n, mask in zip(LENGTHS, masks):
        mk = mask.tolist()
        cnt = max(sum(mk), 1)
        seq_kl = sum((o - w) * q for o, w, q in zip(old[pos:pos + n].tolist(), new[pos:pos + n].tolist(), mk)) / cnt
        ratio, a = math.exp(-seq_kl), float(adv[pos])
        want_loss += -ratio * a * sum(mk) / cnt  # the per-sample masked mean of a constant
        want_kl += seq_kl * sum(mk) / cnt
        # d(-ratio * A) / d new_t = -A * ratio * mask_t / count, for every token of the sample
        want_grad = torch.tensor([-a * ratio * q / cnt * (sum(mk) / cnt) for q in mk], dtype=torch.float64)
        torch.testing.assert_close(new.grad[pos:pos + n], want_grad, rtol=1e-10, atol=1e-14)
        pos += n
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-10)
    assert float(m["ppo_kl"]) == pytest.approx(want_kl, rel=1e-10, abs=1e-14)


def test_tis_weights_are_truncated_importance_ratios():
    old, new, _, rollout, adv, ent, masks = _batch(spread=1.0)
    args = TrainArgs(use_tis=True, tis_clip=1.5, tis_clip_low=0.5, eps_clip=0.2)
    loss, m = policy_loss(args, new, ent, old, adv, masks, LENGTHS, rollout_log_probs=rollout)
    pg, _ = _hand_pg(old, new, adv, 0.2, 0.2)
    tis = [math.exp(o - r) for o, r in zip(old.tolist(), rollout.tolist())]
    clipped = [min(max(t, 0.5), 1.5) for t in tis]
    assert float(m["pg_loss"]) == pytest.approx(_reduce([p * c for p, c in zip(pg, clipped)], masks, False), rel=1e-10)
    assert float(m["tis"]) == pytest.approx(_reduce(tis, masks, False), rel=1e-10)
    frac = _reduce([float(c != t) for c, t in zip(clipped, tis)], masks, False)
    assert float(m["tis_clipfrac"]) == pytest.approx(frac, rel=1e-12) and 0 < frac
    assert float(loss) == float(m["loss"])


def test_missing_inputs_are_clear_errors():
    old, new, _, _, adv, ent, masks = _batch()
    with pytest.raises(ValueError, match="use_kl_loss needs ref_log_probs"):
        policy_loss(TrainArgs(use_kl_loss=True), new, ent, old, adv, masks, LENGTHS)
    with pytest.raises(ValueError, match="use_tis needs rollout_log_probs"):
        policy_loss(TrainArgs(use_tis=True), new, ent, old, adv, masks, LENGTHS)
