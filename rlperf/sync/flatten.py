"""Named tensors -> flattened buckets: the planner, the packing copy, and the checksum of all weights.

Layout rules of the buckets rlperf writes (:func:`plan_buckets`):

* tensors are placed in the order given, greedily: a tensor goes into the current bucket if its
  16-byte-aligned start plus its bytes fit in ``bucket_bytes``, else a new bucket starts;
* a tensor larger than ``bucket_bytes`` gets a bucket of its own (never split);
* every ``start_idx`` is a multiple of :data:`ALIGNMENT` (16 bytes), so the copy kernel moves
  16-byte vectors and every unflattened view is aligned for its dtype;
* a buffer is exactly as long as the end of its last tensor; alignment gaps are zero bytes.

:func:`flatten_buckets` packs each bucket with one launch of the ``rlperf._C`` multi-tensor copy
(:mod:`rlperf.sync.extension`); :func:`iter_buckets` packs the same buckets one at a time, as they
close (a sender that streams its tensors holds one bucket, not all of them). Sources may be
non-contiguous; they are made contiguous first (one extra copy of that tensor) because the bucket
holds a tensor's elements in row-major order. All tensors of one call must share one device, the
buckets'.

:func:`weights_checksum` is one 64-bit hash of a whole set of weights: the bucket checksums
(:mod:`rlperf.sync.checksum`) of its flattening at :data:`rlperf.sync.config.SYNC_BUCKET_BYTES`,
mixed. The same tensors in the same order give the same checksum, on any device (names are not
hashed, only bytes and layout).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from .buckets import FlattenedBucket, FlattenedTensorMetadata
from .checksum import U64, mix64
from .config import SYNC_BUCKET_BYTES
from .dtypes import dtype_name
from .extension import multi_tensor_pack

ALIGNMENT = 16
"""Byte alignment of every tensor's start in a bucket rlperf packs."""


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGNMENT`."""
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _named_items(named_tensors) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, Mapping):
        return named_tensors.items()
    return named_tensors


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")


def _iter_planned(
    named_tensors, bucket_bytes: int
) -> Iterator[tuple[list[FlattenedTensorMetadata], list[torch.Tensor], int, bool]]:
    """Yield (metadata, contiguous sources, buffer bytes, is the last bucket) per bucket, as soon as
    each bucket closes (a bucket closed by a tensor that does not fit is not the last one).

    A generator, so :func:`flatten_buckets` launches bucket k's copy before planning bucket k+1
    (the host plans while the device copies).
    """
    _check_bucket_bytes(bucket_bytes)
    seen: set[str] = set()
    device: torch.device | None = None
    first_name = ""
    metas: list[FlattenedTensorMetadata] = []
    srcs: list[torch.Tensor] = []
    end = 0
    for item in _named_items(named_tensors):
        try:
            name, tensor = item
        except (TypeError, ValueError):
            raise ValueError(f"expected (name, tensor) pairs, got {item!r}") from None
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {name!r} has layout {tensor.layout}; only dense (strided) tensors flatten")
        if device is None:
            device, first_name = tensor.device, name
        elif tensor.device != device:
            raise ValueError(f"tensor {name!r} is on {tensor.device} but {first_name!r} is on {device}: one device per call")
        dtype_name(tensor.dtype)  # rejects dtypes a description could not name
        t = tensor.detach()
        if not t.is_contiguous():
            t = t.contiguous()  # the bucket holds row-major elements; one extra copy of this tensor
        nbytes = t.numel() * t.element_size()
        start = align_up(end)
        if metas and start + nbytes > bucket_bytes:
            yield metas, srcs, end, False
            metas, srcs, start = [], [], 0
        metas.append(FlattenedTensorMetadata(name, tuple(t.shape), t.dtype, start, start + nbytes, nbytes))  # numel: bytes
        srcs.append(t)
        end = start + nbytes
    if metas:
        yield metas, srcs, end, True


def plan_buckets(named_tensors, bucket_bytes: int = SYNC_BUCKET_BYTES) -> list[list[FlattenedTensorMetadata]]:
    """The bucket layout :func:`flatten_buckets` would use, without copying anything.

    Parameters
    ----------
    named_tensors : iterable of (str, Tensor) or mapping str -> Tensor
    bucket_bytes : int
        Upper bound of a bucket's buffer length in bytes (alignment padding included), except for
        a single tensor larger than it, which gets a bucket of its own.

    Returns
    -------
    list of buckets, each a list of :class:`FlattenedTensorMetadata` in placement order.
    """
    return [metas for metas, _, _, _ in _iter_planned(named_tensors, bucket_bytes)]


def flatten_buckets(named_tensors, bucket_bytes: int = SYNC_BUCKET_BYTES) -> list[FlattenedBucket]:
    """Pack named tensors into uint8 buckets, one multi-tensor copy launch per bucket.

    Parameters
    ----------
    named_tensors : iterable of (str, Tensor) or mapping str -> Tensor
        Any dtypes in :data:`rlperf.sync.dtypes.DTYPES`, any shapes (zero-size included), one
        device; non-contiguous tensors are made contiguous first. Names must be unique.
    bucket_bytes : int
        Bucket size limit in bytes (default :data:`rlperf.sync.config.SYNC_BUCKET_BYTES`, 512 MiB);
        see :func:`plan_buckets`.

    Returns
    -------
    list of :class:`FlattenedBucket` (empty for an empty input), buffers on the tensors' device.
    The checksum is not computed here (it would read every bucket again); ask
    :attr:`FlattenedBucket.checksum` when it is needed.
    """
    return list(iter_buckets(named_tensors, bucket_bytes))


def iter_buckets(named_tensors, bucket_bytes: int = SYNC_BUCKET_BYTES) -> Iterator[FlattenedBucket]:
    """:func:`flatten_buckets` one bucket at a time, same layout: a bucket is packed and yielded as
    soon as it closes (the next tensor does not fit, or the input ends).

    ``named_tensors`` may be a generator that produces each tensor only when asked (an FSDP
    trainer's parameters, gathered one by one): while a bucket is packed, only its own tensors and
    the first tensor of the next bucket have been drawn. A consumer that drops each bucket before
    asking for the next one holds about one bucket of memory, never the whole set.
    """
    for bucket, _ in iter_buckets_with_last(named_tensors, bucket_bytes):
        yield bucket


def iter_buckets_with_last(named_tensors, bucket_bytes: int = SYNC_BUCKET_BYTES) -> Iterator[tuple[FlattenedBucket, bool]]:
    """:func:`iter_buckets`, each bucket paired with whether it is the last one. Known without
    packing the next bucket: a bucket that closes because the next tensor does not fit is not the
    last; the one that closes because the input ended is (a sender marks its final request so)."""
    for metas, srcs, nbytes, last in _iter_planned(named_tensors, bucket_bytes):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=srcs[0].device)
        multi_tensor_pack(srcs, buffer, [m.start_idx for m in metas])
        yield FlattenedBucket(buffer, metas, _checked=True), last


def combine_checksums(bucket_checksums: Iterable[int]) -> str:
    """The :func:`weights_checksum` of a flattening from its buckets' checksums, in bucket order
    (:attr:`FlattenedBucket.checksum`): a sender that hashes the buckets it sends gets the checksum
    of what it sent without reading the weights again."""
    h = 0
    for c in bucket_checksums:
        h = mix64((h + c) & U64)
    return f"{h:016x}"


def weights_checksum(named_tensors, bucket_bytes: int = SYNC_BUCKET_BYTES) -> str:
    """One 64-bit hex checksum of all weights: the bucket checksums of a fixed-size flattening, mixed
    (:func:`combine_checksums`).

    The bucket size is part of the definition (padding and bucket boundaries are hashed): compare
    checksums taken at the same ``bucket_bytes``. The buckets are packed and hashed one at a time
    (:func:`iter_buckets`), so this needs about one bucket of extra memory, not a copy of the weights.
    """
    return combine_checksums(b.checksum for b in iter_buckets(named_tensors, bucket_bytes))
