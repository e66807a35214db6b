"""Qwen3-MoE in rlperf's model: HF parity with transformers' Qwen3MoeForCausalLM, config fields read
and refused, HF expert names, prefill ≡ chunked ≡ decode bits, and the routing trace (record, replay)."""
import dataclasses
import json

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.config import config_from_hf_dict
from rlperf.model.moe import RoutingReplayError, RoutingTrace
from rlperf.model.qwen3 import Qwen3ForCausalLM

from test_qwen3 import _assert_logits_match, _packed, _paged_run, _perturbed

CFG = preset("qwen3-moe-tiny")


@pytest.mark.parametrize("changes", [
    {},                                                           # the preset: layer 0 dense (mlp_only_layers)
    {"num_hidden_layers": 3, "mlp_only_layers": (), "decoder_sparse_step": 2, "norm_topk_prob": False},
    {"num_experts": 5, "num_experts_per_tok": 3, "mlp_only_layers": (1,)},
])
def test_logits_match_transformers_qwen3_moe(tmp_path, changes):
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(CFG, **changes)
    model = _perturbed(Qwen3ForCausalLM.random(cfg, seed=1, std=0.1))
    assert [layer.is_moe for layer in model.layers] == [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    assert any(layer.is_moe for layer in model.layers)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3_moe" and saved["num_experts"] == cfg.num_experts
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _assert_logits_match(model, hf)


def test_kernels_match_the_reference_backend(interpreter):
    model = _perturbed(Qwen3ForCausalLM.random(CFG, seed=2, std=0.1))
    _, ids, positions, cu = _packed([4, 9], CFG.vocab_size)
    with torch.no_grad():
        ours = model.forward_packed(ids, positions, cu)
        with K.use_backend("reference"):
            ref = model.forward_packed(ids, positions, cu)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_hf_names_and_round_trip(tmp_path):
    model = Qwen3ForCausalLM.random(CFG, seed=3)
    names = model.hf_state_dict()
    e, mi, h = CFG.num_experts, CFG.moe_intermediate_size, CFG.hidden_size
    assert names["model.layers.1.mlp.gate.weight"].shape == (e, h)
    assert names[f"model.layers.1.mlp.experts.{e - 1}.up_proj.weight"].shape == (mi, h)
    assert names["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (h, mi)
    assert "model.layers.0.mlp.gate_proj.weight" in names  # layer 0: dense (mlp_only_layers)
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in names)
    # views, not copies: writing the HF tensor writes the fused parameter
    names["model.layers.1.mlp.experts.3.up_proj.weight"].detach()[0, 0] = 7.0
    assert model.layers[1].experts_gate_up[3, mi, 0] == 7.0
    model.save_pretrained(tmp_path)
    again = Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert again.cfg == CFG
    for (name, a), b in zip(model.hf_state_dict().items(), again.hf_state_dict().values()):
        assert torch.equal(a, b), name
    assert list(model.hf_state_dict()) == [n for n, _ in model.hf_state_dict().items()]


def test_hf_config_fields_read_and_refused():
    base = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
            "rope_theta": 1e6, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    cfg, _ = config_from_hf_dict(base)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 2, 8)
    assert cfg.moe_layers == [1] and cfg.mlp_only_layers == (3,) and cfg.norm_topk_prob
    defaults, _ = config_from_hf_dict({k: v for k, v in base.items() if k not in (
        "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")})
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.norm_topk_prob) == (128, 8, False)
    assert defaults.moe_layers == [0, 1, 2, 3]
    for field, value in [("shared_expert_intermediate_size", 128), ("n_shared_experts", 1),
                         ("num_experts_per_tok", 7), ("mlp_only_layers", [9]), ("num_experts", 2.5),
                         ("decoder_sparse_step", 0)]:
        with pytest.raises(ValueError, match=field):
            config_from_hf_dict({**base, field: value}, "cfg.json")
    dense, _ = config_from_hf_dict({k: v for k, v in base.items() if k != "model_type" and "expert" not in k
                                    and k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")})
    assert dense.num_experts == 0 and dense.moe_layers == []


def test_prefill_chunked_decode_give_identical_bits(interpreter):
    model = Qwen3ForCausalLM.random(CFG, seed=3, std=0.1)
    longest = K.PAGE_SIZE + 6  # crosses a page boundary
    seqs, ids, positions, cu = _packed([5, 19, longest], CFG.vocab_size, seed=4)
    with torch.no_grad():
        packed = model.forward_packed(ids, positions, cu)
        n_pages = 3 * ((longest + K.PAGE_SIZE - 1) // K.PAGE_SIZE)
        order = torch.randperm(n_pages).tolist()
        for chunk in ((longest, longest), (K.PAGE_SIZE, 1)):
            paged = _paged_run(model, seqs, chunk, order)
            for s in range(len(seqs)):
                assert torch.equal(paged[s], packed[cu[s]:cu[s + 1]]), (chunk, s)
        alone = model.forward_packed(seqs[1], torch.arange(19), torch.tensor([0, 19], dtype=torch.int32))
        assert torch.equal(alone, packed[cu[1]:cu[2]])


def test_routing_trace_records_and_replays(interpreter):
    model = Qwen3ForCausalLM.random(CFG, seed=5, std=0.1)
    _, ids, positions, cu = _packed([6, 11], CFG.vocab_size, seed=6)
    with torch.no_grad():
        trace = RoutingTrace()
        hidden = model.forward_packed(ids, positions, cu, trace)
        experts = trace.experts()
        assert experts.shape == (17, len(CFG.moe_layers), CFG.num_experts_per_tok)
        replay = RoutingTrace(experts.flip(-1))  # replay in any order: same experts, same bits
        assert torch.equal(model.forward_packed(ids, positions, cu, replay), hidden)
        assert torch.equal(replay.experts(), experts)
        other = (experts + 1) % CFG.num_experts  # other experts: the forward follows them
        assert not torch.equal(model.forward_packed(ids, positions, cu, RoutingTrace(other)), hidden)
        with pytest.raises(RoutingReplayError, match="tokens"):
            model.forward_packed(ids, positions, cu, RoutingTrace(experts[:5]))
        with pytest.raises(RoutingReplayError, match="num_experts_per_tok"):
            model.forward_packed(ids, positions, cu, RoutingTrace(experts[:, :, :1]))


@pytest.mark.gpu
def test_gpu_bf16_30b_a3b_layers_prefill_equals_decode_and_routing():
    """The reduced-layer Qwen3-30B-A3B preset (128 experts, top-8) in bf16: a full prefill, a
    chunked prefill and decode give the same final hidden bits, and route every token alike."""
    cfg = preset("qwen3-30b-a3b-2l")
    model = Qwen3ForCausalLM.random(cfg, seed=5, dtype=torch.bfloat16, device="cuda")
    seqs, ids, positions, cu = _packed([3, 130, 257], cfg.vocab_size, seed=6)
    seqs = [s.cuda() for s in seqs]
    with torch.no_grad():
        trace = RoutingTrace()
        packed = model.forward_packed(ids.cuda(), positions.cuda(), cu.cuda(), trace)
        order = torch.randperm(3 * ((257 + K.PAGE_SIZE - 1) // K.PAGE_SIZE)).tolist()
        for chunk in ((1, 1), (100, 100), (200, 1)):
            paged = _paged_run(model, seqs, chunk, order, "cuda")
            for s in range(3):
                assert torch.equal(paged[s], packed[cu[s]:cu[s + 1]]), (chunk, s)
        alone = RoutingTrace()
        model.forward_packed(seqs[2], torch.arange(257, device="cuda"), torch.tensor([0, 257], dtype=torch.int32,
                                                                                     device="cuda"), alone)
        assert torch.equal(alone.experts(), trace.experts()[cu[2]:cu[3]])
