"""fused_logprob: forward and backward (through entropy) vs float64, batch invariance, determinism,
tensor-parallel split (gloo, 2 processes), edge cases.

Tolerances vs float64 (inputs exactly representable, float32 accumulation):
  log-prob / entropy: atol 5e-5 + rtol 1e-5 (a few float32 ulps of |lse| <= ~20);
  gradients: dlogits are rounded to the input dtype before the two matmuls, so relative to the
  largest gradient entry: fp32 1e-4, fp16 4e-3 (2^-11 ulp x a few), bf16 2e-2 (GPU).
"""
import math
import os

import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels import fused_lm_head as FL
from rlperf.kernels.reference.fused_logprob import fused_logprob as ref

CPU_DTYPES = [(torch.float32, 1e-4), (torch.float16, 4e-3)]


def _inputs(N, V, H, dtype, device="cpu", scale=1.0):
    hidden = (torch.randn(N, H, device=device) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device=device) / math.sqrt(H) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), device=device)
    return hidden, weight, targets


def _grads(out, hidden, weight, seed=1):
    lp, ent = out
    gen = torch.Generator(device=lp.device).manual_seed(seed)
    g1 = torch.randn(lp.shape, generator=gen, device=lp.device)
    g2 = torch.randn(lp.shape, generator=gen, device=lp.device)
    return torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), [hidden, weight])


def _close_rel(a, b, tol):
    scale = b.abs().max().item() or 1.0
    torch.testing.assert_close(a.double(), b.double(), atol=tol * scale, rtol=tol)


def _check_against_reference(N, V, H, dtype, gtol, T, device="cpu"):
    hidden, weight, targets = _inputs(N, V, H, dtype, device)
    out = K.fused_logprob(hidden, weight, targets, temperature=T, return_entropy=True)
    r_out = ref(hidden, weight, targets, T, True)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32 and out[0].shape == (N,)
    torch.testing.assert_close(out[0], r_out[0].detach(), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], r_out[1].detach(), atol=5e-5, rtol=1e-5)
    gh, gw = _grads(out, hidden, weight)
    rh, rw = _grads(r_out, hidden, weight)
    assert gh.dtype == dtype and gw.dtype == dtype
    _close_rel(gh, rh, gtol)
    _close_rel(gw, rw, gtol)


@pytest.mark.parametrize("dtype,gtol", CPU_DTYPES)
# V = 17011: two backward chunks of the default BWD_CHUNK_COLUMNS (16384 + a ragged 627), odd vs every tile
@pytest.mark.parametrize("N,V,H", [(1, 1000, 64), (33, 1000, 96), (257, 1000, 64), (7, 17011, 96)])
def test_forward_backward_vs_float64(interpreter, dtype, gtol, N, V, H):
    _check_against_reference(N, V, H, dtype, gtol, T=0.7 if N % 2 else 1.0)


def test_logprob_only_gradient_and_entropy_only_gradient(interpreter):
    hidden, weight, targets = _inputs(19, 1000, 64, torch.float32)
    lp = K.fused_logprob(hidden, weight, targets, temperature=1.3)
    r_lp = ref(hidden, weight, targets, 1.3)
    torch.testing.assert_close(lp, r_lp.detach(), atol=5e-5, rtol=1e-5)
    g = torch.randn(19)
    _close_rel(torch.autograd.grad((lp * g).sum(), hidden)[0], torch.autograd.grad((r_lp * g).sum(), hidden)[0], 1e-4)
    # entropy alone (the log-prob output unused): the gradient flows through the entropy
    _, ent = K.fused_logprob(hidden, weight, targets, temperature=1.3, return_entropy=True)
    _, r_ent = ref(hidden, weight, targets, 1.3, True)
    _close_rel(torch.autograd.grad(ent.sum(), weight)[0], torch.autograd.grad(r_ent.sum(), weight)[0], 1e-4)


def test_multi_chunk_backward(interpreter, monkeypatch):
    """A small chunk budget walks the vocabulary in several backward chunks (incl. a ragged last)."""
    N, V, H = 33, 1000, 64
    monkeypatch.setattr(FL, "BWD_CHUNK_COLUMNS", 192)  # 192 columns -> 128-column chunks
    _check_against_reference(N, V, H, torch.float32, 1e-4, T=0.9)


def test_batch_invariance_and_determinism(interpreter):
    N, V, H = 257, 1000, 96
    hidden, weight, targets = _inputs(N, V, H, torch.float32)
    with torch.no_grad():
        lp, ent = K.fused_logprob(hidden, weight, targets, 0.8, True)
        for i in (0, 100, 256):
            a, b = K.fused_logprob(hidden[i : i + 1], weight, targets[i : i + 1], 0.8, True)
            assert torch.equal(a, lp[i : i + 1]) and torch.equal(b, ent[i : i + 1]), i
        perm = torch.randperm(N)
        a, b = K.fused_logprob(hidden[perm], weight, targets[perm], 0.8, True)
        assert torch.equal(a, lp[perm]) and torch.equal(b, ent[perm])
        a = K.fused_logprob(hidden[5:70], weight, targets[5:70], 0.8)
        assert torch.equal(a, lp[5:70])
        # the entropy flag does not change the log-prob bits
        assert torch.equal(K.fused_logprob(hidden, weight, targets, 0.8), lp)
    # backward is deterministic run to run
    g1 = _grads(K.fused_logprob(hidden, weight, targets, 0.8, True), hidden, weight)
    g2 = _grads(K.fused_logprob(hidden, weight, targets, 0.8, True), hidden, weight)
    assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])


def test_agrees_with_token_logprobs_of_float32_logits(interpreter):
    """Same values as the unfused path (float32 rounding; bit identity is via fused_logprob itself)."""
    hidden, weight, targets = _inputs(40, 1000, 64, torch.float32)
    with torch.no_grad():
        lp, ent = K.fused_logprob(hidden, weight, targets, 0.6, True)
        logits = hidden.double() @ weight.double().t()
        a, b = K.token_logprobs(logits.float(), targets, 0.6, return_entropy=True)
    torch.testing.assert_close(lp, a, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(ent, b, atol=5e-5, rtol=1e-5)


def test_invalid_targets_nan_and_errors(interpreter):
    hidden, weight, targets = _inputs(4, 1000, 64, torch.float32)
    targets[1], targets[2] = 1000, -1
    with torch.no_grad():
        lp = K.fused_logprob(hidden, weight, targets)
    assert torch.isnan(lp[1]) and torch.isnan(lp[2]) and torch.isfinite(lp[[0, 3]]).all()
    with pytest.raises(ValueError, match="temperature"):
        K.fused_logprob(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="disagree on H"):
        K.fused_logprob(hidden, weight[:, :32], targets)
    with pytest.raises(TypeError, match="differ"):
        K.fused_logprob(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="targets must have shape"):
        K.fused_logprob(hidden, weight, targets[:3])
    with pytest.raises(TypeError, match="integer"):
        K.fused_logprob(hidden, weight, targets.float())
    with pytest.raises(TypeError, match="not supported"):
        K.fused_logprob(hidden.double(), weight.double(), targets)
    empty = K.fused_logprob(hidden[:0], weight, targets[:0], return_entropy=True)
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


def test_fast_mode_and_reference_backend(interpreter):
    hidden, weight, targets = _inputs(9, 1000, 64, torch.float32)
    r = ref(hidden, weight, targets, 0.9, True)
    with K.use_mode("fast"):
        f = K.fused_logprob(hidden, weight, targets, 0.9, True)
    torch.testing.assert_close(f[0], r[0].detach(), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(f[1], r[1].detach(), atol=5e-5, rtol=1e-5)
    with K.use_backend("reference"):
        b = K.fused_logprob(hidden, weight, targets, 0.9, True)
    assert torch.equal(b[0], r[0]) and torch.equal(b[1], r[1])


# ----------------------------------------------------------------------------- tensor parallel


def _tp_worker(rank, world, init_file, result_dir):
    import torch.distributed as dist

    from rlperf.loop.placement import leave_process

    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # identical full problem on every rank
        N, V, H = 21, 1000, 64
        hidden, weight, targets = _inputs(N, V, H, torch.float32)
        targets[3] = 599  # last row of rank 0's slice
        targets[4] = 600  # first row of rank 1's slice
        bounds = [0, 600, V]  # unequal slices
        w_local = weight.detach()[bounds[rank] : bounds[rank + 1]].clone().requires_grad_()
        h_local = hidden.detach().clone().requires_grad_()
        out = K.fused_logprob(h_local, w_local, targets, temperature=0.8, return_entropy=True, tp_group=dist.group.WORLD)
        gh, gw = _grads(out, h_local, w_local)
        full = ref(hidden, weight, targets, 0.8, True)
        rh, rw = _grads(full, hidden, weight)
        torch.testing.assert_close(out[0], full[0].detach(), atol=5e-5, rtol=1e-5)
        torch.testing.assert_close(out[1], full[1].detach(), atol=5e-5, rtol=1e-5)
        _close_rel(gh, rh, 1e-4)
        _close_rel(gw, rw[bounds[rank] : bounds[rank + 1]], 1e-4)
        open(os.path.join(result_dir, f"ok{rank}"), "w").close()
    finally:
        dist.destroy_process_group()
    leave_process(0)  # past the interpreter's teardown, which can abort after a gloo group (rlperf.loop.placement)


def test_tensor_parallel_gloo_matches_unsplit(interpreter, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_tensor_parallel_needs_kernels():
    hidden, weight, targets = _inputs(3, 100, 64, torch.float32)
    with K.use_backend("reference"), pytest.raises(RuntimeError, match="tp_group"):
        K.fused_logprob(hidden, weight, targets, tp_group=object())


# ----------------------------------------------------------------------------- GPU (device)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 77, 1025])
def test_gpu_bf16_vs_float64(N):
    _check_against_reference(N, 151936, 2560, torch.bfloat16, 2e-2, T=0.7, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,gtol", [(torch.float16, 4e-3), (torch.float32, 1e-4)])
def test_gpu_other_dtypes(dtype, gtol):
    _check_against_reference(257, 50257, 96, dtype, gtol, T=1.0, device="cuda")


@pytest.mark.gpu
def test_gpu_batch_invariance_and_determinism():
    N, V, H = 300, 151936, 2560
    hidden, weight, targets = _inputs(N, V, H, torch.bfloat16, "cuda")
    with torch.no_grad():
        lp, ent = K.fused_logprob(hidden, weight, targets, 0.8, True)
        for i in (0, 129, 299):
            a, b = K.fused_logprob(hidden[i : i + 1], weight, targets[i : i + 1], 0.8, True)
            assert torch.equal(a, lp[i : i + 1]) and torch.equal(b, ent[i : i + 1]), i
        perm = torch.randperm(N, device="cuda")
        a, b = K.fused_logprob(hidden[perm], weight, targets[perm], 0.8, True)
        assert torch.equal(a, lp[perm]) and torch.equal(b, ent[perm])
        big = torch.cat([torch.randn(4000, H, device="cuda").to(torch.bfloat16), hidden[:3]])
        a = K.fused_logprob(big, weight, torch.cat([targets.new_zeros(4000), targets[:3]]), 0.8)
        assert torch.equal(a[4000:], lp[:3])
    g1 = _grads(K.fused_logprob(hidden, weight, targets, 0.8, True), hidden, weight)
    g2 = _grads(K.fused_logprob(hidden, weight, targets, 0.8, True), hidden, weight)
    assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])


@pytest.mark.parametrize(
    "cfg",
    [FL.FusedConfig(64, 64, 32, 4, 4, 2, flatten=True), FL.FusedConfig(64, 64, 32, 4, 4, 2, tma=True)],
    ids=["flatten", "tma"],
)
def test_config_variants(interpreter, monkeypatch, cfg):
    """The flattened-loop and TMA-descriptor variants compute the same function (and the TMA path's
    zero-filled edges: N, V and H not multiples of the tile)."""
    monkeypatch.setitem(FL._CONFIGS, torch.float32, cfg)
    _check_against_reference(37, 1000, 72, torch.float32, 1e-4, T=0.8)


# Tile configs the benchmark sweeps as candidates for the bf16 default: each must be accurate and
# batch-invariant on the GPU before it may become the default.
GPU_CANDIDATES = [
    FL.FusedConfig(128, 256, 64, 16, 8, 3, flatten=True, tma=True),
    FL.FusedConfig(128, 256, 64, 16, 8, 4, flatten=True, tma=True),
    FL.FusedConfig(128, 256, 128, 16, 8, 2, flatten=True, tma=True),
    FL.FusedConfig(128, 256, 64, 8, 8, 4, flatten=True, tma=True),
    FL.FusedConfig(128, 256, 64, 32, 8, 4, flatten=True, tma=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CANDIDATES, ids=lambda c: f"{c.BLOCK_M}x{c.BLOCK_N}x{c.BLOCK_K}s{c.SPLIT_TILES}st{c.num_stages}")
def test_gpu_candidate_configs(monkeypatch, cfg):
    monkeypatch.setitem(FL._CONFIGS, torch.bfloat16, cfg)
    _check_against_reference(77, 151936, 2560, torch.bfloat16, 2e-2, T=0.9, device="cuda")
    hidden, weight, targets = _inputs(300, 151936, 2560, torch.bfloat16, "cuda")
    with torch.no_grad():
        lp, ent = K.fused_logprob(hidden, weight, targets, 1.0, True)
        for i in (0, 131, 299):
            a, b = K.fused_logprob(hidden[i : i + 1], weight, targets[i : i + 1], 1.0, True)
            assert torch.equal(a, lp[i : i + 1]) and torch.equal(b, ent[i : i + 1]), i


def test_near_certain_tokens_report_log_prob_at_most_zero(interpreter):
    """A log-prob is <= 0: for a near-certain token, lse = m + log(sum) can round a few ulps below its logit
    (+7.7e-07 seen in bf16 on a GPU); the kernel reports 0 there, in the plain and the tree paths alike."""
    from rlperf.kernels.tree_reduce import tree_logprob

    g = torch.Generator().manual_seed(0)
    N, V, H = 37, 100, 32  # V splits into the tree's 4 leaves
    hidden = torch.randn(N, H, generator=g, dtype=torch.float16)
    weight = (torch.randn(V, H, generator=g) * 0.01).to(torch.float16)
    targets = torch.randint(0, V, (N,), generator=g)
    # make each row's target dominant: its logit ~ 30 above the rest (probability 1 - ~1e-11)
    weight[targets] = (hidden.float() * (30.0 / hidden.float().pow(2).sum(1, keepdim=True))).to(torch.float16)
    for logp in (K.fused_logprob(hidden, weight, targets), tree_logprob(hidden, weight, targets, leaves=4)):
        assert torch.isfinite(logp).all() and (logp <= 0).all(), logp.max()
        assert (logp > -1e-3).sum() > N // 2  # most rows near-certain (a target shared by two rows is not)


# ---- fused_sample_logprob: a token and its log-prob from one pass over the lm head ----------------------

def _draw_inputs(N, V, H, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(device=device, dtype=dtype)
    temps = torch.tensor([(0.0, 0.7, 1.0, 1.3)[i % 4] for i in range(N)], dtype=torch.float32, device=device)
    seeds = torch.randint(0, 1 << 62, (N,), generator=g).to(device)
    positions = torch.randint(0, 1 << 20, (N,), generator=g).to(device)
    return hidden, weight, temps, seeds, positions


def _sample_then_logprob(hidden, weight, temps, seeds, positions, T):
    logits = K.linear(hidden, weight, out_dtype=torch.float32)
    tokens = K.sample(logits, temps, 1.0, 0, seeds, positions)
    return tokens, K.fused_logprob(hidden, weight, tokens, T)


@pytest.mark.parametrize("N,V,H,temperatures", [(1, 1000, 64, (1.0, 0.7)), (5, 2053, 40, (1.0,)), (70, 600, 48, (0.7,))])
def test_fused_sample_logprob_is_the_sampler_then_the_trainers_logprob(interpreter, N, V, H, temperatures):
    """float32 (the lm-head product and the fused tile share BLOCK_K 32, so the same logit bits under the
    interpreter): the tokens are ``sample``'s of the float32 logits (greedy rows the argmax), the log-probs
    ``fused_logprob``'s of those tokens, bit for bit; odd V and H, two vocabulary splits (V > 2048), one
    and two token tiles."""
    hidden, weight, temps, seeds, positions = _draw_inputs(N, V, H, torch.float32)
    for T in temperatures:
        tokens, logp = K.fused_sample_logprob(hidden, weight, temps, seeds, positions, T)
        want_tokens, want_logp = _sample_then_logprob(hidden, weight, temps, seeds, positions, T)
        assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
        assert torch.equal(tokens, want_tokens)
        assert torch.equal(logp, want_logp)
    greedy = temps == 0
    logits = hidden.double() @ weight.double().T
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))  # no ties in random data


def test_tile_draw_under_the_interpreter_is_the_left_to_right_draw(interpreter):
    """``_tile_draw``'s interpreter branch (built-in reductions in place of ``tl.reduce`` with ``_better_draw``,
    which the interpreter runs element by element) gives what that reduction gives, left to right: the largest
    key at its lowest column with its logit, ties at the lowest column, the first column of an all -inf row,
    and a NaN first key kept; NaN keys after it never win."""
    import triton
    import triton.language as tl

    @triton.jit
    def draw_kernel(k_ptr, x_ptr, key_ptr, col_ptr, xo_ptr, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows, cols = tl.arange(0, BLOCK_M), col0 + tl.arange(0, BLOCK_N)
        at = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        kmax, kcol, kx = FL._tile_draw(tl.load(k_ptr + at), cols, tl.load(x_ptr + at), BLOCK_M, BLOCK_N)
        tl.store(key_ptr + rows, kmax)
        tl.store(col_ptr + rows, kcol)
        tl.store(xo_ptr + rows, kx)

    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(8, 16, generator=g)
    k[1, [3, 9]] = 5.0                      # a tie at the maximum: column 3
    k[2] = -inf                             # nothing drawable: the first column
    k[3, 0] = nan                           # a NaN first key stays
    k[4, [2, 7]] = nan                      # NaN keys later never win
    k[5, 6] = inf
    k[6, :5] = nan                          # NaN first: kept whatever follows
    k[7] = 1.0                              # every key equal
    x = torch.randn(8, 16, generator=g)
    key, col, xo = torch.empty(8), torch.empty(8, dtype=torch.int32), torch.empty(8)
    draw_kernel[(1,)](k, x, key, col, xo, 100, BLOCK_M=8, BLOCK_N=16)
    for r in range(8):  # the reduction's own order: an accumulator, then each element in turn
        best, best_c = k[r, 0].item(), 0
        for c in range(1, 16):
            kc = k[r, c].item()
            if kc > best or (kc == best and c < best_c):
                best, best_c = kc, c
        assert col[r].item() == 100 + best_c, r
        assert torch.equal(key[r], k[r, best_c]) or (math.isnan(best) and math.isnan(key[r].item())), r
        assert torch.equal(xo[r], x[r, best_c]), r


def test_fused_sample_logprob_fp16_keeps_the_logprob_bits_and_is_batch_invariant(interpreter):
    """float16: the log-prob is ``fused_logprob``'s of the drawn token bit for bit; a row's token and
    log-prob are the same alone and in any position of a batch."""
    N, V, H = 9, 300, 64  # the 16-bit tile is 128 x 256: two vocabulary tiles, the second a partial one
    hidden, weight, temps, seeds, positions = _draw_inputs(N, V, H, torch.float16, seed=3)
    tokens, logp = K.fused_sample_logprob(hidden, weight, temps, seeds, positions, 1.0)
    assert torch.equal(logp, K.fused_logprob(hidden, weight, tokens, 1.0))
    assert bool((logp <= 0).all()) and bool(((tokens >= 0) & (tokens < V)).all())
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    shuffled = K.fused_sample_logprob(hidden[perm], weight, temps[perm], seeds[perm], positions[perm], 1.0)
    assert torch.equal(shuffled[0], tokens[perm]) and torch.equal(shuffled[1], logp[perm])
    for i in (N - 1,):
        alone = K.fused_sample_logprob(hidden[i:i + 1], weight, temps[i:i + 1], seeds[i:i + 1], positions[i:i + 1], 1.0)
        assert int(alone[0]) == int(tokens[i]) and torch.equal(alone[1], logp[i:i + 1])


def test_fused_sample_logprob_off_the_kernels_and_its_errors(interpreter):
    """The reference backend and fast mode (stock log-probs) give the three calls' results; an empty batch
    gives empty tensors; a wrong temperatures / seeds / positions tensor is refused naming it."""
    hidden, weight, temps, seeds, positions = _draw_inputs(6, 300, 32, torch.float32, seed=5)
    for ctx in (K.use_backend("reference"), K.use_mode("fast")):
        with ctx:
            got = K.fused_sample_logprob(hidden, weight, temps, seeds, positions, 0.9)
            want = _sample_then_logprob(hidden, weight, temps, seeds, positions, 0.9)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = K.fused_sample_logprob(hidden[:0], weight, temps[:0], seeds[:0], positions[:0])
    assert empty[0].shape == (0,) and empty[1].shape == (0,)
    with pytest.raises(ValueError, match="temperatures"):
        K.fused_sample_logprob(hidden, weight, temps.double(), seeds, positions)
    with pytest.raises(ValueError, match="positions"):
        K.fused_sample_logprob(hidden, weight, temps, seeds, positions[:3])
    with pytest.raises(ValueError, match="seeds"):
        K.fused_sample_logprob(hidden, weight, temps, seeds.float(), positions)
    with pytest.raises(ValueError, match="temperature"):
        K.fused_sample_logprob(hidden, weight, temps, seeds, positions, 0.0)


@pytest.mark.gpu
def test_gpu_bf16_fused_sample_logprob_is_the_sampler_then_the_trainers_logprob():
    """On the GPU, bf16 at the qwen3-0.6b head's shape: the log-probs are ``fused_logprob``'s of the drawn
    tokens bit for bit, and the tokens the sampler's of the lm-head product (the fused tile's logits are
    that product's bits: the same BLOCK_K), at decode batch sizes and one training-sized batch."""
    for N in (1, 7, 64, 300):
        hidden, weight, temps, seeds, positions = _draw_inputs(N, 151936, 1024, torch.bfloat16, "cuda", seed=N)
        tokens, logp = K.fused_sample_logprob(hidden, weight, temps, seeds, positions, 1.0)
        want_tokens, want_logp = _sample_then_logprob(hidden, weight, temps, seeds, positions, 1.0)
        assert torch.equal(tokens, want_tokens), N
        assert torch.equal(logp, want_logp), N


# ---------------------------------------------------------------------------------------------
# fused_logprob_of_logits: the same bits from the lm-head product's logits
# ---------------------------------------------------------------------------------------------


def _assert_of_logits_is_fused_logprob(N, V, H, dtype, device, temperatures):
    """Fold ``linear(hidden, weight, float32)`` of a random case at each temperature: fused_logprob's bits
    (NaN where the target is out of range)."""
    hidden, weight, targets = _of_logits_case(N, V, H, dtype, device, seed=N)
    assert K.logits_give_fused_logprob(weight)
    logits = K.linear(hidden, weight, out_dtype=torch.float32)
    for t in temperatures:
        want = K.fused_logprob(hidden, weight, targets, t)
        got = K.fused_logprob_of_logits(logits, targets, t, dtype)
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan()[::5].all(), (V, H, t)
        assert torch.equal(got.nan_to_num(1.0), want.nan_to_num(1.0)), (V, H, t)
    return logits, targets, want


def _of_logits_case(N, V, H, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(N, H, device=device, generator=g).to(dtype)
    weight = (torch.randn(V, H, device=device, generator=g) / math.sqrt(H) * 4).to(dtype)
    targets = torch.randint(0, V, (N,), device=device, generator=g)
    targets[::5] = V + 2  # out of range: NaN, as fused_logprob
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,V,H", [(1, 16500, 64), (6, 16391, 72), (129, 16640, 48)])
def test_fused_logprob_of_logits_is_fused_logprob(interpreter, dtype, N, V, H):
    """Folding ``linear(hidden, weight, float32)`` gives fused_logprob's bits (a vocabulary of >= 16384
    words: the lm-head product's BLOCK_K is the fused kernel's, which the interpreter's exact tile products
    need), at two temperatures; rows past a 128-row tile and a vocabulary tail past the last 256 columns."""
    for t in (1.0, 0.6):
        logits, targets, want = _assert_of_logits_is_fused_logprob(N, V, H, dtype, "cpu", (t,))
        # a row's bits do not depend on the others
        assert torch.equal(K.fused_logprob_of_logits(logits[-1:], targets[-1:], t, dtype).nan_to_num(1.0),
                           want[-1:].nan_to_num(1.0))


def test_fold_then_targets_is_fused_logprob_of_logits(interpreter):
    """The fold needs no targets: its partials, merged afterwards for two different target sets, give each
    set's fused_logprob bits (the merge reads the targets' logits)."""
    hidden, weight, targets = _of_logits_case(7, 16500, 64, torch.float16, "cpu", seed=3)
    logits = K.linear(hidden, weight, out_dtype=torch.float32)
    fold = K.fold_logits(logits, 0.7, torch.float16)
    for tg in (targets, torch.flip(targets, [0]) % 16500):
        got = K.logprob_of_fold(fold, tg)
        want = K.fused_logprob(hidden, weight, tg, 0.7)
        assert torch.equal(got.nan_to_num(1.0), want.nan_to_num(1.0))
        assert torch.equal(got.nan_to_num(1.0), K.fused_logprob_of_logits(logits, tg, 0.7, torch.float16).nan_to_num(1.0))
    with pytest.raises(ValueError, match="targets"):
        K.logprob_of_fold(fold, targets[:3])
    assert K.logprob_of_fold(K.fold_logits(logits[:0], 1.0, torch.float16), targets[:0]).shape == (0,)


def test_fused_logprob_of_logits_refuses_what_it_cannot_match(interpreter):
    hidden, weight, targets = _of_logits_case(3, 16500, 64, torch.float16, "cpu")
    logits = K.linear(hidden, weight, out_dtype=torch.float32)
    assert not K.logits_give_fused_logprob(weight.float())  # float32 heads: the product runs tf32x3
    assert not K.logits_give_fused_logprob(weight[:1000])  # a small vocabulary: another BLOCK_K here
    with K.use_mode("fast"):
        assert not K.logits_give_fused_logprob(weight)
    with pytest.raises(TypeError, match="16-bit"):
        K.fused_logprob_of_logits(logits, targets, 1.0, torch.float32)
    with pytest.raises(ValueError, match="float32"):
        K.fused_logprob_of_logits(logits.half(), targets, 1.0, torch.float16)
    with pytest.raises(ValueError, match="targets"):
        K.fused_logprob_of_logits(logits, targets[:2], 1.0, torch.float16)
    with pytest.raises(ValueError, match="temperature"):
        K.fused_logprob_of_logits(logits, targets, 0.0, torch.float16)
    with K.use_backend("reference"), pytest.raises(RuntimeError, match="Triton"):
        K.fused_logprob_of_logits(logits, targets, 1.0, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N", [1, 64, 200])
def test_gpu_fused_logprob_of_logits_is_fused_logprob(dtype, N):
    """On the GPU (any vocabulary: every product is one k16 chain over H): the qwen3 lm head's shape and an
    odd one, two temperatures, bit for bit."""
    for V, H in ((151936, 1024), (50001, 2560)):
        _assert_of_logits_is_fused_logprob(N, V, H, dtype, "cuda", (1.0, 0.7))
