"""RMSNorm / add+RMSNorm: accuracy vs the float64 reference, HF order, batch invariance, errors.

Tolerances (vs float64, values ~N(0,1) times weights ~U(0.5,1.5)): the kernel rounds the normalized
value to the input dtype and then the product, so two roundings of the output dtype:
fp32 1e-5, fp16 2e-3 (2^-10 ulp), bf16 2e-2 (2^-7 ulp, GPU only).
"""

import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels.reference import norm as ref

CPU_DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 2e-3, 2e-3)]
GPU_DTYPES = [(torch.bfloat16, 2e-2, 2e-2), (torch.float16, 2e-3, 2e-3), (torch.float32, 1e-5, 1e-5)]


def _inputs(rows, H, dtype, device="cpu"):
    x = torch.randn(rows, H, device=device).to(dtype)
    w = (torch.rand(H, device=device) + 0.5).to(dtype)
    return x, w


def _hf(x, w, eps):
    """HF Qwen3RMSNorm.forward, verbatim order."""
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("rows,H", [(1, 33), (7, 96), (33, 1000), (127, 33)])
def test_rmsnorm_matches_reference(interpreter, poison, dtype, atol, rtol, rows, H):
    x, w = _inputs(rows, H, dtype)
    y = K.rmsnorm(x, w, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, ref.rmsnorm(x, w, 1e-6), atol=atol, rtol=rtol)
    # the kernel follows HF's rounding order: at most one ulp from HF's own torch code
    torch.testing.assert_close(y, _hf(x, w, 1e-6), atol=atol, rtol=rtol)


def test_rmsnorm_multi_chunk_row(interpreter, monkeypatch):
    """Rows wider than one BLOCK go through the chunked two-pass path."""
    import rlperf.kernels.norm as norm

    monkeypatch.setattr(norm, "MAX_BLOCK", 64)
    x, w = _inputs(5, 1000, torch.float32)
    torch.testing.assert_close(K.rmsnorm(x, w), ref.rmsnorm(x, w), atol=1e-5, rtol=1e-5)
    r = torch.randn_like(x)
    y, s = K.add_rmsnorm(x, r, w)
    ry, rs = ref.add_rmsnorm(x, r, w)
    torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, rs, atol=0, rtol=0)


def test_rmsnorm_nd_noncontiguous_and_eps(interpreter):
    base = torch.randn(3, 5, 130)
    x = base[..., 2:98]  # last dim contiguous, rows strided
    w = torch.rand(96) + 0.5
    y = K.rmsnorm(x, w, eps=0.5)
    torch.testing.assert_close(y, ref.rmsnorm(x, w, 0.5), atol=1e-5, rtol=1e-5)
    # eps matters: a tiny row is scaled by 1/sqrt(eps), not blown up to unit RMS
    tiny = torch.full((1, 96), 1e-4)
    torch.testing.assert_close(K.rmsnorm(tiny, w, eps=1.0), ref.rmsnorm(tiny, w, 1.0), atol=1e-7, rtol=1e-5)


def test_rmsnorm_weight_promotion(interpreter):
    x, _ = _inputs(4, 96, torch.float16)
    w = torch.rand(96) + 0.5  # float32 weight, HF promotes the product to float32
    y = K.rmsnorm(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, _hf(x, w, 1e-6), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("rows,H", [(1, 96), (33, 1000), (127, 33)])
def test_add_rmsnorm_matches_reference(interpreter, poison, dtype, atol, rtol, rows, H):
    x, w = _inputs(rows, H, dtype)
    r = torch.randn(rows, H).to(dtype)
    y, s = K.add_rmsnorm(x, r, w)
    ry, rs = ref.add_rmsnorm(x, r, w)
    assert torch.equal(s, (r + x))  # the residual sum is exactly torch's add in the input dtype
    torch.testing.assert_close(s, rs, atol=0, rtol=0)
    torch.testing.assert_close(y, ry, atol=atol, rtol=rtol)
    assert torch.equal(y, K.rmsnorm(s, w))  # fused == add then rmsnorm, bit for bit


def _check_batch_invariance(fn, rows, H, dtype, device):
    x, w = _inputs(rows, H, dtype, device)
    full = fn(x, w)
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(fn(x[i : i + 1], w), full[i : i + 1]), f"row {i} alone differs"
    perm = torch.randperm(rows, device=device)
    assert torch.equal(fn(x[perm], w), full[perm]), "shuffled batch differs"
    assert torch.equal(fn(x[:2], w), full[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_batch_invariant(interpreter, dtype):
    _check_batch_invariance(lambda x, w: K.rmsnorm(x, w), 300, 96, dtype, "cpu")
    _check_batch_invariance(lambda x, w: K.add_rmsnorm(x, torch.ones_like(x), w)[0], 37, 1000, dtype, "cpu")


def test_fast_mode_is_hf(interpreter):
    x, w = _inputs(9, 96, torch.float16)
    with K.use_mode("fast"):
        y = K.rmsnorm(x, w)
        y2, s2 = K.add_rmsnorm(x, x, w)
    assert torch.equal(y, _hf(x, w, 1e-6))
    assert torch.equal(s2, x + x) and torch.equal(y2, _hf(x + x, w, 1e-6))


def test_reference_backend_matches(monkeypatch):
    x, w = _inputs(5, 96, torch.float32)
    with K.use_backend("reference"):
        y = K.rmsnorm(x, w)
    torch.testing.assert_close(y, ref.rmsnorm(x, w), atol=0, rtol=0)


def test_empty_and_errors(interpreter):
    w = torch.ones(96)
    assert K.rmsnorm(torch.empty(0, 96), w).shape == (0, 96)
    with pytest.raises(ValueError, match="weight must have shape"):
        K.rmsnorm(torch.randn(4, 96), torch.ones(95))
    with pytest.raises(ValueError, match="eps"):
        K.rmsnorm(torch.randn(4, 96), w, eps=0.0)
    with pytest.raises(TypeError, match="floating"):
        K.rmsnorm(torch.ones(4, 96, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="residual"):
        K.add_rmsnorm(torch.randn(4, 96), torch.randn(3, 96), w)


# ----------------------------------------------------------------------------- GPU (device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", GPU_DTYPES)
@pytest.mark.parametrize("rows,H", [(1, 2560), (127, 4096), (1000, 5120), (33, 1000), (64, 12288)])
def test_gpu_rmsnorm_accuracy(dtype, atol, rtol, rows, H):
    x, w = _inputs(rows, H, dtype, "cuda")
    y = K.rmsnorm(x, w)
    torch.testing.assert_close(y, ref.rmsnorm(x, w), atol=atol, rtol=rtol)
    torch.testing.assert_close(y, _hf(x, w, 1e-6), atol=atol, rtol=rtol)
    r = torch.randn_like(x)
    y2, s2 = K.add_rmsnorm(x, r, w)
    assert torch.equal(s2, r + x)
    assert torch.equal(y2, K.rmsnorm(s2, w))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [2560, 4096, 12288])
def test_gpu_rmsnorm_batch_invariant(H):
    _check_batch_invariance(lambda x, w: K.rmsnorm(x, w), 300, H, torch.bfloat16, "cuda")
    _check_batch_invariance(lambda x, w: K.add_rmsnorm(x, x, w)[0], 129, H, torch.bfloat16, "cuda")
