"""The fixed-order Triton backward of varlen attention (kernels/attention_backward.py).

* gradients of q, k, v against autograd through the float64 reference, per dtype, on odd packed
  lengths (a 1-token and an empty sequence, a diagonal-only one, one long enough for unmasked
  blocks in both gradient kernels), GQA and MHA, default and custom scale; dk, dv also with key
  blocks smaller than a query step and spanning several;
* the same call twice gives the same bits; a sequence's gradients do not depend on the batch;
* the forward that saves the log-sum-exp keeps the output's bits, and its LSE is right;
* gradients flow through the op as the model uses it (q and v strided views of one fused qkv
  projection) and only where asked.

CPU runs the interpreter in float32 and float16 (its bf16 ``tl.dot`` is wrong); the ``gpu`` tests
prove accuracy and run-to-run bits in bf16/fp16 at head_dim 128 with Qwen3-0.6B's heads.
"""
from __future__ import annotations

import math

import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels.reference.attention import attention_ref

LENS = [1, 7, 0, 33, 200]  # 200: unmasked steps in the dk/dv and dq loops for every CPU config


def cu_of(lens, device) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make(lens, hq, hkv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv))
    up = torch.randn(T, hq, d, generator=g, dtype=torch.float64).to(device)
    return q, k, v, up, cu_of(lens, device)


def grads(fn, q, k, v, up):
    """(dq, dk, dv) of sum(fn(q, k, v) * up) and the forward output."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return torch.autograd.grad((out.double() * up).sum(), leaves), out.detach()


def ref_grads(q, k, v, up, cu, scale=None):
    return grads(lambda q, k, v: attention_ref(q, k, v, cu, cu, scale), q.double(), k.double(), v.double(), up)[0]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------------------------------------
# CPU (Triton interpreter)
# ---------------------------------------------------------------------------------------------

# (dtype, head_dim, atol, rtol) against float64. fp32: the interpreter's tile products are exact
# and rounded to float32 once, so only exp/accumulation rounding (~1e-7 relative). fp16: P and dS
# are rounded to fp16 (2^-11) before their products, delta uses the fp16 output, and the gradients
# are rounded to fp16 (gradient entries up to ~5).
CPU_TOLS = [(torch.float32, 32, 2e-5, 2e-5), (torch.float16, 16, 6e-3, 5e-3), (torch.float16, 32, 6e-3, 5e-3)]


@pytest.mark.parametrize("dtype,d,atol,rtol", CPU_TOLS, ids=["fp32-d32", "fp16-d16", "fp16-d32"])
@pytest.mark.parametrize("hq,hkv,scale", [(4, 2, None), (2, 2, 0.3)], ids=["gqa", "mha-scale"])
def test_gradients_match_float64_reference(interpreter, poison, dtype, d, atol, rtol, hq, hkv, scale):
    q, k, v, up, cu = make(LENS, hq, hkv, d, dtype, "cpu")
    (dq, dk, dv), _ = grads(lambda q, k, v: K.varlen_attention(q, k, v, cu, scale), q, k, v, up)
    for name, got, want, x in zip("qkv", (dq, dk, dv), ref_grads(q, k, v, up, cu, scale), (q, k, v)):
        assert got.dtype == dtype and got.shape == x.shape, name
        assert not got.isnan().any(), f"d{name}: a row was never written"  # `poison`: empty outputs start as NaN
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("block_kv,step_q", [(32, 64), (128, 16)], ids=["kv32-q64", "kv128-q16"])
def test_dkdv_tile_geometries_match_float64_reference(interpreter, poison, block_kv, step_q):
    """The dk/dv program's one loop over (query head, query block) pairs, with key blocks smaller than
    a query step and spanning several: the first block, the diagonal ones and the unmasked ones."""
    from rlperf.kernels.attention_backward import BackwardConfig, attention_backward
    from rlperf.kernels.attention import attention_forward

    q, k, v, up, cu = make(LENS, 4, 2, 16, torch.float32, "cpu", seed=6)
    out, lse = attention_forward(q, k, v, cu, return_lse=True)
    cfg = BackwardConfig(BLOCK_KV=block_kv, STEP_Q=step_q, BLOCK_Q=32, STEP_KV=32, num_warps=4, num_stages=2)
    _, dk, dv = attention_backward(q, k, v, out, lse, up.float(), cu, need_dq=False, config=cfg)
    _, want_dk, want_dv = ref_grads(q, k, v, up, cu)
    for name, got, want in (("k", dk, want_dk), ("v", dv, want_dv)):
        assert not got.isnan().any(), f"d{name}: a row was never written"
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5, msg=lambda m: f"d{name}: {m}")


def test_same_call_twice_identical_bits(interpreter):
    q, k, v, up, cu = make(LENS, 4, 2, 16, torch.float16, "cpu", seed=1)
    fn = lambda q, k, v: K.varlen_attention(q, k, v, cu)  # noqa: E731
    first, out1 = grads(fn, q, k, v, up)
    second, out2 = grads(fn, q, k, v, up)
    assert torch.equal(out1, out2)
    for name, a, b in zip("qkv", first, second):
        assert torch.equal(a, b), f"d{name} changed between two identical calls"


def test_gradients_do_not_depend_on_the_batch(interpreter):
    """Each sequence's tiles start at its first token: alone, or in another order, the same bits."""
    lens = [33, 1, 200, 7]
    q, k, v, up, cu = make(lens, 4, 2, 16, torch.float16, "cpu", seed=2)
    fn = lambda cu: lambda q, k, v: K.varlen_attention(q, k, v, cu)  # noqa: E731
    batch, _ = grads(fn(cu), q, k, v, up)
    c = cu.tolist()
    for b in (0, 2):
        s = slice(c[b], c[b + 1])
        alone, _ = grads(fn(cu_of([lens[b]], "cpu")), q[s], k[s], v[s], up[s])
        for name, a, full in zip("qkv", alone, batch):
            assert torch.equal(a, full[s]), f"sequence {b} d{name}"
    order = [3, 2, 0, 1]
    idx = torch.cat([torch.arange(c[b], c[b + 1]) for b in order])
    shuffled, _ = grads(fn(cu_of([lens[b] for b in order], "cpu")), q[idx], k[idx], v[idx], up[idx])
    for name, a, full in zip("qkv", shuffled, batch):
        assert torch.equal(a, full[idx]), f"reordered batch d{name}"


def test_lse_forward_keeps_output_bits(interpreter):
    from rlperf.kernels.attention import attention_forward

    lens = [5, 130]
    q, k, v, _, cu = make(lens, 4, 2, 32, torch.float32, "cpu", seed=3)
    out, lse = attention_forward(q, k, v, cu, return_lse=True)
    assert torch.equal(out, attention_forward(q, k, v, cu))
    assert lse.shape == (4, sum(lens)) and lse.dtype == torch.float32
    # lse[j, i] = log2 sum_{p <= i} exp(scale * q . k)
    c = cu.tolist()
    want = torch.empty(4, sum(lens), dtype=torch.float64)
    for b in range(len(lens)):
        s = slice(c[b], c[b + 1])
        qb, kb = q[s].double().transpose(0, 1), k[s].double().repeat_interleave(2, 1).transpose(0, 1)
        scores = qb @ kb.transpose(1, 2) * 32 ** -0.5
        n = lens[b]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want[:, s] = torch.logsumexp(scores, -1) / math.log(2)
    torch.testing.assert_close(lse.double(), want, atol=1e-5, rtol=1e-5)
    # with grad enabled the op runs this forward: still the plain kernel's bits
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    assert torch.equal(K.varlen_attention(*leaves, cu).detach(), out)


def _strided_like_model(qkv, hq, hkv, d):
    """q, k, v as the model makes them: q and v strided views of the fused projection, k a new tensor."""
    T = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(T, hq, d), (k * 1.0).reshape(T, hkv, d), v.reshape(T, hkv, d)


def test_gradients_flow_as_the_model_uses_the_op(interpreter):
    """Backward through strided views of one fused qkv leaf and an output projection, compared with
    autograd through the float64 reference backend; which backward runs is the policy's."""
    lens, hq, hkv, d = [9, 70], 4, 2, 16
    g = torch.Generator().manual_seed(4)
    qkv0 = torch.randn(sum(lens), (hq + 2 * hkv) * d, generator=g)
    w_o = torch.randn(24, hq * d, generator=g)
    cu = cu_of(lens, "cpu")

    def loss_and_grad(backend=None):
        qkv = qkv0.clone().requires_grad_(True)
        with K.use_backend(backend):
            q, k, v = _strided_like_model(qkv, hq, hkv, d)
            a = K.varlen_attention(q, k, v, cu)
            kind = type(a.grad_fn).__name__
            loss = (a.reshape(sum(lens), hq * d) @ w_o.T).square().sum()
        loss.backward()
        return qkv.grad, kind

    got, kind = loss_and_grad()
    assert kind == "_VarlenAttentionBackward"
    want, kind_ref = loss_and_grad("reference")
    assert kind_ref != kind  # autograd differentiates the float64 reference itself
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with K.use_mode("fast"):
        q, k, v = _strided_like_model(qkv0.clone().requires_grad_(True), hq, hkv, d)
        assert type(K.varlen_attention(q, k, v, cu).grad_fn).__name__ == "_RecomputeBackwardBackward"


def test_only_the_wanted_gradients(interpreter):
    q, k, v, up, cu = make([3, 40], 4, 2, 16, torch.float32, "cpu", seed=5)
    (dq, _, dv), _ = grads(lambda q, k, v: K.varlen_attention(q, k, v, cu), q, k, v, up)
    qq = q.clone().requires_grad_(True)
    (only_dq,) = torch.autograd.grad((K.varlen_attention(qq, k, v, cu).double() * up).sum(), [qq])
    assert torch.equal(only_dq, dq)
    vv = v.clone().requires_grad_(True)
    (only_dv,) = torch.autograd.grad((K.varlen_attention(q, k, vv, cu).double() * up).sum(), [vv])
    assert torch.equal(only_dv, dv)


def test_launcher_edge_cases(interpreter):
    from rlperf.kernels.attention_backward import attention_backward, backward_config

    q = torch.zeros(0, 4, 16)
    k = torch.zeros(0, 2, 16)
    dq, dk, dv = attention_backward(q, k, k, q, torch.zeros(4, 0), q, cu_of([], "cpu"))
    assert dq.shape == (0, 4, 16) and dk.shape == dv.shape == (0, 2, 16)
    assert attention_backward(q, k, k, q, torch.zeros(4, 0), q, cu_of([0], "cpu"), need_dq=False)[0] is None
    with pytest.raises(ValueError, match="dtype"):
        backward_config(torch.float64, 64)


# ---------------------------------------------------------------------------------------------
# GPU: Qwen3-0.6B heads (16 q / 8 kv), head_dim 128, ~4096 tokens
# ---------------------------------------------------------------------------------------------

GPU_LENS = [1, 1000, 127, 2047, 921]  # 4096 tokens
# relative (norm) error of each gradient against float64: bf16 P/dS/grads carry 8 significant bits,
# fp16 11; float32 runs its tile products in tf32 (10 bits), as the forward does
GPU_TOLS = [(torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", GPU_TOLS, ids=["bf16", "fp16", "fp32"])
def test_gpu_gradients_close_to_float64_and_identical_run_to_run(dtype, tol):
    q, k, v, up, cu = make(GPU_LENS, 16, 8, 128, dtype, "cuda", seed=10)
    fn = lambda q, k, v: K.varlen_attention(q, k, v, cu)  # noqa: E731
    first, out = grads(fn, q, k, v, up)
    for _ in range(2):
        again, out2 = grads(fn, q, k, v, up)
        assert torch.equal(out2, out)
        for name, a, b in zip("qkv", again, first):
            assert torch.equal(a, b), f"{dtype} d{name}: max diff {(a.double() - b.double()).abs().max()}"
    want = ref_grads(q, k, v, up, cu)
    with K.use_mode("fast"):  # the stock backward (flash / SDPA), for scale in the message
        stock, _ = grads(fn, q, k, v, up)
    for name, a, s, w in zip("qkv", first, stock, want):
        assert a.dtype == dtype and not a.isnan().any()
        err, stock_err = rel_err(a, w), rel_err(s, w)
        assert err < tol, f"{dtype} d{name}: relative error {err:.2e} (stock backward {stock_err:.2e})"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [128, 64, 16])
def test_gpu_lse_forward_keeps_output_bits(dtype, d):
    """The training forward (saving the LSE) gives the bits of the plain kernel, which the engine's
    prefill and decode share (tests/kernels/test_attention.py), also with the model's strided q/v."""
    from rlperf.kernels.attention import attention_forward

    q, k, v, _, cu = make(GPU_LENS, 16, 8, d, dtype, "cuda", seed=11)
    out, lse = attention_forward(q, k, v, cu, return_lse=True)
    assert torch.equal(out, attention_forward(q, k, v, cu)) and not lse.isnan().any()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    assert torch.equal(K.varlen_attention(*leaves, cu).detach(), out)
    qkv = torch.randn(sum(GPU_LENS), (16 + 2 * 8) * d, device="cuda").to(dtype)
    qs, ks, vs = _strided_like_model(qkv, 16, 8, d)
    with torch.no_grad():
        plain = K.varlen_attention(qs, ks, vs, cu)
    qkv.requires_grad_(True)
    assert torch.equal(K.varlen_attention(*_strided_like_model(qkv, 16, 8, d), cu).detach(), plain)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gradients_do_not_depend_on_the_batch(dtype):
    q, k, v, up, cu = make(GPU_LENS, 16, 8, 128, dtype, "cuda", seed=12)
    batch, _ = grads(lambda q, k, v: K.varlen_attention(q, k, v, cu), q, k, v, up)
    c = cu.tolist()
    for b in (1, 3):
        s = slice(c[b], c[b + 1])
        alone, _ = grads(lambda q, k, v: K.varlen_attention(q, k, v, cu_of([GPU_LENS[b]], "cuda")),
                         q[s], k[s], v[s], up[s])
        for name, a, full in zip("qkv", alone, batch):
            assert torch.equal(a, full[s]), f"sequence {b} d{name}"
