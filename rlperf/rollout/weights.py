"""Weight updates for the rollout server: flattened buckets described as JSON, never pickles.

A ``/update_weights_from_tensor`` request with ``load_format: "flattened_bucket"`` carries, per
tensor-parallel rank (one here), a *bucket payload* — a JSON object (or a string holding one)::

    {"description": FlattenedBucket.to_dict(),            # rlperf.sync.buckets: names, shapes, dtypes, byte ranges
     "transport": {"kind": "inline", "data": "<base64 of the buffer>"}         # any host
                | {"kind": "shm", "name": "<shared-memory segment>"}            # same host (CPU)
                | {"kind": "cuda_ipc", "device": 0, "handle": "<b64>", ...}}    # same GPU host

The receiver rebuilds a uint8 buffer from the transport — base64 decoding, a copy out of a named
``multiprocessing.shared_memory`` segment, or ``torch.UntypedStorage._new_shared_cuda`` with the
fields ``storage._share_cuda_()`` gave the sender (the one allowlisted rebuild step; no code or
class name ever comes from the request) — then ``FlattenedBucket.from_dict`` checks the
description against the buffer (sizes, ranges, dtypes, checksum) and ``load_into`` checks every
destination before one byte is copied. Anything that disagrees is a :class:`BadRequest`.

The sender side is :func:`bucket_payload` (and :func:`release` for the shared-memory segment);
:func:`push_weights` flattens named tensors and posts every bucket to a server.
"""
from __future__ import annotations

import base64
import binascii
import json
from multiprocessing import shared_memory

import torch

from rlperf.sync.buckets import DEFAULT_BUCKET_BYTES, FlattenedBucket, flatten_buckets

from .engine import BadRequest

TRANSPORTS = ("inline", "shm", "cuda_ipc")


def bucket_payload(bucket: FlattenedBucket, transport: str = "inline"):
    """JSON payload for ``bucket``; returns ``(payload, handle)`` where ``handle`` must stay alive
    (and, for ``shm``, be passed to :func:`release`) until the server has answered."""
    desc = bucket.to_dict()
    if transport == "inline":
        data = base64.b64encode(bucket.buffer.cpu().numpy().tobytes()).decode()
        return {"description": desc, "transport": {"kind": "inline", "data": data}}, None
    if transport == "shm":
        shm = shared_memory.SharedMemory(create=True, size=max(bucket.nbytes, 1))
        shm.buf[: bucket.nbytes] = bucket.buffer.cpu().numpy().tobytes()
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
    if isinstance(handle, shared_memory.SharedMemory):
        handle.close()
        handle.unlink()


def _field(d: dict, key: str, kind, what: str):
    v = d.get(key)
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"{what}.{key} must be an integer, got {v!r}")
    if kind is not int and not isinstance(v, kind):
        raise BadRequest(f"{what}.{key} must be a {kind.__name__}, got {type(v).__name__}")
    return v


def _b64(d: dict, key: str, what: str) -> bytes:
    try:
        return base64.b64decode(_field(d, key, str, what), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{what}.{key} is not valid base64: {exc}") from None


def _buffer(transport, nbytes: int) -> torch.Tensor:
    if not isinstance(transport, dict):
        raise BadRequest(f"transport must be an object, got {type(transport).__name__}")
    kind = transport.get("kind")
    if kind == "inline":
        raw = _b64(transport, "data", "transport")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if kind == "shm":
        name = _field(transport, "name", str, "transport")
        try:
            shm = shared_memory.SharedMemory(name=name)
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise BadRequest(f"shared-memory segment {name!r} cannot be opened: {exc}") from None
        try:
            if shm.size < nbytes:
                raise BadRequest(f"shared-memory segment {name!r} has {shm.size} bytes, the description says {nbytes}")
            return torch.frombuffer(bytearray(shm.buf[:nbytes]), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        finally:
            shm.close()
    if kind == "cuda_ipc":
        if not torch.cuda.is_available():
            raise BadRequest("transport cuda_ipc needs a CUDA server")
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
                raise BadRequest(f"cuda_ipc handle cannot be opened: {exc}") from None
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
            raise BadRequest(f"cuda_ipc storage has {storage.nbytes()} bytes, the description needs {off + nbytes}")
        t = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return t.set_(storage, off, (nbytes,))
    raise BadRequest(f"transport.kind must be one of {list(TRANSPORTS)}, got {kind!r}")


def receive_bucket(payload, device) -> FlattenedBucket:
    """Rebuild and check one bucket payload (module docstring) on ``device``; BadRequest when anything disagrees."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"bucket payload is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"a bucket payload must be an object with description and transport, got {type(payload).__name__}")
    desc = payload.get("description")
    if not isinstance(desc, dict):
        raise BadRequest("bucket payload field 'description' must be an object (FlattenedBucket.to_dict())")
    nbytes = desc.get("nbytes")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise BadRequest(f"description.nbytes must be a non-negative integer, got {nbytes!r}")
    buffer = _buffer(payload.get("transport"), nbytes)
    try:
        bucket = FlattenedBucket.from_dict(desc, buffer, verify_checksum=True)
    except ValueError as exc:
        raise BadRequest(f"bucket rejected: {exc}") from None
    if bucket.device != torch.device(device):
        bucket = FlattenedBucket(bucket.buffer.to(device), bucket.metadata)
    return bucket


def load_bucket(model, bucket: FlattenedBucket) -> list[str]:
    """Copy the bucket's tensors into the model's parameters (HF names); returns the names loaded."""
    try:
        bucket.load_into(model.hf_state_dict())
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return bucket.names


def push_weights(url: str, named_tensors, *, transport: str = "inline", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 weight_version: str | None = None, api_key: str | None = None, timeout: float = 600.0) -> int:
    """Send ``named_tensors`` (HF names -> tensors) to the server at ``url`` through
    ``/update_weights_from_tensor``, one bucket per request; returns the number of buckets.

    RuntimeError with the server's message when a bucket is refused (earlier buckets stay loaded).
    """
    from .router import http_json

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    buckets = flatten_buckets(named_tensors, bucket_bytes=bucket_bytes)
    for i, bucket in enumerate(buckets):
        payload, handle = bucket_payload(bucket, transport)
        body = {"load_format": "flattened_bucket", "serialized_named_tensors": [payload]}
        if weight_version is not None:
            body["weight_version"] = weight_version
        try:
            status, reply = http_json(url.rstrip("/") + "/update_weights_from_tensor", body, timeout=timeout, headers=headers)
        finally:
            release(handle)
        if status != 200:
            msg = reply.get("error", {}).get("message") if isinstance(reply, dict) else reply
            raise RuntimeError(f"{url}: bucket {i + 1}/{len(buckets)} refused ({status}): {msg}")
    return len(buckets)
