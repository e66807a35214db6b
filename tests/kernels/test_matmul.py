"""rlperf.kernels.matmul: accuracy against the float64 reference, and batch invariance bit for bit.

Inputs are scaled so outputs are O(1) (x ~ N(0,1), w ~ N(0,1)/sqrt(K)); tolerances then read as
errors of O(1) numbers:

* float32 inputs: float32 accumulation (tf32x3 products on the GPU) -> atol = rtol = 2e-5;
* float16: exact products, float32 sums, one rounding to fp16 (2^-11 relative) -> 2e-3;
* bfloat16 (GPU only): one rounding to bf16 (2^-8 relative) -> 1.6e-2;
* float32 output of 16-bit inputs (lm-head logits): float32 sums only -> 5e-5.

CPU tests run the Triton kernel in the interpreter (fp32/fp16; its bf16 dot is wrong), with small
N, K that are not multiples of the tiles; K = 96 takes the TMA-descriptor path, K = 33/130 (rows
not 16-byte aligned in fp16) the masked pointer path. GPU tests (marker ``gpu``) repeat them with
bf16 and real Qwen3 shapes, where the invariance bits actually matter. (The kernel's module is
``rlperf.kernels.gemm``.)
"""
import pytest
import torch
import torch.nn.functional as F

import rlperf.kernels as K
from rlperf.kernels.reference.matmul import matmul_ref

TOL = {  # dtype -> (atol, rtol), see the module docstring
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
F32_OUT_TOL = (5e-5, 5e-5)


def _inputs(m, n, k, dtype, device="cpu", bias=False):
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, w, b


def _poisoned(m, n, dtype, device="cpu"):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def _check_close(y, x, w, b, atol, rtol):
    ref = matmul_ref(x, w, b)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(33, 33), (130, 96), (96, 130)])
@pytest.mark.parametrize("m", [1, 7, 33, 127])
@pytest.mark.parametrize("bias", [False, True])
def test_accuracy_interpreter(interpreter, dtype, m, n, k, bias):
    atol, rtol = TOL[dtype]
    x, w, b = _inputs(m, n, k, dtype, bias=bias)
    out = _poisoned(m, n, dtype)
    y = K.matmul(x, w, b, out=out)
    assert y is out and y.dtype == dtype and y.shape == (m, n)
    _check_close(y, x, w, b, atol, rtol)


@pytest.mark.parametrize("k", [96, 130])
def test_float32_output_of_float16(interpreter, k):
    x, w, b = _inputs(40, 70, k, torch.float16, bias=True)
    y = K.matmul(x, w, b, out_dtype=torch.float32, out=_poisoned(40, 70, torch.float32))
    assert y.dtype == torch.float32
    _check_close(y, x, w, b, *F32_OUT_TOL)
    # fp32 output keeps what the fp16 cast would round away
    assert not torch.equal(y, y.half().float())


def test_bias_added_in_float32_before_the_cast(interpreter):
    # A fp32 bias that fp16 cannot hold: adding it after a cast to fp16 would lose it.
    x, w, _ = _inputs(5, 40, 96, torch.float16)
    b = torch.full((40,), 1e-3, dtype=torch.float32) + torch.randn(40) * 1e-4
    y = K.matmul(x, w, b, out_dtype=torch.float32)
    _check_close(y, x, w, b, *F32_OUT_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(130, 96), (96, 130)])
def test_batch_invariance_interpreter(interpreter, dtype, n, k):
    # rows 1..64 run the small-M config, larger batches the large-M one (16-bit): bits equal across
    small, large = (K.matmul_config(dtype, n, k, m) for m in (1, 300))
    assert (small != large) == (dtype != torch.float32) and small.BLOCK_K == large.BLOCK_K
    x, w, b = _inputs(300, n, k, dtype, bias=True)
    full = K.matmul(x, w, b)
    for row in (0, 5, 128, 299):  # rows in different tiles and tile positions
        assert torch.equal(K.matmul(x[row:row + 1], w, b)[0], full[row]), f"row {row} alone"
    for m in (2, 7, 64, 129, 200):
        assert torch.equal(K.matmul(x[:m], w, b), full[:m]), f"first {m} rows"
    perm = torch.randperm(300)
    shuffled = K.matmul(x[perm], w, b)
    assert torch.equal(shuffled[torch.argsort(perm)], full), "shuffled batch"


def test_noncontiguous_inputs_same_bits(interpreter):
    x, w, b = _inputs(37, 64, 96, torch.float16)
    x_t = x.T.contiguous().T  # column-major view
    w_wide = torch.cat([w, w], dim=1)[:, :96]  # row stride 192, a view
    assert not x_t.is_contiguous() and not w_wide.is_contiguous()
    assert torch.equal(K.matmul(x_t, w_wide, b), K.matmul(x, w, b))
    x_off = torch.randn(37 * 96 + 1).half()[1:].view(37, 96)  # storage offset: unaligned base
    assert torch.equal(K.matmul(x_off, w), K.matmul(x_off.clone(), w))


def test_linear_reshapes_leading_dims(interpreter):
    x, w, b = _inputs(2 * 3 * 5, 40, 96, torch.float16, bias=True)
    y = K.linear(x.view(2, 3, 5, 96), w, b)
    assert y.shape == (2, 3, 5, 40)
    assert torch.equal(y.reshape(30, 40), K.matmul(x, w, b))


def test_empty_sizes(interpreter):
    x, w, b = _inputs(0, 40, 96, torch.float16, bias=True)
    assert K.matmul(x, w, b).shape == (0, 40)
    x0, w0 = torch.randn(3, 0).half(), torch.randn(5, 0).half()
    b0 = torch.randn(5).half()
    assert torch.equal(K.matmul(x0, w0, b0), b0.expand(3, 5))


def test_fast_mode_is_f_linear():
    x, w, b = _inputs(9, 33, 65, torch.float32, bias=True)
    with K.use_mode("fast"):
        y = K.matmul(x, w, b)
    assert torch.equal(y, F.linear(x, w, b))


def test_reference_backend():
    x, w, b = _inputs(9, 33, 65, torch.float16, bias=True)
    with K.use_backend("reference"):
        y = K.matmul(x, w, b)
    assert torch.equal(y, matmul_ref(x, w, b).half())


def test_bad_arguments_name_the_shapes():
    x, w, _ = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=r"x \[M, K\] = \(4, 16\) and w \[N, K\] = \(8, 12\)"):
        K.matmul(x, torch.randn(8, 12))
    with pytest.raises(ValueError, match=r"bias must have shape \[N\] = \(8,\).*got \(7,\)"):
        K.matmul(x, w, torch.randn(7))
    with pytest.raises(TypeError, match="x dtype torch.float32 and w dtype torch.float16"):
        K.matmul(x, w.half())
    with pytest.raises(TypeError, match="not supported"):
        K.matmul(x.double(), w.double())
    with pytest.raises(ValueError, match="x must be 2-D"):
        K.matmul(x[0], w)
    with pytest.raises(ValueError, match=r"out must be \[M, N\] = \(4, 8\)"):
        K.matmul(x, w, out=torch.empty(4, 9))


def test_config_takes_buckets_of_m_that_share_the_reduction():
    from rlperf.kernels import gemm

    shapes = [(33, 33), (1024, 3072), (4096, 1024), (6144, 2560), (24576, 4096), (151936, 1024)] + list(gemm._TUNED_16BIT)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n, k in shapes:
            limit, tiny_limit = gemm.small_m_limit(n, k), gemm.tiny_m_limit(n, k)
            assert gemm.TINY_M <= tiny_limit < limit
            tiny = K.matmul_config(dtype, n, k, 1)
            small = K.matmul_config(dtype, n, k, tiny_limit + 1)
            large = K.matmul_config(dtype, n, k, limit + 1)
            assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"} <= set(vars(large))
            # every M of a bucket gets its config; all buckets share one BLOCK_K
            assert all(K.matmul_config(dtype, n, k, m) == tiny for m in (1, 2, 7, gemm.TINY_M, tiny_limit))
            assert all(K.matmul_config(dtype, n, k, m) == small for m in (tiny_limit + 1, limit))
            assert all(K.matmul_config(dtype, n, k, m) == large for m in (limit + 1, 1000, 1 << 20))
            assert tiny.BLOCK_K == small.BLOCK_K == large.BLOCK_K >= 16, (dtype, n, k, small, large)
            assert small.BLOCK_M % 64 == 0 and large.BLOCK_M % 64 == 0
            # the tiny bucket: the small-M config, or 16-row tiles computed transposed (64 w rows per wgmma)
            assert tiny == small or (tiny.BLOCK_M == 16 and tiny.BLOCK_N % 64 == 0), (n, k, tiny)
            # launches that cannot swap (SwiGLU epilogue, [K, N] weights) keep the small-M config
            assert K.matmul_config(dtype, n, k, 1, swapped_ok=False) == small
            if dtype == torch.float32:
                assert tiny == small == large
    # decode-sized batches of a small-N layer run narrower tiles than its large-M config, up to 256 rows
    assert K.matmul_config(torch.bfloat16, 1024, 3072, 1).BLOCK_N < K.matmul_config(torch.bfloat16, 1024, 3072, 4096).BLOCK_N
    assert K.matmul_config(torch.bfloat16, 1024, 3072, 256) == K.matmul_config(torch.bfloat16, 1024, 3072, 65)
    assert K.matmul_config(torch.bfloat16, 1024, 2048, 1).BLOCK_M == 16  # swapped at decode batches of <= 16
    # ... and up to 64 rows for the 0.6B o_proj and down, the 16 rows elsewhere
    assert K.matmul_config(torch.bfloat16, 1024, 3072, 64).BLOCK_M == 16
    assert K.matmul_config(torch.bfloat16, 1024, 3072, 65).BLOCK_M == 64
    assert K.matmul_config(torch.bfloat16, 4096, 1024, 17).BLOCK_M == 64
    with pytest.raises(TypeError, match="not supported"):
        K.matmul_config(torch.float64, 8, 8, 1)


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 6144, 2560), (257, 2560, 9728), (1024, 4096, 4096), (33, 1000, 1001),
                                   (4097, 3072, 1024)])
def test_accuracy_gpu(dtype, m, n, k):
    atol, rtol = TOL[dtype]
    x, w, b = _inputs(m, n, k, dtype, device="cuda", bias=True)
    y = K.matmul(x, w, b, out=_poisoned(m, n, dtype, "cuda"))
    _check_close(y, x, w, b, atol, rtol)


@pytest.mark.gpu
def test_float32_logits_gpu():
    x, w, _ = _inputs(300, 4099, 2560, torch.bfloat16, device="cuda")
    y = K.matmul(x, w, out_dtype=torch.float32, out=_poisoned(300, 4099, torch.float32, "cuda"))
    _check_close(y, x, w, None, *F32_OUT_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1024, 2560])
def test_float32_logits_full_vocab_gpu(k):
    """The Qwen3 lm-head (V = 151936): the float32 epilogue must fit shared memory, and the rows stay
    batch-invariant whatever pipeline depth had to be used."""
    x, w, _ = _inputs(257, 151936, k, torch.bfloat16, device="cuda")
    y = K.matmul(x, w, out_dtype=torch.float32)
    _check_close(y[:64], x[:64], w, None, *F32_OUT_TOL)
    assert torch.equal(K.matmul(x[200:201], w, out_dtype=torch.float32), y[200:201])
    assert torch.equal(K.matmul(x[:33], w, out_dtype=torch.float32), y[:33])


GPU_MS = (1, 2, 7, 16, 17, 33, 64, 65, 128, 255, 256, 257, 1024, 2048, 4097)  # the edges of the M buckets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,i,k", [(1, 48, 33), (7, 130, 96), (33, 64, 130), (127, 5, 16)])
def test_linear_silu_mul_is_the_two_calls_interpreter(interpreter, poison, monkeypatch, dtype, m, i, k):
    """One launch with the SwiGLU epilogue: the bits of silu_mul(matmul) (ragged tiles, odd I, K),
    leading dims kept; with autograd, in fast mode and on the reference backend it is the two calls.
    The epilogue is tested at every M here (the threshold raised), whatever rows it takes by default."""
    from rlperf.kernels import gemm

    monkeypatch.setattr(gemm, "SWIGLU_EPILOGUE_MAX_ROWS", 1 << 20)
    x, w, _ = _inputs(m, 2 * i, k, dtype)
    fused = K.linear_silu_mul(x, w)
    assert fused.shape == (m, i) and fused.dtype == dtype
    assert torch.equal(fused, K.silu_mul(K.matmul(x, w)))
    assert torch.equal(K.linear_silu_mul(x.reshape(1, m, k), w)[0], fused)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = K.linear_silu_mul(xg, wg)  # the train step's forward: the two calls, differentiable
    assert torch.equal(y.detach(), fused)
    y.sum().backward()
    assert xg.grad is not None and wg.grad is not None
    with K.use_backend("reference"):
        assert torch.equal(K.linear_silu_mul(x, w), K.silu_mul(K.matmul(x, w)))
    with pytest.raises(ValueError, match="2I, K"):
        K.linear_silu_mul(x, w[:-1])


def test_linear_silu_mul_takes_the_epilogue_up_to_its_row_threshold_only(interpreter, monkeypatch):
    """Up to SWIGLU_EPILOGUE_MAX_ROWS rows the one fused launch runs, above it the plain product and
    silu_mul; the bits are the same either way."""
    from rlperf.kernels import gemm

    launches = []
    real = gemm.launch
    monkeypatch.setattr(gemm, "launch", lambda *a, **kw: launches.append(kw.get("swiglu", False)) or real(*a, **kw))
    monkeypatch.setattr(gemm, "SWIGLU_EPILOGUE_MAX_ROWS", 5)
    x, w, _ = _inputs(6, 2 * 24, 16, torch.float32)
    for m, fused in ((5, True), (6, False)):
        launches.clear()
        y = K.linear_silu_mul(x[:m], w)
        assert (True in launches) == fused, m
        assert torch.equal(y, K.silu_mul(K.matmul(x[:m], w)))


def test_linear_silu_mul_bf16_under_the_interpreter_takes_the_two_calls(interpreter):
    """The interpreter rounds bf16 unlike torch (its matmul writes float32 that torch rounds): there
    the fused epilogue could not give the two calls' bits, so it is not used."""
    x, w, _ = _inputs(9, 64, 32, torch.bfloat16)
    assert torch.equal(K.linear_silu_mul(x, w), K.silu_mul(K.matmul(x, w)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n,k,bias,out_dtype", [
    (torch.bfloat16, 6144, 2560, False, None),    # Qwen3-4B fused qkv
    (torch.bfloat16, 2560, 9728, False, None),    # Qwen3-4B down
    (torch.bfloat16, 1024, 3072, True, None),     # Qwen3-0.6B down, with bias
    (torch.bfloat16, 1024, 2048, False, None),    # Qwen3-0.6B o_proj (swapped tiles to 16 rows, narrow to 256)
    (torch.bfloat16, 6144, 1024, False, None),    # Qwen3-0.6B gate_up
    (torch.bfloat16, 1024, 4096, False, None),    # Qwen3-0.6B qkv's input-gradient shape (128x256x64 tiles)
    (torch.bfloat16, 4099, 2560, False, torch.float32),  # lm-head-like: odd N, float32 logits
    (torch.bfloat16, 1000, 1001, False, None),    # K rows not 16-byte aligned: pointer path
    (torch.float16, 4096, 4096, False, None),
    (torch.float32, 1024, 2048, True, None),
])
def test_batch_invariance_gpu(dtype, n, k, bias, out_dtype):
    total = max(GPU_MS)
    x, w, b = _inputs(total, n, k, dtype, device="cuda", bias=bias)
    full = K.matmul(x, w, b, out_dtype=out_dtype)
    for m in GPU_MS:
        part = K.matmul(x[:m], w, b, out_dtype=out_dtype)
        assert torch.equal(part, full[:m]), f"first {m} rows differ from the same rows inside M={total}"
    for row in (0, 63, 64, 1000, total - 1):
        assert torch.equal(K.matmul(x[row:row + 1], w, b, out_dtype=out_dtype)[0], full[row]), f"row {row} alone"
    for seed in range(2):
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).cuda()
        shuffled = K.matmul(x[perm], w, b, out_dtype=out_dtype)
        assert torch.equal(shuffled[torch.argsort(perm)], full), "shuffled batch"
    # a row inside a mixed batch of other requests (different values around it)
    other = torch.randn(200, k, device="cuda").to(dtype)
    mixed = torch.cat([other[:77], x[5:6], other[77:]])
    assert torch.equal(K.matmul(mixed, w, b, out_dtype=out_dtype)[77], full[5])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,i,k", [
    (torch.bfloat16, 3072, 1024),   # Qwen3-0.6B gate_up [6144, 1024]
    (torch.bfloat16, 9728, 2560),   # Qwen3-4B gate_up
    (torch.bfloat16, 1000, 1001),   # odd sizes: the pointer path, a ragged last tile
    (torch.float16, 3072, 1024),
    (torch.float32, 3072, 1024),
])
def test_linear_silu_mul_is_the_two_calls_gpu(monkeypatch, dtype, i, k):
    """The SwiGLU epilogue gives the bits of matmul then silu_mul at every batch size, decode to prefill
    (the threshold raised: the epilogue is proven where the default does not take it too)."""
    from rlperf.kernels import gemm

    monkeypatch.setattr(gemm, "SWIGLU_EPILOGUE_MAX_ROWS", 1 << 30)
    x, w, _ = _inputs(max(GPU_MS), 2 * i, k, dtype, device="cuda")
    for m in GPU_MS:
        fused = K.linear_silu_mul(x[:m], w)
        assert torch.equal(fused, K.silu_mul(K.matmul(x[:m], w))), f"M={m}"


@pytest.mark.gpu
def test_unaligned_and_strided_inputs_gpu():
    m, n, k = 300, 2560, 4096
    x, w, _ = _inputs(m, n, k, torch.bfloat16, device="cuda")
    ref = K.matmul(x, w)
    x_off = torch.empty(m * k + 1, device="cuda", dtype=torch.bfloat16)[1:].view(m, k).copy_(x)  # base % 16 == 2
    assert torch.equal(K.matmul(x_off, w), ref)
    assert torch.equal(K.matmul(x.T.contiguous().T, w), ref)


# ---- the backward's products: input_grad (row invariant) and weight_grad (row-count invariant) ----


def test_weight_grad_sums_the_tokens_in_one_order_for_every_shape():
    """weight_grad's tiles may differ per layer shape, its rows per step (the order of the sum over the
    tokens) may not: a tensor-parallel rank's shard of dw (another N or K) must keep its bits."""
    from rlperf.kernels import gemm

    shapes = [(33, 33), (2048, 1024), (3072, 1024), (151936, 1024)] + list(gemm._WEIGHT_GRAD_TUNED_16BIT)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows = {gemm.weight_grad_config(dtype, n, k).BLOCK_M for n, k in shapes}
        rows |= {gemm.weight_grad_config(dtype, n // 2, k).BLOCK_M for n, k in shapes}
        rows |= {gemm.weight_grad_config(dtype, n, k // 2).BLOCK_M for n, k in shapes}
        assert rows == {gemm.weight_grad_config(dtype).BLOCK_M}, (dtype, rows)
    with pytest.raises(TypeError, match="not supported"):
        gemm.weight_grad_config(torch.float64, 8, 8)


def _grad_inputs(m, n, k, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    dy = torch.randn(m, n, generator=g, device=device).to(dtype)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    return dy, x, w


def _padded(t, rows, fill):
    """``t`` with ``rows`` rows appended: zeros (a pad token's gradient) or random (its activations)."""
    extra = torch.zeros if fill == "zeros" else (lambda *s, **kw: torch.randn(*s, **kw).to(t.dtype))
    return torch.cat([t, extra(rows, t.shape[1], dtype=t.dtype, device=t.device)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# (37, 70, 33) and (130, 19, 96): rows not 16-byte aligned on one side (pointer loads); (29, 64, 96):
# aligned both ways, so input_grad reads w [N, K] through a [BLOCK_K, BLOCK_N] TMA descriptor
@pytest.mark.parametrize("m, n, k", [(37, 70, 33), (130, 19, 96), (29, 64, 96), (1, 5, 8)])
def test_weight_and_input_grads_match_float64_interpreter(interpreter, dtype, m, n, k):
    from rlperf.kernels.gemm import input_grad, weight_grad

    dy, x, w = _grad_inputs(m, n, k, dtype)
    atol, rtol = TOL[dtype]
    scale = m**0.5  # dw sums m products of O(1) numbers
    torch.testing.assert_close(weight_grad(dy, x).double(), dy.double().T @ x.double(),
                               atol=atol * scale, rtol=rtol)
    torch.testing.assert_close(input_grad(dy, w).double(), dy.double() @ w.double(), atol=atol * 4, rtol=rtol)
    assert weight_grad(dy, x, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_padding_rows_change_no_bit_of_either_grad_interpreter(interpreter, dtype):
    """What a micro-batch padded to a CUDA-graph bucket does to a linear layer's backward: dy gains
    zero rows, x gains arbitrary rows. dw = dy.T @ x keeps every bit (odd pads, across the 64-row
    steps of the sum) and dx's real rows keep theirs; one row alone gives its dx row's bits."""
    from rlperf.kernels.gemm import input_grad, weight_grad

    for n, k in ((70, 33), (64, 96)):  # pointer loads; TMA descriptors
        dy, x, w = _grad_inputs(45, n, k, dtype, seed=3)
        want_dw, want_dx = weight_grad(dy, x), input_grad(dy, w)
        for pad in (1, 19, 83):
            assert torch.equal(weight_grad(_padded(dy, pad, "zeros"), _padded(x, pad, "random")), want_dw), pad
            assert torch.equal(input_grad(_padded(dy, pad, "random"), w)[:45], want_dx), pad
        assert torch.equal(input_grad(dy[7:8], w), want_dx[7:8])


def test_invariant_mode_backward_runs_the_kernels_fast_mode_torch(interpreter):
    """The matmul's autograd: in invariant mode dx and dw are input_grad's and weight_grad's bits
    (the choice is made at forward time, so it holds on autograd's thread); in fast mode torch's."""
    from rlperf.kernels.gemm import input_grad, weight_grad

    dy, x, w = _grad_inputs(29, 40, 24, torch.float32, seed=5)
    for mode, want in (("invariant", (input_grad(dy, w), weight_grad(dy, x))), ("fast", (dy @ w, dy.T @ x))):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        with K.use_mode(mode):
            y = K.matmul(xr, wr)
        gx, gw = torch.autograd.grad(y, (xr, wr), dy)
        assert torch.equal(gx, want[0]) and torch.equal(gw, want[1]), mode


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)])
def test_padding_rows_change_no_bit_of_either_grad_gpu(dtype, n, k):
    """The same on the GPU, Qwen3 0.6b shapes (qkv, o_proj, gate_up, down, lm-head): a 470-token
    micro-batch padded to 471, 768 and 2048 rows; its first rows alone (the small-M tiles of dx) keep
    their dx bits; accuracy against float64 on the unpadded one."""
    from rlperf.kernels.gemm import input_grad, weight_grad

    m = 470
    dy, x, w = _grad_inputs(m, n, k, dtype, device="cuda", seed=9)
    want_dw, want_dx = weight_grad(dy, x), input_grad(dy, w)
    for pad in (1, 768 - m, 2048 - m):
        assert torch.equal(weight_grad(_padded(dy, pad, "zeros"), _padded(x, pad, "random")), want_dw), pad
        assert torch.equal(input_grad(_padded(dy, pad, "random"), w)[:m], want_dx), pad
    for rows in (1, 64, 65):
        assert torch.equal(input_grad(dy[:rows], w), want_dx[:rows]), rows
    ref_dw = dy.double().T @ x.double()
    ref_dx = dy.double() @ w.double()
    err_dw = ((want_dw.double() - ref_dw).abs().max() / ref_dw.abs().max()).item()
    err_dx = ((want_dx.double() - ref_dx).abs().max() / ref_dx.abs().max()).item()
    bound = 1.6e-2 if dtype == torch.bfloat16 else 1e-5
    assert err_dw < bound and err_dx < bound, (err_dw, err_dx)
