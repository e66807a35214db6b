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


# ----------------------------------------------------------------------------- backward

GRAD_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative norm vs float64


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _norm_grads(fn, inputs, upstream):
    """Outputs (detached) and d(sum_i out_i * upstream_i)/d inputs; None upstream: that output unused."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, u.to(o.dtype)) for o, u in zip(outs, upstream) if u is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [u for _, u in pairs])
    return [o.detach() for o in outs], grads


def _check_backward(op, reference, inputs, upstream, dtype):
    outs, got = _norm_grads(op, inputs, upstream)
    _, want = _norm_grads(reference, [t.double() for t in inputs], upstream)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == inputs[i].dtype and a.shape == inputs[i].shape, i
        assert _rel(a, b) < GRAD_TOL[dtype], (i, _rel(a, b))
    return outs, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,H", [(1, 33), (7, 96), (33, 1000)])
def test_rmsnorm_backward_matches_float64(interpreter, dtype, rows, H):
    x, w = _inputs(rows, H, dtype)
    up = [torch.randn(rows, H, dtype=torch.float64)]
    outs, _ = _check_backward(lambda x, w: K.rmsnorm(x, w), ref.rmsnorm, [x, w], up, dtype)
    assert torch.equal(outs[0], K.rmsnorm(x, w)), "the forward with grad enabled is the plain kernel's bits"
    xl = x.clone().requires_grad_(True)
    assert type(K.rmsnorm(xl, w).grad_fn).__name__ == "_RMSNormBackward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("used", ["both", "normed", "residual"])
def test_add_rmsnorm_backward_matches_float64(interpreter, dtype, used):
    rows, H = 9, 96
    x, w = _inputs(rows, H, dtype)
    r = torch.randn(rows, H).to(dtype)
    g = torch.Generator().manual_seed(1)
    up = [torch.randn(rows, H, generator=g, dtype=torch.float64) if used in (k, "both") else None
          for k in ("normed", "residual")]
    op = lambda x, r, w: K.add_rmsnorm(x, r, w)
    inputs = [x, r, w] if used != "residual" else [x, r]
    if used == "residual":  # the norm weight gets no gradient: leave it out of the inputs
        op = lambda x, r: K.add_rmsnorm(x, r, w)
    reference = ref.add_rmsnorm if used != "residual" else (lambda x, r: ref.add_rmsnorm(x, r, w.double()))
    outs, got = _check_backward(op, reference, inputs, up, dtype)
    assert torch.equal(got[0], got[1]), "d x = d residual"
    y, s = K.add_rmsnorm(x, r, w)
    assert torch.equal(outs[0], y) and torch.equal(outs[1], s)


def test_rmsnorm_backward_chunked_rows_and_program_blocks(interpreter, monkeypatch):
    """Rows wider than MAX_BLOCK take the chunked backward; few programs own several row tiles each
    (masked tails included). Both give the float64 gradient, and two runs give the same bits."""
    import rlperf.kernels.norm as norm

    monkeypatch.setattr(norm, "BWD_ROWS_PER_PROGRAM", 20)
    for max_block, (rows, H) in ((64, (5, 200)), (8192, (37, 33))):
        monkeypatch.setattr(norm, "MAX_BLOCK", max_block)
        x, w = _inputs(rows, H, torch.float32)
        r = torch.randn(rows, H)
        up = [torch.randn(rows, H, dtype=torch.float64), torch.randn(rows, H, dtype=torch.float64)]
        op = lambda x, r, w: K.add_rmsnorm(x, r, w)
        _, first = _check_backward(op, ref.add_rmsnorm, [x, r, w], up, torch.float32)
        _, again = _norm_grads(op, [x, r, w], up)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), max_block
        _check_backward(lambda x, w: K.rmsnorm(x, w), ref.rmsnorm, [x, w], up[:1], torch.float32)


def test_backward_weight_dtype_and_fast_mode(interpreter):
    """Gradients come back in their inputs' dtypes (a float32 weight on fp16 rows); fast mode's stock
    path on the CPU is differentiated by torch itself."""
    x, _ = _inputs(4, 96, torch.float16)
    w = torch.rand(96) + 0.5
    _check_backward(lambda x, w: K.rmsnorm(x, w), ref.rmsnorm, [x, w], [torch.randn(4, 96, dtype=torch.float64)],
                    torch.float16)
    with K.use_mode("fast"):
        xl = x.clone().requires_grad_(True)
        assert "RMSNorm" not in type(K.rmsnorm(xl, w).grad_fn).__name__
        assert "RMSNorm" not in type(K.add_rmsnorm(xl, xl, w)[0].grad_fn).__name__


def _blocks_both_ways(x, w, blocks, dy):
    """(y, dx, dweights) of rmsnorm_blocks over ``blocks`` replicas of w, and of the per-block calls
    (x sliced along dim 0, one rmsnorm per block with its replica, concatenated) with the same upstream."""
    def one_launch(x, reps):
        return K.rmsnorm_blocks(x, reps)

    def per_block(x, reps):
        per = x.shape[0] // blocks
        return torch.cat([K.rmsnorm(x[b * per:(b + 1) * per], reps[b]) for b in range(blocks)])

    reps = w[None].expand(blocks, -1).contiguous()
    got = [None, None]
    for i, fn in enumerate((one_launch, per_block)):
        outs, grads = _norm_grads(fn, [x, reps], [dy])
        got[i] = (outs[0], *grads)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,blocks,H", [(8 * 37, 8, 96), (16, 8, 33), (6, 2, 1000), (5, 1, 96), (8 * 70, 4, 64)])
def test_blocks_in_one_launch_equal_the_per_block_calls(interpreter, dtype, T, blocks, H):
    """rmsnorm_blocks (the megatron tree mode's token-block norm: one launch forward, the backward kernel
    and one grouped partial sum) against a call per block and the slices' gradients: output, dx and
    every block's weight gradient bit for bit, at block sizes that leave a backward program a tail (37,
    70 rows against 32 per program), odd widths, one block, and x [T, 1, H] as megatron passes it."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(T, 1, H, generator=g).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    dy = torch.randn(T, 1, H, generator=g, dtype=torch.float64)
    (y, gx, gw), (ry, rgx, rgw) = _blocks_both_ways(x, w, blocks, dy)
    assert gw.shape == (blocks, H) and gw.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, ry) and torch.equal(gw, rgw)
    assert torch.equal(gx, rgx)  # equal values (the slices' gradient adds may turn a -0.0 into +0.0)
    with torch.no_grad():
        assert torch.equal(K.rmsnorm_blocks(x, w[None].expand(blocks, -1).contiguous()), ry)


def test_blocks_chunked_rows_the_reference_backend_and_errors(interpreter, monkeypatch):
    """Rows wider than MAX_BLOCK (the chunked backward, zeroed partials) still have the per-block bits;
    on the reference backend the per-block calls run; bad shapes are named."""
    import rlperf.kernels.norm as norm

    monkeypatch.setattr(norm, "MAX_BLOCK", 64)
    monkeypatch.setattr(norm, "BWD_ROWS_PER_PROGRAM", 3)
    g = torch.Generator().manual_seed(22)
    x, w = torch.randn(4 * 5, 200, generator=g), torch.rand(200, generator=g) + 0.5
    dy = torch.randn(20, 200, generator=g, dtype=torch.float64)
    (y, gx, gw), (ry, rgx, rgw) = _blocks_both_ways(x, w, 4, dy)
    assert torch.equal(y, ry) and torch.equal(gx, rgx) and torch.equal(gw, rgw)
    with K.use_policy(K.KernelPolicy(backend="reference")):
        reps = torch.stack([w, w * 2])
        assert torch.equal(K.rmsnorm_blocks(x, reps), torch.cat([K.rmsnorm(x[:10], reps[0]), K.rmsnorm(x[10:], reps[1])]))
    with pytest.raises(ValueError, match=r"do not split into 3 equal blocks"):
        K.rmsnorm_blocks(x, w[None].expand(3, -1))
    with pytest.raises(ValueError, match=r"weights \[blocks, H\] with H = 200"):
        K.rmsnorm_blocks(x, w[None, :100])


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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_qwen3_shape_backward(dtype):
    """8192 tokens of the qwen3-0.6b hidden size (H=1024): rmsnorm and add_rmsnorm gradients close to
    float64, the forward with grad enabled is the plain kernel's bits, and two backward runs give the
    same bits (fixed-order partial sums of dweight, no atomics)."""
    rows, H = 8192, 1024
    x, w = _inputs(rows, H, dtype, "cuda")
    r = torch.randn_like(x)
    g = torch.Generator().manual_seed(1)
    up = [torch.randn(rows, H, generator=g, dtype=torch.float64).cuda() for _ in range(2)]
    for op, reference, inputs, ups in (
        (lambda x, w: K.rmsnorm(x, w), ref.rmsnorm, [x, w], up[:1]),
        (lambda x, r, w: K.add_rmsnorm(x, r, w), ref.add_rmsnorm, [x, r, w], up),
    ):
        outs, first = _check_backward(op, reference, inputs, ups, dtype)
        outs2, again = _norm_grads(op, inputs, ups)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), "the backward must be deterministic"
        with torch.no_grad():
            plain = op(*inputs)
        plain = plain if isinstance(plain, tuple) else (plain,)
        assert all(torch.equal(a, b) for a, b in zip(outs, plain))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_blocks_in_one_launch_equal_the_per_block_calls(dtype):
    """The megatron tree mode's token-block norm on the qwen3-0.6b shape (8 blocks, H = 1024), 8192 and
    16 tokens: one launch gives the per-block calls' output, dx and block weight gradients bit for bit."""
    for T in (8192, 16):
        g = torch.Generator().manual_seed(23)
        x = torch.randn(T, 1, 1024, generator=g).to(dtype).cuda()
        w = (torch.rand(1024, generator=g) + 0.5).to(dtype).cuda()
        dy = torch.randn(T, 1, 1024, generator=g, dtype=torch.float64).cuda()
        (y, gx, gw), (ry, rgx, rgw) = _blocks_both_ways(x, w, 8, dy)
        assert torch.equal(y, ry) and torch.equal(gw, rgw) and torch.equal(gx, rgx), T
