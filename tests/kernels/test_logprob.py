"""log_softmax / token_logprobs / entropy: accuracy vs float64, invariance, edge cases, errors.

Tolerances vs float64: the kernels do float32 math on exactly-representable inputs, so errors are a
few float32 ulps of lse (|lse| <= ~15 here): atol 2e-5, rtol 1e-5 for every input dtype.
"""
import math

import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels.reference import logprob as ref

CPU_DTYPES = [(torch.float32, 2e-5, 1e-5), (torch.float16, 2e-5, 1e-5)]
GPU_DTYPES = [(torch.bfloat16, 5e-5, 1e-5), (torch.float16, 5e-5, 1e-5), (torch.float32, 5e-5, 1e-5)]


def _inputs(n, V, dtype, device="cpu", scale=3.0):
    logits = (torch.randn(n, V, device=device) * scale).to(dtype)
    targets = torch.randint(0, V, (n,), device=device)
    return logits, targets


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("n,V", [(1, 1000), (7, 50257), (33, 1000), (5, 4097)])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_token_logprobs_and_entropy(interpreter, poison, dtype, atol, rtol, n, V, T):
    logits, targets = _inputs(n, V, dtype)
    logp, ent = K.token_logprobs(logits, targets, temperature=T, return_entropy=True)
    r_logp, r_ent = ref.token_logprobs(logits, targets, T, return_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32 and logp.shape == (n,)
    torch.testing.assert_close(logp, r_logp, atol=atol, rtol=rtol)
    torch.testing.assert_close(ent, r_ent, atol=atol, rtol=rtol)
    # the entropy flag does not change the log-prob bits
    assert torch.equal(K.token_logprobs(logits, targets, temperature=T), logp)


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("n,V", [(1, 1000), (7, 50257), (127, 1000)])
def test_log_softmax(interpreter, poison, dtype, atol, rtol, n, V):
    logits, targets = _inputs(n, V, dtype)
    y = K.log_softmax(logits, temperature=1.3)
    assert y.dtype == torch.float32 and y.shape == (n, V)
    torch.testing.assert_close(y, ref.log_softmax(logits, 1.3), atol=atol, rtol=rtol)
    torch.testing.assert_close(y.double().exp().sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-5, rtol=0)
    # token_logprobs is log_softmax gathered, bit for bit (same lse, same z)
    assert torch.equal(K.token_logprobs(logits, targets, 1.3), y.gather(1, targets[:, None]).squeeze(1))


def test_temperature_changes_the_distribution(interpreter):
    logits, targets = _inputs(4, 1000, torch.float32)
    e1 = K.token_logprobs(logits, targets, 1.0, return_entropy=True)[1]
    e2 = K.token_logprobs(logits, targets, 2.0, return_entropy=True)[1]
    assert (e2 > e1).all()  # a hotter distribution has more entropy
    torch.testing.assert_close(
        K.token_logprobs(logits, targets, 2.0), ref.token_logprobs(logits / 2.0, targets), atol=2e-5, rtol=1e-5
    )


def test_masked_logits_and_peaked_rows(interpreter):
    logits, targets = _inputs(3, 5000, torch.float32)
    logits[0, 100:] = -math.inf          # only 100 live tokens (a vocab mask)
    logits[1, :4096] = -math.inf         # the whole first chunk is masked
    targets[0], targets[1] = 7, 4500
    logits[2] = -50.0
    logits[2, 3] = 50.0                  # nearly one-hot: entropy ~ 0, logp ~ 0
    targets[2] = 3
    logp, ent = K.token_logprobs(logits, targets, return_entropy=True)
    r_logp, r_ent = ref.token_logprobs(logits, targets, return_entropy=True)
    torch.testing.assert_close(logp, r_logp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, r_ent, atol=2e-5, rtol=1e-5)
    y = K.log_softmax(logits)
    assert torch.isneginf(y[0, 100:]).all() and torch.isfinite(y[0, :100]).all()


def test_out_of_range_target_is_nan(interpreter):
    logits, targets = _inputs(4, 1000, torch.float32)
    targets[1] = 1000
    targets[2] = -1
    logp = K.token_logprobs(logits, targets)
    assert torch.isnan(logp[1]) and torch.isnan(logp[2])
    assert torch.isfinite(logp[[0, 3]]).all()


def _check_invariance(logits, targets):
    full_lp, full_ent = K.token_logprobs(logits, targets, 0.8, return_entropy=True)
    full_ls = K.log_softmax(logits, 0.8)
    n = logits.shape[0]
    for i in (0, n // 3, n - 1):
        lp, ent = K.token_logprobs(logits[i : i + 1], targets[i : i + 1], 0.8, return_entropy=True)
        assert torch.equal(lp, full_lp[i : i + 1]) and torch.equal(ent, full_ent[i : i + 1]), f"row {i}"
        assert torch.equal(K.log_softmax(logits[i : i + 1], 0.8), full_ls[i : i + 1])
    perm = torch.randperm(n, device=logits.device)
    lp, ent = K.token_logprobs(logits[perm], targets[perm], 0.8, return_entropy=True)
    assert torch.equal(lp, full_lp[perm]) and torch.equal(ent, full_ent[perm])
    assert torch.equal(K.log_softmax(logits[perm], 0.8), full_ls[perm])
    # inside a bigger batch of other rows
    other = torch.randn(17, logits.shape[1], device=logits.device).to(logits.dtype)
    big = torch.cat([other, logits[:2]])
    lp = K.token_logprobs(big, torch.cat([targets[:17].clone().fill_(0), targets[:2]]), 0.8)
    assert torch.equal(lp[17:], full_lp[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_invariance(interpreter, dtype):
    _check_invariance(*_inputs(300, 1000, dtype))


def test_leading_dims_and_noncontiguous_rows(interpreter):
    base = torch.randn(2, 3, 1200)
    logits = base[..., :1000]
    targets = torch.randint(0, 1000, (2, 3))
    lp = K.token_logprobs(logits, targets)
    assert lp.shape == (2, 3)
    torch.testing.assert_close(lp, ref.token_logprobs(logits, targets), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(K.log_softmax(logits), ref.log_softmax(logits), atol=2e-5, rtol=1e-5)


def test_fast_mode_and_reference_backend(interpreter):
    logits, targets = _inputs(6, 1000, torch.float32)
    r_lp, r_ent = ref.token_logprobs(logits, targets, 0.9, True)
    with K.use_mode("fast"):
        lp, ent = K.token_logprobs(logits, targets, 0.9, return_entropy=True)
        ls = K.log_softmax(logits, 0.9)
    torch.testing.assert_close(lp, r_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, r_ent, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ls, ref.log_softmax(logits, 0.9), atol=2e-5, rtol=1e-5)
    with K.use_backend("reference"):
        assert torch.equal(K.token_logprobs(logits, targets, 0.9), r_lp)


def test_empty_and_errors(interpreter):
    assert K.token_logprobs(torch.randn(0, 10), torch.zeros(0, dtype=torch.long)).shape == (0,)
    logits, targets = _inputs(3, 10, torch.float32)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            K.token_logprobs(logits, targets, bad)
        with pytest.raises(ValueError, match="temperature"):
            K.log_softmax(logits, bad)
    with pytest.raises(TypeError, match="temperature"):
        K.token_logprobs(logits, targets, torch.tensor(1.0))
    with pytest.raises(ValueError, match="targets must have shape"):
        K.token_logprobs(logits, targets[:2])
    with pytest.raises(TypeError, match="integer"):
        K.token_logprobs(logits, targets.float())
    with pytest.raises(TypeError, match="floating"):
        K.log_softmax(targets[:, None])


# ----------------------------------------------------------------------------- GPU (device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", GPU_DTYPES)
@pytest.mark.parametrize("n,V", [(1, 151936), (257, 151936), (1000, 50257), (33, 1000)])
def test_gpu_accuracy(dtype, atol, rtol, n, V):
    logits, targets = _inputs(n, V, dtype, "cuda")
    lp, ent = K.token_logprobs(logits, targets, 0.7, return_entropy=True)
    r_lp, r_ent = ref.token_logprobs(logits, targets, 0.7, True)
    torch.testing.assert_close(lp, r_lp, atol=atol, rtol=rtol)
    torch.testing.assert_close(ent, r_ent, atol=atol, rtol=rtol)
    y = K.log_softmax(logits, 0.7)
    torch.testing.assert_close(y, ref.log_softmax(logits, 0.7), atol=atol, rtol=rtol)
    assert torch.equal(K.token_logprobs(logits, targets, 0.7), y.gather(1, targets[:, None]).squeeze(1))


@pytest.mark.gpu
def test_gpu_batch_invariance():
    _check_invariance(*_inputs(300, 151936, torch.bfloat16, "cuda"))
