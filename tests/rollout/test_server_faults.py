"""`rlperf serve` inputs that used to give 500 or hold a request forever (issue #24), over real HTTP.

* A bucket payload that is a JSON string nested 100,000 deep or holding a 5,000-digit integer, and a
  ``bucket_bytes`` of 5,000 digits: 400.
* A client that sends its headers and never its body gets 408 and a closed connection after the
  body idle timeout.
* A FIFO (or anything but a regular file) in ``/dev/shm`` under a bucket's segment name is refused at
  once, never blocking a worker thread.
"""
import asyncio
import json
import os
import socket
import threading
import time

import pytest
import torch

from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.tokenizer import ByteTokenizer
from rlperf.sync import PayloadError, flatten_buckets, receive_bucket
from rlperf.sync.transports import SHM_PREFIX

pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from inprocess_server import cpu_args, serve  # noqa: E402

from rlperf.rollout.http_body import BODY_IDLE_TIMEOUT  # noqa: E402
from rlperf.rollout.server import RolloutServer  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM.random(preset("tiny"), seed=0)


async def _json(resp):
    return resp.status, await resp.json(content_type=None)


def _update(payload) -> dict:
    return {"load_format": "flattened_bucket", "serialized_named_tensors": [payload]}


def test_hostile_bucket_payloads_and_bucket_bytes_are_400(model):
    deep = "[" * 100_000 + "]" * 100_000
    huge = '{"description": {"nbytes": ' + "9" * 5000 + '}, "transport": {"kind": "inline", "data": ""}}'
    cases = [("deep string", _update(deep)), ("5000-digit integer", _update(huge)),
             ("deep object", _update('{"a":' * 100_000 + "1" + "}" * 100_000))]

    async def fn(server, client):
        for what, body in cases:
            status, reply = await _json(await client.post("/update_weights_from_tensor", json=body))
            assert status == 400, (what, reply)
            assert "bucket payload" in reply["error"]["message"], (what, reply)
        for raw in ("9" * 5000, "1" * 15, "١٢", "0"):
            status, reply = await _json(await client.get(f"/weights_checksum?bucket_bytes={raw}"))
            assert status == 400 and "bucket_bytes" in reply["error"]["message"], (raw, reply)
        status, reply = await _json(await client.get("/weights_checksum?bucket_bytes=4096"))
        assert status == 200 and reply["bucket_bytes"] == 4096
    serve(model, cpu_args(skip_warmup=True), fn)


def test_a_body_that_never_comes_gets_408_and_a_closed_connection(model):
    idle = 1.5
    server = RolloutServer(cpu_args(skip_warmup=True), model, ByteTokenizer(512))
    server.app[BODY_IDLE_TIMEOUT] = idle

    async def main():
        async with TestClient(TestServer(server.app)) as client:
            port = client.port

            def raw(path, body_part: bytes):
                t0 = time.perf_counter()
                with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              f"Content-Length: 100\r\n\r\n".encode() + body_part)
                    data = b""
                    while chunk := s.recv(65536):  # read until the server closes the connection
                        data += chunk
                return data, time.perf_counter() - t0
            for path, part in (("/generate", b""), ("/generate", b'{"text": '), ("/abort_request", b"")):
                data, seconds = await asyncio.to_thread(raw, path, part)
                head, _, body = data.partition(b"\r\n\r\n")
                assert head.split()[1] == b"408", data[:300]
                assert "no byte of the request body arrived" in json.loads(body)["error"]["message"]
                assert idle - 0.2 <= seconds < idle + 10, seconds
            status, _ = await _json(await client.get("/health"))  # the server goes on
            assert status == 200
    asyncio.run(main())


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux /dev/shm")
def test_a_fifo_under_a_segment_name_is_refused_without_blocking():
    name = f"{SHM_PREFIX}{os.getpid()}_{os.urandom(8).hex()}"
    path = os.path.join("/dev/shm", name)
    os.mkfifo(path)
    try:
        (bucket,) = flatten_buckets([("w", torch.ones(4))])
        payload = {"description": bucket.to_dict(), "transport": {"kind": "shm", "name": name}}
        outcome = []

        def receive():  # in a thread: an open that blocks must fail this test, not hang it
            try:
                receive_bucket(payload, "cpu")
            except PayloadError as exc:
                outcome.append(str(exc))
        t = threading.Thread(target=receive, daemon=True)
        t.start()
        t.join(10)
        if t.is_alive():
            with open(path, "wb"):  # a writer end releases the blocked open
                pass
            pytest.fail("receiving from a FIFO blocked")
        assert outcome and "not a regular file" in outcome[0], outcome
    finally:
        os.unlink(path)
