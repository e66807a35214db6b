"""`rlperf serve` against a careless or hostile client (issue #12, "Server"), over real HTTP.

Each test runs a ``RolloutServer`` in this process behind aiohttp's test server (a real socket on
127.0.0.1), so a test can configure it (a small body limit, a profile root under ``tmp_path``) or
open a hole on purpose (validation switched off, so a value that breaks the sampler reaches it).
The cluster tests in test_server.py cover the same ground on real server processes.

* A request that makes an engine step fail fails alone, with an error; every other request in the
  batch goes on with exactly the tokens it gets alone.
* Bodies over their route's limit are refused (413) by Content-Length before they are read, and
  while reading when they come without one.
* Profile traces land only under the profile root; names cannot escape; links are never followed.
"""
import asyncio
import gzip
import json
import os
import socket
import time

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout import engine as engine_module
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.tokenizer import ByteTokenizer

pytest.importorskip("aiohttp")

from inprocess_server import cpu_args, serve  # noqa: E402

from rlperf.rollout.http_body import OTHER_BODY_BYTES, generate_body_limit  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM.random(preset("tiny"), seed=0)




async def _json(resp):
    return resp.status, await resp.json(content_type=None)


def _sp(n, seed, **kw):
    return {"max_new_tokens": n, "sampling_seed": seed, "temperature": 1.0, "ignore_eos": True, **kw}


def _alone(model, prompt, params):
    """(tokens, log-probs) of ``prompt`` run alone in an engine with a roomy cache."""
    with K.use_backend("reference"):
        engine = Engine(model, ByteTokenizer(512), EngineConfig(max_total_tokens=1 << 14))
        (r,) = engine.generate([prompt], SamplingParams.from_dict(params))
    return r.output_ids, r.output_logprobs


async def _wait_in_engine(client, n, timeout=30.0):
    deadline = time.time() + timeout
    while True:
        state = (await (await client.get("/get_server_info")).json())["internal_states"][0]
        if state["num_running_reqs"] + state["num_waiting_reqs"] == n:
            return
        assert time.time() < deadline, f"{n} requests never reached the engine: {state}"
        await asyncio.sleep(0.02)


# ---- 1. one request must not abort everyone ---------------------------------------------------------

# each passes a float64 range check but breaks the sampler in its own types (float32 inf, float32 0,
# int64 overflow): rlperf.rollout.sampling_params refuses them, which these tests switch off
BREAKS_THE_SAMPLER = [{"temperature": 1e300}, {"top_p": 1e-300}, {"top_k": 2 ** 63}]


def test_requests_that_break_a_step_fail_alone_and_the_batch_gets_its_own_bits(model, monkeypatch):
    monkeypatch.setattr(engine_module, "check_sampling_values", lambda *a, **k: None)  # the hole
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(torch.randint(5, 90, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    good = [{"input_ids": p, "sampling_params": _sp(20, 50 + i), "return_logprob": True} for i, p in enumerate(prompts)]
    bad = [{"input_ids": [7, 8, 9], "sampling_params": {**_sp(20, 90 + i), **b}, "return_logprob": True}
           for i, b in enumerate(BREAKS_THE_SAMPLER)]
    bodies = good[:2] + bad[:1] + good[2:4] + bad[1:] + good[4:]

    async def run(server, client):
        # paused, the requests all queue up and then share steps (and, in 4 KV pages, preempt each other)
        assert (await client.post("/pause_generation", json={"mode": "in_place"})).status == 200
        tasks = [asyncio.ensure_future(client.post("/generate", json=b)) for b in bodies]
        await _wait_in_engine(client, len(bodies))
        assert (await client.post("/continue_generation", json={})).status == 200
        replies = [await _json(await t) for t in tasks]
        stream = await client.post("/generate", json={**bad[0], "stream": True})
        events = (await stream.text()).split("\n\n")
        after = await _json(await client.post("/generate", json=good[0]))
        info = (await (await client.get("/get_server_info")).json())["internal_states"][0]
        health = (await client.get("/health_generate")).status
        return replies, (stream.status, events), after, info, health

    args = cpu_args(max_total_tokens=4 * K.PAGE_SIZE, chunked_prefill_size=32, num_threads=1)
    replies, (sstatus, events), after, info, health = serve(model, args, run)
    for body, (status, reply) in zip(bodies, replies):
        if body in bad:
            assert status == 500, reply
            assert "the engine step failed on this request" in reply["error"]["message"], reply
        else:
            assert status == 200, reply
            got = reply["output_ids"], [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
            assert got == _alone(model, body["input_ids"], body["sampling_params"])
    assert info["num_failed_steps"] >= len(bad) and info["num_retractions"] > 0, info
    # a streamed request that fails gets an error event, then [DONE]
    assert sstatus == 200 and events[-2:] == ["data: [DONE]", ""], events
    assert json.loads(events[-3][6:])["error"]["code"] == 500
    assert after[0] == 200 and health == 200  # and the server goes on serving


def test_a_batch_with_a_breaking_request_answers_the_error_naming_it(model, monkeypatch):
    monkeypatch.setattr(engine_module, "check_sampling_values", lambda *a, **k: None)

    async def run(server, client):
        body = {"input_ids": [[1, 2, 3], [4, 5, 6]], "sampling_params": [_sp(4, 1), _sp(4, 2, temperature=1e300)]}
        return await _json(await client.post("/generate", json=body))

    status, reply = serve(model, cpu_args(), run)
    assert status == 500 and "request 1 of the batch" in reply["error"]["message"], reply


# ---- 3. body size ---------------------------------------------------------------------------------

def _raw(port, head: bytes, body_chunks=(), timeout=10.0) -> tuple[int, dict, float]:
    """Send ``head`` (request line and headers) and ``body_chunks`` on a socket; (status, JSON reply, seconds)."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        try:
            for c in body_chunks:
                s.sendall(c)
        except OSError:  # the server answered and closed while we were still sending
            pass
        with s.makefile("rb") as f:
            status = int(f.readline().split()[1])
            headers = {}
            while (line := f.readline().strip()):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            payload = f.read(int(headers["content-length"]))
    return status, json.loads(payload), time.perf_counter() - t0


def _post_head(path, length=None, chunked=False, auth=None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    if auth:
        lines.append(f"Authorization: Bearer {auth}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def test_bodies_over_their_route_limit_get_413_before_they_are_read(model):
    limit = 4096

    async def run(server, client):
        port = client.server.port
        loop = asyncio.get_running_loop()
        out = {"info": (await (await client.get("/get_server_info")).json())}
        # 50 MB announced, not one byte sent: the answer comes at once
        out["announced"] = await loop.run_in_executor(None, _raw, port, _post_head("/generate", 50_000_000))
        # chunked, no Content-Length: refused as soon as the bytes read pass the limit
        filler = _chunk(b'{"text": "' + b"a" * 2000) + b"".join(_chunk(b"a" * 2000) for _ in range(500))
        out["chunked"] = await loop.run_in_executor(None, _raw, port, _post_head("/generate", chunked=True), [filler])
        under = json.dumps({"text": "a", "sampling_params": _sp(2, 1)}).encode()
        under += b" " * (limit - len(under))  # exactly the limit
        out["under"] = await _json(await client.post("/generate", data=under))
        # the weights route has its own limit; every other route a small one
        weights = json.dumps({"load_format": "flattened_bucket", "serialized_named_tensors": ["x" * 6000]}).encode()
        out["weights"] = await _json(await client.post("/update_weights_from_tensor", data=weights))
        out["weights_big"] = await _json(await client.post("/update_weights_from_tensor", data=b" " * 9000))
        out["admin"] = await _json(await client.post("/abort_request", data=b" " * (OTHER_BODY_BYTES + 1)))
        out["after"] = await _json(await client.post("/generate", json={"input_ids": [1, 2], "sampling_params": _sp(3, 1)}))
        return out

    out = serve(model, cpu_args(max_generate_body_bytes=limit, max_weights_body_bytes=8192), run)
    assert out["info"]["max_generate_body_bytes"] == limit and out["info"]["max_weights_body_bytes"] == 8192
    status, reply, seconds = out["announced"]
    assert status == 413 and seconds < 5, (status, reply, seconds)
    assert reply["error"]["message"] == ("the request body is 50000000 bytes; /generate takes at most 4096 bytes "
                                         "(rlperf serve --max-generate-body-bytes)")
    status, reply, _ = out["chunked"]
    assert status == 413 and "more than 4096 bytes" in reply["error"]["message"], reply
    assert out["under"][0] == 200, out["under"]
    assert out["weights"][0] == 400 and "bucket payload" in out["weights"][1]["error"]["message"], out["weights"]
    assert out["weights_big"][0] == 413 and "--max-weights-body-bytes" in out["weights_big"][1]["error"]["message"]
    assert out["admin"][0] == 413 and "/abort_request takes at most" in out["admin"][1]["error"]["message"]
    assert out["after"][0] == 200 and len(out["after"][1]["output_ids"]) == 3


def test_the_default_generate_limit_follows_the_context_length(model):
    async def run(server, client):
        return (await (await client.get("/server_info")).json()), server.engine.context_length

    info, ctx = serve(model, cpu_args(context_length=512), run)
    assert ctx == 512 and info["max_generate_body_bytes"] == generate_body_limit(512) == (1 << 20) + 64 * 512
    assert info["max_weights_body_bytes"] == 1 << 30


# ---- 4. profile output only under the profile root -------------------------------------------------

def _profile_run(model, root, fn, **kw):
    async def run(server, client):
        async def start(body):
            return await _json(await client.post("/start_profile", json={"activities": ["CPU"], **body}))

        async def stop():
            return await _json(await client.post("/stop_profile", json={}))

        async def generate():
            return (await client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": _sp(3, 1)})).status

        return await fn(server, client, start, stop, generate)

    return serve(model, cpu_args(profile_root=str(root), **kw), run)


def test_traces_go_under_the_profile_root_as_slime_asks(model, tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_TORCH_PROFILER_DIR", raising=False)
    root = tmp_path / "root"

    async def fn(server, client, start, stop, generate):
        out = []
        # slime's tools/profile_rollout.py body (SGLang's ProfileReqInput fields) with its output_dir under the root
        for body in ({"output_dir": str(root / "slime" / "run1"), "num_steps": None, "profile_by_stage": False,
                      "with_stack": False, "record_shapes": True, "profile_id": "slime1"},
                     {"output_dir": "relative/dir"},  # relative to the root
                     {}):  # no output_dir: the root itself
            s, r = await start(body)
            assert s == 200, r
            assert await generate() == 200
            out.append((r["trace_path"], await stop()))
        trace = await client.get("/profile_trace")
        return out, trace.status, trace.headers.get("X-Trace-Path"), await trace.read()

    out, status, header, data = _profile_run(model, root, fn)
    paths = [p for p, _ in out]
    assert paths[0] == str(root / "slime" / "run1" / "slime1-TP-0.trace.json.gz")
    assert os.path.dirname(paths[1]) == str(root / "relative" / "dir") and os.path.dirname(paths[2]) == str(root)
    for path, (s, r) in out:
        assert s == 200 and r["trace_path"] == path
        with gzip.open(path) as f:
            assert any(e.get("name", "").startswith("aten::") for e in json.load(f)["traceEvents"])
    assert status == 200 and header == paths[2] and gzip.decompress(data) == gzip.decompress(open(paths[2], "rb").read())


def test_profile_paths_outside_the_root_links_and_existing_files_are_refused(model, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "to_outside").symlink_to(outside, target_is_directory=True)
    (outside / "victim").write_text("keep me")
    (root / "taken-TP-0.trace.json.gz").symlink_to(outside / "victim")  # a link where the trace would go
    (root / "a_file").write_text("")
    cases = [
        ({"output_dir": str(outside)}, "is outside the profile root"),
        ({"output_dir": "/etc/rlperf-profile-test"}, "is outside the profile root"),
        ({"output_dir": str(root / ".." / "outside")}, "has a '..' component"),
        ({"output_dir": "../outside"}, "has a '..' component"),
        ({"output_dir": str(root / "to_outside" / "sub")}, "a symbolic link"),
        ({"output_dir": str(root / "a_file")}, "cannot be entered at 'a_file'"),
        ({"output_dir": str(root), "profile_id": "taken"}, "already exists"),
        ({"output_dir": str(root), "profile_id": "../../outside/x"}, "must be a plain name"),
        ({"output_dir": str(root), "profile_id": ".hidden"}, "must be a plain name"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"output_dir": str(root), "activities": ["GPU"]}, "GPU needs CUDA"))

    async def fn(server, client, start, stop, generate):
        replies = [await start(body) for body, _ in cases]
        ok = await start({"output_dir": str(root / "fine")})  # nothing above left a profile running
        return replies, ok, await stop()

    replies, ok, stopped = _profile_run(model, root, fn)
    for (body, message), (status, reply) in zip(cases, replies):
        assert status == 400 and message in reply["error"]["message"], (body, reply)
        if "profile_id" not in body and "activities" not in body:
            assert str(root) in reply["error"]["message"], reply  # names the root
    assert ok[0] == 200 and stopped[0] == 200
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_text() == "keep me"
    assert not os.path.exists("/etc/rlperf-profile-test")
    assert sorted(os.listdir(root)) == ["a_file", "fine", "taken-TP-0.trace.json.gz", "to_outside"]


def test_workers_that_start_on_the_same_clock_tick_write_distinct_traces(tmp_path, monkeypatch):
    # every worker of a router writes TP-0 traces; the default profile_id is the start time, so two
    # workers started together can read the same tick: the second keeps it and adds its process id
    # (never overwriting the first), while a profile_id the client chose still refuses to collide
    from rlperf.rollout import profiler as P

    monkeypatch.setattr(P.time, "time", lambda: 1700000000.5)
    a, b = P.TraceProfiler(root=tmp_path), P.TraceProfiler(root=tmp_path)  # one torch profiler at a time
    path_a = a.start(str(tmp_path), activities=["CPU"])
    a.stop()
    path_b = b.start(str(tmp_path), activities=["CPU"])
    b.stop()
    assert path_a.name == "1700000000.5-TP-0.trace.json.gz"
    assert path_b.name == f"1700000000.5-{os.getpid()}-TP-0.trace.json.gz"
    assert path_a.is_file() and path_b.is_file()
    with pytest.raises(ValueError, match="already exists"):
        P.TraceProfiler(root=tmp_path).start(str(tmp_path), activities=["CPU"], profile_id="1700000000.5")
