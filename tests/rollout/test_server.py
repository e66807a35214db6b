"""`rlperf serve` over real HTTP: two servers on the tiny model behind the real sglang-router.

The servers run in subprocesses (reference kernels, float32, one thread each) with a KV cache of
4 pages, so the concurrent test forces preemption. They and the router have an API key: the router
asks for it on everything but health and info (``/generate`` too), a worker on its admin routes. Expected tokens and log-probs come from an
in-process engine over the same model with a roomy cache: equal lists mean the server path,
the router, batching with strangers and preemption changed nothing.
"""
import concurrent.futures
import gzip
import http.client
import json
import os
import re
import sys
import urllib.request
import uuid

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.args import ServerArgs
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.kv_cache import bytes_per_token
from rlperf.rollout.router import http_json
from rlperf.rollout.tokenizer import ByteTokenizer
from rlperf.loop.clients import push_weights
from rlperf.sync import SyncConfig, bucket_payload, flatten_buckets
from rlperf.telemetry.memory import system_memory_bytes

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
KV_TOKENS = 4 * K.PAGE_SIZE


@pytest.fixture(scope="module")
def cluster(launch_router_cluster, tmp_path_factory):
    # profile traces may go anywhere under pytest's base temporary directory (each test's tmp_path)
    args = ServerArgs(model_path="tiny", kernel_backend="reference", max_total_tokens=KV_TOKENS, chunked_prefill_size=64,
                      api_key=KEY, num_threads=1, device="cpu", profile_root=str(tmp_path_factory.getbasetemp()))
    with launch_router_cluster(args) as c:
        yield c


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM.random(preset("tiny"), seed=0)


def _expected(model, prompts, params):
    """Tokens and log-probs of an in-process engine with a roomy cache (reference backend)."""
    with K.use_backend("reference"):
        engine = Engine(model, ByteTokenizer(512), EngineConfig(max_total_tokens=1 << 14))
        reqs = engine.generate(prompts, params)
    return [(r.output_ids, r.output_logprobs) for r in reqs]


def _got(reply):
    m = reply["meta_info"]
    return reply["output_ids"], [lp for lp, _, _ in m["output_token_logprobs"]]


def _post_raw(url, data: bytes, headers=None):
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _sp(n, seed, **kw):
    return {"max_new_tokens": n, "sampling_seed": seed, "temperature": 1.0, "ignore_eos": True, **kw}


def _stream(url, body, timeout=60):
    """POST a streamed /generate; (Content-Type, the decoded events: JSON chunks, then the string "[DONE]").
    With the key: the router asks for it (a worker's /generate does not)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        ctype, raw = resp.headers.get("Content-Type", ""), resp.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(block[6:] if block == "data: [DONE]" else json.loads(block[6:]))
    return ctype, events


def _check_cumulative(chunks):
    """Every chunk holds all tokens so far (SGLang's default streaming); only the last one has a finish_reason."""
    prev = []
    for c in chunks:
        m = c["meta_info"]
        assert c["output_ids"][:len(prev)] == prev and len(c["output_ids"]) > len(prev)
        assert m["completion_tokens"] == len(c["output_ids"]) and m["id"] == chunks[0]["meta_info"]["id"]
        if "output_token_logprobs" in m:
            assert [t for _, t, _ in m["output_token_logprobs"]] == c["output_ids"]
        assert (m["finish_reason"] is None) == (c is not chunks[-1])
        prev = c["output_ids"]


def _same_reply(a, b):
    """Equal replies but for the request id and the latency."""
    def strip(r):
        return {**r, "meta_info": {k: v for k, v in r["meta_info"].items() if k not in ("id", "e2e_latency")}}
    return strip(a) == strip(b)


def test_router_lists_both_workers(cluster):
    status, body = http_json(cluster.router_url + "/workers", headers=AUTH)
    assert status == 200 and {w["url"] for w in body["workers"]} == set(cluster.worker_urls)
    for url in cluster.worker_urls:
        for path in ("/model_info", "/get_model_info"):
            s, info = http_json(url + path)
            assert s == 200 and info["is_generation"] and info["model_path"] == "tiny"
        s, info = http_json(url + "/get_server_info")
        assert s == 200 and info["max_total_num_tokens"] == KV_TOKENS and "api_key" not in info
        assert http_json(url + "/health_generate")[0] == 200
        # the engine's memory (rlperf's key beside SGLang's): the KV pools of every layer, inside the resident set
        mem = http_json(url + "/get_server_info")[1]["internal_states"][0]["memory"]
        assert (mem["kind"], mem["device"], mem["reserved_bytes"]) == ("cpu_rss", "cpu", None)
        assert mem["kv_pool_bytes"] == bytes_per_token(preset("tiny"), torch.float32) * KV_TOKENS
        assert mem["kv_pool_bytes"] < mem["current_bytes"] <= mem["peak_bytes"] < mem["capacity_bytes"]
        assert mem["capacity_bytes"] == system_memory_bytes()
        # no CUDA graphs on CPU: no failed capture to report
        assert http_json(url + "/get_server_info")[1]["internal_states"][0]["cuda_graph_failures"] == []


def test_generate_single_and_batched_with_logprobs(cluster, model):
    tok = ByteTokenizer(512)
    status, one = http_json(cluster.router_url + "/generate",
                            {"text": "hello rollout", "sampling_params": _sp(12, 5), "return_logprob": True}, headers=AUTH)
    assert status == 200, one
    m = one["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 12}
    assert m["prompt_tokens"] == len("hello rollout") and m["completion_tokens"] == 12
    assert m["weight_version"] == "default" and isinstance(one["text"], str)
    assert [t for _, t, _ in m["output_token_logprobs"]] == one["output_ids"]
    assert all(x is None for _, _, x in m["output_token_logprobs"])
    assert _got(one) == _expected(model, [tok.encode("hello rollout")], SamplingParams(max_new_tokens=12, seed=5, ignore_eos=True))[0]

    prompts = [[1, 2, 3], list(range(40, 110)), [7]]
    # sglang-router takes one sampling_params object for a batch; a server also takes one per prompt
    status, batch = http_json(cluster.router_url + "/generate",
                              {"input_ids": prompts, "sampling_params": _sp(5, 1), "return_logprob": True}, headers=AUTH)
    assert status == 200 and isinstance(batch, list) and len(batch) == 3, batch
    assert [_got(r) for r in batch] == _expected(model, prompts, SamplingParams.from_dict(_sp(5, 1)))
    params = [_sp(5, 1), _sp(9, 2, top_k=20), _sp(3, 3, temperature=0.0)]
    status, batch = http_json(cluster.worker_urls[0] + "/generate",
                              {"input_ids": prompts, "sampling_params": params, "return_logprob": True})
    assert status == 200 and isinstance(batch, list) and len(batch) == 3, batch
    expect = _expected(model, prompts, [SamplingParams.from_dict(p) for p in params])
    assert [_got(r) for r in batch] == expect
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [3, 70, 1]
    status, no_lp = http_json(cluster.worker_urls[1] + "/generate", {"input_ids": prompts[1], "sampling_params": params[1]})
    assert status == 200 and "output_token_logprobs" not in no_lp["meta_info"] and no_lp["output_ids"] == expect[1][0]


@pytest.mark.parametrize("via", ["router", "worker"])
def test_stream_sends_cumulative_chunks_ending_in_the_non_streamed_reply(cluster, model, via):
    url = cluster.router_url if via == "router" else cluster.worker_urls[0]
    body = {"text": "stream me", "sampling_params": _sp(20, 11, top_k=50), "return_logprob": True}
    status, whole = http_json(url + "/generate", body, headers=AUTH)
    assert status == 200, whole
    ctype, events = _stream(url, body)
    assert ctype.startswith("text/event-stream") and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1 and all("index" not in c for c in chunks)
    _check_cumulative(chunks)
    assert _same_reply(chunks[-1], whole) and "e2e_latency" in chunks[-1]["meta_info"]
    assert _got(chunks[-1]) == _expected(model, [ByteTokenizer(512).encode("stream me")],
                                         SamplingParams.from_dict(body["sampling_params"]))[0]
    _, events = _stream(url, {"input_ids": [5, 6, 7], "sampling_params": _sp(4, 2)})
    assert all("output_token_logprobs" not in c["meta_info"] for c in events[:-1])


def test_stream_of_a_batch_interleaves_chunks_with_their_index(cluster, model):
    prompts = [[1, 2, 3], list(range(40, 70)), [7]]
    body = {"input_ids": prompts, "sampling_params": _sp(6, 3), "return_logprob": True}
    status, whole = http_json(cluster.router_url + "/generate", body, headers=AUTH)
    assert status == 200 and len(whole) == 3, whole
    _, events = _stream(cluster.router_url, body)
    assert events[-1] == "[DONE]" and sorted({c["index"] for c in events[:-1]}) == [0, 1, 2]
    for i in range(3):
        chunks = [c for c in events[:-1] if c["index"] == i]
        _check_cumulative(chunks)
        assert _same_reply({k: v for k, v in chunks[-1].items() if k != "index"}, whole[i])
    assert [_got(r) for r in whole] == _expected(model, prompts, SamplingParams.from_dict(_sp(6, 3)))


def test_a_stream_whose_client_disconnects_is_aborted_and_others_are_unharmed(cluster, model):
    from rlperf.rollout.router import wait_until

    url = cluster.worker_urls[1]

    def in_engine():
        state = http_json(url + "/get_server_info")[1]["internal_states"][0]
        return state["num_running_reqs"] + state["num_waiting_reqs"]

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/generate", json.dumps({"input_ids": [1, 2, 3], "sampling_params": _sp(400, 5), "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")  # mid-stream now
    other = {"input_ids": [9, 8, 7], "sampling_params": _sp(30, 6), "return_logprob": True}
    # paused, nothing can finish by itself: the request that leaves the engine is the one aborted
    assert http_json(url + "/pause_generation", {"mode": "in_place"}, headers=AUTH)[0] == 200
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(http_json, url + "/generate", other)
            wait_until(lambda: in_engine() == 2, 10, "the second request to arrive")
            conn.close()  # the client hangs up mid-stream
            wait_until(lambda: in_engine() == 1, 10, "the abort of the disconnected stream")
            assert http_json(url + "/continue_generation", {}, headers=AUTH)[0] == 200
            status, reply = fut.result(timeout=60)
    finally:
        http_json(url + "/continue_generation", {}, headers=AUTH)
    assert status == 200 and _got(reply) == _expected(model, [other["input_ids"]], SamplingParams.from_dict(other["sampling_params"]))[0]
    wait_until(lambda: in_engine() == 0, 10, "an empty engine")
    _, events = _stream(url, {"input_ids": [4], "sampling_params": _sp(3, 1)})
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_a_stream_dropped_behind_the_router_is_aborted_on_the_worker(cluster):
    from rlperf.rollout.router import wait_until

    def states():
        return [http_json(u + "/get_server_info")[1]["internal_states"][0] for u in cluster.worker_urls]

    steps = sum(s["num_steps"] for s in states())
    host, port = cluster.router_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/generate", json.dumps({"input_ids": [1, 2, 3], "sampling_params": _sp(500, 5), "stream": True}),
                 {"Content-Type": "application/json", **AUTH})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    conn.close()  # sglang-router notices at its next write and drops its own connection to the worker
    wait_until(lambda: all(s["num_running_reqs"] + s["num_waiting_reqs"] == 0 for s in states()), 60, "an empty engine")
    assert sum(s["num_steps"] for s in states()) - steps < 250  # far from the 500 steps of a finished request


def test_v1_models_lists_the_served_model(cluster):
    for url in cluster.worker_urls:
        status, body = http_json(url + "/v1/models")
        assert status == 200 and body["object"] == "list", body
        (card,) = body["data"]
        assert card["id"] == card["root"] == "tiny" and card["object"] == "model" and card["owned_by"] == "rlperf"
        assert isinstance(card["created"], int) and card["max_model_len"] == 1024
    # sglang-router answers /v1/models itself from its workers' model path; sglang.bench_serving reads data[0].id
    status, body = http_json(cluster.router_url + "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny", body


def test_rollout_logprobs_equal_training_forward_through_the_router(cluster, model):
    prompt = list(range(100, 150))
    status, r = http_json(cluster.router_url + "/generate",
                          {"input_ids": prompt, "sampling_params": _sp(16, 9, temperature=0.7), "return_logprob": True},
                          headers=AUTH)
    assert status == 200
    seq = prompt + r["output_ids"]
    with K.use_backend("reference"), torch.no_grad():
        hidden = model.forward_packed(torch.tensor(seq), torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32))
        train = K.fused_logprob(hidden[len(prompt) - 1:-1], model.head_weight, torch.tensor(r["output_ids"]), 0.7)
    assert torch.equal(torch.tensor(_got(r)[1], dtype=torch.float32), train)


def test_64_concurrent_requests_with_preemption_match_the_roomy_engine(cluster, model):
    g = torch.Generator().manual_seed(0)
    P = K.PAGE_SIZE  # prompts of P/2 .. 3P/2 tokens plus 24 new ones: many requests cross a page while decoding
    prompts = [torch.randint(0, 256, (int(torch.randint(P // 2, P + P // 2, (1,), generator=g)),), generator=g).tolist()
               for _ in range(64)]
    params = [_sp(24, 1000 + i, top_p=0.95) for i in range(64)]

    def one(i):
        return http_json(cluster.router_url + "/generate", {"input_ids": prompts[i], "sampling_params": params[i],
                                                            "return_logprob": True}, timeout=120, headers=AUTH)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(one, range(64)))
    assert all(s == 200 for s, _ in replies), [r for s, r in replies if s != 200][:2]
    expect = _expected(model, prompts, [SamplingParams.from_dict(p) for p in params])
    assert [_got(r) for _, r in replies] == expect
    retractions = sum(http_json(u + "/get_server_info")[1]["internal_states"][0]["num_retractions"] for u in cluster.worker_urls)
    assert retractions > 0  # 4 KV pages per server for ~32 requests of ~P tokens each: preemption happened


@pytest.mark.parametrize("body, message", [
    (b"{not json", "malformed JSON"),
    (b"", "empty"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"text": 5}).encode(), "'text' must be"),
    (json.dumps({"text": "a", "input_ids": [1]}).encode(), "exactly one"),
    (json.dumps({"input_ids": [1, "2"]}).encode(), "integers"),
    (json.dumps({"input_ids": [1, 600]}).encode(), "in [0, 512)"),
    (json.dumps({"text": "a", "sampling_params": "x"}).encode(), "'sampling_params' must be an object"),
    (json.dumps({"text": "a", "return_logprob": "yes"}).encode(), "'return_logprob' must be a boolean"),
    (json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -1}}).encode(), "max_new_tokens=-1"),
    (json.dumps({"text": "a", "sampling_params": {"temperature": "hot"}}).encode(), "temperature must be a number"),
    (json.dumps({"input_ids": list(range(256)) * 4}).encode(), "context length is 1024"),
    (json.dumps({"input_ids": [[1], [2]], "sampling_params": [{}]}).encode(), "1 entries for 2 prompts"),
    (json.dumps({"text": "a", "stream": "yes"}).encode(), "'stream' must be a boolean"),
    (json.dumps({"input_ids": [1, 600], "stream": True}).encode(), "in [0, 512)"),  # a 400, before any event
])
def test_bad_generate_requests_get_400_and_the_server_keeps_serving(cluster, body, message):
    url = cluster.worker_urls[0]
    status, reply = _post_raw(url + "/generate", body)
    assert status == 400 and message in reply["error"]["message"], reply
    status, ok = http_json(url + "/generate", {"input_ids": [1, 2], "sampling_params": _sp(2, 1)})
    assert status == 200 and len(ok["output_ids"]) == 2


def test_router_passes_client_errors_through(cluster):
    status, _ = http_json(cluster.router_url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}},
                          headers=AUTH)
    assert 400 <= status < 500


def test_admin_endpoints_need_the_api_key(cluster):
    url = cluster.worker_urls[0]
    status, reply = http_json(url + "/flush_cache", {})
    assert status == 401 and "API key" in reply["error"]["message"]
    assert http_json(url + "/flush_cache", {}, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert http_json(url + "/flush_cache", {}, headers=AUTH)[0] == 200


def test_pause_continue_and_abort(cluster):
    url = cluster.worker_urls[1]
    assert http_json(url + "/pause_generation", {"mode": "in_place"}, headers=AUTH)[0] == 200
    assert http_json(url + "/health_generate", timeout=5)[0] == 503  # answers at once: it cannot generate now
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(http_json, url + "/generate", {"input_ids": [5, 6], "sampling_params": _sp(4, 1), "rid": "held"})
        dropped = pool.submit(http_json, url + "/generate", {"input_ids": [5, 6], "sampling_params": _sp(4, 1), "rid": "gone"})
        with pytest.raises(concurrent.futures.TimeoutError):
            held.result(timeout=1.0)  # paused: nothing is generated
        s, r = http_json(url + "/abort_request", {"rid": "gone"}, headers=AUTH)
        assert s == 200 and r["num_aborted"] == 1
        status, reply = dropped.result(timeout=10)
        assert status == 200 and reply["meta_info"]["finish_reason"]["type"] == "abort"
        s, r = http_json(url + "/flush_cache", {}, headers=AUTH)
        assert s == 400 and "running" in r["error"]["message"]  # a request is still waiting
        assert http_json(url + "/continue_generation", {}, headers=AUTH)[0] == 200
        status, reply = held.result(timeout=30)
        assert status == 200 and reply["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert http_json(url + "/abort_request", {}, headers=AUTH)[0] == 400
    assert http_json(url + "/pause_generation", {"mode": "sideways"}, headers=AUTH)[0] == 400


def test_pause_with_retract_then_continue_gives_the_same_tokens(cluster, model):
    from rlperf.rollout.router import wait_until

    url = cluster.worker_urls[0]
    prompt, sp = list(range(30, 90)), _sp(150, 77)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http_json, url + "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True})
        wait_until(lambda: http_json(url + "/get_server_info")[1]["internal_states"][0]["num_running_reqs"] == 1, 10,
                   "the request to start")
        assert http_json(url + "/pause_generation", {"mode": "retract"}, headers=AUTH)[0] == 200
        state = http_json(url + "/get_server_info")[1]["internal_states"][0]
        assert state["paused"] and state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1
        assert http_json(url + "/continue_generation", {}, headers=AUTH)[0] == 200
        status, reply = fut.result(timeout=60)
    assert status == 200 and _got(reply) == _expected(model, [prompt], SamplingParams.from_dict(sp))[0]


def test_a_client_that_hangs_up_has_its_request_aborted(cluster):
    from rlperf.rollout.router import wait_until

    url = cluster.worker_urls[1]
    assert http_json(url + "/pause_generation", {"mode": "in_place"}, headers=AUTH)[0] == 200
    try:
        with pytest.raises(OSError):  # urllib's timeout: the client gives up and closes the connection
            http_json(url + "/generate", {"input_ids": [1, 2], "sampling_params": _sp(4, 1)}, timeout=0.5)

        def queue_empty():
            state = http_json(url + "/get_server_info")[1]["internal_states"][0]
            return state["num_waiting_reqs"] == 0 and state["num_running_reqs"] == 0
        wait_until(queue_empty, 10, "abort of a disconnected request")
    finally:
        assert http_json(url + "/continue_generation", {}, headers=AUTH)[0] == 200


def test_start_and_stop_profile_write_an_sglang_named_trace(cluster, tmp_path):
    url = cluster.worker_urls[0]
    s, r = http_json(url + "/start_profile", {"output_dir": str(tmp_path), "activities": ["CPU"], "record_shapes": True},
                     headers=AUTH)
    assert s == 200, r
    assert http_json(url + "/start_profile", {"output_dir": str(tmp_path)}, headers=AUTH)[0] == 400  # one at a time
    assert http_json(url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": _sp(3, 1)})[0] == 200
    s, r = http_json(url + "/stop_profile", {}, headers=AUTH)
    assert s == 200, r
    (trace,) = list(tmp_path.iterdir())
    assert re.fullmatch(r"\d+(\.\d+)?-TP-0\.trace\.json\.gz", trace.name) and str(trace) == r["trace_path"]
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert http_json(url + "/stop_profile", {}, headers=AUTH)[0] == 400  # nothing running now
    assert http_json(url + "/start_profile", {"num_steps": "two"}, headers=AUTH)[0] == 400


def test_profile_endpoints_take_get_as_sglang_does(cluster, tmp_path):
    url = cluster.worker_urls[0]
    assert http_json(url + "/stop_profile")[0] == 401  # GET, and still behind the API key
    status, reply = http_json(url + "/stop_profile", headers=AUTH)
    assert status == 400 and "profil" in reply["error"]["message"]  # nothing to stop (was 405 Method Not Allowed)
    assert http_json(url + "/start_profile", {"output_dir": str(tmp_path), "activities": ["CPU"]}, headers=AUTH)[0] == 200
    assert http_json(url + "/generate", {"input_ids": [1, 2], "sampling_params": _sp(2, 1)})[0] == 200
    status, reply = http_json(url + "/stop_profile", headers=AUTH)
    assert status == 200 and os.path.exists(reply["trace_path"]), reply


def test_profile_with_num_steps_stops_by_itself(cluster, tmp_path):
    from rlperf.rollout.router import wait_until

    url = cluster.worker_urls[0]
    s, r = http_json(url + "/start_profile", {"output_dir": str(tmp_path), "num_steps": 3, "activities": ["CPU"],
                                              "profile_id": "run7"}, headers=AUTH)
    assert s == 200 and r["trace_path"].endswith("run7-TP-0.trace.json.gz")
    assert http_json(url + "/generate", {"input_ids": [4, 5], "sampling_params": _sp(6, 1)})[0] == 200
    wait_until(lambda: (tmp_path / "run7-TP-0.trace.json.gz").exists(), 10, "a trace after 3 steps")
    assert http_json(url + "/stop_profile", {}, headers=AUTH)[0] == 400  # it already stopped


def _update(url, payload, version=None):
    body = {"load_format": "flattened_bucket", "serialized_named_tensors": [payload]}
    if version is not None:
        body["weight_version"] = version
    return http_json(url + "/update_weights_from_tensor", body, headers=AUTH)


def _push(url, named, version, transport):
    n = push_weights(url, named, config=SyncConfig(transport=transport, bucket_bytes=64 * 1024), weight_version=version,
                     api_key=KEY)
    assert n > 1  # several buckets, so a multi-request update is exercised


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_weight_update_through_flattened_buckets(cluster, model, transport):
    url = cluster.worker_urls[0]
    new = Qwen3ForCausalLM.random(preset("tiny"), seed=1)
    prompt, sp = [3, 1, 4, 1, 5], _sp(10, 2)
    before = _got(http_json(url + "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True})[1])
    assert before == _expected(model, [prompt], SamplingParams.from_dict(sp))[0]
    try:
        _push(url, new.hf_state_dict(), "v2", transport)
        s, r = http_json(url + "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True})
        assert s == 200 and r["meta_info"]["weight_version"] == "v2"
        assert _got(r) == _expected(new, [prompt], SamplingParams.from_dict(sp))[0] != before
    finally:
        _push(url, model.hf_state_dict(), "default", "inline")
    assert _got(http_json(url + "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True})[1]) == before


def _corrupt(kind):
    named = {"model.norm.weight": torch.full((64,), 3.0), "model.layers.0.input_layernorm.weight": torch.full((64,), 2.0)}
    (bucket,) = flatten_buckets(named)
    payload, _ = bucket_payload(bucket, "inline")
    desc, data = payload["description"], payload["transport"]
    if kind == "nbytes":
        desc["nbytes"] += 16
    elif kind == "range":
        desc["tensors"][1]["end_idx"] += 4
    elif kind == "overlap":
        desc["tensors"][1]["start_idx"], desc["tensors"][1]["end_idx"] = 0, 256
    elif kind == "checksum":
        raw = bytearray(__import__("base64").b64decode(data["data"]))
        raw[5] ^= 1
        data["data"] = __import__("base64").b64encode(bytes(raw)).decode()
    elif kind == "name":
        desc["tensors"][0]["name"] = "model.not_a_weight"
    elif kind == "shape":
        desc["tensors"][0]["shape"] = [8, 8]
    elif kind == "dtype":
        desc["tensors"][0]["dtype"] = "pickle"
    elif kind == "base64":
        data["data"] = "%%%not base64%%%"
    elif kind == "transport":
        payload["transport"] = {"kind": "pickle", "data": ""}
    elif kind == "shm":
        # rlperf's form, a name no process holds: this pid and 64 fresh random bits (a fixed name fails
        # with another error whenever some other process on the machine holds that segment)
        payload["transport"] = {"kind": "shm", "name": f"rlperf_bucket_{os.getpid()}_{uuid.uuid4().hex[:16]}"}
    return payload


@pytest.mark.parametrize("kind, message", [
    ("nbytes", "bytes but the buffer has"), ("range", "do not hold"), ("overlap", "overlaps"),
    ("checksum", "checksum mismatch"), ("name", "no destination"), ("shape", "has shape"),
    ("dtype", "unknown dtype"), ("base64", "base64"), ("transport", "transport.kind"), ("shm", "cannot be opened"),
])
def test_bad_bucket_gets_400_and_changes_nothing(cluster, model, kind, message):
    url = cluster.worker_urls[1]
    status, reply = _update(url, _corrupt(kind), "bad")
    assert status == 400 and message in reply["error"]["message"], reply
    prompt, sp = [9, 9, 9], _sp(6, 4)
    s, r = http_json(url + "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True})
    assert s == 200 and r["meta_info"]["weight_version"] == "default"
    assert _got(r) == _expected(model, [prompt], SamplingParams.from_dict(sp))[0]


def test_push_weights_reports_a_refused_bucket(cluster):
    bad = {"model.norm.weight": torch.ones(7)}
    with pytest.raises(RuntimeError, match=r"bucket 1/1 refused \(400\).*has shape"):
        push_weights(cluster.worker_urls[1], bad, api_key=KEY)
    with pytest.raises(RuntimeError, match=r"\(401\)"):
        push_weights(cluster.worker_urls[1], bad)


def test_update_weights_rejects_other_load_formats(cluster):
    status, reply = http_json(cluster.worker_urls[0] + "/update_weights_from_tensor",
                              {"load_format": None, "serialized_named_tensors": ["gASV"]}, headers=AUTH)
    assert status == 400 and "flattened_bucket" in reply["error"]["message"]


def test_cli_serve_router_starts_and_stops_the_cluster(tmp_path, free_ports):
    import signal
    import subprocess

    port, _, router_port = free_ports(3, consecutive=True)  # the servers take port and port + 1
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "rlperf", "serve", "--router", "2", "--port", str(port),
                             "--router-port", str(router_port), "--kernel-backend", "reference", "--device", "cpu",
                             "--num-threads", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    router = f"http://127.0.0.1:{router_port}"
    workers = {f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the CLI says when the cluster is up
            line = pool.submit(proc.stdout.readline).result(timeout=120).decode()
        if "sglang-router at" not in line:  # its first line names what failed; the rest quotes its output
            proc.terminate()
            pytest.fail(line + proc.communicate(timeout=30)[0].decode(errors="replace"))
        s, body = http_json(router + "/workers")
        assert s == 200 and {w["url"] for w in body["workers"]} == workers
        s, r = http_json(router + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert s == 200 and r["meta_info"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    assert proc.returncode == 0 and "Traceback" not in out, out
    for url in workers:  # the servers went down with it
        with pytest.raises(OSError):
            urllib.request.urlopen(url + "/health", timeout=2)


# ---- a careless or hostile client (issue #12, "Server"); in-process variants: test_server_hostile.py ----

def _nested(depth):
    return "[" * depth + "]" * depth


# every one is a client error: 4xx with a message, and the server serves the next request
MALFORMED_GENERATE = [
    # not JSON, or not an object
    (b"null", "must be a JSON object, got NoneType"), (b"42", "got int"), (b'"hello"', "got str"),
    (b"[]", "got list"), (b"   ", "empty"), (b"{", "malformed JSON"), (b'{"text": "a",}', "malformed JSON"),
    (b"{'text': 'a'}", "malformed JSON"), (b'{"text": "a"} trailing', "malformed JSON"),
    (b'{"text": "a"}{"text": "b"}', "malformed JSON"), (b'\xff\xfe{"text": "a"}', "not UTF-8"),
    (b'\xef\xbb\xbf{"text": "a"}', "malformed JSON"), (b'{"text": "\xc3"}', "not UTF-8"),
    (b'{"text": "a", "sampling_params": {"temperature": NaN}}', "NaN is not JSON"),
    (b'{"input_ids": [1, Infinity]}', "Infinity is not JSON"),
    (b'{"input_ids": [' + b"7" * 5000 + b"]}", "malformed JSON"),  # an integer over Python's 4300 digits
    (b'{"text": "a", "x": ' + _nested(100_000).encode() + b"}", "nests too deeply"),
    (b'{"text": "a", "x": ' + _nested(40).encode() + b"}", "deeper than 32 levels"),
    (b'{"text": "\\ud800"}', "lone surrogate"), (b'{"input_ids": [1], "rid": "\\udc00x"}', "lone surrogate"),
    (b'{"text": "a", "\\ud83d": 1}', "lone surrogate"),
    # missing or doubled fields
    ({}, "exactly one of 'text' and 'input_ids'"), ({"sampling_params": {}}, "exactly one"),
    ({"text": None}, "exactly one"), ({"text": "a", "input_ids": [1]}, "exactly one"),
    # wrong types per field
    ({"text": 5}, "'text' must be"), ({"text": 1.5}, "'text' must be"), ({"text": True}, "'text' must be"),
    ({"text": {}}, "'text' must be"), ({"text": []}, "'text' must be"), ({"text": [1]}, "'text' must be"),
    ({"text": ["a", None]}, "'text' must be"), ({"text": [["a"]]}, "'text' must be"), ({"text": ""}, "non-empty"),
    ({"input_ids": "12"}, "'input_ids' must be"), ({"input_ids": 5}, "'input_ids' must be"),
    ({"input_ids": {}}, "'input_ids' must be"), ({"input_ids": []}, "non-empty lists of integers"),
    ({"input_ids": [[]]}, "non-empty lists of integers"), ({"input_ids": [1, None]}, "lists of integers"),
    ({"input_ids": [1, 2.5]}, "lists of integers"), ({"input_ids": [1, True]}, "lists of integers"),
    ({"input_ids": [[1], [2, [3]]]}, "lists of integers"), ({"input_ids": [[[1]]]}, "lists of integers"),
    ({"input_ids": [-1]}, "in [0, 512)"), ({"input_ids": [512]}, "in [0, 512)"),
    ({"input_ids": [[1], [600]]}, "in [0, 512)"), ({"input_ids": [10 ** 300]}, "in [0, 512)"),
    ({"input_ids": list(range(256)) * 4}, "context length is 1024"),
    ({"text": "a", "sampling_params": "x"}, "'sampling_params' must be an object"),
    ({"text": "a", "sampling_params": 5}, "'sampling_params' must be an object"),
    ({"text": "a", "sampling_params": [{}]}, "'sampling_params' must be an object"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 entries for 2 prompts"),
    ({"input_ids": [[1], [2]], "return_logprob": [True]}, "1 entries for 2 prompts"),
    ({"text": "a", "return_logprob": "yes"}, "'return_logprob' must be a boolean"),
    ({"text": "a", "return_logprob": 1}, "'return_logprob' must be a boolean"),
    ({"text": "a", "return_logprob": [True]}, "'return_logprob' must be a boolean"),
    ({"text": "a", "rid": 5}, "'rid' must be a string"), ({"text": "a", "rid": ["r"]}, "'rid' must be a string"),
    ({"input_ids": [[1], [2]], "rid": ["r"]}, "'rid' must be a string"),
    ({"input_ids": [[1], [2]], "rid": ["same", "same"]}, "already in flight"),
    ({"text": "a", "stream": "yes"}, "'stream' must be a boolean"),
    ({"text": "a", "stream": 1}, "'stream' must be a boolean"),
    ({"input_ids": [1, 600], "stream": True}, "in [0, 512)"),  # a 400, before any event
    # sampling_params, field by field
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens=-1"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens must be an integer"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens must be an integer"),
    ({"text": "a", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens must be an integer"),
    ({"text": "a", "sampling_params": {"max_new_tokens": [3]}}, "max_new_tokens must be an integer"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -10 ** 400}}, "is outside"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature must be a number"),
    ({"text": "a", "sampling_params": {"temperature": -0.5}}, "temperature=-0.5 is outside"),
    ({"text": "a", "sampling_params": {"temperature": [1]}}, "temperature must be a number"),
    ({"text": "a", "sampling_params": {"temperature": 1e300}}, "finite as a float32"),  # inf in float32
    ({"text": "a", "sampling_params": {"temperature": 10 ** 400}}, "not finite as a float"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p=0.0 is outside"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p=1.5 is outside"),
    ({"text": "a", "sampling_params": {"top_p": 1e-300}}, "> 0 as a float32"),  # 0 in float32
    ({"text": "a", "sampling_params": {"top_p": "0.9"}}, "top_p must be a number"),
    ({"text": "a", "sampling_params": {"top_k": -2}}, "top_k=-2 is outside"),
    ({"text": "a", "sampling_params": {"top_k": 1.5}}, "top_k must be an integer"),
    ({"text": "a", "sampling_params": {"top_k": 2 ** 31}}, "top_k must be an integer in [-1, 2147483647]"),
    ({"text": "a", "sampling_params": {"top_k": 2 ** 63}}, "top_k must be an integer in [-1, 2147483647]"),
    ({"text": "a", "sampling_params": {"top_k": 10 ** 400}}, "top_k must be an integer in [-1, 2147483647]"),
    ({"text": "a", "sampling_params": {"sampling_seed": 2 ** 64}}, "seed=18446744073709551616 is outside"),
    ({"text": "a", "sampling_params": {"seed": 10 ** 400}}, "seed=an integer of 401 digits is outside"),
    ({"text": "a", "sampling_params": {"seed": "s"}}, "seed must be an integer"),
    ({"text": "a", "sampling_params": {"stop": 5}}, "stop must be"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "stop must be"),
    ({"text": "a", "sampling_params": {"stop": [1]}}, "stop must be"),
    ({"text": "a", "sampling_params": {"stop": [["a"]]}}, "stop must be"),
    ({"text": "a", "sampling_params": {"stop_token_ids": "1"}}, "stop_token_ids must be"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [1.5]}}, "stop_token_ids must be"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [True]}}, "stop_token_ids must be"),
    ({"text": "a", "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos must be a boolean"),
    ({"text": "a", "sampling_params": {"no_stop_trim": 0}}, "no_stop_trim must be a boolean"),
    ({"text": "a", "sampling_params": {"skip_special_tokens": "no"}}, "skip_special_tokens must be a boolean"),
    ({"text": "a", "sampling_params": {"foo": 1}}, "unsupported keys ['foo']"),
    ({"text": "a", "sampling_params": {"n": 2}}, "sampling_params.n=2 is not supported"),
    ({"text": "a", "sampling_params": {"min_p": 0.5}}, "min_p=0.5 is not supported"),
    ({"text": "a", "sampling_params": {"repetition_penalty": 2}}, "repetition_penalty=2 is not supported"),
    ({"text": "a", "sampling_params": {"n": 10 ** 400}}, "n=an integer of 401 digits is not supported"),
]


@pytest.mark.parametrize("body, message", MALFORMED_GENERATE,
                         ids=[f"{i}-{m[:30]}" for i, (_, m) in enumerate(MALFORMED_GENERATE)])
def test_malformed_generate_bodies_get_4xx_with_a_message_and_the_server_is_unharmed(cluster, body, message):
    url = cluster.worker_urls[0]
    status, reply = _post_raw(url + "/generate", body if isinstance(body, bytes) else json.dumps(body).encode())
    assert 400 <= status < 500 and message in reply["error"]["message"], (status, reply)
    assert reply["error"]["code"] == status
    status, ok = http_json(url + "/generate", {"input_ids": [1, 2], "sampling_params": _sp(2, 1)})
    assert status == 200 and len(ok["output_ids"]) == 2


def test_values_that_break_the_sampler_get_400_with_the_api_key_too(cluster):
    # the three: inf as a float32, 0 as a float32, an int64 overflow
    for bad in ({"temperature": 1e300}, {"top_p": 1e-300}, {"top_k": 2 ** 63}):
        body = {"input_ids": [1, 2], "sampling_params": {**_sp(2, 1), **bad}}
        for headers in ({}, AUTH):
            status, reply = http_json(cluster.worker_urls[1] + "/generate", body, headers=headers)
            assert status == 400 and next(iter(bad)) in reply["error"]["message"], reply
        # sglang-router 0.3 parses sampling_params in its own types first: top_k (i32) and top_p get 4xx, but a
        # temperature of 1e300 becomes f32 inf, which it forwards as null (the default, 1.0): never a 5xx or an abort
        status, reply = http_json(cluster.router_url + "/generate", body, headers=AUTH)
        assert 400 <= status < 500 or (status == 200 and reply["meta_info"]["finish_reason"]["type"] == "length"), reply


def test_other_client_errors_are_4xx_not_500(cluster, tmp_path):
    url = cluster.worker_urls[0]
    host, port = url.removeprefix("http://").split(":")
    # a non-UTF-8 Authorization header
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/flush_cache")
    conn.putheader("Authorization", b"Bearer \xff\xfe\x80")
    conn.putheader("Content-Length", "0")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 401 and "API key" in json.loads(resp.read())["error"]["message"]
    conn.close()
    # start_profile with an existing file as output_dir; GPU activities on a CPU server
    existing = tmp_path / "a-file"
    existing.write_text("")
    status, reply = http_json(url + "/start_profile", {"output_dir": str(existing), "activities": ["CPU"]}, headers=AUTH)
    assert status == 400 and "a-file" in reply["error"]["message"], reply
    if not torch.cuda.is_available():
        status, reply = http_json(url + "/start_profile", {"output_dir": str(tmp_path), "activities": ["GPU"]}, headers=AUTH)
        assert status == 400 and "GPU needs CUDA" in reply["error"]["message"], reply
    # profile output outside the profile root (pytest's base temporary directory here), or escaping it
    for body in ({"output_dir": "/etc/rlperf-test"}, {"output_dir": str(tmp_path), "profile_id": "../../../etc/x"},
                 {"output_dir": str(tmp_path / ".." / ".." / "..")}):
        status, reply = http_json(url + "/start_profile", {**body, "activities": ["CPU"]}, headers=AUTH)
        assert status == 400 and ("profile root" in reply["error"]["message"] or "plain name" in reply["error"]["message"])
    assert not os.path.exists("/etc/rlperf-test") and list(tmp_path.iterdir()) == [existing]
    assert http_json(url + "/stop_profile", {}, headers=AUTH)[0] == 400  # none of them started a profile
    # the admin routes' bodies are checked the same way
    for path, body in (("/abort_request", b'{"rid": "\\ud800"}'), ("/pause_generation", b"[1]"),
                       ("/update_weights_from_tensor", b'{"load_format": ' + _nested(50_000).encode() + b"}")):
        status, reply = _post_raw(url + path, body, AUTH)
        assert status == 400 and reply["error"]["message"], (path, reply)


def _raw_request(url, head: bytes) -> tuple[int, dict]:
    """Send a request head (no body) on a socket; the status and JSON reply."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s, s.makefile("rb") as f:
        s.sendall(head)
        status = int(f.readline().split()[1])
        headers = {}
        while (line := f.readline().strip()):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, json.loads(f.read(int(headers["content-length"])))


def test_a_50_mb_generate_body_is_refused_by_its_content_length_at_once(cluster):
    import time

    url = cluster.worker_urls[1]
    limit = http_json(url + "/get_server_info")[1]["max_generate_body_bytes"]
    assert limit == (1 << 20) + 64 * 1024  # 1 MiB + 64 bytes a token of the context length
    t0 = time.perf_counter()
    status, reply = _raw_request(url, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: 50000000\r\n\r\n")  # and not one byte of it
    assert status == 413 and time.perf_counter() - t0 < 2, reply
    assert f"/generate takes at most {limit} bytes" in reply["error"]["message"]
    # without a Content-Length (chunked), the reading stops at the limit
    req = urllib.request.Request(url + "/generate", data=iter([b'{"text": "', b"a" * (2 << 20), b'"}']), method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 413
    status, ok = http_json(url + "/generate", {"input_ids": [1, 2], "sampling_params": _sp(2, 1)})
    assert status == 200 and len(ok["output_ids"]) == 2


class _Unpickled:
    """Unpickling this creates the file ``path`` (pickle calls ``open(path, "w")``): proof of an unpickle."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickle_payloads(marker):
    import base64
    import pickle

    raw = pickle.dumps(_Unpickled(marker))
    b64 = base64.b64encode(raw).decode()
    named = {"model.norm.weight": torch.full((64,), 3.0)}
    (bucket,) = flatten_buckets(named)
    payload, _ = bucket_payload(bucket, "inline")
    payload["transport"]["data"] = base64.b64encode(raw.ljust(payload["description"]["nbytes"], b"\0")).decode()

    def weights(tensors, load_format="flattened_bucket"):
        return json.dumps({"load_format": load_format, "serialized_named_tensors": tensors}).encode()

    return {  # path, body: SGLang's pickled forms and others
        "sglang-default": ("/update_weights_from_tensor", weights([b64], None)),  # MultiprocessingSerializer, base64
        "sglang-direct": ("/update_weights_from_tensor", weights([b64], "direct")),
        "flattened-b64": ("/update_weights_from_tensor", weights([b64])),
        "flattened-str": ("/update_weights_from_tensor", weights(b64)),
        "latin1-string": ("/update_weights_from_tensor", weights([raw.decode("latin-1")])),
        "transport-pickle": ("/update_weights_from_tensor", weights([{"description": payload["description"],
                                                                      "transport": {"kind": "pickle", "data": b64}}])),
        "description-pickle": ("/update_weights_from_tensor",
                               weights([{"description": b64, "transport": payload["transport"]}])),
        "inline-bytes": ("/update_weights_from_tensor", weights([payload])),  # the pickle as a bucket's bytes
        "raw-body": ("/update_weights_from_tensor", raw),
        "raw-body-protocol-0": ("/update_weights_from_tensor", pickle.dumps(_Unpickled(marker), protocol=0)),
        "generate-raw-body": ("/generate", raw),
    }


def test_pickle_payloads_are_refused_and_never_unpickled(cluster, tmp_path):
    import pickle

    # the payloads are live: unpickling one here creates its marker
    control = tmp_path / "control"
    pickle.loads(_pickle_payloads(control)["raw-body"][1])
    assert control.exists()
    marker = tmp_path / "unpickled"
    payloads = _pickle_payloads(marker)
    assert len(payloads) >= 9
    for name, (path, body) in payloads.items():
        for url in cluster.worker_urls:
            status, reply = _post_raw(url + path, body, {**AUTH, "Content-Type": "application/octet-stream"})
            assert 400 <= status < 500 and reply["error"]["message"], (name, status, reply)
            assert not marker.exists(), name
    for url in cluster.worker_urls:  # and the weights are the ones they were
        assert http_json(url + "/get_weight_version")[1] == {"weight_version": "default"}


def test_router_concurrency_with_mid_flight_aborts_and_preemption_gives_the_bits_of_running_alone(cluster, model):
    """16 requests through the router into two 4-page KV caches; 4 of them aborted mid-flight. The
    other 12 get the tokens and log-probs they get alone (a roomy engine), bit for bit."""
    from rlperf.rollout.router import wait_until

    def states():
        return [http_json(u + "/get_server_info")[1]["internal_states"][0] for u in cluster.worker_urls]

    g = torch.Generator().manual_seed(5)
    P = K.PAGE_SIZE
    # Prompts of P-12 .. P-1 tokens: each request fills one page and crosses into a second within
    # 12 of its 24 new tokens. Whichever 8 requests the router sends a worker, the engine admits at
    # least three of them at once, and three requests that each need two pages while alive do not fit
    # a 4-page cache: preemption is certain, not a matter of arrival order.
    prompts = [torch.randint(0, 256, (int(torch.randint(P - 12, P, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    victims = {1, 6, 10, 13}
    params = [_sp(P + P // 2 if i in victims else 24, 700 + i, top_k=100) for i in range(16)]
    before = states()
    for url in cluster.worker_urls:  # paused: all 16 are in the engines before a step runs
        assert http_json(url + "/pause_generation", {"mode": "in_place"}, headers=AUTH)[0] == 200
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(http_json, cluster.router_url + "/generate",
                                   {"input_ids": prompts[i], "sampling_params": params[i], "return_logprob": True,
                                    "rid": f"rlperf-concurrency-{i}"}, 120, AUTH) for i in range(16)]
            wait_until(lambda: sum(s["num_running_reqs"] + s["num_waiting_reqs"] for s in states()) == 16, 30,
                       "16 requests in the engines")
            for url in cluster.worker_urls:
                assert http_json(url + "/continue_generation", {}, headers=AUTH)[0] == 200
            steps = sum(s["num_steps"] for s in states())
            wait_until(lambda: sum(s["num_steps"] for s in states()) >= steps + 20, 30, "20 steps")
            aborted = 0
            for i in sorted(victims):
                for url in cluster.worker_urls:
                    s, r = http_json(url + "/abort_request", {"rid": f"rlperf-concurrency-{i}"}, headers=AUTH)
                    assert s == 200, r
                    aborted += r["num_aborted"]
            replies = [f.result(timeout=120) for f in futures]
    finally:
        for url in cluster.worker_urls:
            http_json(url + "/continue_generation", {}, headers=AUTH)
    assert aborted == len(victims)
    assert all(s == 200 for s, _ in replies), [r for s, r in replies if s != 200][:2]
    for i in sorted(victims):
        m = replies[i][1]["meta_info"]
        assert m["finish_reason"]["type"] == "abort" and m["completion_tokens"] < params[i]["max_new_tokens"], m
    keep = [i for i in range(16) if i not in victims]
    expect = _expected(model, [prompts[i] for i in keep], [SamplingParams.from_dict(params[i]) for i in keep])
    assert [_got(replies[i][1]) for i in keep] == expect
    after = states()
    assert sum(a["num_retractions"] - b["num_retractions"] for a, b in zip(after, before)) > 0  # preemption happened
