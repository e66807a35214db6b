"""The Qwen3-style model: HF parity, checkpoint round trip, prefill ≡ chunked ≡ decode bits, and the seeded
init (its formula, moments, chunking, and the same bits on CPU and GPU)."""
import dataclasses
import json
import math
import struct

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import PRESETS, preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.model.seeded_normal import fill_seeded_normal_

CFG = preset("tiny")


def _packed(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return seqs, ids, positions, cu


def _perturbed(model):
    """``model`` with non-trivial norm weights, so that a swapped norm would show."""
    with torch.no_grad():
        for layer in model.layers:
            layer.q_norm.uniform_(0.5, 1.5)
            layer.input_layernorm.uniform_(0.5, 1.5)
    return model


def _assert_logits_match(model, hf):
    """rlperf's logits (reference backend) against transformers' ``hf`` on sequences of 1, 7 and 33 tokens."""
    seqs, ids, positions, cu = _packed([1, 7, 33], model.cfg.vocab_size)
    with K.use_backend("reference"), torch.no_grad():
        ours = model.logits(model.forward_packed(ids, positions, cu))
        for s, seq in enumerate(seqs):
            ref = hf(seq[None]).logits[0].double()
            # fp32 model: our ops run in float64 and round per op; HF runs fp32 throughout
            torch.testing.assert_close(ours[cu[s]:cu[s + 1]].double(), ref, atol=2e-5, rtol=1e-4)


def test_logits_match_transformers_qwen3(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _perturbed(Qwen3ForCausalLM.random(CFG, seed=1, std=0.1))
    model.save_pretrained(tmp_path)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _assert_logits_match(model, hf)


def test_sharded_checkpoint_round_trip_and_bad_shapes(tmp_path):
    model = Qwen3ForCausalLM.random(CFG, seed=2)
    model.save_pretrained(tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = Qwen3ForCausalLM.from_pretrained(tmp_path)
    for (name, a), b in zip(model.hf_state_dict().items(), again.hf_state_dict().values()):
        assert torch.equal(a, b), name
    bad = dict(model.hf_state_dict())
    bad["model.norm.weight"] = torch.ones(CFG.hidden_size + 1)
    with pytest.raises(ValueError, match="model.norm.weight"):
        again.load_hf_state_dict(bad)


def test_prefill_chunked_decode_give_identical_bits(interpreter):
    # float16 only: the model adds the composition (per-layer caches, decode positions, page tables) to
    # kernels tests/kernels proves in fp16 and fp32; a path that rounds where the other does not shows in
    # fp16 and may not in fp32, and any order difference shows in both (fp32 ran the same steps again)
    model = Qwen3ForCausalLM.random(CFG, seed=3, dtype=torch.float16)
    longest = K.PAGE_SIZE + 6  # crosses a page boundary
    seqs, ids, positions, cu = _packed([5, 19, longest], CFG.vocab_size, seed=4)
    with torch.no_grad():
        packed = model.forward_packed(ids, positions, cu)
        n_pages = 3 * ((longest + K.PAGE_SIZE - 1) // K.PAGE_SIZE)
        order = torch.randperm(n_pages).tolist()
        # whole prefill; chunked prefill (odd chunks, one across the page boundary); prefill of one page then
        # decode token by token across the boundary
        for chunk in ((longest, longest), (37, 37), (K.PAGE_SIZE, 1)):
            paged = _paged_run(model, seqs, chunk, order)
            for s in range(len(seqs)):
                assert torch.equal(paged[s], packed[cu[s]:cu[s + 1]]), (chunk, s)
        alone = model.forward_packed(seqs[1], torch.arange(19), torch.tensor([0, 19], dtype=torch.int32))
        assert torch.equal(alone, packed[cu[1]:cu[2]])


@pytest.mark.gpu
def test_bf16_gpu_prefill_equals_decode_and_tracks_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    model = Qwen3ForCausalLM.random(cfg, seed=5, dtype=torch.bfloat16, device="cuda")
    seqs, ids, positions, cu = _packed([3, 130, 257], cfg.vocab_size, seed=6)
    seqs = [s.cuda() for s in seqs]
    with torch.no_grad():
        packed = model.forward_packed(ids.cuda(), positions.cuda(), cu.cuda())
        order = torch.randperm(3 * ((257 + K.PAGE_SIZE - 1) // K.PAGE_SIZE)).tolist()
        for chunk in ((1, 1), (100, 100), (200, 1)):
            paged = _paged_run(model, seqs, chunk, order, "cuda")
            for s in range(3):
                assert torch.equal(paged[s], packed[cu[s]:cu[s + 1]]), (chunk, s)
        model.save_pretrained(tmp_path)
        hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
        ours = model.logits(packed)
        for s, seq in enumerate(seqs):
            ref = hf(seq[None]).logits[0].float()
            rel = (ours[cu[s]:cu[s + 1]] - ref).norm() / ref.norm()
            assert rel < 2e-2, rel  # bf16 end to end, two implementations rounding differently


def _paged_run(model, seqs, chunk, page_order, device="cpu"):
    """Run every sequence through forward_paged, ``chunk = (first, rest)`` tokens per step (NaN-poisoned
    cache pages in ``page_order``); return each sequence's final hidden states."""
    cfg, P = model.cfg, K.PAGE_SIZE
    pages_per_seq = max((len(s) + P - 1) // P for s in seqs)
    dt = model.embed_tokens.dtype
    caches = [(torch.full((len(page_order), P, cfg.num_key_value_heads, cfg.head_dim), float("nan"), dtype=dt, device=device),
               torch.full((len(page_order), P, cfg.num_key_value_heads, cfg.head_dim), float("nan"), dtype=dt, device=device))
              for _ in range(cfg.num_hidden_layers)]
    table = torch.as_tensor(page_order, dtype=torch.int32, device=device)[: len(seqs) * pages_per_seq].reshape(len(seqs), pages_per_seq)
    outs = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < len(s) for d, s in zip(done, seqs)):
        ids, pos, slots, cu, lens, rows = [], [], [], [0], [], []
        for b, s in enumerate(seqs):
            n = min(chunk[0] if done[b] == 0 else chunk[1], len(s) - done[b])
            if n <= 0:
                continue
            p = torch.arange(done[b], done[b] + n, device=device)
            ids.append(s[p]); pos.append(p)
            slots.append(table[b, p // P].long() * P + p % P)
            cu.append(cu[-1] + n); lens.append(done[b] + n); rows.append(b)
            done[b] += n
        hidden = model.forward_paged(torch.cat(ids), torch.cat(pos), caches, torch.cat(slots), table[rows],
                                     torch.tensor(cu, dtype=torch.int32, device=device),
                                     torch.tensor(lens, dtype=torch.int32, device=device))
        for i, b in enumerate(rows):
            outs[b].append(hidden[cu[i]:cu[i + 1]])
    return [torch.cat(o) for o in outs]


def test_random_init_draws_in_float32_then_casts():
    """A half-precision init is the float32 init cast (the scale is applied before the cast)."""
    full = Qwen3ForCausalLM.random(CFG, seed=4)
    half = Qwen3ForCausalLM.random(CFG, seed=4, dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(full.named_parameters(), half.named_parameters()):
        assert torch.equal(a.detach().to(torch.bfloat16), b.detach()), name


# ---- the seeded init's values (rlperf.model.seeded_normal) ---------------------------------------
_M32 = 0xFFFFFFFF


def _ref_mix(x: int) -> int:
    """The init's 32-bit hash, written out on Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _ref_value(seed: int, k: int, i: int, std: float, segment: int = 1 << 31) -> float:
    """Element ``i`` of matrix ``k`` from the formula of ``rlperf.model.seeded_normal``'s docstring, in
    pure Python: integers, then float64 products that are exact and rounded once to float32."""
    s0, s1 = seed & _M32, (seed >> 32) & _M32
    h, r = divmod(i, segment)
    a = _ref_mix(_ref_mix(_ref_mix(_ref_mix(s0 ^ 0x9E3779B9) ^ s1) ^ k) ^ h)
    b = _ref_mix(a ^ 0x5BD1E995)
    w0, w1 = (_ref_mix(_ref_mix((2 * r + j) ^ a) ^ b) for j in (0, 1))
    total = (w0 & 0xFFFF) + (w0 >> 16) + (w1 & 0xFFFF) + (w1 >> 16) - 131070
    c = struct.unpack("f", struct.pack("f", std * math.sqrt(3 / (65536 ** 2 - 1))))[0]
    return struct.unpack("f", struct.pack("f", total * c))[0]  # |total| < 2**18, c has 24 bits: exact, one rounding


def _matrices(model):
    return [(n, p.detach()) for n, p in model.named_parameters() if p.dim() >= 2]


def test_random_init_is_reproducible_and_differs_across_seeds_and_matrices():
    a, again, other = (Qwen3ForCausalLM.random(CFG, seed=s) for s in (7, 7, 8))
    for (name, x), (_, y), (_, z) in zip(_matrices(a), _matrices(again), _matrices(other)):
        assert torch.equal(x, y), name
        assert (x != z).float().mean() > 0.999, name  # another seed: other values nearly everywhere
    for _, p in a.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p))
    # matrices of one shape in two layers: other values, uncorrelated
    q0, q1 = a.layers[0].qkv_proj.detach().double(), a.layers[1].qkv_proj.detach().double()
    assert (q0 != q1).float().mean() > 0.999
    corr = (q0 * q1).mean() / (q0.std() * q1.std())
    assert abs(corr) < 5 / q0.numel() ** 0.5


def test_seeded_normal_moments_and_symmetry():
    """Over 4 M values: mean 0 and standard deviation ``std`` within a few standard errors, skewness 0,
    the Irwin–Hall kurtosis 2.7, bounded by sqrt(12) std, and a histogram symmetric about 0."""
    std = 0.02
    x = torch.empty(2048, 2048)
    fill_seeded_normal_(x, seed=3, k=11, std=std)
    z = x.double() / std
    n = z.numel()
    assert abs(z.mean()) < 5 / n ** 0.5
    assert abs(z.std() - 1) < 5 * 0.66 / n ** 0.5  # sd of the sample std: sqrt(kurtosis - 1) / 2 / sqrt(n)
    assert abs((z ** 3).mean()) < 5 * 15 ** 0.5 / n ** 0.5
    assert abs((z ** 4).mean() - 2.7) < 0.01
    assert z.abs().max() <= 12 ** 0.5
    counts = torch.histc(z, bins=40, min=-3.5, max=3.5)
    mirrored = counts.flip(0)
    assert ((counts - mirrored).abs() <= 5 * (counts + mirrored).clamp(min=1).sqrt()).all()
    for lag in (1, 2, 2047, 2048, 4096):  # neighbours along a row, down a column: uncorrelated
        assert abs((z.flatten()[:-lag] * z.flatten()[lag:]).mean()) < 5 / n ** 0.5, lag


@pytest.mark.parametrize("shape", [(3, 5), (7, 1, 13), (1, 1), (2, 3, 4, 5)])
def test_seeded_normal_matches_the_formula_in_pure_python(shape):
    x = torch.empty(shape)
    fill_seeded_normal_(x, seed=(1 << 40) + 12345, k=3, std=0.05)
    flat = x.flatten().tolist()
    for i in range(len(flat)):
        assert flat[i] == _ref_value((1 << 40) + 12345, 3, i, 0.05), (shape, i)


def test_random_init_matches_the_formula_for_sampled_elements():
    """Sampled elements of every matrix of the tiny model (float32 and bf16) against the pure-Python formula:
    matrix k counts only the parameters of two or more dimensions, in ``named_parameters`` order."""
    full = Qwen3ForCausalLM.random(CFG, seed=9, std=0.03)
    half = Qwen3ForCausalLM.random(CFG, seed=9, std=0.03, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for k, ((name, x), (_, y)) in enumerate(zip(_matrices(full), _matrices(half))):
        n = x.numel()
        for i in [0, 1, n - 1] + torch.randint(0, n, (16,), generator=g).tolist():
            want = _ref_value(9, k, i, 0.03)
            assert x.flatten()[i].item() == want, (name, i)
            assert y.flatten()[i].item() == torch.tensor(want).to(torch.bfloat16).item(), (name, i)


def test_seeded_normal_across_counter_segments(monkeypatch):
    """A tensor longer than a counter segment (the segment shrunk to 16 elements): the draw splits its
    chunks at the segment ends and each segment takes its own key."""
    import rlperf.model.seeded_normal as S

    monkeypatch.setattr(S, "SEGMENT", 16)
    x = torch.empty(5, 11)
    fill_seeded_normal_(x, seed=2, k=1, std=1.0, chunk=7)
    assert x.flatten().tolist() == [_ref_value(2, 1, i, 1.0, segment=16) for i in range(55)]
    with pytest.raises(ValueError, match="cross a segment"):
        S.seeded_normal(2, 1, 10, 10)


@pytest.mark.parametrize("chunk", [1, 7, 1000, 1 << 30])
def test_chunked_init_equals_the_unchunked_init(chunk):
    whole = Qwen3ForCausalLM.random(CFG, seed=5, chunk=1 << 40)
    got = Qwen3ForCausalLM.random(CFG, seed=5, chunk=chunk)
    for (name, a), (_, b) in zip(whole.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), (chunk, name)


def test_random_init_on_the_meta_device_allocates_nothing():
    model = Qwen3ForCausalLM.random(preset("qwen3-8b"), device="meta")
    assert model.embed_tokens.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny", "qwen3-moe-tiny", "qwen3-0.6b-2l"])
def test_gpu_random_init_equals_the_cpu_init_bit_for_bit(name, dtype):
    """The seeded init is computed on each device and gives the same bits there: the tiny presets, and two
    layers of qwen3-0.6b (its 155 M-value embedding spans several of the GPU's chunks and thousands of the
    CPU's)."""
    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2) if name == "qwen3-0.6b-2l" else preset(name)
    cpu = Qwen3ForCausalLM.random(cfg, seed=4, dtype=dtype)
    gpu = Qwen3ForCausalLM.random(cfg, seed=4, dtype=dtype, device="cuda")
    for (pname, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        assert b.device.type == "cuda" and torch.equal(a.detach(), b.detach().cpu()), pname


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_parameters_counts_what_the_model_builds(name):
    """The count a run's memory estimate uses before it allocates: the built model's, on the meta device
    (no memory), for dense, tied and untied, and MoE shapes."""
    model = Qwen3ForCausalLM(PRESETS[name], torch.float32, "meta")
    assert PRESETS[name].num_parameters == sum(p.numel() for p in model.parameters())
