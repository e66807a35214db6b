"""The pieces of the disaggregated sync that need no server: buckets packed one at a time from a
generator, the weights checksum from the buckets sent, the weight-update group (gloo, two ranks
in one process) with no default process group, and the sender facing an engine that fails the group's
first broadcast."""
import concurrent.futures
import json
import threading
import time

import torch
import torch.distributed as dist

from rlperf.sync import combine_checksums, flatten_buckets, iter_buckets, iter_buckets_with_last, weights_checksum
from rlperf.sync.distributed import (UPDATE_ENDPOINT, WeightBroadcaster, WeightSyncError, init_weight_update_group,
                                     is_back_to_back, master_store)


def _named(n=7):
    g = torch.Generator().manual_seed(0)
    return [(f"t{i}", torch.randn(5 + 3 * i, generator=g)) for i in range(n)]


def test_buckets_are_packed_as_they_close_from_a_generator():
    named, drawn = _named(), []

    def gen():
        for item in named:
            drawn.append(item[0])
            yield item

    buckets = iter_buckets_with_last(gen(), bucket_bytes=48)
    first, last = next(buckets)
    assert (first.names, last, drawn) == (["t0"], False, ["t0", "t1"])  # t1 closed it: nothing more was drawn
    rest = list(buckets)
    assert [b for b, _ in rest][-1].names == ["t6"] and [is_last for _, is_last in rest] == [False] * 5 + [True]
    expected = flatten_buckets(named, bucket_bytes=48)
    got = [first] + [b for b, _ in rest]
    assert [b.names for b in got] == [b.names for b in expected]
    assert all(torch.equal(a.buffer, b.buffer) for a, b in zip(got, expected))
    assert combine_checksums(b.checksum for b in iter_buckets(named, 48)) == weights_checksum(named, 48)
    assert weights_checksum(named) == combine_checksums(b.checksum for b in flatten_buckets(named))


def test_a_gloo_weight_update_group_broadcasts_from_rank_0_without_a_default_group():
    store = master_store("127.0.0.1", timeout=30)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joins = [pool.submit(init_weight_update_group, "127.0.0.1", store.port, rank, 2, group_name="t",
                             timeout=30, store=store if rank == 0 else None) for rank in (0, 1)]
        root, peer = (f.result() for f in joins)
        bucket = flatten_buckets(_named(), 1 << 20)[0]
        received = torch.zeros_like(bucket.buffer)
        works = [pool.submit(lambda g, t: g.wait(g.broadcast(t), host=True), g, t)
                 for g, t in ((root, bucket.buffer), (peer, received))]
        for w in works:
            w.result()
    assert torch.equal(received, bucket.buffer)
    assert not is_back_to_back(bucket.metadata)  # 20-byte t0: t1 starts at 32, a gap a bucket request describes
    assert not dist.is_initialized()  # the engine's (and the trainer's) default group is left alone
    root.close()
    peer.close()


def test_pipelined_replies_are_read_one_by_one_whatever_their_framing():
    """The sender's reply reader (requests pipelined on one connection: the replies arrive back to back)."""
    import io

    import pytest

    from rlperf.sync.distributed import _read_http_reply

    stream = io.BufferedReader(io.BytesIO(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4\r\n{\"a\"\r\n3;x=y\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{\"b\": 2}"))
    assert _read_http_reply(stream) == (200, b"{}")
    assert _read_http_reply(stream) == (400, b'{"a": 1}')
    assert _read_http_reply(stream) == (200, b'{"b": 2}')
    with pytest.raises(ValueError, match="closed the connection"):
        _read_http_reply(stream)


class _FirstCallWaitsGroup:
    """A weight-update group whose first broadcast call does not return until released, as NCCL's does
    when a peer's side of the communicator setup failed (NCCL sets its communicator up inside the group's
    first collective; gloo connects when the group forms, so a gloo group cannot show this)."""

    backend, rank, world_size = "nccl", 0, 2

    def __init__(self):
        self.device = torch.device("cpu")
        self.started, self.release, self.closed = False, threading.Event(), False

    def broadcast(self, tensor):
        self.release.wait(60)
        raise RuntimeError("the communicator was aborted")

    def close(self):
        self.closed = True
        self.release.set()


def _refusing_engine(message: str):
    """A real HTTP server answering as an SGLang engine whose side of the first broadcast failed: 200 to
    pause/continue/destroy, 400 with ``message`` to every ``/update_weights_from_distributed``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # the sender pipelines its requests on one connection

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            refused = self.path == UPDATE_ENDPOINT
            body = json.dumps({"success": False, "message": message} if refused else {"success": True}).encode()
            self.send_response(400 if refused else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_engine_that_fails_the_first_broadcast_fails_the_update_with_its_reply_at_once():
    """The sender watches the engines' replies while the group's first broadcast call has not returned:
    the engine's own message fails the update within seconds (not at the group's 300 s timeout, nor never),
    and the sender leaves the group."""
    import pytest

    nccl_error = ("Failed to update parameter online: NCCL error in: NCCLUtils.cpp:93, unhandled cuda error, "
                  "Cuda failure 'invalid argument'")
    server = _refusing_engine(nccl_error)
    try:
        b = WeightBroadcaster([f"http://127.0.0.1:{server.server_address[1]}"], device="cpu", timeout=120)
        group = b.group = _FirstCallWaitsGroup()
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="invalid argument") as failed:
            b.update_weights({"w": torch.ones(4), "v": torch.arange(3.0)}, "1", check_checksum=False,
                             sglang_engines=True)
        assert time.monotonic() - t0 < 15, "the sender waited in the first broadcast call"
        assert "bucket 1" in str(failed.value) and "400" in str(failed.value)
        assert group.closed and b.group is None  # the next update forms a new group
    finally:
        server.shutdown()
