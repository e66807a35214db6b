"""silu_mul: accuracy against float64 and batch invariance."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels.reference.activation import silu_mul_ref

# (dtype, atol, rtol): one rounding of an fp32 result to the dtype
TOLERANCES = [(torch.float32, 1e-6, 1e-5), (torch.float16, 1e-3, 2e-3)]


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("rows,inter", [(1, 1), (7, 33), (33, 1000), (127, 96)])
def test_silu_mul_matches_float64(interpreter, dtype, atol, rtol, rows, inter):
    x = torch.randn(rows, 2 * inter, dtype=dtype) * 3
    y = K.silu_mul(x)
    assert y.shape == (rows, inter) and y.dtype == dtype
    torch.testing.assert_close(y.double(), silu_mul_ref(x), atol=atol, rtol=rtol)


def test_silu_mul_rows_are_batch_invariant(interpreter):
    x = torch.randn(300, 2 * 130)
    alone = K.silu_mul(x[5:6])
    for m in (6, 33, 300):
        assert torch.equal(K.silu_mul(x[:m])[5:6], alone)
    perm = torch.randperm(300)
    assert torch.equal(K.silu_mul(x[perm])[torch.argsort(perm)], K.silu_mul(x))


def test_silu_mul_leading_dims_and_odd_width_error(interpreter):
    x = torch.randn(2, 3, 2 * 17)
    torch.testing.assert_close(K.silu_mul(x).double(), silu_mul_ref(x), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="even"):
        K.silu_mul(torch.randn(4, 7))


def test_silu_mul_reference_and_fast_paths():
    x = torch.randn(9, 2 * 40)
    with K.use_backend("reference"):
        torch.testing.assert_close(K.silu_mul(x).double(), silu_mul_ref(x), atol=1e-6, rtol=1e-5)
    with K.use_mode("fast"):
        g, u = x.chunk(2, dim=-1)
        assert torch.equal(K.silu_mul(x), torch.nn.functional.silu(g) * u)


def _silu_grads(fn, x, dy):
    leaf = x.detach().clone().requires_grad_(True)
    y = fn(leaf)
    (g,) = torch.autograd.grad(y, leaf, dy.to(y.dtype))
    return y.detach(), g


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# relative norm error of d gate_up vs float64 autograd: fp32 math, one rounding to the dtype
GRAD_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 1), (7, 33), (33, 1000)])
def test_silu_mul_backward_matches_float64(interpreter, dtype, rows, inter):
    x = torch.randn(rows, 2 * inter, dtype=dtype) * 3
    dy = torch.randn(rows, inter, dtype=torch.float64)
    y, g = _silu_grads(K.silu_mul, x, dy)
    _, want = _silu_grads(silu_mul_ref, x.double(), dy)
    assert g.dtype == dtype and g.shape == x.shape
    assert _rel(g, want) < GRAD_TOL[dtype], _rel(g, want)
    assert torch.equal(y, K.silu_mul(x)) and torch.equal(_silu_grads(K.silu_mul, x, dy)[1], g)
    assert type(K.silu_mul(x.clone().requires_grad_(True)).grad_fn).__name__ == "_SiLUMulBackward"


def test_silu_mul_backward_strided_and_fast_mode(interpreter):
    base = torch.randn(2, 5, 2 * 40 + 6)
    x = base[..., 3:83]  # rows strided, last dim contiguous
    dy = torch.randn(2, 5, 40, dtype=torch.float64)
    _, g = _silu_grads(K.silu_mul, x, dy)
    _, want = _silu_grads(silu_mul_ref, x.double(), dy)
    assert _rel(g, want) < GRAD_TOL[torch.float32]
    with K.use_mode("fast"):  # CPU: the stock op, differentiated by torch
        assert "SiLUMul" not in type(K.silu_mul(x.clone().requires_grad_(True)).grad_fn).__name__


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_gpu_qwen3_shape_backward(dtype):
    """8192 tokens of the qwen3-0.6b MLP (I=3072): d gate_up close to float64, twice the same bits."""
    x = torch.randn(8192, 2 * 3072, dtype=dtype, device="cuda") * 3
    dy = torch.randn(8192, 3072, dtype=torch.float64, device="cuda")
    y, g = _silu_grads(K.silu_mul, x, dy)
    _, want = _silu_grads(silu_mul_ref, x.double(), dy)
    assert _rel(g, want) < GRAD_TOL[dtype], _rel(g, want)
    assert torch.equal(_silu_grads(K.silu_mul, x, dy)[1], g) and torch.equal(y, K.silu_mul(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_gpu(dtype):
    x = torch.randn(4097, 2 * 3072, dtype=dtype, device="cuda") * 3
    y = K.silu_mul(x)
    torch.testing.assert_close(y.double(), silu_mul_ref(x), atol=1e-2, rtol=1e-2)
    assert torch.equal(K.silu_mul(x[100:101]), y[100:101])
    perm = torch.randperm(4097, device="cuda")
    assert torch.equal(K.silu_mul(x[perm])[torch.argsort(perm)], y)
