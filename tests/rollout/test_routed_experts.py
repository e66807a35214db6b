"""Routed experts and rollout routing replay (R3) on the tiny MoE model (CPU, reference kernels):
the engine returns each token's experts, they equal the training forward's routing, they travel
through ``rlperf serve``'s ``meta_info["routed_experts"]``, and the trainer replays them; missing
or malformed routing is a clear error."""
import base64

import numpy as np
import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.moe import RoutingReplayError, RoutingTrace, decode_routed_experts, routing_agreement
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.engine import BadRequest, Engine, EngineConfig, SamplingParams
from rlperf.rollout.tokenizer import ByteTokenizer
from rlperf.train import Sample, compute_log_probs

pytest.importorskip("aiohttp")

from inprocess_server import cpu_args, serve  # noqa: E402

CFG = preset("qwen3-moe-tiny")
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7]]
PARAMS = SamplingParams(max_new_tokens=9, temperature=1.0, ignore_eos=True, seed=5)


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM.random(CFG, seed=0, std=0.1)


@pytest.fixture(autouse=True)
def _reference_backend():
    with K.use_backend("reference"):
        yield


def _generate(model, **engine_kw):
    engine = Engine(model, ByteTokenizer(CFG.vocab_size), EngineConfig(max_total_tokens=1024, **engine_kw))
    reqs = [engine.add_request(p, PARAMS, return_routed_experts=True) for p in PROMPTS]
    engine.run_until_done()
    return [r.result() for r in reqs]


def _samples(results):
    return [Sample(torch.tensor(p + r.output_ids), len(r.output_ids), rollout_log_probs=r.output_logprobs,
                   rollout_routed_experts=r.routed_experts) for p, r in zip(PROMPTS, results)]


def test_engine_routing_equals_the_training_forward(model):
    results = _generate(model, chunked_prefill_size=4)  # chunked prefill, then decode
    for p, r in zip(PROMPTS, results):
        tokens = torch.tensor(p + r.output_ids)
        n = tokens.numel()
        assert r.routed_experts.shape == (n - 1, len(CFG.moe_layers), CFG.num_experts_per_tok)
        trace = RoutingTrace()
        with torch.no_grad():
            model.forward_packed(tokens, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), trace)
        assert torch.equal(trace.experts()[: n - 1], r.routed_experts)
        assert routing_agreement(r.routed_experts, trace.experts()[: n - 1]) == 1.0


def test_routing_survives_retraction(model):
    plain = _generate(model)
    engine = Engine(model, ByteTokenizer(CFG.vocab_size), EngineConfig(max_total_tokens=1024))
    reqs = [engine.add_request(p, PARAMS, return_routed_experts=True) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    engine.retract_all()  # re-prefilled from position 0: recorded again, not twice
    engine.run_until_done()
    for r, ref in zip(reqs, plain):
        assert torch.equal(r.result().routed_experts, ref.routed_experts)


def test_dense_model_refuses_return_routed_experts():
    dense = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    engine = Engine(dense, ByteTokenizer(512), EngineConfig(max_total_tokens=256))
    with pytest.raises(BadRequest, match="no MoE layers"):
        engine.add_request([1, 2, 3], PARAMS, return_routed_experts=True)


def test_trainer_replays_the_rollout_routing(model):
    samples = _samples(_generate(model))
    replayed = compute_log_probs(model, samples, 1.0, micro_batch_size=2, replay_routing=True)
    for s, lp in zip(samples, replayed):  # invariant kernels: replay changes nothing, and equals the rollout
        assert torch.equal(lp, torch.tensor(s.rollout_log_probs))
    # the replay is really used: other experts give other log-probs
    moved = [Sample(s.tokens, s.response_length, rollout_routed_experts=(s.rollout_routed_experts + 1) % CFG.num_experts)
             for s in samples]
    other = compute_log_probs(model, moved, 1.0, micro_batch_size=2, replay_routing=True)
    assert not all(torch.equal(a, b) for a, b in zip(other, replayed))


def test_missing_or_short_routing_is_a_clear_error(model):
    samples = _samples(_generate(model))
    samples[1].rollout_routed_experts = None
    with pytest.raises(RoutingReplayError, match="sample 1: .* has none"):
        compute_log_probs(model, samples, 1.0, replay_routing=True)
    samples[1].rollout_routed_experts = samples[0].rollout_routed_experts
    with pytest.raises(RoutingReplayError, match="sample 1: .* do not cover"):
        compute_log_probs(model, samples, 1.0, replay_routing=True)
    with pytest.raises(RoutingReplayError, match="has none"):
        decode_routed_experts(None, CFG, 4)
    with pytest.raises(RoutingReplayError, match="bytes"):
        decode_routed_experts(base64.b64encode(b"\0" * 12).decode(), CFG, 4)
    with pytest.raises(RoutingReplayError, match="base64"):
        decode_routed_experts("not base64!", CFG, 4)


def test_routing_agreement_counts_token_layers():
    a = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])
    b = a.clone()
    b[1, 0] = torch.tensor([3, 2])   # same set, other order: agrees
    b[3, 0, 1] = 0                    # one expert differs
    assert routing_agreement(a, b) == 0.75


def test_serve_returns_routed_experts_in_meta_info(model):
    body = {"input_ids": PROMPTS, "return_logprob": True, "return_routed_experts": [True, False, True],
            "sampling_params": {"max_new_tokens": 9, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5}}

    async def run(server, client):
        resp = await client.post("/generate", json=body)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    replies = serve(model, cpu_args(), run)
    expected = _generate(model)
    assert "routed_experts" not in replies[1]["meta_info"]
    for i in (0, 2):
        meta, tokens = replies[i]["meta_info"], PROMPTS[i] + replies[i]["output_ids"]
        raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
        assert raw.size == (len(tokens) - 1) * CFG.num_hidden_layers * CFG.num_experts_per_tok
        full = raw.reshape(len(tokens) - 1, CFG.num_hidden_layers, CFG.num_experts_per_tok)
        assert (full[:, CFG.mlp_only_layers] == -1).all()  # dense layers: -1
        got = decode_routed_experts(meta["routed_experts"], CFG, len(tokens) - 1)
        assert torch.equal(got, expected[i].routed_experts)


def test_serve_refuses_routed_experts_of_a_dense_model():
    dense = Qwen3ForCausalLM.random(preset("tiny"), seed=0)

    async def run(server, client):
        out = []
        for flag in (True, "yes"):
            resp = await client.post("/generate", json={"input_ids": [1, 2], "return_routed_experts": flag})
            out.append((resp.status, await resp.text()))
        return out

    (status, text), (bad_status, bad_text) = serve(dense, cpu_args(), run)
    assert status == 400 and "no MoE layers" in text
    assert bad_status == 400 and "return_routed_experts" in bad_text


def test_routing_agreement_gate(model):
    from rlperf.gates.checks import routing_agreement as gate
    from rlperf.train import compute_routed_experts

    samples = _samples(_generate(model))
    train = compute_routed_experts(model, samples, micro_batch_size=2)
    ok = gate(samples, train, true_on_policy=True)
    assert ok.passed and ok.measured["agreement"] == 1.0
    flipped = [t.clone() for t in train]
    flipped[1][4, 0] = (flipped[1][4, 0] + 1) % CFG.num_experts
    bad = gate(samples, flipped, true_on_policy=True)
    assert not bad.passed and "sample 1, token 4, MoE layer 0" in bad.message
    assert gate(samples, flipped, true_on_policy=False, min_agreement=0.9).passed
    samples[2].rollout_routed_experts = None
    missing = gate(samples, train, true_on_policy=True)
    assert not missing.passed and "sample 2 has no rollout routed experts" in missing.message


def test_trainer_with_routing_replay(model):
    """``Trainer(routing_replay=True)`` (``--use-rollout-routing-replay``): a sample without routing
    is a RoutingReplayError naming it, and with routing one step runs."""
    from rlperf.train import TrainArgs, Trainer

    args = TrainArgs(n_samples_per_prompt=3, lr=1e-3, micro_batch_size=2)
    samples = _samples(_generate(model))
    for s in samples:
        s.reward = float(len(s.tokens) % 2)
    trainer = Trainer(Qwen3ForCausalLM.random(CFG, seed=0, std=0.1), args, routing_replay=True)
    trainer.prepare(samples)
    assert all(torch.equal(s.log_probs, torch.tensor(s.rollout_log_probs)) for s in samples)
    metrics = trainer.train_step(samples)
    assert metrics["train/train_rollout_logprob_abs_diff"] == 0.0
    samples[0].rollout_routed_experts = None
    with pytest.raises(RoutingReplayError, match="sample 0"):
        trainer.prepare(samples)


def test_routed_experts_survive_the_debug_rollout_data():
    """``--save-debug-rollout-data`` / ``--load-debug-rollout-data`` keep a sample's routing (replay reads it)."""
    import json

    routed = torch.randint(0, CFG.num_experts, (5, len(CFG.moe_layers), CFG.num_experts_per_tok), dtype=torch.int32)
    s = Sample([1, 2, 3, 4, 5, 6], 3, rollout_log_probs=[-1.0, -2.0, -0.5], rollout_routed_experts=routed)
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.rollout_routed_experts.dtype == torch.int32 and torch.equal(back.rollout_routed_experts, routed)
    assert Sample.from_dict(json.loads(json.dumps(Sample([1, 2], 1).to_dict()))).rollout_routed_experts is None
