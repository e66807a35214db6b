"""rmsnorm_rope (fused q/k RMSNorm + RoPE): accuracy vs float64, backward, determinism, batch invariance.

Inputs are strided views of a qkv-like buffer, as the model passes them. Tolerances (vs float64;
values ~N(0,1) times weights ~U(0.5,1.5)): the kernel rounds the normed value twice in the input
dtype (rmsnorm's order), then rounds the rotation once, so a few ulps of the dtype at the size of
``|y1| + |y2|`` (not of ``|out|``, which can cancel to ~0): fp32 2e-5, fp16 8e-3 (1.6e-2 absolute
on the GPU's 16M values, whose largest inputs reach ~8), bf16 1e-1 absolute (GPU only).
Gradients: the float32 backward against autograd of the float64 reference; fp16 gradients are
rounded to fp16 (and get fp16-rounded upstream gradients), so they are compared by relative norm.
"""
import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels import rope as rope_mod
from rlperf.kernels.reference.rope import rmsnorm_rope as ref_rope
from rlperf.model.layer import RopeTable

CPU_DTYPES = [(torch.float32, 2e-5, 2e-5), (torch.float16, 8e-3, 8e-3)]
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
MAX_POS = 4096
EPS = 1e-6


def _table(D, device="cpu"):
    return RopeTable(D, MAX_POS, 1_000_000.0, device)


def _inputs(T, heads, D, dtype, device="cpu", seed=0, other_heads=2):
    """x [T, heads, D] as a strided view of a [T, (heads + other_heads) * D] projection, weight [D],
    positions [T] (random, within the table)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (heads + other_heads) * D, generator=g).to(device=device, dtype=dtype)
    x = qkv[:, D : (heads + 1) * D].reshape(T, heads, D)
    w = (torch.rand(D, generator=g) + 0.5).to(device=device, dtype=dtype)
    pos = torch.randint(0, MAX_POS, (T,), generator=g).to(device)
    return x, w, pos


def _grads(fn, x, w, dout):
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out = fn(x, w)
    gx, gw = torch.autograd.grad(out, (x, w), dout.to(out.dtype))
    return out.detach(), gx, gw


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("T,heads,D", [(1, 3, 16), (7, 3, 32), (33, 3, 128), (5, 1, 128)])
def test_forward_matches_float64_reference(interpreter, poison, dtype, atol, rtol, T, heads, D):
    x, w, pos = _inputs(T, heads, D, dtype)
    table = _table(D)
    cos, sin = table.cos, table.sin
    y = K.rmsnorm_rope(x, w, pos, cos, sin, EPS)
    assert y.dtype == dtype and y.shape == (T, heads, D) and y.is_contiguous()
    torch.testing.assert_close(y, ref_rope(x, w, pos, cos, sin, EPS), atol=atol, rtol=rtol)
    # the unfused torch formula (rmsnorm, then RopeTable.apply) rounds the same way: within an ulp or so
    unfused = table.apply(K.rmsnorm(x, w, EPS), pos)
    torch.testing.assert_close(y, unfused, atol=atol, rtol=rtol)


def test_position_zero_is_the_norm(interpreter):
    """cos = 1, sin = 0 at position 0: the output is the normed value itself, rounded as rmsnorm rounds."""
    x, w, _ = _inputs(9, 3, 32, torch.float16)
    t32 = _table(32)
    cos, sin = t32.cos, t32.sin
    y = K.rmsnorm_rope(x, w, torch.zeros(9, dtype=torch.int64), cos, sin, EPS)
    torch.testing.assert_close(y, K.rmsnorm(x, w, EPS), atol=1e-3, rtol=1e-3)  # rstd may differ in its last bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,heads,D", [(1, 3, 16), (7, 3, 32), (33, 3, 128)])
def test_backward_matches_float64_reference(interpreter, dtype, T, heads, D):
    x, w, pos = _inputs(T, heads, D, dtype, seed=1)
    table = _table(D)
    cos, sin = table.cos, table.sin
    dout = torch.randn(T, heads, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y, gx, gw = _grads(lambda x, w: K.rmsnorm_rope(x, w, pos, cos, sin, EPS), x, w, dout)
    _, rx, rw = _grads(lambda x, w: ref_rope(x, w, pos, cos, sin, EPS), x.double(), w.double(), dout)
    assert gx.dtype == dtype and gw.dtype == dtype and gx.shape == x.shape
    assert _rel(gx, rx) < GRAD_TOL[dtype] and _rel(gw, rw) < GRAD_TOL[dtype], (_rel(gx, rx), _rel(gw, rw))
    # the forward with grad enabled is the plain kernel's bits
    with torch.no_grad():
        assert torch.equal(y, K.rmsnorm_rope(x, w, pos, cos, sin, EPS))


def test_backward_many_tokens_per_program_and_twice_same_bits(interpreter, monkeypatch):
    """Few backward programs (each owns several tokens and loops over head blocks): still the float64
    gradient, and two runs give the same bits."""
    monkeypatch.setattr(rope_mod, "BWD_TOKENS_PER_PROGRAM", 4)
    monkeypatch.setattr(rope_mod, "MAX_HALF_TILE", 16)  # BLOCK_H = 1 for D = 32: a loop over the 5 heads
    x, w, pos = _inputs(11, 5, 32, torch.float32, seed=3)
    t32 = _table(32)
    cos, sin = t32.cos, t32.sin
    dout = torch.randn(11, 5, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    fn = lambda x, w: K.rmsnorm_rope(x, w, pos, cos, sin, EPS)
    y1, gx1, gw1 = _grads(fn, x, w, dout)
    y2, gx2, gw2 = _grads(fn, x, w, dout)
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2) and torch.equal(gw1, gw2)
    _, rx, rw = _grads(lambda x, w: ref_rope(x, w, pos, cos, sin, EPS), x.double(), w.double(), dout)
    assert _rel(gx1, rx) < 1e-5 and _rel(gw1, rw) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_invariant(interpreter, dtype):
    """A token's bits are the same alone, in any batch, in any order (decode vs packed prefill)."""
    x, w, pos = _inputs(33, 3, 32, dtype, seed=5)
    t32 = _table(32)
    cos, sin = t32.cos, t32.sin
    full = K.rmsnorm_rope(x, w, pos, cos, sin, EPS)
    for i in (0, 16, 32):
        assert torch.equal(K.rmsnorm_rope(x[i : i + 1], w, pos[i : i + 1], cos, sin, EPS), full[i : i + 1]), i
    perm = torch.randperm(33)
    assert torch.equal(K.rmsnorm_rope(x[perm], w, pos[perm], cos, sin, EPS), full[perm])
    assert torch.equal(K.rmsnorm_rope(x.contiguous(), w, pos, cos, sin, EPS), full)  # strides do not matter


def test_dispatch_reference_fast_and_autograd(interpreter):
    x, w, pos = _inputs(6, 3, 32, torch.float32, seed=6)
    t32 = _table(32)
    cos, sin = t32.cos, t32.sin
    with K.use_backend("reference"):
        assert torch.equal(K.rmsnorm_rope(x, w, pos, cos, sin, EPS), ref_rope(x, w, pos, cos, sin, EPS))
        xl = x.detach().clone().requires_grad_(True)
        assert "RMSNormRope" not in type(K.rmsnorm_rope(xl, w, pos, cos, sin, EPS).grad_fn).__name__
    with K.use_mode("fast"):  # CPU: the unfused torch formula, differentiated by torch itself
        stock = rope_mod._torch_rmsnorm_rope(x, w, pos, cos, sin, EPS)
        assert torch.equal(K.rmsnorm_rope(x, w, pos, cos, sin, EPS), stock)
        xl = x.detach().clone().requires_grad_(True)
        out = K.rmsnorm_rope(xl, w, pos, cos, sin, EPS)
        assert torch.equal(out, stock) and "RMSNormRope" not in type(out.grad_fn).__name__
    xl = x.detach().clone().requires_grad_(True)
    assert type(K.rmsnorm_rope(xl, w, pos, cos, sin, EPS).grad_fn).__name__ == "_RMSNormRopeBackward"


def test_empty_and_errors(interpreter):
    t32 = _table(32)
    cos, sin = t32.cos, t32.sin
    w = torch.ones(32)
    assert K.rmsnorm_rope(torch.empty(0, 3, 32), w, torch.empty(0, dtype=torch.int64), cos, sin).shape == (0, 3, 32)
    x = torch.randn(4, 3, 32)
    pos = torch.arange(4)
    with pytest.raises(ValueError, match="D even"):
        K.rmsnorm_rope(torch.randn(4, 3, 31), torch.ones(31), pos, cos, sin)
    with pytest.raises(ValueError, match="weight"):
        K.rmsnorm_rope(x, torch.ones(16), pos, cos, sin)
    with pytest.raises(ValueError, match="positions"):
        K.rmsnorm_rope(x, w, pos.float(), cos, sin)
    with pytest.raises(ValueError, match="float32"):
        K.rmsnorm_rope(x, w, pos, cos.double(), sin)
    with pytest.raises(ValueError, match="eps"):
        K.rmsnorm_rope(x, w, pos, cos, sin, eps=0.0)


def _store_kv_both_ways(T, q_heads, kv_heads, D, dtype, device="cpu", page=16, pages=9, seed=3):
    """rmsnorm_rope_store_kv's q and caches, and those of the separate calls (rmsnorm_rope of q and of
    k, then write_kv_cache), from the same inputs: q, k and v strided views of a qkv buffer, slots
    spread over the pages (some -1)."""
    from rlperf.kernels.attention import write_kv_cache

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (q_heads + 2 * kv_heads) * D, generator=g).to(device=device, dtype=dtype)
    q = qkv[:, :q_heads * D].reshape(T, q_heads, D)
    k = qkv[:, q_heads * D:(q_heads + kv_heads) * D].reshape(T, kv_heads, D)
    v = qkv[:, (q_heads + kv_heads) * D:].reshape(T, kv_heads, D)
    wq, wk = ((torch.rand(D, generator=g) + 0.5).to(device=device, dtype=dtype) for _ in range(2))
    pos = torch.randint(0, MAX_POS, (T,), generator=g).to(device)
    slots = torch.randperm(pages * page, generator=g)[:T].to(device)
    slots[1::3] = -1  # every third from the second: padding rows (a one-token batch keeps its slot)
    table = _table(D, device)
    fill = torch.full((pages, page, kv_heads, D), 7.0, dtype=dtype, device=device)  # untouched slots keep it
    fused_k, fused_v, sep_k, sep_v = (fill.clone() for _ in range(4))
    fused_q = K.rmsnorm_rope_store_kv(q, wq, k, wk, pos, table.cos, table.sin, EPS, v, fused_k, fused_v, slots)
    sep_q = K.rmsnorm_rope(q, wq, pos, table.cos, table.sin, EPS)
    write_kv_cache(K.rmsnorm_rope(k, wk, pos, table.cos, table.sin, EPS), v, sep_k, sep_v, slots)
    return (fused_q, fused_k, fused_v), (sep_q, sep_k, sep_v), fill


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,q_heads,kv_heads,D", [(1, 6, 3, 16), (7, 3, 3, 32), (33, 2, 1, 128), (5, 16, 8, 64)])
def test_store_kv_is_rmsnorm_rope_then_the_cache_write(interpreter, dtype, T, q_heads, kv_heads, D):
    """The engine's fused Q/K/V step gives Q and writes the cache bits of the separate calls, skips
    slot -1 and touches nothing else (bf16 too: both ways round through the same interpreter casts)."""
    (fq, fk, fv), (sq, sk, sv), fill = _store_kv_both_ways(T, q_heads, kv_heads, D, dtype)
    assert fq.shape == (T, q_heads, D) and fq.is_contiguous() and torch.equal(fq, sq)
    assert torch.equal(fk, sk) and torch.equal(fv, sv)
    assert (fk != fill).any() and (fv != fill).any()


def test_store_kv_on_the_reference_backend_and_in_the_engine_step(interpreter):
    """The reference backend takes the separate calls; on the kernels, the tiny model's engine
    (prefill chunks and decode steps) gives the tokens and log-probs it gives through the separate
    calls."""
    from rlperf.kernels.attention import write_kv_cache
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
    from rlperf.rollout.tokenizer import ByteTokenizer

    with K.use_backend("reference"):
        fused, separate, _ = _store_kv_both_ways(6, 4, 2, 32, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(fused, separate))

    cfg = preset("tiny")
    model = Qwen3ForCausalLM.random(cfg, seed=1, std=0.1)
    prompts, params = [[1, 2, 3, 4, 5], [6, 7], list(range(9, 40))], SamplingParams(max_new_tokens=4, seed=5)

    def generate():
        engine = Engine(model, ByteTokenizer(cfg.vocab_size), EngineConfig(max_total_tokens=1024))
        return [(r.output_ids, r.output_logprobs) for r in engine.generate(prompts, params)]

    def two_calls(q, q_weight, k, k_weight, positions, cos, sin, eps, v, k_cache, v_cache, slot_mapping):
        write_kv_cache(K.rmsnorm_rope(k, k_weight, positions, cos, sin, eps), v, k_cache, v_cache, slot_mapping)
        return K.rmsnorm_rope(q, q_weight, positions, cos, sin, eps)

    with K.use_backend("interpreter"):
        fused = generate()
        original = K.rmsnorm_rope_store_kv
        K.rmsnorm_rope_store_kv = two_calls
        try:
            unfused = generate()
        finally:
            K.rmsnorm_rope_store_kv = original
    assert fused == unfused and all(len(ids) == 4 for ids, _ in fused)


def _blocks_both_ways(x, w, pos, cos, sin, blocks, dout):
    """(one launch, per-block calls) of rmsnorm_rope over ``blocks`` head blocks, each block's weight a
    replica of ``w`` (as the tree mode's block_replicas gives them): outputs, dx and d(replicas)."""
    per = x.shape[1] // blocks
    results = []
    for fused in (True, False):
        xx = x.detach().clone().requires_grad_(True)
        reps = w.detach()[None].expand(blocks, -1).clone().requires_grad_(True)
        if fused:
            out = K.rmsnorm_rope_blocks(xx, reps, pos, cos, sin, EPS)
        else:
            out = torch.cat([K.rmsnorm_rope(xx[:, b * per:(b + 1) * per], reps[b], pos, cos, sin, EPS)
                             for b in range(blocks)], dim=1)
        gx, gw = torch.autograd.grad(out, (xx, reps), dout.to(out.dtype))
        results.append((out.detach(), gx, gw))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,heads,blocks,D", [(1, 4, 4, 16), (7, 6, 3, 32), (33, 8, 2, 128), (17, 3, 1, 32),
                                              (40, 16, 8, 32)])
def test_blocks_in_one_launch_equal_the_per_block_calls(interpreter, poison, dtype, T, heads, blocks, D):
    """rmsnorm_rope_blocks (one launch forward, one backward + one partial sum) against a call per head
    block and the slices' gradients: output, dx and every block's weight gradient bit for bit, at odd
    token counts (a backward program's tail), odd block sizes and one block; then the forward alone."""
    x, w, pos = _inputs(T, heads, D, dtype, seed=11)
    table = _table(D)
    dout = torch.randn(T, heads, D, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    (y, gx, gw), (ry, rgx, rgw) = _blocks_both_ways(x, w, pos, table.cos, table.sin, blocks, dout)
    assert gw.shape == (blocks, D) and gw.dtype == dtype
    assert torch.equal(y, ry) and torch.equal(gw, rgw)
    assert torch.equal(gx, rgx)  # equal values (the slices' gradient adds may turn a -0.0 into +0.0)
    with torch.no_grad():
        reps = w[None].expand(blocks, -1).contiguous()
        assert torch.equal(K.rmsnorm_rope_blocks(x, reps, pos, table.cos, table.sin, EPS), ry)


def test_blocks_small_tiles_and_the_reference_backend(interpreter, monkeypatch):
    """A block wider than the tile (BLOCK_H = 1: a loop over each block's heads, several programs per
    block) still has the per-block bits; on the reference backend the per-block calls run; bad weights
    name the shapes."""
    monkeypatch.setattr(rope_mod, "BWD_TOKENS_PER_PROGRAM", 4)
    monkeypatch.setattr(rope_mod, "MAX_HALF_TILE", 16)
    x, w, pos = _inputs(11, 6, 32, torch.float32, seed=13)
    table = _table(32)
    dout = torch.randn(11, 6, 32, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    (y, gx, gw), (ry, rgx, rgw) = _blocks_both_ways(x, w, pos, table.cos, table.sin, 2, dout)
    assert torch.equal(y, ry) and torch.equal(gx, rgx) and torch.equal(gw, rgw)
    with K.use_policy(K.KernelPolicy(backend="reference")):
        reps = w[None].expand(3, -1).contiguous()
        got = K.rmsnorm_rope_blocks(x, reps, pos, table.cos, table.sin, EPS)
        assert torch.equal(got, torch.cat([K.rmsnorm_rope(x[:, 2 * b:2 * b + 2], w, pos, table.cos, table.sin, EPS)
                                           for b in range(3)], dim=1))
    with pytest.raises(ValueError, match=r"blocks dividing x's heads"):
        K.rmsnorm_rope_blocks(x, w[None].expand(4, -1), pos, table.cos, table.sin, EPS)


# ----------------------------------------------------------------------------- GPU (device)

QWEN3_06B = {"T": 8192, "q_heads": 16, "kv_heads": 8, "D": 128}


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [QWEN3_06B["q_heads"], QWEN3_06B["kv_heads"]])
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 1e-1, 5e-2), (torch.float16, 1.6e-2, 8e-3)])
def test_gpu_qwen3_shape_forward_backward(heads, dtype, atol, rtol):
    """8192 tokens of the qwen3-0.6b shape (a view of the [T, 4096] qkv output): forward and backward
    close to float64, the backward twice gives the same bits, the grad-enabled forward is the plain one."""
    T, D = QWEN3_06B["T"], QWEN3_06B["D"]
    x, w, pos = _inputs(T, heads, D, dtype, "cuda", seed=7, other_heads=32 - heads)
    table = _table(D, "cuda")
    cos, sin = table.cos, table.sin
    y = K.rmsnorm_rope(x, w, pos, cos, sin, EPS)
    torch.testing.assert_close(y, ref_rope(x, w, pos, cos, sin, EPS), atol=atol, rtol=rtol)
    dout = torch.randn(T, heads, D, generator=torch.Generator().manual_seed(8), dtype=torch.float64).cuda()
    fn = lambda x, w: K.rmsnorm_rope(x, w, pos, cos, sin, EPS)
    y1, gx1, gw1 = _grads(fn, x, w, dout)
    y2, gx2, gw2 = _grads(fn, x, w, dout)
    assert torch.equal(y1, y) and torch.equal(y2, y)
    assert torch.equal(gx1, gx2) and torch.equal(gw1, gw2), "the backward must be deterministic"
    _, rx, rw = _grads(lambda x, w: ref_rope(x, w, pos, cos, sin, EPS), x.double(), w.double(), dout)
    assert _rel(gx1, rx) < GRAD_TOL[dtype] and _rel(gw1, rw) < GRAD_TOL[dtype], (_rel(gx1, rx), _rel(gw1, rw))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [QWEN3_06B["q_heads"], QWEN3_06B["kv_heads"]])
def test_gpu_batch_invariant_bf16(heads):
    """A token alone (decode), in a decode batch, and inside 8192 packed tokens: the same bits."""
    T, D = QWEN3_06B["T"], QWEN3_06B["D"]
    x, w, pos = _inputs(T, heads, D, torch.bfloat16, "cuda", seed=9, other_heads=32 - heads)
    table = _table(D, "cuda")
    cos, sin = table.cos, table.sin
    full = K.rmsnorm_rope(x, w, pos, cos, sin, EPS)
    for i in (0, 4097, T - 1):
        assert torch.equal(K.rmsnorm_rope(x[i : i + 1], w, pos[i : i + 1], cos, sin, EPS), full[i : i + 1]), i
    idx = torch.randperm(T, device="cuda")[:64]
    assert torch.equal(K.rmsnorm_rope(x[idx], w, pos[idx], cos, sin, EPS), full[idx])
    # the unfused torch formula differs only where a last bit moved (rstd's reduction tree, FMA
    # contraction) and flipped a bf16 rounding: rare, one bf16 ulp
    unfused = table.apply(K.rmsnorm(x, w, EPS), pos)
    assert _rel(full, unfused) < 5e-3 and (full != unfused).float().mean().item() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_store_kv_is_rmsnorm_rope_then_the_cache_write(dtype):
    """The qwen3-0.6b Q/K/V shape (16 Q and 8 KV heads of 128) on the GPU: the fused step's Q and cache
    bits equal the separate calls'; decode-sized (1, 64 tokens) and a 1000-token chunk."""
    for T in (1, 64, 1000):
        fused, separate, _ = _store_kv_both_ways(T, QWEN3_06B["q_heads"], QWEN3_06B["kv_heads"], QWEN3_06B["D"],
                                                 dtype, "cuda", page=16, pages=80)
        assert all(torch.equal(a, b) for a, b in zip(fused, separate)), T


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_blocks_in_one_launch_equal_the_per_block_calls(dtype):
    """The tree mode's q/k norm on the qwen3-0.6b shape (8 head blocks: 16 Q heads of 128 in blocks of 2,
    8 KV heads in blocks of 1), 8192 and 5 tokens: one launch gives the per-block calls' output, dx and
    block weight gradients bit for bit on the GPU."""
    for T in (8192, 5):
        for heads in (QWEN3_06B["q_heads"], QWEN3_06B["kv_heads"]):
            x, w, pos = _inputs(T, heads, QWEN3_06B["D"], dtype, "cuda", seed=15, other_heads=32 - heads)
            table = _table(QWEN3_06B["D"], "cuda")
            dout = torch.randn(T, heads, QWEN3_06B["D"], generator=torch.Generator().manual_seed(16),
                               dtype=torch.float64).cuda()
            (y, gx, gw), (ry, rgx, rgw) = _blocks_both_ways(x, w, pos, table.cos, table.sin, 8, dout)
            assert torch.equal(y, ry) and torch.equal(gw, rgw) and torch.equal(gx, rgx), (T, heads)
