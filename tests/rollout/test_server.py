"""`rlperf serve` over real HTTP: two servers on the tiny model behind the real sglang-router.

The servers run in subprocesses (reference kernels, float32, one thread each) with a KV cache of
4 pages, so the concurrent test forces preemption. Expected tokens and log-probs come from an
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

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.args import ServerArgs
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.router import http_json
from rlperf.rollout.tokenizer import ByteTokenizer
from rlperf.loop.clients import push_weights
from rlperf.sync import SyncConfig, bucket_payload, flatten_buckets

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
KV_TOKENS = 4 * K.PAGE_SIZE


@pytest.fixture(scope="module")
def cluster(launch_router_cluster):
    args = ServerArgs(model_path="tiny", kernel_backend="reference", max_total_tokens=KV_TOKENS, chunked_prefill_size=64,
                      api_key=KEY, num_threads=1, device="cpu")
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
    """POST a streamed /generate; (Content-Type, the decoded events: JSON chunks, then the string "[DONE]")."""
    req = urllib.request.Request(url + "/generate", data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
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
    status, body = http_json(cluster.router_url + "/workers")
    assert status == 200 and {w["url"] for w in body["workers"]} == set(cluster.worker_urls)
    for url in cluster.worker_urls:
        for path in ("/model_info", "/get_model_info"):
            s, info = http_json(url + path)
            assert s == 200 and info["is_generation"] and info["model_path"] == "tiny"
        s, info = http_json(url + "/get_server_info")
        assert s == 200 and info["max_total_num_tokens"] == KV_TOKENS and "api_key" not in info
        assert http_json(url + "/health_generate")[0] == 200


def test_generate_single_and_batched_with_logprobs(cluster, model):
    tok = ByteTokenizer(512)
    status, one = http_json(cluster.router_url + "/generate",
                            {"text": "hello rollout", "sampling_params": _sp(12, 5), "return_logprob": True})
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
                              {"input_ids": prompts, "sampling_params": _sp(5, 1), "return_logprob": True})
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
    status, whole = http_json(url + "/generate", body)
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
    status, whole = http_json(cluster.router_url + "/generate", body)
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
                 {"Content-Type": "application/json"})
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
                          {"input_ids": prompt, "sampling_params": _sp(16, 9, temperature=0.7), "return_logprob": True})
    assert status == 200
    seq = prompt + r["output_ids"]
    with K.use_backend("reference"), torch.no_grad():
        logits = model.logits(model.forward_packed(torch.tensor(seq), torch.arange(len(seq)),
                                                   torch.tensor([0, len(seq)], dtype=torch.int32)))
        train = K.token_logprobs(logits[len(prompt) - 1:-1], torch.tensor(r["output_ids"]), 0.7)
    assert torch.equal(torch.tensor(_got(r)[1], dtype=torch.float32), train)


def test_64_concurrent_requests_with_preemption_match_the_roomy_engine(cluster, model):
    g = torch.Generator().manual_seed(0)
    P = K.PAGE_SIZE  # prompts of P/2 .. 3P/2 tokens plus 24 new ones: many requests cross a page while decoding
    prompts = [torch.randint(0, 256, (int(torch.randint(P // 2, P + P // 2, (1,), generator=g)),), generator=g).tolist()
               for _ in range(64)]
    params = [_sp(24, 1000 + i, top_p=0.95) for i in range(64)]

    def one(i):
        return http_json(cluster.router_url + "/generate", {"input_ids": prompts[i], "sampling_params": params[i],
                                                            "return_logprob": True}, timeout=120)

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
    status, _ = http_json(cluster.router_url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}})
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
        payload["transport"] = {"kind": "shm", "name": "rlperf-no-such-segment"}
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

    port, router_port = free_ports(2)
    while port + 1 == router_port:
        port, router_port = free_ports(2)
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
        assert "sglang-router at" in line, line
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
