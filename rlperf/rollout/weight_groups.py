"""The engine's side of SGLang's distributed weight update: typed requests, its process groups, the receive.

``rlperf serve``'s handlers (:mod:`rlperf.rollout.server`) only turn JSON into the typed requests here
(SGLang 0.5.9's ``InitWeightsUpdateGroupReqInput`` and ``UpdateWeightsFromDistributedReqInput``, same
field names, defaults and meanings) and back; the sender's side and the group itself are
:mod:`rlperf.sync.distributed`.

* ``POST /init_weights_update_group`` (:class:`InitGroupRequest`): join the group named
  ``group_name`` as rank ``rank_offset`` (+ this engine's tensor-parallel rank, always 0 here) of
  ``world_size``; rank 0 (the trainer) is the store master at ``master_address:master_port`` and the
  root of every broadcast. ``backend`` ``nccl`` needs a CUDA engine; ``gloo`` works anywhere (a CUDA
  engine receives into host memory, then copies).
* ``POST /update_weights_from_distributed`` (:class:`DistributedUpdateRequest`): take part in the
  broadcasts of one update request and load what arrives into the parameters named ``names``.
  ``load_format`` absent: one broadcast per tensor, in order, each in its ``dtype`` and ``shape``
  (SGLang's default). ``"flattened_bucket"``: one broadcast of one uint8 buffer holding the tensors
  back to back (:func:`rlperf.sync.distributed.sglang_bucket_layout`), or where rlperf's
  ``description`` says (byte offsets; its checksum, when given, is verified), unflattened and loaded
  by :class:`rlperf.sync.FlattenedBucket`. ``flush_cache`` (default true, SGLang's) flushes the KV
  cache when the engine is idle and, on CUDA, waits for the device, so the reply means the weights
  are in place; otherwise the reply means the receive and load are queued on the device, ahead of
  any later step. ``weight_version`` sets the engine's version; ``abort_all_requests`` aborts what
  is in flight first.
* ``POST /destroy_weights_update_group``: leave a group.

Checks, before any collective is joined (a 400 naming the field, the group untouched): types, dtype
names from :data:`rlperf.sync.DTYPES`, equal lengths, non-negative shapes, a known group, at most
the bytes of this engine's weights. A request that passes them but names a tensor the model lacks
(or with another shape or dtype) still receives its broadcast, so the sender and the group stay in
step, then loads nothing and answers 400 with the mismatch. A sender pauses the engine around an
update if it wants to; receiving never holds up generation for longer than the bounds below.

Against a peer of the group that misbehaves (the bounds: docs/ARCHITECTURE.md, "Weight updates"):

* gloo (CPU engines, and CUDA engines that ask for it): the membership is held by a child process
  (:class:`rlperf.sync.receiver.GlooReceiver`), because gloo aborts the process that receives a
  message longer than announced. The child receives a whole request into a file both map; only then,
  on the engine thread between steps, is it checked (a broadcast that came short is refused) and
  loaded. So a request loads all its tensors or none: a failed, short, overlong or stalled transfer
  leaves the previous weights in place. Generation goes on during the receive; a receive that has
  not finished after :data:`RECEIVE_TIMEOUT_S` fails.
* NCCL (CUDA engines): receives and loads are queued on the engine thread between steps
  (:mod:`rlperf.rollout.engine_loop`); NCCL carries no sizes, so a mismatch is a broadcast that never
  completes, bounded by :data:`rlperf.sync.distributed.GROUP_TIMEOUT_S`.

A join whose rendezvous does not complete within :data:`JOIN_TIMEOUT_S` (a closed port, a missing
peer) fails. A receive that fails for any reason answers ``{"success": false, "message"}`` with 400,
as SGLang does, and the engine leaves the group (it is no longer listed; the sender forms a new one).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import threading

import torch

from rlperf.sync import DTYPES, FlattenedBucket, FlattenedTensorMetadata, PayloadError, dtype_from_name, load_bucket
from rlperf.sync.distributed import BACKENDS, GROUP_NAME, WeightUpdateGroup, init_weight_update_group, sglang_bucket_layout
from rlperf.sync.receiver import GlooReceiver, ReceiverError, ReceiverGone

from .engine import BadRequest

RECEIVE_SLOTS = 2
"""Receive buffers of the NCCL bucket path (:meth:`WeightGroups._receive_bucket`): bucket k is received
into slot ``k mod RECEIVE_SLOTS`` once the load of bucket ``k - RECEIVE_SLOTS`` has read it, so two
let a receive overlap the previous load; each holds the largest bucket seen (kept between updates,
freed when the engine leaves its last group)."""
MAX_GROUPS = 4
"""Groups one engine may be in at once (each holds a connection to every peer)."""
MAX_WORLD_SIZE = 65536
JOIN_TIMEOUT_S = 120.0
"""Seconds a ``/init_weights_update_group`` waits for its rendezvous (the master's store to answer and
every rank to join) before it fails with 400; the sender starts its store before it asks the engines.
Roomy because a gloo join starts a receiver process that imports torch first, which on a loaded
2-core machine has taken more than 30 s."""
RECEIVE_TIMEOUT_S = 60.0
"""Seconds one ``/update_weights_from_distributed`` request over gloo may take to receive its bytes
before it fails with 400 and the group is left (one 512 MiB bucket takes about a second on loopback;
this only bounds how long a sender that stalls is waited for)."""
COLLECTIVE_MARGIN_S = 10.0
"""How much longer the receiver child's gloo collectives wait than the request's receive bound: the
engine's bound always ends a stalled receive first (the child is killed, the reply names the bound:
"no answer within N s"), never gloo's own timeout inside the child, whose error would race it."""
_RANGE_ALIGN = 16
_NAME = re.compile(r"[A-Za-z0-9_.:/\-]{1,128}")
_HOST = re.compile(r"[A-Za-z0-9_.:\-\[\]%]{1,255}")
LOAD_FORMATS = (None, "flattened_bucket")


class WeightGroupError(RuntimeError):
    """A join, receive or leave that failed after its request was accepted (SGLang answers these with
    ``{"success": false, "message"}`` and status 400)."""


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _int(body: dict, key: str, lo: int, hi: int) -> int:
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be a boolean, got {_short(v)}")
    return v


def group_name_of(body: dict) -> str:
    """``group_name`` (default SGLang's ``weight_update_group``): 1-128 letters, digits, ``_.:/-``."""
    v = body.get("group_name", GROUP_NAME)
    if v is None:
        return GROUP_NAME
    if not isinstance(v, str) or not _NAME.fullmatch(v):
        raise BadRequest(f"'group_name' must be 1-128 characters of letters, digits and _.:/-, got {_short(v)}")
    return v


@dataclasses.dataclass(frozen=True)
class InitGroupRequest:
    """A ``/init_weights_update_group`` body (SGLang's ``InitWeightsUpdateGroupReqInput``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = GROUP_NAME
    backend: str = "nccl"

    @property
    def rank(self) -> int:
        """This engine's rank in the group: ``rank_offset`` plus its tensor-parallel rank (0: one GPU per engine)."""
        return self.rank_offset

    @classmethod
    def from_json(cls, body: dict) -> "InitGroupRequest":
        """Check a decoded body; :class:`BadRequest` naming the field."""
        address = body.get("master_address")
        if not isinstance(address, str) or not _HOST.fullmatch(address):
            raise BadRequest(f"'master_address' must be a host name or IP address, got {_short(address)}")
        world = _int(body, "world_size", 2, MAX_WORLD_SIZE)
        offset = body.get("rank_offset")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 1 <= offset < world:
            raise BadRequest(f"'rank_offset' must be an integer in [1, world_size - 1] = [1, {world - 1}] (rank 0 is "
                             f"the sender), got {_short(offset)}")
        backend = body.get("backend", "nccl")
        if backend not in BACKENDS:
            raise BadRequest(f"'backend' must be one of {list(BACKENDS)}, got {_short(backend)}")
        return cls(address, _int(body, "master_port", 1, 65535), offset, world, group_name_of(body), backend)


@dataclasses.dataclass(frozen=True)
class DistributedUpdateRequest:
    """A ``/update_weights_from_distributed`` body (SGLang's ``UpdateWeightsFromDistributedReqInput``),
    checked; ``layout`` is the bucket's byte layout for ``load_format: "flattened_bucket"``."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    layout: tuple[FlattenedTensorMetadata, ...] | None = None
    nbytes: int = 0
    """Bytes the request receives: the bucket's buffer, or the sum of the tensors' bytes."""
    checksum: int | None = None
    """The ``description``'s bucket checksum, verified after the broadcast (None: not given)."""

    @classmethod
    def from_json(cls, body: dict, max_bytes: int) -> "DistributedUpdateRequest":
        """Check a decoded body; :class:`BadRequest` naming the field. ``max_bytes``: the most bytes
        one request may receive (the engine's weights)."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise BadRequest(f"'names' must be a non-empty list of strings, got {_short(names)}")
        if len(set(names)) != len(names):
            raise BadRequest("'names' lists a tensor twice")
        if not isinstance(dtypes, list) or len(dtypes) != len(names):
            raise BadRequest(f"'dtypes' must be a list of {len(names)} dtype names (one per entry of 'names'), "
                             f"got {_short(dtypes)}")
        if not isinstance(shapes, list) or len(shapes) != len(names):
            raise BadRequest(f"'shapes' must be a list of {len(names)} shapes (one per entry of 'names'), "
                             f"got {_short(shapes)}")
        try:
            dts = tuple(dtype_from_name(d) for d in dtypes)
        except ValueError:
            bad = next(d for d in dtypes if not isinstance(d, str) or (d[6:] if d.startswith("torch.") else d) not in DTYPES)
            raise BadRequest(f"'dtypes': {_short(bad)} is not a dtype name; one of {sorted(DTYPES)}") from None
        shp = []
        for s in shapes:
            if (not isinstance(s, list) or len(s) > 8
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40 for x in s)):
                raise BadRequest(f"'shapes' must hold lists of at most 8 non-negative integers, got {_short(s)}")
            shp.append(tuple(s))
        load_format = body.get("load_format")
        if load_format not in LOAD_FORMATS:
            raise BadRequest(f"'load_format' must be null (one broadcast per tensor) or 'flattened_bucket', "
                             f"got {_short(load_format)}")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise BadRequest(f"'weight_version' must be a string, got {_short(version)}")
        tensor_bytes = sum(math.prod(s) * d.itemsize for s, d in zip(shp, dts))
        if tensor_bytes > max_bytes:
            raise BadRequest(f"'shapes' describe {tensor_bytes} bytes; this engine's weights are {max_bytes} bytes")
        layout, nbytes, checksum = None, tensor_bytes, None
        description = body.get("description")
        if description is not None:
            if load_format != "flattened_bucket":
                raise BadRequest("'description' (rlperf's bucket layout) needs load_format 'flattened_bucket'")
            layout, nbytes, checksum = _description_layout(description, names, dts, shp, max_bytes)
        elif load_format == "flattened_bucket":
            layout = tuple(sglang_bucket_layout(names, dts, shp))
        return cls(tuple(names), dts, tuple(shp), group_name_of(body), _bool(body, "flush_cache", True),
                   _bool(body, "abort_all_requests", False), version, load_format, layout, nbytes, checksum)


def _description_layout(description, names, dtypes, shapes, max_bytes: int):
    """(layout, nbytes, checksum) of rlperf's bucket description, which must list exactly the tensors
    of ``names``/``dtypes``/``shapes`` in that order; BadRequest otherwise."""
    if not isinstance(description, dict):
        raise BadRequest(f"'description' must be an object (FlattenedBucket.to_dict()), got {_short(description)}")
    nbytes = description.get("nbytes")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= max_bytes + 16 * len(names):
        raise BadRequest(f"'description.nbytes' must be an integer in [0, {max_bytes + 16 * len(names)}], "
                         f"got {_short(nbytes)}")
    try:  # format, ranges inside the buffer, no overlap, byte counts: the bucket's own checks, on a meta buffer
        bucket = FlattenedBucket.from_dict(description, torch.empty(nbytes, dtype=torch.uint8, device="meta"))
    except ValueError as exc:
        raise BadRequest(f"'description': {exc}") from None
    expected = [(n, d, s) for n, d, s in zip(names, dtypes, shapes)]
    if [(m.name, m.dtype, m.shape) for m in bucket.metadata] != expected:
        raise BadRequest("'description' must list the tensors of 'names', 'dtypes' and 'shapes', in that order")
    checksum = description.get("checksum")
    return bucket.metadata, nbytes, None if checksum is None else int(checksum, 16)


def _mismatch(req: DistributedUpdateRequest, params: dict) -> str | None:
    """Why the request's tensors cannot load into ``params`` (the first reason and a count), or None."""
    problems = []
    for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):
        p = params.get(name)
        if p is None:
            problems.append(f"{name!r} is not a parameter of this engine's model")
        elif p.dtype != dtype or tuple(p.shape) != shape:
            problems.append(f"{name!r} is {list(shape)} {dtype} but the engine's parameter is {list(p.shape)} {p.dtype}")
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"'names': {problems[0]}{more}; the broadcast was received and dropped, no weight was loaded"


def receive_ranges(req: DistributedUpdateRequest) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each broadcast of ``req`` in a gloo receive buffer: the bucket's one
    buffer, or one range per tensor at 16-byte-aligned offsets (each viewable as its dtype)."""
    if req.layout is not None:
        return [(0, req.nbytes)]
    out, offset = [], 0
    for dtype, shape in zip(req.dtypes, req.shapes):
        nbytes = math.prod(shape) * dtype.itemsize
        out.append((offset, nbytes))
        offset += -(-nbytes // _RANGE_ALIGN) * _RANGE_ALIGN
    return out


class WeightGroups:
    """The weight-update groups this engine is in (name -> :class:`WeightUpdateGroup` for NCCL, or the
    :class:`GlooReceiver` child holding a gloo membership) and each request's receive. :meth:`join`
    and :meth:`receive_isolated` run the blocking parts off the event loop; :meth:`receive` (NCCL)
    and :meth:`load_received` run on the engine thread; :meth:`leave` from any thread.

    ``join_timeout`` and ``receive_timeout``: :data:`JOIN_TIMEOUT_S` and :data:`RECEIVE_TIMEOUT_S`."""

    def __init__(self, device: torch.device, join_timeout: float = JOIN_TIMEOUT_S,
                 receive_timeout: float = RECEIVE_TIMEOUT_S):
        self.device = torch.device(device)
        self.join_timeout, self.receive_timeout = join_timeout, receive_timeout
        self.groups: dict[str, WeightUpdateGroup | GlooReceiver] = {}
        self._joining: dict[str, GlooReceiver | None] = {}
        self._lock = threading.Lock()
        self._streams: tuple | None = None  # CUDA: (receive, load) streams of the bucket path
        # CUDA: the bucket path's receive buffers, RECEIVE_SLOTS of them used in turn, each with the event
        # of the load that last read it (module docstring of rlperf.sync.distributed: the pipeline)
        self._slots: list[list] = [[None, None] for _ in range(RECEIVE_SLOTS)]
        self._next_slot = 0
        self._lost: list[str] = []  # receivers found dead at an update (ReceiverGone): this engine has failed

    def names(self) -> list[str]:
        return sorted(self.groups)

    def isolated(self, name: str) -> bool:
        """Whether group ``name`` is held by a child process (gloo): receive with :meth:`receive_isolated`."""
        return isinstance(self.groups.get(name), GlooReceiver)

    async def join(self, req: InitGroupRequest) -> str:
        """Join ``req``'s group (BadRequest before trying; WeightGroupError when the rendezvous fails or
        takes longer than ``join_timeout``)."""
        name = req.group_name
        with self._lock:
            if name in self.groups or name in self._joining:
                raise BadRequest(f"'group_name': this engine is already in a group named {name!r} "
                                 "(POST /destroy_weights_update_group first)")
            if len(self.groups) + len(self._joining) >= MAX_GROUPS:
                raise BadRequest(f"'group_name': this engine is in {MAX_GROUPS} groups already, the most it joins")
            if req.backend == "nccl" and self.device.type != "cuda":
                raise BadRequest(f"'backend': nccl needs a CUDA engine; this one runs on {self.device.type} (use gloo)")
            receiver = GlooReceiver(name) if req.backend == "gloo" else None
            self._joining[name] = receiver
        try:
            if receiver is not None:
                await asyncio.to_thread(receiver.join, req.master_address, req.master_port, req.rank,
                                        req.world_size, self.join_timeout, self.receive_timeout + COLLECTIVE_MARGIN_S)
                group = receiver
            else:
                group = await asyncio.to_thread(
                    init_weight_update_group, req.master_address, req.master_port, req.rank, req.world_size,
                    group_name=name, backend=req.backend, device=self.device, connect_timeout=self.join_timeout)
        except Exception as exc:  # the rendezvous failed or timed out: the sender's problem, not this engine's
            if receiver is not None:
                receiver.close()
            raise WeightGroupError(f"Failed to initialize custom process group: {exc}.") from None
        finally:
            with self._lock:
                self._joining.pop(name, None)
        with self._lock:
            if receiver is not None and receiver.closed:  # closed meanwhile (the server is stopping)
                raise WeightGroupError("Failed to initialize custom process group: the engine is shutting down.")
            self.groups[name] = group
        return (f"Succeeded to initialize custom process group {name!r} (rank {req.rank} of {req.world_size}, "
                f"{req.backend}).")

    def leave(self, name: str) -> bool:
        """Leave group ``name``; False when this engine is not in it. The last group to go frees the
        receive buffers."""
        with self._lock:
            group = self.groups.pop(name, None)
        if group is None:
            return False
        group.close()
        if not self.groups:
            self._slots = [[None, None] for _ in range(RECEIVE_SLOTS)]
        return True

    def close_all(self) -> None:
        """Leave every group and stop every join under way (a server that stops: its children die now)."""
        with self._lock:
            joining = [r for r in self._joining.values() if r is not None]
        for r in joining:
            r.close()
        for name in self.names():
            self.leave(name)

    def broken(self) -> list[str]:
        """Why each gloo group's receiver child can no longer receive, or could not at an update (it died:
        the engine has failed, and stays failed)."""
        with self._lock:
            groups = list(self.groups.values())
        return [*self._lost, *(why for g in groups if isinstance(g, GlooReceiver) and (why := g.dead()) is not None)]

    def require(self, name: str) -> None:
        if name not in self.groups:
            raise BadRequest(f"'group_name': this engine is in no group named {name!r} (POST /init_weights_update_group "
                             f"first; its groups: {self.names()})")

    async def receive_isolated(self, req: DistributedUpdateRequest) -> torch.Tensor:
        """A gloo group's receive of ``req`` in its child process (off the event loop, generation going
        on): the received bytes, laid out as :func:`receive_ranges` says. WeightGroupError (and the
        group left) when the child fails, a broadcast comes short or overlong, or ``receive_timeout``
        passes."""
        self.require(req.group_name)
        receiver = self.groups[req.group_name]
        try:
            return await asyncio.to_thread(receiver.receive, receive_ranges(req), self.receive_timeout)
        except ReceiverError as exc:
            if isinstance(exc, ReceiverGone):
                self._lost.append(str(exc))
            self.leave(req.group_name)
            raise WeightGroupError(f"Failed to update parameter online: {exc}. No weight was loaded; this engine "
                                   f"left the group {req.group_name!r} (the previous weights stay).") from None

    def load_received(self, req: DistributedUpdateRequest, data: torch.Tensor, params: dict[str, torch.Tensor]) -> int:
        """On the engine thread: load what :meth:`receive_isolated` received into ``params``; the number of
        tensors. BadRequest when the tensors do not match ``params``, PayloadError when a description's
        checksum disagrees (nothing loaded either way)."""
        mismatch = _mismatch(req, params)
        if mismatch:
            raise BadRequest(mismatch)
        with torch.no_grad():
            if req.layout is not None:
                self._load(FlattenedBucket(data[:req.nbytes].to(self.device), req.layout), req, params)
            else:
                for (offset, nbytes), name, dtype, shape in zip(receive_ranges(req), req.names, req.dtypes, req.shapes):
                    src = data[offset:offset + nbytes]
                    params[name].copy_(src.view(dtype).reshape(shape) if nbytes else
                                       torch.empty(shape, dtype=dtype))
        return len(req.names)

    def receive(self, req: DistributedUpdateRequest, params: dict[str, torch.Tensor]) -> int:
        """An NCCL group's receive, on the engine thread: take part in ``req``'s broadcasts and load them
        into ``params`` (name -> parameter); returns the number of tensors loaded. BadRequest after
        receiving when the tensors do not match ``params`` (nothing loaded); PayloadError when a
        description's checksum disagrees; WeightGroupError (and the group left) when a broadcast fails."""
        self.require(req.group_name)
        group = self.groups[req.group_name]
        mismatch = _mismatch(req, params)
        try:
            if req.layout is None:
                self._receive_tensors(group, req, None if mismatch else params)
            else:
                self._receive_bucket(group, req, None if mismatch else params)
        except PayloadError:
            raise
        except Exception as exc:
            self.leave(req.group_name)
            raise WeightGroupError(f"Failed to update parameter online: {exc}. The weights of this engine may be "
                                   f"partly updated: update them all again; this engine left the group "
                                   f"{req.group_name!r}.") from None
        if mismatch:
            raise BadRequest(mismatch)
        return len(req.names)

    def _receive_tensors(self, group: WeightUpdateGroup, req: DistributedUpdateRequest, params) -> None:
        """NCCL, SGLang's default format: one broadcast per tensor, all started, then waited for; straight
        into the parameters where they can take it (same device, contiguous), else through a fresh
        tensor. ``params`` None: receive and drop."""
        works, copies = [], []
        with torch.no_grad():
            for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):
                p = params.get(name) if params is not None else None
                if p is not None and p.device == group.device and p.is_contiguous():
                    dst = p.data
                else:
                    dst = torch.empty(shape, dtype=dtype, device=group.device)
                    if p is not None:
                        copies.append((p, dst))
                works.append(group.broadcast(dst))
            for w in works:
                group.wait(w, host=False)
            for p, t in copies:
                p.copy_(t)

    def _receive_bucket(self, group: WeightUpdateGroup, req: DistributedUpdateRequest, params) -> None:
        """NCCL: one broadcast of the bucket's uint8 buffer, then its tensors loaded into ``params``
        (None: receive and drop).

        Nothing here waits for the device. The receive goes into the next of
        :data:`RECEIVE_SLOTS` buffers, kept from one request to the next (grown when a bucket is
        larger), on a stream of its own that waits only for the load that last read that buffer; the
        load waits for the receive and for the engine's stream (a queued step may still read the
        parameters) on a second stream, and the engine's stream waits for the load. So a sender's
        requests can queue up ahead of its broadcasts: the receive of the next bucket overlaps the
        load of this one, the buffers never outnumber the slots, and every later step of the engine
        sees the new weights."""
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        receiving, loading = self._streams
        main = torch.cuda.current_stream(self.device)
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % RECEIVE_SLOTS
        buffer, read = slot
        with torch.cuda.stream(receiving):
            if read is not None:
                receiving.wait_event(read)  # the last load from this buffer is done
            if buffer is None or buffer.numel() < req.nbytes:
                # a buffer allocated on this stream: its memory goes back to this stream's pool, behind the wait
                buffer = slot[0] = torch.empty(req.nbytes, dtype=torch.uint8, device=self.device)
            received = buffer[:req.nbytes]
            work = group.broadcast(received)
        loading.wait_stream(main)
        with torch.cuda.stream(loading):
            group.wait(work, host=False)
            self._load(FlattenedBucket(received, req.layout), req, params)
            slot[1] = loading.record_event()
        main.wait_stream(loading)
        if req.flush_cache:  # the last bucket of an update: the next update starts at slot 0 again
            self._next_slot = 0

    @staticmethod
    def _load(bucket: FlattenedBucket, req: DistributedUpdateRequest, params) -> None:
        if req.checksum is not None and bucket.compute_checksum() != req.checksum:
            raise PayloadError("bucket rejected: checksum mismatch")
        if params is not None:
            load_bucket(bucket, params)
