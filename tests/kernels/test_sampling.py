"""Seeded sampling: hash bits == reference, tokens == reference, batch invariance, distribution,
filters, greedy, errors."""
import math

import pytest
import torch
import triton
import triton.language as tl

import rlperf.kernels as K
from rlperf.kernels import sampling as S
from rlperf.kernels.reference import sampling as R


@triton.jit
def _uniform_probe(seed_ptr, pos_ptr, u_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    one = tl.arange(0, 1)
    key, key2 = S.row_keys(tl.load(seed_ptr + row + one), tl.load(pos_ptr + row + one))
    c = tl.arange(0, BLOCK)[None, :]
    tl.store(u_ptr + row * V + c, S.uniform(c, key[:, None], key2[:, None]), mask=c < V)


def _uniform_triton(seeds, positions, V):
    u = torch.full((seeds.shape[0], V), math.nan, dtype=torch.float32, device=seeds.device)
    _uniform_probe[(seeds.shape[0],)](seeds, positions, u, V, BLOCK=triton.next_power_of_2(V))
    return u


def _seeds(n, device="cpu"):
    s = torch.randint(-(2**62), 2**62, (n,), device=device)
    s[0], s[-1] = 0, -1
    return s


def _ref_tokens(logits, temperature, top_p, top_k, seeds, positions):
    with K.use_backend("reference"):
        return K.sample(logits, temperature, top_p, top_k, seeds, positions)


def _near_ties(logits, temperature, top_p, top_k, seeds, positions, gap=1e-4):
    """Rows whose two best float64 reference keys are within ``gap`` (float32 rounding may flip them)."""
    B, V = logits.shape
    f = lambda v, dt: v if isinstance(v, torch.Tensor) else torch.full((B,), v, dtype=dt, device=logits.device)
    T, P, Kk = f(temperature, torch.float32), f(top_p, torch.float32), f(top_k, torch.int64)
    x = logits.double()
    g = -torch.log(-torch.log(R.uniform(seeds, positions, V)))
    thr = R.thresholds(logits, T, P, Kk)
    keys = torch.where(x >= thr[:, None], x / torch.where(T > 0, T, 1).double()[:, None] + g, -math.inf)
    keys = torch.where((T == 0)[:, None], x, keys)
    top2 = keys.topk(2, dim=-1).values
    near_thr = ((x - thr[:, None]).abs() < gap).any(-1)  # a logit at the filter boundary
    return ((top2[:, 0] - top2[:, 1]) < gap) | near_thr


def test_uniform_bits_match_reference(interpreter):
    seeds, pos = _seeds(16), torch.randint(0, 2**40, (16,))
    u = _uniform_triton(seeds, pos, 1000)
    assert torch.equal(u.double(), R.uniform(seeds, pos, 1000))
    assert (u > 0).all() and (u < 1).all()
    # roughly uniform: mean, variance and decile counts of 16000 draws
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert ((counts - 1600).abs() < 200).all(), counts


def test_uniform_depends_on_seed_position_and_index():
    j = 4096
    a = R.uniform(torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5]), j)
    assert len(torch.unique(a[0])) > 0.999 * j  # distinct indices give distinct variates
    assert (a[0] != a[1]).float().mean() > 0.99 and (a[0] != a[2]).float().mean() > 0.99
    assert abs(torch.corrcoef(a[:2])[0, 1].item()) < 0.05


CASES = [
    dict(temperature=1.0, top_p=1.0, top_k=0),
    dict(temperature=0.7, top_p=0.9, top_k=0),
    dict(temperature=1.3, top_p=1.0, top_k=20),
    dict(temperature=0.0, top_p=0.5, top_k=3),
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(interpreter, params, dtype):
    B, V = 64, 1000
    logits = (torch.randn(B, V) * 2).to(dtype)
    seeds, pos = _seeds(B), torch.randint(0, 4096, (B,))
    tok = K.sample(logits, seeds=seeds, positions=pos, **params)
    assert tok.dtype == torch.int64 and tok.shape == (B,)
    ref = _ref_tokens(logits, seeds=seeds, positions=pos, **params)
    ok = (tok == ref) | _near_ties(logits, seeds=seeds, positions=pos, **params)
    assert ok.all(), (tok[~ok], ref[~ok])
    assert (tok == ref).float().mean() > 0.95


def test_a_row_spread_over_programs_draws_the_one_pass_token(interpreter):
    """A vocabulary wider than one program's share (several splits, an odd V, a ragged last split):
    the tokens are the reference's, greedy ties go to the lowest index across splits, and an
    all-masked row gives token 0 as one pass would."""
    B, V = 6, 3 * S._block(20000) * S.SPLIT_BLOCKS - 77
    logits = torch.randn(B, V) * 2
    logits[1, :] = -5.0
    logits[1, [9000, 3, V - 1]] = 7.0          # a greedy tie across splits: the lowest index wins
    logits[2, :] = float("-inf")
    temp = torch.tensor([1.0, 0.0, 1.0, 0.7, 0.0, 1.3])
    seeds, pos = _seeds(B), torch.randint(0, 4096, (B,))
    tok = K.sample(logits, temp, 1.0, 0, seeds, pos)
    assert tok[1] == 3 and tok[2] == 0 and tok[4] == logits[4].argmax()
    ref = _ref_tokens(logits, temp, 1.0, 0, seeds, pos)
    rows = [0, 3, 5]
    assert ((tok[rows] == ref[rows]) | _near_ties(logits, temp, 1.0, 0, seeds, pos)[rows]).all()


def test_per_row_parameters(interpreter):
    B, V = 96, 1000
    logits = torch.randn(B, V) * 2
    temp = torch.rand(B) * 1.5
    temp[::7] = 0.0
    top_p = torch.rand(B) * 0.9 + 0.1
    top_p[::5] = 1.0
    top_k = torch.randint(0, 60, (B,))
    top_k[::3] = 0
    seeds, pos = _seeds(B), torch.randint(0, 4096, (B,))
    tok = K.sample(logits, temp, top_p, top_k, seeds, pos)
    ref = _ref_tokens(logits, temp, top_p, top_k, seeds, pos)
    assert ((tok == ref) | _near_ties(logits, temp, top_p, top_k, seeds, pos)).all()
    # each row behaves exactly like the same request sampled with scalar parameters
    for i in (0, 1, 5, 7, 21):
        one = K.sample(logits[i : i + 1], float(temp[i]), float(top_p[i]), int(top_k[i]), seeds[i : i + 1], pos[i : i + 1])
        assert one.item() == tok[i].item(), i


def test_engine_fast_path_draws_the_same_tokens(interpreter):
    """``check_values=False`` and a host-known ``filtered`` (the engine's sync-free call) change nothing."""
    B, V = 33, 500
    logits = torch.randn(B, V) * 2
    temp = torch.rand(B) * 1.5
    temp[::4] = 0.0
    seeds, pos = _seeds(B), torch.randint(0, 4096, (B,))
    ones, zeros = torch.ones(B), torch.zeros(B, dtype=torch.int64)
    plain = K.sample(logits, temp, ones, zeros, seeds, pos)
    assert torch.equal(K.sample(logits, temp, ones, zeros, seeds, pos, check_values=False, filtered=False), plain)
    top_p, top_k = torch.full((B,), 0.8), torch.full((B,), 40, dtype=torch.int64)
    want = K.sample(logits, temp, top_p, top_k, seeds, pos)
    assert torch.equal(K.sample(logits, temp, top_p, top_k, seeds, pos, check_values=False, filtered=True), want)
    assert not torch.equal(want, plain)  # the filters do act on these rows


def test_batch_invariance(interpreter):
    V = 9001  # odd, more than two of the kernel's vocabulary chunks
    logits = torch.randn(24, V) * 3
    seeds, pos = _seeds(24), torch.randint(0, 10**6, (24,))
    full = K.sample(logits, 0.8, 0.95, 40, seeds, pos)
    for i in (0, 17, 23):
        assert K.sample(logits[i : i + 1], 0.8, 0.95, 40, seeds[i : i + 1], pos[i : i + 1]).item() == full[i].item()
    perm = torch.randperm(24)
    assert torch.equal(K.sample(logits[perm], 0.8, 0.95, 40, seeds[perm], pos[perm]), full[perm])
    # the same request inside a batch of different requests
    other = torch.randn(3, V) * 3
    mixed = torch.cat([other, logits[3:4]])
    got = K.sample(mixed, 0.8, 0.95, 40, torch.cat([_seeds(3), seeds[3:4]]), torch.cat([pos[:3], pos[3:4]]))
    assert got[-1].item() == full[3].item()


def test_seeds_and_positions_change_the_draw(interpreter):
    logits = torch.zeros(1, 1000).expand(64, 1000).contiguous()  # uniform distribution
    pos = torch.arange(64)
    a = K.sample(logits, 1.0, 1.0, 0, torch.full((64,), 1), pos)
    b = K.sample(logits, 1.0, 1.0, 0, torch.full((64,), 2), pos)
    c = K.sample(logits, 1.0, 1.0, 0, torch.full((64,), 1), pos + 1)
    assert (a != b).sum() >= 55 and (a != c).sum() >= 55
    assert len(torch.unique(a)) >= 55  # positions of one request are not correlated


def _chi2(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    live = expected > 0
    assert counts[~live].sum() == 0, "a token of probability 0 was drawn"
    return (((counts - expected) ** 2)[live] / expected[live]).sum().item(), int(live.sum()) - 1


def test_distribution_matches_softmax(interpreter):
    """20000 seeds draw one token each from softmax(logits / T) (after filters): chi-square < the
    p = 1e-4 quantile (the seeds are fixed, so this is deterministic, not flaky).

    The 20000 draws run on the reference backend (the interpreter takes ~15 ms a program); the
    kernel draws the same uniforms bit for bit (test_uniform_bits_match_reference) and the same
    tokens, checked here on the first 64 seeds of each case.
    """
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]]).expand(n, 8).contiguous()
    seeds, pos = torch.arange(n) * 7919 + 13, torch.full((n,), 3)
    crit = {7: 29.9, 2: 18.4, 3: 21.1}  # chi-square quantiles at 1 - 1e-4 per degrees of freedom
    p = torch.softmax(logits[0] / 0.7, -1)
    # top_k=3: renormalized over the 3 largest logits (indices 0, 6, 1)
    pk = torch.zeros(8)
    pk[[0, 6, 1]] = p[[0, 6, 1]] / p[[0, 6, 1]].sum()
    # top_p: the smallest prefix of sorted probabilities reaching top_p, renormalized
    order = p.argsort(descending=True)
    cut = int((p[order].cumsum(0) < 0.8).sum()) + 1
    pp = torch.zeros(8)
    pp[order[:cut]] = p[order[:cut]] / p[order[:cut]].sum()
    for (top_p, top_k), probs in (((1.0, 0), p), ((1.0, 3), pk), ((0.8, 0), pp)):
        tokens = _ref_tokens(logits, 0.7, top_p, top_k, seeds, pos)
        stat, dof = _chi2(tokens, probs)
        assert stat < crit[dof], (top_p, top_k, stat, dof)
        assert torch.equal(K.sample(logits[:64], 0.7, top_p, top_k, seeds[:64], pos[:64]), tokens[:64])


def test_filters_never_emit_filtered_tokens(interpreter):
    B, V = 48, 1000
    row = torch.randn(V) * 2
    logits = row.expand(B, V).contiguous()
    seeds, pos = torch.arange(B), torch.zeros(B, dtype=torch.long)
    topk_set = set(row.topk(5).indices.tolist())
    assert set(K.sample(logits, 1.0, 1.0, 5, seeds, pos).tolist()) <= topk_set
    p = torch.softmax(row.double(), -1)
    order = p.argsort(descending=True)
    cut = int((p[order].cumsum(0) < 0.3).sum()) + 1
    nucleus = set(order[:cut].tolist())
    drawn = K.sample(logits, 1.0, 0.3, 0, seeds, pos)
    assert set(drawn.tolist()) <= nucleus and len(set(drawn.tolist())) > 1
    both = K.sample(logits, 1.0, 0.3, 2, seeds, pos)
    assert set(both.tolist()) <= nucleus & set(row.topk(2).indices.tolist())


def test_greedy_at_temperature_zero(interpreter):
    logits = torch.randn(33, 5000)
    logits[4, 10] = logits[4, 4000] = 100.0  # tie across chunks: the lowest index wins
    logits[5, 4097] = logits[5, 4099] = 100.0  # tie inside a chunk
    tok = K.sample(logits, 0.0, 0.3, 2, _seeds(33), torch.arange(33))
    expected = logits.argmax(-1)
    expected[4], expected[5] = 10, 4097
    assert torch.equal(tok, expected)
    # seeds do not matter for greedy rows
    assert torch.equal(K.sample(logits, 0.0, 1.0, 0, _seeds(33), torch.arange(33) + 9), expected)


def test_masked_vocab(interpreter):
    logits = torch.randn(50, 3000)
    logits[:, 1000:] = -math.inf
    tok = K.sample(logits, 1.0, 0.9, 0, _seeds(50), torch.arange(50))
    assert (tok < 1000).all()


def test_errors(interpreter):
    x = torch.randn(4, 100)
    s, p = torch.arange(4), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        K.sample(x, -0.1, 1.0, 0, s, p)
    with pytest.raises(ValueError, match="temperature"):
        K.sample(x, math.nan, 1.0, 0, s, p)
    with pytest.raises(ValueError, match="top_p"):
        K.sample(x, 1.0, 0.0, 0, s, p)
    with pytest.raises(ValueError, match="top_p"):
        K.sample(x, 1.0, torch.tensor([1.0, 1.0, 1.5, 1.0]), 0, s, p)
    with pytest.raises(ValueError, match="top_k"):
        K.sample(x, 1.0, 1.0, -1, s, p)
    with pytest.raises(TypeError, match="top_k"):
        K.sample(x, 1.0, 1.0, 2.5, s, p)
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        K.sample(x, torch.ones(3), 1.0, 0, s, p)
    with pytest.raises(ValueError, match="seeds"):
        K.sample(x, 1.0, 1.0, 0, s[:3], p)
    with pytest.raises(TypeError, match="positions"):
        K.sample(x, 1.0, 1.0, 0, s, p.float())
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        K.sample(x[0], 1.0, 1.0, 0, s, p)
    assert K.sample(torch.empty(0, 100), 1.0, 1.0, 0, s[:0], p[:0]).shape == (0,)


# ----------------------------------------------------------------------------- GPU (device)


@pytest.mark.gpu
def test_gpu_uniform_bits_match_reference():
    seeds, pos = _seeds(64, "cuda"), torch.randint(0, 2**40, (64,), device="cuda")
    assert torch.equal(_uniform_triton(seeds, pos, 50257).double(), R.uniform(seeds, pos, 50257))


@pytest.mark.gpu
@pytest.mark.parametrize("params", CASES)
def test_gpu_matches_reference_and_is_invariant(params):
    B, V = 256, 151936
    logits = (torch.randn(B, V, device="cuda") * 3).to(torch.bfloat16)
    seeds, pos = _seeds(B, "cuda"), torch.randint(0, 4096, (B,), device="cuda")
    tok = K.sample(logits, seeds=seeds, positions=pos, **params)
    ref = _ref_tokens(logits, seeds=seeds, positions=pos, **params)
    assert ((tok == ref) | _near_ties(logits, seeds=seeds, positions=pos, **params)).all()
    perm = torch.randperm(B, device="cuda")
    assert torch.equal(K.sample(logits[perm], seeds=seeds[perm], positions=pos[perm], **params), tok[perm])
    for i in (0, 100, 255):
        assert K.sample(logits[i : i + 1], seeds=seeds[i : i + 1], positions=pos[i : i + 1], **params).item() == tok[i].item()


@pytest.mark.gpu
def test_gpu_distribution():
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]], device="cuda").expand(n, 8).contiguous()
    seeds, pos = torch.arange(n, device="cuda") * 7919 + 13, torch.full((n,), 3, device="cuda")
    stat, dof = _chi2(K.sample(logits, 0.7, 1.0, 0, seeds, pos).cpu(), torch.softmax(logits[0].cpu() / 0.7, -1))
    assert stat < 29.9, stat
