"""Weight-bucket transports: a bucket as a JSON payload, its bytes by value or by handle, never a pickle.

A server's ``/update_weights_from_tensor`` request with ``load_format: "flattened_bucket"`` carries,
per tensor-parallel rank (one here), a *bucket payload* — a JSON object (or a string holding one)::

    {"description": FlattenedBucket.to_dict(),            # rlperf.sync.buckets: names, shapes, dtypes, byte ranges
     "transport": {"kind": "inline", "data": "<base64 of the buffer>"}         # any host
                | {"kind": "shm", "name": "rlperf_bucket_<pid>_<16 hex>"}       # same host (CPU)
                | {"kind": "cuda_ipc", "device": 0, "handle": "<b64>", ...}}    # same GPU host

The receiver rebuilds a uint8 buffer from the transport — base64 decoding, a copy out of a named
``multiprocessing.shared_memory`` segment, or ``torch.UntypedStorage._new_shared_cuda`` with the
fields ``storage._share_cuda_()`` gave the sender (the one allowlisted rebuild step; no code or
class name ever comes from the request) — then ``FlattenedBucket.from_dict`` checks the
description against the buffer (sizes, ranges, dtypes, checksum) and ``load_into`` checks every
destination before one byte is copied. Anything that disagrees is a :class:`PayloadError` (a
server answers 400 with its message).

Shared memory is another process's memory, so the receiver trusts a segment name no further than this:
it opens only names of the form :data:`SHM_NAME` (``rlperf_bucket_<pid>_<16 random hex digits>``, what
:func:`bucket_payload` creates for one transfer) whose size is the description's ``nbytes``; it reads
the segment read-only and never registers it with ``multiprocessing``'s resource tracker (which would
unlink it when the receiver exits; the sender's :func:`release` unlinks it); the description must
carry the checksum, and a mismatch says only "checksum mismatch", never a hash of what was read.

Sender: :func:`bucket_payload` (and :func:`release` for the shared-memory segment). Receiver:
:func:`receive_bucket`, :func:`load_bucket`. :func:`sync_weights` runs the whole path in one
process (flatten, then each bucket straight into the destination or through a transport), as the
loop's in-process engine and the sync benchmark do; the HTTP side (pause, push every bucket, flush,
continue) is the loop's router client (:mod:`rlperf.loop.clients`).
"""
from __future__ import annotations

import atexit
import base64
import binascii
import contextlib
import dataclasses
import json
import os
import re
import secrets
import stat
import sys
from collections.abc import Mapping
from multiprocessing import resource_tracker, shared_memory

import torch

from .buckets import FlattenedBucket
from .config import TRANSPORTS, SyncConfig
from .flatten import flatten_buckets


class PayloadError(ValueError):
    """A bucket payload, or a bucket's destinations, that the receiver refuses; the message says why."""


SHM_PREFIX = "rlperf_bucket_"
SHM_NAME = re.compile(r"rlperf_bucket_[0-9]{1,10}_[0-9a-f]{16}")
"""The only shared-memory names a receiver opens: ``rlperf_bucket_<sender pid>_<64 random bits in hex>``,
one segment per bucket transfer (:func:`bucket_payload`)."""
_SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps POSIX segments on Linux
_created: dict[str, shared_memory.SharedMemory | None] = {}
"""Segments this process created (or is creating: None until the constructor returns) and has not
released, by name (the fallback reader needs the names; :func:`_release_at_exit` the segments)."""


def _new_segment(nbytes: int) -> shared_memory.SharedMemory:
    """A fresh segment of ``max(nbytes, 1)`` bytes named ``rlperf_bucket_<pid>_<random>`` (:data:`SHM_NAME`)."""
    name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
    _created[name] = None  # first: a stop inside the constructor leaves the name to _release_at_exit
    shm = _created[name] = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
    return shm


def _remove_segment(name: str) -> None:
    """Remove segment ``name`` and leave ``multiprocessing``'s resource tracker without it, from whichever
    state a stop left: never created; created but not yet registered with the tracker (a stop inside the
    constructor); registered; or unlinked with the tracker not told (a stop between the two steps of
    ``SharedMemory.unlink``, which would make the tracker warn of a leak and fail to unlink it at exit).
    The tracker keeps a set of names: registering is idempotent and unregistering an absent name is an
    error it prints, so the name is registered first and unregistered exactly once."""
    key = "/" + name  # the tracker's key: SharedMemory's name on POSIX
    resource_tracker.register(key, "shared_memory")
    try:
        shm = shared_memory.SharedMemory(name=name)  # registers again: a no-op
    except FileNotFoundError:  # never created, or unlinked already
        resource_tracker.unregister(key, "shared_memory")
        return
    shm.close()
    shm.unlink()  # removes the name and unregisters it


def _release_at_exit() -> None:
    """Unlink the segments still held when the interpreter exits: a run stopped by SIGTERM in the middle
    of a weight sync (its ``finally`` may not have reached :func:`release`, or the transfer ran in a
    thread) leaves nothing in ``/dev/shm``, and ``multiprocessing``'s resource tracker has no leak to
    warn about after the run's last line, wherever the stop landed (:func:`_remove_segment`)."""
    for name, shm in list(_created.items()):
        if shm is not None:
            with contextlib.suppress(BufferError):  # a view still open: the unlink frees the name all the same
                shm.close()
        with contextlib.suppress(OSError):
            _remove_segment(name)
        _created.pop(name, None)


atexit.register(_release_at_exit)


def bucket_payload(bucket: FlattenedBucket, transport: str = "inline"):
    """JSON payload for ``bucket``; returns ``(payload, handle)`` where ``handle`` must stay alive
    (and, for ``shm``, be passed to :func:`release`) until the server has answered."""
    desc = bucket.to_dict()
    if transport == "inline":
        data = base64.b64encode(bucket.buffer.cpu().numpy().tobytes()).decode()
        return {"description": desc, "transport": {"kind": "inline", "data": data}}, None
    if transport == "shm":
        shm = _new_segment(bucket.nbytes)
        try:
            shm.buf[: bucket.nbytes] = bucket.buffer.cpu().numpy().tobytes()
        except BaseException:  # SIGTERM (cli.Terminated) or an error before the caller holds the handle
            release(shm)
            raise
        return {"description": desc, "transport": {"kind": "shm", "name": shm.name}}, shm
    if transport == "cuda_ipc":
        buf = bucket.buffer
        if buf.device.type != "cuda":
            raise ValueError("cuda_ipc needs a bucket on a CUDA device")
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = buf.untyped_storage()._share_cuda_()
        b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
        return {"description": desc, "transport": {
            "kind": "cuda_ipc", "device": device, "handle": b64(handle), "storage_size": size, "storage_offset": offset,
            "ref_counter_handle": b64(ref_handle), "ref_counter_offset": ref_offset, "event_handle": b64(event_handle),
            "event_sync_required": bool(event_sync), "tensor_offset": buf.storage_offset()}}, buf
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def release(handle) -> None:
    """Free what a :func:`bucket_payload` handle holds once the receiver has answered (the
    shared-memory segment; other handles, None and a segment released before need nothing)."""
    if isinstance(handle, shared_memory.SharedMemory) and handle.name in _created:
        handle.close()
        handle.unlink()
        del _created[handle.name]  # last: a stop before it leaves the segment to _release_at_exit


def _field(d: dict, key: str, kind, what: str):
    v = d.get(key)
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise PayloadError(f"{what}.{key} must be an integer, got {v!r}")
    if kind is not int and not isinstance(v, kind):
        raise PayloadError(f"{what}.{key} must be a {kind.__name__}, got {type(v).__name__}")
    return v


def _b64(d: dict, key: str, what: str) -> bytes:
    try:
        return base64.b64decode(_field(d, key, str, what), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(f"{what}.{key} is not valid base64: {exc}") from None


def _buffer(transport, nbytes: int) -> torch.Tensor:
    if not isinstance(transport, dict):
        raise PayloadError(f"transport must be an object, got {type(transport).__name__}")
    kind = transport.get("kind")
    if kind == "inline":
        raw = _b64(transport, "data", "transport")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if kind == "shm":
        return _read_segment(_field(transport, "name", str, "transport"), nbytes)
    if kind == "cuda_ipc":
        if not torch.cuda.is_available():
            raise PayloadError("transport cuda_ipc needs a CUDA server")
        from torch.multiprocessing import reductions

        what = "transport"
        handle, offset = _b64(transport, "handle", what), _field(transport, "storage_offset", int, what)
        torch.cuda._lazy_init()
        # a handle opened before (the sender reuses its buffer) must come from torch's cache: CUDA
        # refuses to open one IPC handle twice in a process
        storage = reductions.storage_from_cache(torch.UntypedStorage, (handle, offset))
        if storage is None:
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    _field(transport, "device", int, what), handle, _field(transport, "storage_size", int, what), offset,
                    _b64(transport, "ref_counter_handle", what), _field(transport, "ref_counter_offset", int, what),
                    _b64(transport, "event_handle", what), bool(transport.get("event_sync_required", True)))
            except RuntimeError as exc:
                raise PayloadError(f"cuda_ipc handle cannot be opened: {exc}") from None
            reductions.shared_cache[(handle, offset)] = reductions.StorageWeakRef(storage)
        else:
            # already open here: the sender still incremented its reference counter for this
            # message, so release that count now or its memory would never be freed or reused
            torch.UntypedStorage._release_ipc_counter(
                _b64(transport, "ref_counter_handle", what), _field(transport, "ref_counter_offset", int, what),
                device=_field(transport, "device", int, what))
            if not isinstance(storage, torch.UntypedStorage):
                storage = storage._untyped_storage
        off = _field(transport, "tensor_offset", int, what)
        if off + nbytes > storage.nbytes():
            raise PayloadError(f"cuda_ipc storage has {storage.nbytes()} bytes, the description needs {off + nbytes}")
        t = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return t.set_(storage, off, (nbytes,))
    raise PayloadError(f"transport.kind must be one of {list(TRANSPORTS)}, got {kind!r}")


_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
                (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _what(mode: int) -> str:
    return next((w for test, w in _NOT_REGULAR if test(mode)), f"mode {stat.filemode(mode)}")


def _not_regular(name: str, what: str) -> PayloadError:
    return PayloadError(f"transport.name: shared-memory segment {name!r} is not a regular file ({what})")


def _open_regular_segment(name: str):
    """``/dev/shm/<name>`` opened read-only (an unbuffered binary file) when it is a regular file;
    anything else under the name (a directory, a FIFO, a symbolic link, a socket, a device) is a
    :class:`PayloadError` naming ``transport.name`` and what the path is, before one byte is read.
    ``O_NONBLOCK``: a FIFO (or a device) must not block the open; ``O_NOFOLLOW``: a link is never
    followed (the open fails with ``ELOOP``; a socket fails with ``ENXIO``: ``lstat`` then names
    it); ``fstat`` on the opened descriptor decides, so the path cannot change between the check and
    the read."""
    path = os.path.join(_SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        try:  # what the path is, without following a link (a link fails with ELOOP, a socket with ENXIO)
            mode = os.lstat(path).st_mode
        except OSError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise _not_regular(name, _what(mode)) from None
        raise PayloadError(f"transport.name: shared-memory segment {name!r} cannot be opened: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(name, _what(mode))
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _read_segment(name: str, nbytes: int) -> torch.Tensor:
    """A copy of the first ``nbytes`` of the sender's segment ``name`` (module docstring: which names,
    read-only, never tracked, so never unlinked by this process)."""
    if not SHM_NAME.fullmatch(name):
        raise PayloadError(f"transport.name must name a segment rlperf created for this transfer "
                           f"({SHM_PREFIX}<pid>_<16 hex digits>), got {name[:80]!r}")
    if os.path.isdir(_SHM_DIR):
        # Linux: the segment is a file in /dev/shm; opened read-only, nothing registers it anywhere
        f = _open_regular_segment(name)
        with f:
            st = os.fstat(f.fileno())
            if st.st_size != max(nbytes, 1):
                raise PayloadError(f"shared-memory segment {name!r} has {st.st_size} bytes, the description's "
                                   f"nbytes is {nbytes}: not the segment of this bucket")
            out = torch.empty(nbytes, dtype=torch.uint8)
            view, done = memoryview(out.numpy()), 0
            while done < nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise PayloadError(f"shared-memory segment {name!r} ended after {done} of {nbytes} bytes")
                done += n
        return out
    # elsewhere (macOS): attach without leaving the segment to this process's resource tracker
    try:
        if sys.version_info >= (3, 13):
            shm = shared_memory.SharedMemory(name=name, track=False)
        else:
            shm = shared_memory.SharedMemory(name=name)
            if shm.name not in _created:  # registered on attach before 3.13: the tracker would unlink it at exit
                resource_tracker.unregister(shm._name, "shared_memory")
    except (OSError, ValueError) as exc:
        raise PayloadError(f"shared-memory segment {name!r} cannot be opened: {exc}") from None
    try:
        if shm.size < nbytes:
            raise PayloadError(f"shared-memory segment {name!r} has {shm.size} bytes, the description says {nbytes}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        out.numpy()[:] = memoryview(shm.buf)[:nbytes]
    finally:
        shm.close()
    return out


def receive_bucket(payload, device) -> FlattenedBucket:
    """Rebuild and check one bucket payload (module docstring) on ``device``; PayloadError when anything disagrees."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except RecursionError:
            raise PayloadError("bucket payload nests too deeply to be a bucket payload") from None
        except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
            raise PayloadError(f"bucket payload is not JSON: {str(exc)[:200]}") from None
    if not isinstance(payload, dict):
        raise PayloadError(f"a bucket payload must be an object with description and transport, got {type(payload).__name__}")
    desc = payload.get("description")
    if not isinstance(desc, dict):
        raise PayloadError("bucket payload field 'description' must be an object (FlattenedBucket.to_dict())")
    nbytes = desc.get("nbytes")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise PayloadError(f"description.nbytes must be a non-negative integer, got {nbytes!r}")
    buffer = _buffer(payload.get("transport"), nbytes)
    try:
        bucket = FlattenedBucket.from_dict(desc, buffer, verify_checksum=True)
    except ValueError as exc:
        raise PayloadError(f"bucket rejected: {exc}") from None
    if bucket.device != torch.device(device):
        bucket = FlattenedBucket(bucket.buffer.to(device), bucket.metadata)
    return bucket


def load_bucket(bucket: FlattenedBucket, params: Mapping[str, torch.Tensor]) -> list[str]:
    """Copy the bucket's tensors into ``params`` (name -> destination, e.g. a model's
    ``hf_state_dict()``); returns the names loaded. PayloadError when a destination disagrees."""
    try:
        bucket.load_into(params)
    except ValueError as exc:
        raise PayloadError(str(exc)) from None
    return bucket.names


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """What one :func:`sync_weights` moved."""

    buckets: int
    bytes: int
    """Bytes of the bucket buffers (alignment gaps included)."""
    weights_checksum: str | None = None
    """The :func:`rlperf.sync.weights_checksum` every engine reported after the sync, equal to the
    sender's (a broadcast checks it: :class:`rlperf.sync.distributed.WeightBroadcaster`); None when
    the sync did not ask the engines."""


def sync_weights(named_tensors, params: Mapping[str, torch.Tensor], *, config: SyncConfig | None = None) -> SyncStats:
    """Flatten ``named_tensors`` into buckets and load every bucket into ``params``, in this process.

    ``params`` maps names to destination tensors (contiguous, the buckets' shapes and dtypes; it may
    hold more names). ``config.transport`` None copies each bucket's tensors straight into the
    destinations (one launch per bucket; same device); a transport sends each bucket as that payload
    and receives it as a server does (:func:`receive_bucket`: description and checksum checked),
    onto the destinations' device. The bucket size is ``config.bucket_bytes``.
    """
    config = config or SyncConfig()
    buckets = flatten_buckets(named_tensors, bucket_bytes=config.bucket_bytes)
    device = next(iter(params.values())).device if params else None
    nbytes = 0
    for b in buckets:
        if config.transport is None:
            b.load_into(params)
        else:
            handle = None
            try:
                payload, handle = bucket_payload(b, config.transport)
                load_bucket(receive_bucket(payload, device or b.device), params)
            finally:
                release(handle)
        nbytes += b.nbytes
    return SyncStats(buckets=len(buckets), bytes=nbytes)
