"""``rlperf serve``'s start-up warm-up: /health answers 503 until it is over, then 200; it leaves
nothing a client can see and changes no bits of later requests.

The warm-up is made observable with :data:`rlperf.rollout.server.WARMUP_DELAY_ENV` (a sleep at its
end). On CPU it is one short prefill on the reference kernels (milliseconds for the tiny model); the
GPU test compiles the Triton kernels and captures every CUDA-graph decode size.
"""
import asyncio
import time

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout import router as R
from rlperf.rollout.args import ServerArgs, server_argv
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.tokenizer import ByteTokenizer

pytest.importorskip("aiohttp")

from inprocess_server import cpu_args, serve  # noqa: E402

from rlperf.rollout.server import WARMUP_DELAY_ENV  # noqa: E402

DELAY_S = 1.5
BODY = {"input_ids": [3, 1, 4, 1, 5, 9, 2, 6], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "sampling_seed": 11, "temperature": 1.0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM.random(preset("tiny"), seed=0)




async def _status(client, path):
    resp = await client.get(path)
    return resp.status, await resp.json(content_type=None) if resp.status != 200 else None


async def _until_ready(client, timeout=30.0):
    deadline = time.time() + timeout
    while (await client.get("/health")).status != 200:
        assert time.time() < deadline, "the warm-up did not end"
        await asyncio.sleep(0.05)


def test_health_is_503_during_the_warm_up_and_200_after(model, monkeypatch):
    monkeypatch.setenv(WARMUP_DELAY_ENV, str(DELAY_S))

    async def run(server, client):
        during = [await _status(client, "/health"), await _status(client, "/health_generate")]
        info = await (await client.get("/get_server_info")).json()
        t0 = time.time()
        await _until_ready(client)
        waited = time.time() - t0
        after = [(await client.get(p)).status for p in ("/health", "/health_generate")]
        info_after = await (await client.get("/get_server_info")).json()
        return during, info, waited, after, info_after

    during, info, waited, after, info_after = serve(model, cpu_args(), run)
    for status, body in during:
        assert status == 503 and "warming up" in body["error"]["message"]
    assert info["warmup_seconds"] is None and info["skip_warmup"] is False
    assert waited > DELAY_S / 2 and after == [200, 200]
    assert info_after["warmup_seconds"] >= DELAY_S
    state = info_after["internal_states"][0]  # the warm-up left nothing behind (/health_generate ran 1 step)
    assert state["num_running_reqs"] == state["num_waiting_reqs"] == 0
    assert state["num_steps"] == 1 and state["num_retractions"] == 0
    assert state["num_free_pages"] == 1024 // K.PAGE_SIZE and info_after["weight_version"] == "default"


def test_a_request_sent_during_the_warm_up_waits_and_gets_the_bits_of_a_server_without_one(model, monkeypatch):
    monkeypatch.setenv(WARMUP_DELAY_ENV, str(DELAY_S))

    async def early(server, client):  # sent at once: queued behind the warm-up
        assert (await client.get("/health")).status == 503
        resp = await client.post("/generate", json=BODY)
        assert server.ready
        return resp.status, await resp.json()

    async def after(server, client):
        await _until_ready(client)
        resp = await client.post("/generate", json=BODY)
        return resp.status, await resp.json()

    got_early = serve(model, cpu_args(), early)
    got_after = serve(model, cpu_args(), after)
    monkeypatch.delenv(WARMUP_DELAY_ENV)

    async def skipped(server, client):
        assert (await client.get("/health")).status == 200  # no warm-up: ready at once
        info = await (await client.get("/get_server_info")).json()
        assert info["warmup_seconds"] is None and info["skip_warmup"] is True
        resp = await client.post("/generate", json=BODY)
        return resp.status, await resp.json()

    want = serve(model, cpu_args(skip_warmup=True), skipped)
    for status, reply in (got_early, got_after, want):
        assert status == 200 and len(reply["output_ids"]) == 6
    for status, reply in (got_early, got_after):
        assert reply["output_ids"] == want[1]["output_ids"]
        assert reply["meta_info"]["output_token_logprobs"] == want[1]["meta_info"]["output_token_logprobs"]


def test_engine_warm_up_leaves_the_engine_as_new(model):
    tok = ByteTokenizer(512)
    with K.use_backend("reference"):
        warmed = Engine(model, tok, EngineConfig(max_total_tokens=256, poison_kv_cache=True, chunked_prefill_size=32))
        fresh = Engine(model, tok, EngineConfig(max_total_tokens=256, poison_kv_cache=True, chunked_prefill_size=32))
        assert warmed.warm_up((7, 1000)) == 0  # 1000: cut to what the cache holds, prefilled in chunks
        assert warmed.num_steps == 0 and not warmed.requests and not warmed.has_work()
        assert warmed.kv._free == fresh.kv._free
        assert all(torch.isnan(t).all() for layer in warmed.kv.layers for t in layer)  # refilled as new
        # no seed given: the engine's seed draw was not touched either
        params = [SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True),
                  SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True, seed=4)]
        prompts = [[5, 6, 7], list(range(40))]
        a, b = warmed.generate(prompts, params), fresh.generate(prompts, params)
    assert [(r.output_ids, r.output_logprobs) for r in a] == [(r.output_ids, r.output_logprobs) for r in b]
    assert warmed.num_steps == fresh.num_steps


def test_warm_up_refuses_a_busy_engine(model):
    engine = Engine(model, ByteTokenizer(512), EngineConfig(max_total_tokens=256))
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        engine.warm_up((7,))


def test_server_argv_passes_skip_warmup_as_a_bare_flag():
    assert "--skip-warmup" not in server_argv(ServerArgs())
    argv = server_argv(ServerArgs(skip_warmup=True))
    assert "--skip-warmup" in argv and "True" not in argv and "False" not in argv


def test_the_launcher_waits_through_the_503s_of_the_warm_up(free_ports):
    """``start_servers`` (what ``rlperf serve --router N`` waits with) returns only once /health is 200."""
    (port,) = free_ports(1)
    args = ServerArgs(kernel_backend="reference", device="cpu", num_threads=1, port=port, max_total_tokens=1024)
    env = {**R.child_env(None, None), "OMP_NUM_THREADS": "1", WARMUP_DELAY_ENV: "3"}
    env.pop("TRITON_INTERPRET", None)
    procs, urls = R.start_servers(args, 1, env=env, timeout=90)
    try:
        status, info = R.http_json(urls[0] + "/get_server_info")
        assert R.http_json(urls[0] + "/health")[0] == 200
        assert status == 200 and info["warmup_seconds"] >= 3
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


@pytest.mark.gpu
def test_gpu_warm_up_captures_every_graph_and_changes_no_bits():
    """Triton kernels, bf16, CUDA graphs up to 64: after ``warm_up`` every bucket is captured, and
    requests of several batch sizes get the bits of an engine that was never warmed up."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from rlperf.rollout.server import WARMUP_PROMPT_LENGTHS

    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0, dtype=torch.bfloat16, device="cuda")
    tok = ByteTokenizer(512)
    cfg = EngineConfig(max_total_tokens=1 << 15, cuda_graph_max_bs=64)
    with K.use_backend("triton"):
        warmed, cold = Engine(model, tok, cfg), Engine(model, tok, cfg)
        t0 = time.perf_counter()
        captured = warmed.warm_up(WARMUP_PROMPT_LENGTHS)
        seconds = time.perf_counter() - t0
        assert captured == len(warmed.graphs.buckets)
        assert set(warmed.graphs.graphs) == {(K.mode(), bs, True) for bs in warmed.graphs.buckets}
        assert warmed.num_steps == 0 and warmed.kv.num_free_pages == warmed.kv.num_pages
        gen = torch.Generator().manual_seed(0)
        for batch in (1, 3, 17, 64):
            prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
                       for n in torch.randint(3, 300, (batch,), generator=gen)]
            params = [SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, seed=i) for i in range(batch)]
            a, b = warmed.generate(prompts, params), cold.generate(prompts, params)
            assert [(r.output_ids, r.output_logprobs) for r in a] == [(r.output_ids, r.output_logprobs) for r in b]
        t0 = time.perf_counter()
        warmed.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, seed=0))
        first_after = time.perf_counter() - t0
    print(f"warm-up {seconds:.2f} s ({captured} graphs); first request after it {first_after * 1e3:.1f} ms")
