"""Weight sync to disaggregated engines: a broadcast from trainer rank 0 through a process group of their own.

Engines on their own GPUs (another process, maybe another host) cannot open a CUDA IPC handle of the
trainer's memory, so the weights travel by collective, as slime and SGLang move them: trainer rank 0
and the N engines form one process group (NCCL on CUDA, gloo on CPU), and every bucket is one
broadcast from rank 0. The HTTP side speaks SGLang's endpoints (field names of SGLang 0.5.9's
``InitWeightsUpdateGroupReqInput`` and ``UpdateWeightsFromDistributedReqInput``)::

    trainer rank 0 (WeightBroadcaster)                         engine i (rlperf serve, group rank i + 1)
    TCPStore master on a free port
    POST /init_weights_update_group  -------------------->    join the group: rank = rank_offset (+ TP rank 0)
      {master_address, master_port, rank_offset: i + 1,
       world_size: N + 1, group_name, backend}
    join the group as rank 0
    per update, on one HTTP/1.1 connection per engine, every request written as soon as it is known
    (pipelined: none waits for the reply of the one before; the engine takes them in order):
      POST /pause_generation
      per bucket of iter_buckets(named tensors, bucket_bytes = DISTRIBUTED_BUCKET_BYTES):
        POST /update_weights_from_distributed  ---------->    receive the broadcast into one of its
          {names, dtypes, shapes, group_name,                  preallocated slot buffers, load it into the
           load_format: "flattened_bucket", flush_cache,       parameters on a side stream (rlperf.sync's
           weight_version}                                     FlattenedBucket); reply once both are queued
        broadcast(bucket.buffer) from rank 0 at once
      GET /weights_checksum?bucket_bytes=B  ------------->    weights_checksum of the engine's parameters
        (equal to combine_checksums of the buckets sent, the trainer's weights_checksum)
      POST /continue_generation
      then wait for every reply
    close: POST /destroy_weights_update_group

Layout of a bucket request (SGLang's ``load_format: "flattened_bucket"``): the tensors of ``names``
(with ``dtypes`` and ``shapes``) lie back to back in one uint8 buffer, in that order
(:func:`sglang_bucket_layout`, what SGLang's ``FlattenedTensorBucket`` builds). rlperf packs its
buckets with 16-byte-aligned starts (:mod:`rlperf.sync.flatten`); for every tensor whose byte count is
a multiple of 16 (every Qwen3 shape in bf16 and fp32) that is the same layout. A bucket with gaps
carries rlperf's ``description`` (:meth:`FlattenedBucket.to_dict`, byte offsets, no checksum) too,
which an rlperf engine reads instead.

The process group (:func:`init_weight_update_group`) never touches ``torch.distributed``'s default
group: a ``TCPStore`` (rank 0 is its master) wrapped in the ``PrefixStore`` chain SGLang's
``init_custom_process_group`` and torch's group helper put around it (``group_name``, then
``group_name/``, then the device type), and a ``ProcessGroupNCCL`` or ``ProcessGroupGloo`` built on it
directly. With NCCL these are the store keys a slime or SGLang peer uses, so either side may be
theirs. Collectives time out after :data:`GROUP_TIMEOUT_S`.

Pipelining: nothing on the sender waits for an HTTP round trip between buckets. Bucket k's request
goes out as soon as bucket k is packed, and its broadcast is issued right behind it, so the engine
already holds the requests of the buckets to come while it receives bucket k. With NCCL, each engine
replies once its receive and load are queued on its device (the last bucket, ``flush_cache: true``,
once they are done) and receives into a ring of preallocated buffers
(:class:`rlperf.rollout.weight_groups.WeightGroups`): the receive of bucket k+1 overlaps the load of
bucket k. The sender packs bucket k+1 (on its stream) while bucket k broadcasts (on NCCL's), and waits
on the host only for the broadcast ``max_inflight`` buckets back, whose buffer it then drops (each
bucket stays referenced until its broadcast is done); meanwhile it watches the replies, so an engine
that refused a bucket (and never takes its broadcast) fails the update at once instead of after
:data:`GROUP_TIMEOUT_S`. NCCL sets its communicator up inside the group's first broadcast call, which
waits there for every peer's side of the setup; that one call runs in a daemon thread while the
replies are watched, so an engine whose setup failed (SGLang answers the request with NCCL's error)
fails the update with its message too. An update that fails with a broadcast unfinished leaves the group (NCCL
aborts it); the next update forms a new one.

An engine that dies or stops in the middle of an update (a killed process whose NCCL peer never
completes, a stopped one that never answers) would hold the sender until :data:`GROUP_TIMEOUT_S`,
or until the HTTP timeout for a reply that never comes. A ``watch`` (the run's engine health monitor,
:meth:`rlperf.loop.health.HealthMonitor.found_failed`) names the engines found failed meanwhile; every
wait of the update (forming the group, each broadcast, the replies) looks at it every
:data:`_WATCH_POLL_S` and fails at once with :class:`EngineLost` naming them. The group is then
aborted as for any unfinished broadcast, and the engines lost are not asked to leave it or to continue
(they would not answer either): the update ends within the health check's own bound.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
import gc
import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from .buckets import FlattenedTensorMetadata
from .config import DISTRIBUTED_BUCKET_BYTES
from .dtypes import dtype_name
from .flatten import combine_checksums, iter_buckets_with_last
from .transports import SyncStats

GROUP_NAME = "weight_update_group"
"""SGLang's default ``group_name``."""
BACKENDS = ("nccl", "gloo")
"""``backend`` values: NCCL for CUDA tensors, gloo for CPU tensors."""
GROUP_TIMEOUT_S = 300.0
"""Seconds a rendezvous or a collective of the group may take before it fails (an 8 GB broadcast
takes ~25 ms over NVLink; this only bounds how long a peer that never comes is waited for)."""
CLOSE_TIMEOUT_S = 10.0
"""How long :meth:`WeightBroadcaster.close` waits for an engine to leave the group."""
INIT_ENDPOINT = "/init_weights_update_group"
UPDATE_ENDPOINT = "/update_weights_from_distributed"
DESTROY_ENDPOINT = "/destroy_weights_update_group"
CHECKSUM_ENDPOINT = "/weights_checksum"


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def master_store(address: str, timeout: float = GROUP_TIMEOUT_S):
    """Rank 0's ``TCPStore``, listening on a port the OS picks (``store.port``): the engines are told
    that port, so no other process can take it between choosing and binding it."""
    from torch.distributed import TCPStore

    return TCPStore(address, 0, None, True, _timedelta(timeout), wait_for_workers=False)


@dataclasses.dataclass(eq=False)
class WeightUpdateGroup:
    """One process group of trainer rank 0 and the engines (module docstring); collectives root at rank 0."""

    name: str
    backend: str
    rank: int
    world_size: int
    device: torch.device
    """Where this side's tensors of the group live (CUDA for NCCL)."""
    _pg: object = dataclasses.field(repr=False)
    _store: object = dataclasses.field(repr=False)
    started: bool = False
    """Whether a :meth:`broadcast` call has returned: NCCL sets up its communicator inside the first
    call, which waits there for every peer's side of the setup (see :meth:`_Update.start_broadcast`)."""
    _works: list = dataclasses.field(default_factory=list, repr=False)
    """Broadcasts not seen complete (what :meth:`close` must not destroy the group under)."""

    def broadcast(self, tensor: torch.Tensor):
        """Start the broadcast of ``tensor`` from rank 0 (rank 0 sends it, the others receive into it:
        same bytes, dtype and shape on every rank); returns the work for :meth:`wait`."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        work = self._pg.broadcast([tensor], opts)
        self._works = [w for w in self._works if not w.is_completed()] + [work]
        return work

    def wait(self, work, *, host: bool) -> None:
        """Wait for a :meth:`broadcast`. gloo: on the host. NCCL: this thread's current stream waits
        (later kernels see the data); with ``host`` the host waits too."""
        work.wait()
        if host and self.backend == "nccl":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Leave the group; it cannot be used afterwards. The process group is aborted (where the torch
        build can: NCCL, and gloo in recent torch), which also ends a broadcast a failed peer left
        waiting (a graceful shutdown would wait for it); with gloo the peers see the connections close
        and their own pending receives fail at once instead of at the timeout."""
        pg, self._pg, self._store = self._pg, None, None

        def end():
            for method in ("abort", "shutdown"):
                if pg is not None and hasattr(pg, method):
                    try:
                        getattr(pg, method)()
                    except Exception:  # noqa: BLE001  (a communicator that never started has nothing to end)
                        pass
                    break

        # a communicator whose setup a failed peer left half done may not end at once: this side goes
        # on after CLOSE_TIMEOUT_S (the abort carries on in its daemon thread)
        concurrent.futures.wait([_in_thread(end)], timeout=CLOSE_TIMEOUT_S)
        _reap_abandoned()
        stuck = [w for w in self._works if not w.is_completed()]
        self._works = []
        if stuck:
            # a gloo group's destructor joins its worker threads, holding the GIL: one still sending to a
            # stopped peer would freeze every thread of this process (the health checks too) until the
            # collective's timeout. Such a group is kept until its broadcasts end (the peer killed closes
            # the connection) and only then let go (_reap_abandoned, at the next close or join).
            _ABANDONED.append((pg, stuck))
        pg = None  # this frame's reference goes; end() may still be running and reads the name


_ABANDONED: list[tuple[object, list]] = []
"""Groups left with broadcasts unfinished (:meth:`WeightUpdateGroup.close`), kept until those end."""


def _reap_abandoned() -> None:
    """Let go of the abandoned groups whose broadcasts have all ended (destroying them no longer blocks)."""
    _ABANDONED[:] = [(pg, works) for pg, works in _ABANDONED if not all(w.is_completed() for w in works)]


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                             group_name: str = GROUP_NAME, backend: str = "gloo", device=None,
                             timeout: float = GROUP_TIMEOUT_S, store=None,
                             connect_timeout: float | None = None) -> WeightUpdateGroup:
    """Join the group as ``rank`` of ``world_size`` (blocks until every rank has joined: gloo connects
    now, NCCL at the first broadcast). Rank 0 passes its :func:`master_store` as ``store``; the others
    connect to ``master_address:master_port``. ``device``: this side's device of the group's tensors
    (NCCL: a CUDA device; default the current one). ``connect_timeout``: how long a rank other than 0
    tries to reach the master's store (default ``timeout``; a closed port is retried until then).
    RuntimeError when the rendezvous fails or times out."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    _reap_abandoned()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    td = _timedelta(timeout)
    if store is None:
        store = TCPStore(master_address, master_port, world_size, False,
                         td if connect_timeout is None else _timedelta(connect_timeout))
        store.set_timeout(td)
    # the key prefixes of SGLang's init_custom_process_group and torch's _new_process_group_helper
    prefixed = PrefixStore(f"{group_name}/", PrefixStore(group_name, store))
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("backend nccl: this torch has no NCCL (a CPU build); use gloo")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = td
        pg = dist.ProcessGroupNCCL(PrefixStore("cuda/", prefixed), rank, world_size, opts)
    else:
        device = torch.device("cpu") if device is None else torch.device(device)
        pg = dist.ProcessGroupGloo(PrefixStore("cpu/", prefixed), rank, world_size, td)
    return WeightUpdateGroup(group_name, backend, rank, world_size, device, pg, store)


def sglang_bucket_layout(names: Sequence[str], dtypes: Sequence[torch.dtype],
                         shapes: Sequence[Sequence[int]]) -> list[FlattenedTensorMetadata]:
    """Where SGLang's ``FlattenedTensorBucket`` puts these tensors: back to back in the given order,
    no gaps (byte offsets; ``numel`` the byte count, SGLang's meaning)."""
    out, start = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        out.append(FlattenedTensorMetadata(name, tuple(shape), dtype, start, start + nbytes, nbytes))
        start += nbytes
    return out


def is_back_to_back(metadata: Sequence[FlattenedTensorMetadata]) -> bool:
    """Whether a bucket's layout is :func:`sglang_bucket_layout`'s (no gaps, in order)."""
    end = 0
    for m in metadata:
        if m.start_idx != end:
            return False
        end = m.end_idx
    return True


# ---- trainer rank 0 ------------------------------------------------------------------------------


class WeightSyncError(RuntimeError):
    """An engine refused or failed a step of the sync; ``status`` is its HTTP status (0: unreachable)."""

    unfinished_broadcast = False
    """Whether a broadcast of the update was left unfinished (the sender then leaves the group)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class EngineLost(WeightSyncError):
    """Engines found failed (dead, stopped, not answering their health check) while an update waited on
    them; ``gone``: their URLs, which the update's clean-up does not ask again."""

    unfinished_broadcast = True

    def __init__(self, failed: Mapping[str, str]):
        super().__init__("; ".join(f"{url} {why}" for url, why in failed.items()) + " during the weight update")
        self.gone = tuple(failed)


def _message(reply) -> str:
    if isinstance(reply, dict):
        err = reply.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if reply.get("message"):
            return str(reply["message"])
    return str(reply)[:500]


def _reply(url: str, path: str, status: int, raw: bytes) -> dict:
    """The decoded reply of a 200, else WeightSyncError naming the engine, the endpoint and its message."""
    try:
        reply = json.loads(raw) if raw else {}
    except ValueError:
        reply = raw.decode(errors="replace")
    if status != 200:
        raise WeightSyncError(f"{url}{path.split('?')[0]} answered {status}: {_message(reply)}", status)
    return reply if isinstance(reply, dict) else {}


def _in_thread(fn, *args, **kwargs) -> concurrent.futures.Future:
    """Run ``fn(*args, **kwargs)`` in a daemon thread (one that is still waiting for a peer never holds
    up the interpreter's exit, unlike a thread pool's); its result or exception in the future."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001  (handed to whoever waits)
            fut.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="rlperf-weight-sync").start()
    return fut


def _results(futures: list[concurrent.futures.Future]) -> list[dict]:
    """Every future's reply; one WeightSyncError naming every failure if any failed."""
    concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        status = next((e.status for e in errors if isinstance(e, WeightSyncError)), 0)
        raise WeightSyncError("; ".join(str(e) for e in errors), status)
    return [f.result() for f in futures]


class _PipelinedConnection:
    """One HTTP/1.1 connection to one engine on which requests are pipelined: :meth:`submit` writes a
    request at once (from the caller's thread) without waiting for the replies of those before it, and
    one daemon thread reads the replies in order. The engine (aiohttp, as uvicorn) handles a
    connection's requests one after the other, in the order written, so its ``/pause_generation``, its
    bucket requests (joining their broadcasts in order) and its ``/continue_generation`` queue up on
    its side while the sender is busy broadcasting. A connection that fails (unreachable, closed by the
    engine, unreadable reply) fails every request still waiting on it and takes no more."""

    def __init__(self, url: str, headers: dict, timeout: float):
        parts = urllib.parse.urlsplit(url)
        self.url, self._timeout = url, timeout
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        self._head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{port}", **headers}.items())
        self._lock = threading.Lock()
        self._waiting: queue.SimpleQueue = queue.SimpleQueue()
        self._error: WeightSyncError | None = None
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise WeightSyncError(f"{url}: the engine cannot be reached ({exc})") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rfile = self._sock.makefile("rb")
        threading.Thread(target=self._read, daemon=True, name="rlperf-weight-sync-replies").start()

    def submit(self, method: str, path: str, body=None) -> concurrent.futures.Future:
        """Write ``method path`` (``body`` as JSON) now; the future gets the decoded reply of a 200, or
        :class:`WeightSyncError` naming the engine and the endpoint."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\n{self._head}Content-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        with self._lock:
            if self._error is None:
                try:
                    self._sock.sendall(head + data)
                except OSError as exc:
                    self._fail(WeightSyncError(f"{self.url}{path.split('?')[0]}: the engine cannot be reached ({exc})"))
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                self._waiting.put((fut, path))
        return fut

    def close(self) -> None:
        """Close the connection; requests still waiting fail, and so does every later :meth:`submit`."""
        with self._lock:
            self._fail(WeightSyncError(f"{self.url}: the connection was closed"))
            self._waiting.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _fail(self, error: WeightSyncError) -> None:
        if self._error is None:
            self._error = error

    def _read(self) -> None:
        try:
            while (item := self._waiting.get()) is not None:
                fut, path = item
                try:
                    status, raw = _read_http_reply(self._rfile)
                except (OSError, ValueError) as exc:
                    with self._lock:  # nothing is queued after this: the rest fail here
                        self._fail(WeightSyncError(f"{self.url}{path.split('?')[0]}: no reply from the engine ({exc})"))
                    fut.set_exception(self._error)
                    break
                try:
                    fut.set_result(_reply(self.url, path, status, raw))
                except WeightSyncError as exc:
                    fut.set_exception(exc)
            while True:
                try:
                    item = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].set_exception(self._error)
        finally:
            self._rfile.close()


def _read_http_reply(rfile) -> tuple[int, bytes]:
    """One HTTP/1.1 response from ``rfile``: (status, body). Content-Length or chunked bodies; a reply
    that ends the connection (no length) is read to its end. ValueError for what is not HTTP."""
    line = rfile.readline(65537)
    if not line:
        raise ValueError("the engine closed the connection")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP status line: {line[:80]!r}")
    status, headers = int(parts[1]), {}
    while (h := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
        key, _, value = h.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    if 100 <= status < 200:  # an interim reply (never asked for): the real one follows
        return _read_http_reply(rfile)
    if "content-length" in headers:
        n = int(headers["content-length"])
        body = rfile.read(n)
        if len(body) != n:
            raise ValueError("the engine closed the connection within a reply")
        return status, body
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while (size := int(rfile.readline(65537).split(b";")[0].strip() or b"0", 16)) > 0:
            chunks.append(rfile.read(size))
            rfile.readline(65537)
        while rfile.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return status, b"".join(chunks)
    return status, rfile.read()


def _address_towards(url: str) -> str:
    """This host's address as the engine at ``url`` reaches it (the interface that routes there)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, parts.port or 80))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


class WeightBroadcaster:
    """Trainer rank 0's side of a disaggregated weight sync (module docstring).

    Parameters
    ----------
    engine_urls : the engines' base URLs (``GET /workers`` of their router lists them; the router does
        not proxy admin endpoints, so each engine is called directly).
    device : where the trainer's tensors live: CUDA -> NCCL, CPU -> gloo.
    api_key : the engines' admin key (sent as ``Authorization: Bearer``).
    master_address : how the engines reach this process (default: the interface that routes to the
        first engine; 127.0.0.1 for local engines).
    bucket_bytes : bucket size of each broadcast (default :data:`rlperf.sync.DISTRIBUTED_BUCKET_BYTES`).
    max_inflight : buckets whose broadcast may be unfinished on this side (each holds its packed buffer)
        before the next one is packed; the replies are awaited at the end (module docstring).
    watch : called while an update waits on the engines: the engines found failed meanwhile (URL -> why),
        on which the update gives up at once (:class:`EngineLost`, module docstring); None: no watch.

    :meth:`connect` forms the group (:meth:`update_weights` does it the first time); :meth:`close`
    leaves it. Only trainer rank 0 uses this; other trainer ranks take part in gathering the full
    tensors it consumes, never in this group.
    """

    def __init__(self, engine_urls: Sequence[str], *, device, api_key: str | None = None,
                 group_name: str = GROUP_NAME, master_address: str | None = None,
                 bucket_bytes: int = DISTRIBUTED_BUCKET_BYTES, timeout: float = GROUP_TIMEOUT_S,
                 max_inflight: int = 2, watch: Callable[[], Mapping[str, str]] | None = None):
        if not engine_urls:
            raise ValueError("WeightBroadcaster needs at least one engine URL")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.group_name, self.master_address = group_name, master_address
        self.bucket_bytes, self.timeout, self.max_inflight = bucket_bytes, timeout, max_inflight
        self.watch = watch
        self.group: WeightUpdateGroup | None = None
        self._next_look = 0.0

    def check_engines(self) -> None:
        """:class:`EngineLost` when ``watch`` names an engine of this group as failed (looked at once per
        :data:`_WATCH_POLL_S` however often this is called)."""
        if self.watch is None or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + _WATCH_POLL_S
        failed = {u.rstrip("/"): why for u, why in self.watch().items() if u.rstrip("/") in self.urls}
        if failed:
            raise EngineLost(failed)

    # ---- HTTP ----------------------------------------------------------------------------------
    def _call(self, url: str, path: str, body=None, timeout: float | None = None) -> dict:
        """POST ``body`` (GET without one) to an engine on a connection of its own; its reply, or
        WeightSyncError naming the engine, the endpoint and its message."""
        req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except OSError as exc:
            raise WeightSyncError(f"{url}{path.split('?')[0]}: the engine cannot be reached ({exc})") from None
        return _reply(url, path, status, raw)

    def _all(self, path: str, body=None, timeout: float | None = None, urls: Sequence[str] | None = None) -> list[dict]:
        """The same request to every engine (or to ``urls``) at once; their replies."""
        return _results([_in_thread(self._call, url, path, body, timeout) for url in (self.urls if urls is None else urls)])

    # ---- the group -----------------------------------------------------------------------------
    def connect(self) -> None:
        """Form the group: ask every engine to join (concurrently), then join as rank 0. An engine
        that refuses fails this at once with its message (not after the rendezvous timeout)."""
        if self.group is not None:
            return
        address = self.master_address or _address_towards(self.urls[0])
        store = master_store(address, self.timeout)
        world = len(self.urls) + 1
        engines = [_in_thread(self._call, url, INIT_ENDPOINT, {
            "master_address": address, "master_port": store.port, "rank_offset": i + 1, "world_size": world,
            "group_name": self.group_name, "backend": self.backend}) for i, url in enumerate(self.urls)]
        joined = _in_thread(init_weight_update_group, address, store.port, 0, world, group_name=self.group_name,
                            backend=self.backend, device=self.device, timeout=self.timeout, store=store)
        pending = set(engines) | {joined}
        while pending:
            self.check_engines()
            done, pending = concurrent.futures.wait(pending, timeout=_WATCH_POLL_S,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            failed = [f for f in done if f.exception() is not None]
            if failed:  # a refusal: the others would wait for it until the timeout
                exc = failed[0].exception()
                raise WeightSyncError(f"the weight-update group {self.group_name!r} was not formed: {exc}",
                                      getattr(exc, "status", 0))
        self.group = joined.result()

    def close(self, gone: Collection[str] = ()) -> None:
        """Ask the engines to leave the group (best effort), then leave it. Engines whose URL is in
        ``gone`` (known to have failed: killed, stopped, not answering) are not asked, so a run that ends
        because of one does not wait ``CLOSE_TIMEOUT_S`` for its answer."""
        if self.group is None:
            return
        gone = {u.rstrip("/") for u in gone}
        try:
            self._all(DESTROY_ENDPOINT, {"group_name": self.group_name}, timeout=CLOSE_TIMEOUT_S,
                      urls=[u for u in self.urls if u not in gone])
        except WeightSyncError:
            pass  # an engine that is gone has left already
        finally:
            self.group.close()
            self.group = None

    def __enter__(self) -> "WeightBroadcaster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def engine_checksums(self, bucket_bytes: int | None = None) -> list[str]:
        """Every engine's ``GET /weights_checksum`` at ``bucket_bytes`` (default :attr:`bucket_bytes`), in
        :attr:`urls` order."""
        query = f"{CHECKSUM_ENDPOINT}?bucket_bytes={bucket_bytes or self.bucket_bytes}"
        return [r.get("weights_checksum") for r in self._all(query)]

    # ---- one update ----------------------------------------------------------------------------
    def update_weights(self, named_tensors, version: str | None = None, *, check_checksum: bool = True,
                       sglang_engines: bool = False) -> SyncStats:
        """Broadcast ``named_tensors`` to every engine and load them there (module docstring).

        ``named_tensors``: (name, tensor) pairs on :attr:`device`, or a mapping; a generator is drawn
        bucket by bucket (about ``max_inflight + 1`` buckets of the weights are materialized at a
        time). ``version``: the engines' new ``weight_version``. ``check_checksum``: afterwards every
        engine's ``weights_checksum`` must equal the checksum of the buckets sent (the trainer's
        :func:`rlperf.sync.weights_checksum` at ``bucket_bytes``; the tensors must come in the
        engines' ``hf_state_dict()`` order). The engines are paused during the update and continued
        after it, also when it fails. WeightSyncError when an engine refuses or differs; when the
        failure leaves a broadcast unfinished, this side aborts the group, the engines are asked to
        leave it (as :meth:`close` does), and the next update forms a new one.

        ``sglang_engines``: the engines are real SGLang servers, which lay a bucket out back to back (no
        ``description``): a bucket with gaps is refused before it is sent, and, with ``check_checksum``
        off (SGLang has no ``/weights_checksum``), the stats still carry the checksum of the bytes sent.
        """
        if self.group is None:
            self.connect()
        if hasattr(named_tensors, "items"):
            named_tensors = named_tensors.items()
        conns: list[_PipelinedConnection] = []
        try:
            conns = [_PipelinedConnection(url, self.headers, self.timeout) for url in self.urls]
            return self._broadcast(conns, named_tensors, version, check_checksum, sglang_engines)
        except BaseException as exc:
            for c in conns:
                c.close()
            conns = []
            live = [u for u in self.urls if u not in getattr(exc, "gone", ())]  # a lost engine would not answer
            if getattr(exc, "unfinished_broadcast", False):
                # a collective that cannot finish: abort this side first (gloo peers see their pending
                # receives fail; NCCL's aborts here), then ask the engines to leave too
                group, self.group = self.group, None
                group.close()
                del group
                gc.collect()  # a work the failure's frames still reach would keep gloo's connections open
                try:
                    self._all(DESTROY_ENDPOINT, {"group_name": self.group_name}, timeout=CLOSE_TIMEOUT_S, urls=live)
                except WeightSyncError:
                    pass  # an engine that cannot leave now fails the next connect, which says so
            try:  # the pipelined /continue_generation may not have gone out: ask again on a fresh connection
                self._all("/continue_generation", {}, timeout=CLOSE_TIMEOUT_S, urls=live)
            except WeightSyncError:
                pass
            raise
        finally:
            for c in conns:
                c.close()

    def _broadcast(self, conns: list[_PipelinedConnection], named_tensors, version: str | None,
                   check_checksum: bool, sglang_engines: bool = False) -> SyncStats:
        update = _Update(self, conns)
        try:
            return update.run(named_tensors, version, check_checksum, sglang_engines)
        except BaseException as exc:
            if update.broken or update.inflight:
                try:  # broadcasts not seen through: the caller leaves the group (the engines may never take them)
                    exc.unfinished_broadcast = True
                except AttributeError:
                    pass
            update.inflight.clear()  # no work of the group outlives it (its buffers with them)
            raise


class _Update:
    """One pipelined update of a :class:`WeightBroadcaster` (module docstring): every request is written
    as soon as it is known, the broadcasts are issued back to back, and the host waits only for the
    broadcast ``max_inflight`` buckets back (whose buffer it then drops) and, at the end, for every reply."""

    def __init__(self, sender: WeightBroadcaster, conns: list[_PipelinedConnection]):
        self.sender, self.conns, self.group = sender, conns, sender.group
        self.inflight: collections.deque = collections.deque()  # (bucket, work): broadcasts not seen done
        self.requests: list[tuple[str, concurrent.futures.Future]] = []  # (what, reply), every engine's, in order
        self.outstanding: list[tuple[str, concurrent.futures.Future]] = []  # not answered yet
        self.broken = False  # a broadcast failed: the group cannot be used any more

    def post(self, what: str, method: str, path: str, body=None) -> None:
        for c in self.conns:
            fut = c.submit(method, path, body)
            self.requests.append((what, fut))
            self.outstanding.append((what, fut))

    def start_broadcast(self, buffer: torch.Tensor):
        """Issue the broadcast of ``buffer``; its work. The group's first call runs in a daemon thread
        while the replies are watched: NCCL sets up its communicator inside that call, and an engine
        whose side of the setup failed (SGLang answers the bucket's request with the NCCL error) leaves
        it waiting there, so the engine's reply fails the update instead (the call is left behind)."""
        if self.group.started:
            return self.group.broadcast(buffer)
        if buffer.is_cuda:  # NCCL orders the broadcast after the calling thread's current stream, which
            stream = torch.cuda.current_stream(buffer.device)  # packed the buffer: the thread takes this one

            def broadcast(t):
                with torch.cuda.device(t.device), torch.cuda.stream(stream):
                    return self.group.broadcast(t)
        else:
            broadcast = self.group.broadcast
        call = _in_thread(broadcast, buffer)
        try:
            while not call.done():
                self.check_replies()
                time.sleep(_FIRST_CALL_POLL_S)
        except BaseException:
            self.broken = True  # the group's first collective may never finish: the caller leaves the group
            raise
        self.group.started = True
        return call.result()

    def check_replies(self) -> None:
        """A reply that failed already fails the update, and so does an engine the sender's ``watch`` found
        failed (:meth:`WeightBroadcaster.check_engines`)."""
        self.sender.check_engines()
        still = []
        for what, fut in self.outstanding:
            if not fut.done():
                still.append((what, fut))
            elif fut.exception() is not None:
                raise _failed_reply(what, fut.exception())
        self.outstanding = still

    def retire(self) -> None:
        """Wait until the oldest bucket's broadcast is done on this side (looking at the replies meanwhile:
        an engine that refused never takes it); then its buffer may go."""
        bucket, work = self.inflight[0]
        while not work.is_completed():
            self.check_replies()
            time.sleep(_POLL_S)
        failure = None
        try:
            self.group.wait(work, host=False)  # later work on this stream sees the broadcast done (NCCL)
        except Exception as exc:  # the collective failed (a peer left, or it timed out)
            failure = str(exc)
        if failure is not None:
            # raised outside the except clause, with no work in this frame: the error's traceback must not
            # keep a work, which would keep the group's connections open after the sender leaves it
            del work
            self.broken = True
            deadline = time.monotonic() + CLOSE_TIMEOUT_S / 10
            while any(not f.done() for _, f in self.outstanding) and time.monotonic() < deadline:
                time.sleep(0.01)  # an engine's own reply says best why: give it a moment
            self.check_replies()
            raise WeightSyncError(f"the broadcast of a bucket of {bucket.nbytes} bytes failed: {failure}")
        self.inflight.popleft()

    def run(self, named_tensors, version: str | None, check_checksum: bool, sglang_engines: bool = False) -> SyncStats:
        sender, engines = self.sender, len(self.conns)
        checksums: list[int] = []
        n = nbytes = 0
        self.post("/pause_generation", "POST", "/pause_generation", {})
        for bucket, last in iter_buckets_with_last(named_tensors, sender.bucket_bytes):
            if bucket.device != sender.device:
                raise ValueError(f"the tensors are on {bucket.device}; this broadcaster sends from {sender.device}")
            metas = bucket.metadata
            body = {"names": [m.name for m in metas], "dtypes": [dtype_name(m.dtype) for m in metas],
                    "shapes": [list(m.shape) for m in metas], "group_name": sender.group_name,
                    "load_format": "flattened_bucket", "flush_cache": last, "abort_all_requests": False}
            if version is not None:
                body["weight_version"] = version
            if not is_back_to_back(metas):
                if sglang_engines:  # SGLang rebuilds the bucket back to back: these offsets would scramble it
                    gap = next(m for i, m in enumerate(metas) if m.start_idx != (metas[i - 1].end_idx if i else 0))
                    raise WeightSyncError(f"bucket {n + 1}: {gap.name} ({dtype_name(gap.dtype)}, shape "
                                          f"{list(gap.shape)}) does not start right after the tensor before it: "
                                          f"SGLang engines take only gap-free buckets (byte counts multiple of 16)")
                body["description"] = bucket.to_dict(with_checksum=False)
            n, nbytes = n + 1, nbytes + bucket.nbytes
            self.post(f"bucket {n} ({len(metas)} tensors, {bucket.nbytes} bytes)", "POST", UPDATE_ENDPOINT, body)
            self.inflight.append((bucket, self.start_broadcast(bucket.buffer)))
            if check_checksum or sglang_engines:
                checksums.append(bucket.checksum)  # a read of the buffer, beside the broadcast's
            self.check_replies()
            while len(self.inflight) > sender.max_inflight:
                self.retire()
        if n == 0:
            raise ValueError("update_weights got no tensors")
        if check_checksum:
            self.post(CHECKSUM_ENDPOINT, "GET", f"{CHECKSUM_ENDPOINT}?bucket_bytes={sender.bucket_bytes}")
        self.post("/continue_generation", "POST", "/continue_generation", {})
        while self.inflight:
            self.retire()
        replies = []
        deadline = time.monotonic() + sender.timeout
        for what, fut in self.requests:
            while True:
                sender.check_engines()  # a reply that never comes (a stopped engine) is not waited out
                try:
                    replies.append(fut.result(timeout=min(_WATCH_POLL_S, max(0.0, deadline - time.monotonic()))))
                    break
                except concurrent.futures.TimeoutError:
                    if time.monotonic() >= deadline:
                        raise WeightSyncError(f"{what}: no reply within {sender.timeout:g} s") from None
                except WeightSyncError as exc:
                    raise _failed_reply(what, exc) from None
        checksum = combine_checksums(checksums) if checksums else None
        if check_checksum:
            got = [r.get("weights_checksum") for r in replies[-2 * engines:-engines]]
            wrong = [f"{url}: {g}" for url, g in zip(sender.urls, got) if g != checksum]
            if wrong:
                raise WeightSyncError(f"after weight update {version!r} the engines' weights differ from the trainer's "
                                      f"(weights_checksum {checksum}): " + "; ".join(wrong))
        return SyncStats(buckets=n, bytes=nbytes, weights_checksum=checksum)


_POLL_S = 50e-6
"""How often the sender looks at a broadcast it waits for (and at the engines' replies meanwhile)."""
_WATCH_POLL_S = 0.05
"""How often a waiting update looks at its ``watch`` (the engines found failed)."""
_FIRST_CALL_POLL_S = 1e-3
"""How often the sender looks at the engines' replies while the group's first broadcast call (NCCL's
communicator setup) has not returned."""


def _failed_reply(what: str, exc: BaseException) -> WeightSyncError:
    """The WeightSyncError of a failed request (``what``: the endpoint or the bucket)."""
    return WeightSyncError(f"{what}: {exc}", getattr(exc, "status", 0))
