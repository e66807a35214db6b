"""The Qwen3-style model: HF parity, checkpoint round trip, and prefill ≡ chunked ≡ decode bits."""
import dataclasses
import json

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import PRESETS, preset
from rlperf.model.qwen3 import Qwen3ForCausalLM

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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_random_init_equals_the_cpu_init_bit_for_bit(dtype):
    """The seeded init is the same on every device (its scale is applied on the GPU there)."""
    cpu = Qwen3ForCausalLM.random(CFG, seed=4, dtype=dtype)
    gpu = Qwen3ForCausalLM.random(CFG, seed=4, dtype=dtype, device="cuda")
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        assert torch.equal(a.detach(), b.detach().cpu()), name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_parameters_counts_what_the_model_builds(name):
    """The count a run's memory estimate uses before it allocates: the built model's, on the meta device
    (no memory), for dense, tied and untied, and MoE shapes."""
    model = Qwen3ForCausalLM(PRESETS[name], torch.float32, "meta")
    assert PRESETS[name].num_parameters == sum(p.numel() for p in model.parameters())
