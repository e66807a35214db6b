"""The seam between the loop and its engines: every client is a RolloutClient with one weight method,
load_weights((name, tensor) pairs, version), and the factory picks the client from the configuration."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.loop.clients import EngineClient, RolloutClient, RouterClient, client_for
from rlperf.loop.config import RunConfig
from rlperf.loop.data_parallel import DataParallelEngineClient, Rank0EnginesClient
from rlperf.loop.resolve import parse_train_args
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout import ByteTokenizer, SamplingParams
from rlperf.sync import weights_checksum

PROTOCOL = ("generate", "load_weights", "weights_checksum", "close")


@pytest.fixture
def models():
    with K.use_backend("reference"):
        yield Qwen3ForCausalLM.random(preset("tiny"), seed=1), Qwen3ForCausalLM.random(preset("tiny"), seed=2)


def _pairs(model):
    """(name, tensor) pairs as a one-pass generator, as the data-parallel trainer's gather yields them."""
    return ((n, t.detach()) for n, t in model.hf_state_dict().items())


@pytest.mark.parametrize("cls", [EngineClient, RouterClient, DataParallelEngineClient, Rank0EnginesClient])
def test_every_client_has_the_protocol_and_no_other_weight_method(cls):
    assert all(callable(getattr(cls, m, None)) for m in PROTOCOL)
    assert not hasattr(cls, "update_weights") and not hasattr(cls, "engine_checksum")


@pytest.mark.parametrize("weights", ["buckets", "copy"])
def test_an_engine_loads_the_weights_it_is_given_and_generates_with_them(models, weights):
    start, target = models
    tok = ByteTokenizer(512)
    with K.use_backend("reference"):
        engine_model = start if weights == "buckets" else Qwen3ForCausalLM.random(preset("tiny"), seed=1)
        client = EngineClient(engine_model, tok, max_total_tokens=256, weights=weights)
        assert isinstance(client, RolloutClient)
        before = client.weights_checksum()
        assert before == weights_checksum(start.hf_state_dict()) != weights_checksum(target.hf_state_dict())
        stats = client.load_weights(_pairs(target), "7")
        assert client.weights_checksum() == weights_checksum(target.hf_state_dict())
        assert client.engine.weight_version == "7" and stats.bytes in (0, sum(
            t.numel() * t.element_size() for t in target.hf_state_dict().values()))
        params = [SamplingParams(max_new_tokens=4, temperature=1.0, seed=s) for s in range(3)]
        prompts = [[1, 2, 3], [4, 5], [6]]
        got = client.generate(prompts, params)
        fresh = EngineClient(target, tok, max_total_tokens=256, weights="buckets").generate(prompts, params)
    assert [(r.output_ids, r.output_logprobs) for r in got] == [(r.output_ids, r.output_logprobs) for r in fresh]


def test_an_engine_refuses_weights_it_does_not_have_or_that_never_came(models):
    start, target = models
    with K.use_backend("reference"):
        client = EngineClient(start, ByteTokenizer(512), max_total_tokens=256, weights="copy")
        with pytest.raises(RuntimeError, match="'nope' is not a weight"):
            client.load_weights([("nope", torch.zeros(1))], "1")
        first = next(iter(target.hf_state_dict().items()))
        with pytest.raises(RuntimeError, match="no tensor for"):
            client.load_weights([first], "1")
        shared = EngineClient(start, ByteTokenizer(512), max_total_tokens=256, weights="shared")
        shared.load_weights(_pairs(start), "2")  # the very tensors it runs on: nothing moves
        with pytest.raises(RuntimeError, match="no longer holds the trainer's"):
            shared.load_weights(_pairs(target), "3")
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineClient(start, ByteTokenizer(512), weights="mapping")


def test_rank0_engines_client_on_other_ranks_walks_the_gather_and_reports_nothing():
    client = Rank0EnginesClient(None, rank=1, world_size=2)
    walked = []

    def gather():
        for i in range(3):
            walked.append(i)
            yield f"w{i}", torch.zeros(2, dtype=torch.float32)

    assert client.load_weights(gather(), "1").bytes == 24 and walked == [0, 1, 2]
    assert client.weights_checksum() is None and client.runs_rollout is False
    with pytest.raises(RuntimeError, match="generate through rank 0"):
        client.generate([[1]], [SamplingParams()])
    with pytest.raises(ValueError, match="rank 0, and only rank 0"):
        Rank0EnginesClient(None, rank=0, world_size=2)


def test_the_factory_picks_the_client_from_the_configuration(models, tmp_path):
    start, _ = models
    ns = parse_train_args(["--device", "cpu", "--output-dir", str(tmp_path)])
    config = RunConfig.from_args(ns)
    assert (config.rollout.engine, config.rollout.engine_weights) == ("in-process", "buckets")
    with K.use_backend("reference"):
        client, fleet = client_for(config, start, ByteTokenizer(512), kv_tokens=256)
        assert fleet is None and type(client) is EngineClient and client.weights == "buckets"
        assert client.model is not start  # its own copy, loaded at every sync
    import socket

    with socket.socket() as router:  # the flags are checked against a port that accepts connections
        router.bind(("127.0.0.1", 0))
        router.listen()
        ns = parse_train_args(["--device", "cpu", "--output-dir", str(tmp_path), "--sglang-router-ip", "127.0.0.1",
                               "--sglang-router-port", str(router.getsockname()[1])])
    assert RunConfig.from_args(ns).rollout.engine == "router"
    with pytest.raises(dataclasses_frozen_error()):
        config.rollout.batch_size = 3


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError
