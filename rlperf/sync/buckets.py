"""Flattened buckets: many named tensors in one contiguous uint8 buffer, and the metadata that finds them.

Weight sync (trainer -> rollout servers) moves parameters as *buckets*: each bucket is one
contiguous ``torch.uint8`` buffer holding many tensors of any dtypes, plus per-tensor metadata with
SGLang's ``FlattenedTensorMetadata`` fields ``{name, shape, dtype, start_idx, end_idx, numel}`` in
SGLang's meanings (``sglang.srt.weight_sync.tensor_bucket``): ``start_idx``/``end_idx`` are *byte*
offsets into the buffer and ``numel`` is the tensor's **byte** count, not its element count::

    numel == end_idx - start_idx == prod(shape) * dtype.itemsize

Buckets cross both ways with SGLang's own ``FlattenedTensorBucket``: its
``FlattenedTensorBucket(flattened_tensor=bucket.buffer, metadata=bucket.metadata)`` rebuilds an
rlperf bucket, and ``FlattenedBucket(sglang_bucket.get_flattened_tensor(),
sglang_bucket.get_metadata())`` takes an SGLang one (its metadata objects are converted and
checked; :meth:`FlattenedTensorMetadata.of`).

rlperf packs buckets with :func:`rlperf.sync.flatten.flatten_buckets` (its layout rules: aligned
starts, zero gaps). Buckets rlperf *reads* need not follow those rules: SGLang flattens unpadded
(tensors back to back, so e.g. a float32 after 3 int8 bytes starts at byte 3). Any non-overlapping
ranges inside the buffer are accepted. :meth:`FlattenedBucket.unflatten` gives zero-copy views of
tensors whose start is aligned for their dtype and copies of the others (one launch for all of
them), and :meth:`FlattenedBucket.load_into` copies bytes, so it loads aligned and misaligned
tensors alike. Both are one launch of the ``rlperf._C`` multi-tensor copy (:mod:`rlperf.sync.extension`).

Destinations of :meth:`FlattenedBucket.load_into` must be contiguous (a byte copy cannot write
through strides); a non-contiguous destination is rejected with an error that names it. All tensors
of one call must share one device, the bucket's.

Descriptions (:meth:`FlattenedBucket.to_dict` / :meth:`FlattenedBucket.from_dict`): plain JSON
data (format tag, byte size, checksum as 16 hex digits (:mod:`rlperf.sync.checksum`), per-tensor
metadata ``{name, shape, dtype, start_idx, end_idx, numel}`` with ``numel`` the byte count as above
and dtype names from an allowlist (:mod:`rlperf.sync.dtypes`)), so a server can rebuild views over a
received buffer without unpickling anything.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import torch

from .checksum import bucket_checksum, check_buffer
from .dtypes import dtype_from_name, dtype_name
from .extension import multi_tensor_unpack

# v2: metadata numel is the byte count (SGLang's meaning); a v1 sender (element counts) is refused by name
DESCRIPTION_FORMAT = "rlperf.flattened_bucket.v2"


_METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
_CHECKSUM_HEX = re.compile(r"[0-9a-fA-F]{16}")


@dataclasses.dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one tensor lives in a bucket: SGLang's ``FlattenedTensorMetadata``, same fields, same meanings.

    ``start_idx``/``end_idx``: byte offsets into the bucket's uint8 buffer. ``numel``: the tensor's
    **byte** count, as SGLang writes it (``end_idx - start_idx``), so
    ``numel == end_idx - start_idx == prod(shape) * dtype.itemsize``; the element count is
    :attr:`nelements`. Buckets rlperf packs start every tensor at a multiple of
    :data:`rlperf.sync.flatten.ALIGNMENT`; received metadata may start anywhere (SGLang's flattening
    is unpadded).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the buffer (``end_idx - start_idx``, equal to :attr:`numel`)."""
        return self.end_idx - self.start_idx

    @property
    def nelements(self) -> int:
        """Number of elements (``prod(shape)``); ``numel`` is a byte count, this is not."""
        return math.prod(self.shape)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "start_idx": self.start_idx,
            "end_idx": self.end_idx,
            "numel": self.numel,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "FlattenedTensorMetadata":
        """Rebuild from :meth:`to_dict` output, checking every field's type and consistency.

        ``dtype`` is a name from :data:`DTYPES` (``"bfloat16"`` or ``"torch.bfloat16"``); ``numel``
        is the byte count (module docstring).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"tensor metadata must be a mapping, got {type(d).__name__}")
        missing = set(_METADATA_FIELDS) - set(d)
        if missing:
            raise ValueError(f"tensor metadata {d.get('name', '?')!r} lacks fields {sorted(missing)}")
        name = d["name"]
        if not isinstance(name, str):
            raise ValueError(f"tensor metadata name must be a string, got {name!r}")

        def nonneg_int(key: str, value) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"tensor {name!r}: {key} must be a non-negative int, got {value!r}")
            return value

        shape = d["shape"]
        if not isinstance(shape, (list, tuple)):
            raise ValueError(f"tensor {name!r}: shape must be a list of ints, got {shape!r}")
        shape = tuple(nonneg_int("shape", s) for s in shape)
        try:
            dtype = dtype_from_name(d["dtype"])
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: dtype: {exc}") from None
        meta = cls(
            name=name,
            shape=shape,
            dtype=dtype,
            start_idx=nonneg_int("start_idx", d["start_idx"]),
            end_idx=nonneg_int("end_idx", d["end_idx"]),
            numel=nonneg_int("numel", d["numel"]),
        )
        meta._check_consistent()
        return meta

    @classmethod
    def of(cls, meta) -> "FlattenedTensorMetadata":
        """This class's metadata for ``meta``: returned as is, a mapping (:meth:`from_dict`), or any
        object with the six attributes, such as SGLang's own ``FlattenedTensorMetadata`` (``shape``
        a ``torch.Size``, ``dtype`` a ``torch.dtype``). Checked like :meth:`from_dict`."""
        if isinstance(meta, cls):
            return meta
        if isinstance(meta, Mapping):
            return cls.from_dict(meta)
        missing = [f for f in _METADATA_FIELDS if not hasattr(meta, f)]
        if missing:
            raise ValueError(f"tensor metadata {type(meta).__name__} lacks attributes {missing}")
        d = {f: getattr(meta, f) for f in _METADATA_FIELDS}
        if isinstance(d["dtype"], torch.dtype):
            try:
                d["dtype"] = dtype_name(d["dtype"])
            except ValueError as exc:
                raise ValueError(f"tensor {d['name']!r}: dtype: {exc}") from None
        if isinstance(d["shape"], torch.Size):
            d["shape"] = list(d["shape"])
        return cls.from_dict(d)

    def _check_consistent(self) -> None:
        itemsize = self.dtype.itemsize
        nbytes = self.end_idx - self.start_idx
        if nbytes != self.numel:
            raise ValueError(
                f"tensor {self.name!r}: bytes [{self.start_idx}, {self.end_idx}) do not hold numel {self.numel}: "
                f"end_idx - start_idx = {nbytes} != numel (numel is the byte count, as in SGLang's "
                "FlattenedTensorMetadata)"
            )
        expected = math.prod(self.shape) * itemsize
        if self.numel != expected:
            raise ValueError(
                f"tensor {self.name!r}: numel {self.numel} != the bytes of shape {list(self.shape)} of "
                f"{dtype_name(self.dtype)} ({math.prod(self.shape)} elements x {itemsize} bytes = {expected})"
            )



class FlattenedBucket:
    """One uint8 buffer and the metadata of the tensors packed in it.

    Parameters
    ----------
    buffer : Tensor
        1-D contiguous ``torch.uint8``; every metadata byte range lies inside it.
    metadata : sequence of FlattenedTensorMetadata (or SGLang's ``FlattenedTensorMetadata``, or dicts)
        Non-overlapping byte ranges with unique names, at any byte offsets (SGLang's unpadded
        layout included); foreign entries are converted by :meth:`FlattenedTensorMetadata.of`.
        ``numel`` is the byte count (module docstring).
    """

    def __init__(self, buffer: torch.Tensor, metadata: Sequence[FlattenedTensorMetadata], *, _checked: bool = False):
        check_buffer(buffer)
        self.buffer = buffer
        self.metadata: tuple[FlattenedTensorMetadata, ...] = (
            tuple(metadata) if _checked else tuple(FlattenedTensorMetadata.of(m) for m in metadata)
        )
        self._checksum: int | None = None
        if not _checked:
            self._validate()

    def _validate(self) -> None:
        names = set()
        previous_end, previous_name = 0, None
        for m in sorted(self.metadata, key=lambda m: (m.start_idx, m.end_idx)):
            m._check_consistent()
            if m.name in names:
                raise ValueError(f"tensor name {m.name!r} appears twice in one bucket")
            names.add(m.name)
            if m.end_idx > self.nbytes:
                raise ValueError(f"tensor {m.name!r}: bytes [{m.start_idx}, {m.end_idx}) exceed the {self.nbytes}-byte buffer")
            if m.nbytes and m.start_idx < previous_end:
                raise ValueError(f"tensor {m.name!r} overlaps tensor {previous_name!r} in the bucket")
            if m.nbytes:
                previous_end, previous_name = m.end_idx, m.name

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]

    def __len__(self) -> int:
        return len(self.metadata)

    def __repr__(self) -> str:
        return f"FlattenedBucket({len(self.metadata)} tensors, {self.nbytes} bytes, {self.device})"

    @property
    def checksum(self) -> int:
        """:func:`bucket_checksum` of the buffer, computed on first access and cached.

        The buffer is treated as immutable once packed; :meth:`compute_checksum` rehashes it.
        """
        if self._checksum is None:
            self._checksum = bucket_checksum(self.buffer)
        return self._checksum

    def compute_checksum(self) -> int:
        """Hash the buffer now (ignores and refreshes the cached value)."""
        self._checksum = bucket_checksum(self.buffer)
        return self._checksum

    def _viewable(self, m: FlattenedTensorMetadata) -> bool:
        """Whether ``buffer[m.start_idx:m.end_idx]`` can be viewed as ``m.dtype`` in place: its
        address and its storage offset (torch's condition for ``view(dtype)``) are multiples of
        the item size."""
        itemsize = m.dtype.itemsize
        return (
            (self.buffer.storage_offset() + m.start_idx) % itemsize == 0
            and (self.buffer.data_ptr() + m.start_idx) % itemsize == 0
        )

    def unflatten(self) -> dict[str, torch.Tensor]:
        """name -> the tensor, ``buffer[start_idx:end_idx]`` as ``dtype`` and ``shape``, in metadata order.

        Zero-copy where the tensor's start is aligned for its dtype (always, for buckets rlperf
        packs): the view shares the buffer's memory, so writing it writes the bucket. Where it is
        not (SGLang's unpadded layout puts e.g. a float32 at byte 3), a view is impossible and the
        tensor is a contiguous copy on the bucket's device, made for all such tensors of the
        bucket with one multi-tensor copy launch; writing a copy does not write the bucket.
        """
        out: dict[str, torch.Tensor] = {}
        copies: list[torch.Tensor] = []
        offsets: list[int] = []
        for m in self.metadata:
            if self._viewable(m):
                out[m.name] = self.buffer[m.start_idx : m.end_idx].view(m.dtype).view(m.shape)
            else:
                t = torch.empty(m.shape, dtype=m.dtype, device=self.buffer.device)
                out[m.name] = t
                if m.nbytes:
                    copies.append(t)
                    offsets.append(m.start_idx)
        if copies:
            multi_tensor_unpack(self.buffer, copies, offsets)
        return out

    def load_into(self, params: Mapping[str, torch.Tensor]) -> None:
        """Copy every tensor of the bucket into ``params[name]`` with one launch.

        A byte copy from each tensor's ``start_idx``, so aligned and misaligned tensors (SGLang's
        unpadded buckets) load alike. ``params`` maps names to destination tensors (e.g.
        ``dict(model.named_parameters())``); it may hold more names than the bucket. Each
        destination must exist and match the metadata's shape and dtype, be contiguous and be on
        the bucket's device; otherwise ValueError naming the tensor, before anything is copied.
        Runs under ``torch.no_grad()`` (parameters that require grad are written in place, as an
        optimizer step does).
        """
        if not isinstance(params, Mapping):
            raise TypeError(f"load_into: params must be a mapping name -> tensor, got {type(params).__name__}")
        dsts, offsets = [], []
        device = self.buffer.device
        for m in self.metadata:
            dst = params.get(m.name)
            if dst is None:
                raise ValueError(f"load_into: tensor {m.name!r} of the bucket has no destination in params")
            if not isinstance(dst, torch.Tensor):
                raise ValueError(f"load_into: destination {m.name!r} is a {type(dst).__name__}, not a tensor")
            if tuple(dst.shape) != m.shape:
                raise ValueError(f"load_into: tensor {m.name!r} has shape {list(m.shape)} in the bucket but {list(dst.shape)} in params")
            if dst.dtype != m.dtype:
                raise ValueError(f"load_into: tensor {m.name!r} is {m.dtype} in the bucket but {dst.dtype} in params")
            if dst.device != device:
                raise ValueError(f"load_into: tensor {m.name!r} is on {dst.device} but the bucket is on {device}")
            if not dst.is_contiguous():
                raise ValueError(
                    f"load_into: destination {m.name!r} is not contiguous (strides {list(dst.stride())}); "
                    "a byte copy needs contiguous destinations"
                )
            dsts.append(dst.detach())
            offsets.append(m.start_idx)
        if dsts:
            with torch.no_grad():
                multi_tensor_unpack(self.buffer, dsts, offsets)

    def to_dict(self, *, with_checksum: bool = True) -> dict:
        """JSON-serializable description: format, nbytes, checksum (16 hex digits or None), tensors."""
        return {
            "format": DESCRIPTION_FORMAT,
            "nbytes": self.nbytes,
            "checksum": f"{self.checksum:016x}" if with_checksum else None,
            "tensors": [m.to_dict() for m in self.metadata],
        }

    @classmethod
    def from_dict(cls, description: Mapping, buffer: torch.Tensor, *, verify_checksum: bool = False) -> "FlattenedBucket":
        """Rebuild a bucket over a received ``buffer`` from :meth:`to_dict` output.

        Checks the format tag, that ``buffer`` has ``nbytes`` bytes, every tensor's fields and that
        ranges do not overlap; with ``verify_checksum`` the description must carry a checksum (16
        hex digits), and the buffer is hashed and compared (one extra read of the buffer). A
        mismatch says only "checksum mismatch": the buffer may be someone else's memory, and its
        hash would tell a prober about its bytes.
        """
        if not isinstance(description, Mapping) or description.get("format") != DESCRIPTION_FORMAT:
            got = description.get("format") if isinstance(description, Mapping) else type(description).__name__
            raise ValueError(f"not a flattened-bucket description: format {got!r}, expected {DESCRIPTION_FORMAT!r}")
        check_buffer(buffer)
        if description.get("nbytes") != buffer.numel():
            raise ValueError(f"description says {description.get('nbytes')!r} bytes but the buffer has {buffer.numel()}")
        tensors = description.get("tensors")
        if not isinstance(tensors, list):
            raise ValueError("description field 'tensors' must be a list")
        bucket = cls(buffer, [FlattenedTensorMetadata.from_dict(t) for t in tensors])
        checksum = description.get("checksum")
        if checksum is None:
            if verify_checksum:
                raise ValueError("the description has no checksum; a receiver verifies every bucket against one")
            return bucket
        if not isinstance(checksum, str) or not _CHECKSUM_HEX.fullmatch(checksum):
            raise ValueError(f"description checksum must be 16 hex digits, got {str(checksum)[:40]!r}")
        expected = int(checksum, 16)
        if verify_checksum:
            if bucket.compute_checksum() != expected:
                raise ValueError("checksum mismatch")
        else:
            bucket._checksum = expected
        return bucket

