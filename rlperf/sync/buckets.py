"""Bucketed weight flatten/unflatten: many named tensors <-> a few contiguous uint8 buffers.

Weight sync (trainer -> rollout servers) moves parameters as *buckets*: each bucket is one
contiguous ``torch.uint8`` buffer of at most ``bucket_bytes`` bytes holding many tensors of any
dtypes, plus per-tensor metadata with SGLang's ``FlattenedTensorMetadata`` fields
``{name, shape, dtype, start_idx, end_idx, numel}`` in SGLang's meanings
(``sglang.srt.weight_sync.tensor_bucket``): ``start_idx``/``end_idx`` are *byte* offsets into the
buffer and ``numel`` is the tensor's **byte** count, not its element count::

    numel == end_idx - start_idx == prod(shape) * dtype.itemsize

Buckets cross both ways with SGLang's own ``FlattenedTensorBucket``: its
``FlattenedTensorBucket(flattened_tensor=bucket.buffer, metadata=bucket.metadata)`` rebuilds an
rlperf bucket, and ``FlattenedBucket(sglang_bucket.get_flattened_tensor(),
sglang_bucket.get_metadata())`` takes an SGLang one (its metadata objects are converted and
checked; :meth:`FlattenedTensorMetadata.of`).

Layout rules of the buckets rlperf writes (the planner, :func:`plan_buckets`):

* tensors are placed in the order given, greedily: a tensor goes into the current bucket if its
  16-byte-aligned start plus its bytes fit in ``bucket_bytes``, else a new bucket starts;
* a tensor larger than ``bucket_bytes`` gets a bucket of its own (never split);
* every ``start_idx`` is a multiple of :data:`ALIGNMENT` (16 bytes), so the copy kernel moves
  16-byte vectors and every unflattened view is aligned for its dtype;
* a buffer is exactly as long as the end of its last tensor; alignment gaps are zero bytes.

Buckets rlperf *reads* need not follow these rules: SGLang flattens unpadded (tensors back to back,
so e.g. a float32 after 3 int8 bytes starts at byte 3). Any non-overlapping ranges inside the
buffer are accepted. :meth:`FlattenedBucket.unflatten` gives zero-copy views of tensors whose
start is aligned for their dtype and copies of the others (one launch for all of them), and
:meth:`FlattenedBucket.load_into` copies bytes, so it loads aligned and misaligned tensors alike.

Copies (:func:`flatten_buckets` packs, :meth:`FlattenedBucket.load_into` unpacks) are one launch
per bucket of the ``rlperf._C`` multi-tensor copy (``torch.ops.rlperf.multi_tensor_pack`` /
``multi_tensor_unpack``; CUDA: 16-byte vectorized chunks spread over all SMs; CPU: threads over
chunks). Without the extension a pure-torch fallback (one copy per tensor) runs and warns once.

Inputs: sources may be non-contiguous; they are made contiguous first (one extra copy of that
tensor) because the bucket holds a tensor's elements in row-major order. Destinations of
:meth:`FlattenedBucket.load_into` must be contiguous (a byte copy cannot write through strides);
a non-contiguous destination is rejected with an error that names it. All tensors of one call
must share one device, the bucket's.

Checksum (:func:`bucket_checksum`): a deterministic 64-bit hash of a buffer's bytes, the same on
CPU, CUDA and the fallback. Read the ``n`` bytes as little-endian uint64 words ``w_i``
(``i = 0 .. ceil(n/8) - 1``, the last one zero-padded); ``S = sum_i mix64(w_i + (i+1)*G) mod 2^64``
with ``G = 0x9E3779B97F4A7C15`` and ``mix64`` the splitmix64 finalizer; checksum
``= mix64(S + n) mod 2^64``. Any change of one byte changes it (``mix64`` is a bijection), word
swaps change it (the index is mixed in), and integer sums are order-free, so a parallel
reduction gives the same bits every time. It detects corruption; it is not cryptographic.

Descriptions (:meth:`FlattenedBucket.to_dict` / :meth:`FlattenedBucket.from_dict`): plain JSON
data (format tag, byte size, checksum as 16 hex digits, per-tensor metadata ``{name, shape, dtype,
start_idx, end_idx, numel}`` with ``numel`` the byte count as above and dtype names from an
allowlist), so a server can rebuild views over a received buffer without unpickling anything.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
ALIGNMENT = 16
# v2: metadata numel is the byte count (SGLang's meaning); a v1 sender (element counts) is refused by name
DESCRIPTION_FORMAT = "rlperf.flattened_bucket.v2"

_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# dtype names a description may carry: looked up in this table, never through getattr on input.
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "complex64", "complex128", "int64", "int32", "int16", "int8", "uint64", "uint32",
    "uint16", "uint8", "bool",
)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_DTYPE_TO_NAME = {d: n for n, d in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; ValueError for a dtype outside :data:`DTYPES`."""
    try:
        return _DTYPE_TO_NAME[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported in a flattened bucket; supported: {sorted(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (also accepts ``"torch.bfloat16"``); ValueError otherwise."""
    key = name[len("torch."):] if isinstance(name, str) and name.startswith("torch.") else name
    try:
        return DTYPES[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype name {name!r}; supported: {sorted(DTYPES)}") from None


def _align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


# ---------------------------------------------------------------------------------------------
# Backend: the rlperf._C extension, or the pure-torch fallback.

try:
    from rlperf import _C as _extension  # noqa: F401  (importing it registers torch.ops.rlperf.*)

    _EXTENSION_ERROR: BaseException | None = None
except ImportError as exc:  # built without the extension (RLPERF_NO_EXTENSION=1, no compiler, ...)
    _extension = None
    _EXTENSION_ERROR = exc

_force_torch = False
_warned_fallback = False


def extension_available(device: torch.device | str = "cpu") -> bool:
    """True when ``rlperf._C`` is importable and has kernels for ``device``'s type."""
    if _extension is None:
        return False
    key = "CUDA" if torch.device(device).type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key("rlperf::multi_tensor_pack", key)


def backend(device: torch.device | str = "cpu") -> str:
    """``"extension"`` (rlperf._C) or ``"torch"`` (the fallback) for tensors on ``device``."""
    return "extension" if not _force_torch and extension_available(device) else "torch"


@contextlib.contextmanager
def use_torch_fallback() -> Iterator[None]:
    """Force the pure-torch fallback inside the block (for tests and comparisons; no warning)."""
    global _force_torch
    previous, _force_torch = _force_torch, True
    try:
        yield
    finally:
        _force_torch = previous


def _use_extension(device: torch.device) -> bool:
    global _warned_fallback
    if _force_torch:
        return False
    if extension_available(device):
        return True
    if not _warned_fallback:
        _warned_fallback = True
        reason = f"import failed: {_EXTENSION_ERROR}" if _extension is None else f"built without {device.type} kernels"
        warnings.warn(
            f"rlperf._C is not usable ({reason}); rlperf.sync.buckets falls back to pure torch "
            "(one copy per tensor, slower). Rebuild with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _pack(srcs: list[torch.Tensor], buffer: torch.Tensor, offsets: list[int], chunk_bytes: int = 0) -> None:
    """buffer[offsets[i] : offsets[i] + nbytes(srcs[i])] = bytes of srcs[i]; every other byte = 0."""
    if _use_extension(buffer.device):
        torch.ops.rlperf.multi_tensor_pack(srcs, buffer, offsets, chunk_bytes)
        return
    buffer.zero_()
    for t, off in zip(srcs, offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            buffer[off : off + nbytes].copy_(t.reshape(-1).view(torch.uint8))


def _unpack(buffer: torch.Tensor, dsts: list[torch.Tensor], offsets: list[int], chunk_bytes: int = 0) -> None:
    """bytes of dsts[i] = buffer[offsets[i] : offsets[i] + nbytes(dsts[i])]."""
    if _use_extension(buffer.device):
        torch.ops.rlperf.multi_tensor_unpack(buffer, dsts, offsets, chunk_bytes)
        return
    for t, off in zip(dsts, offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            t.view(-1).view(torch.uint8).copy_(buffer[off : off + nbytes])


# ---------------------------------------------------------------------------------------------
# Checksum


def _mix64_int(z: int) -> int:
    z &= _U64
    z = ((z ^ (z >> 30)) * _MIX1) & _U64
    z = ((z ^ (z >> 27)) * _MIX2) & _U64
    return z ^ (z >> 31)


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    # int64 tensors wrap mod 2^64 on + and *; >> is arithmetic, so mask to make it logical.
    def lsr(x: torch.Tensor, s: int) -> torch.Tensor:
        return (x >> s) & ((1 << (64 - s)) - 1)

    z = (z ^ lsr(z, 30)) * _signed64(_MIX1)
    z = (z ^ lsr(z, 27)) * _signed64(_MIX2)
    return z ^ lsr(z, 31)


_CHECKSUM_WORDS_PER_STEP = 1 << 22  # fallback: 32 MiB of the buffer per step bounds its temporaries


def _checksum_torch(buffer: torch.Tensor) -> int:
    n = buffer.numel()
    nwords = (n + 7) // 8
    total = 0
    for first in range(0, nwords, _CHECKSUM_WORDS_PER_STEP):
        last = min(nwords, first + _CHECKSUM_WORDS_PER_STEP)
        raw = buffer[first * 8 : min(n, last * 8)]
        if raw.numel() % 8 or raw.storage_offset() % 8:
            padded = torch.zeros((last - first) * 8, dtype=torch.uint8, device=buffer.device)
            padded[: raw.numel()] = raw
            raw = padded
        words = raw.view(torch.int64)
        index = torch.arange(first + 1, last + 1, dtype=torch.int64, device=buffer.device)
        terms = _mix64_tensor(words + index * _signed64(_GOLDEN))
        total = (total + int(terms.sum().item())) & _U64
    return _mix64_int(total + n)


def bucket_checksum(buffer: torch.Tensor) -> int:
    """The 64-bit checksum (module docstring) of a 1-D contiguous uint8 ``buffer``, as an int in [0, 2^64).

    One read of the buffer (CUDA: one reduction kernel and a device-to-host sync; CPU: threads).
    """
    _check_buffer(buffer)
    if _use_extension(buffer.device):
        return torch.ops.rlperf.bucket_checksum(buffer) & _U64
    return _checksum_torch(buffer)


def _check_buffer(buffer: torch.Tensor) -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            "a bucket buffer must be a 1-D torch.uint8 tensor, got "
            + (f"{buffer.dtype} of shape {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor) else type(buffer).__name__)
        )
    if not buffer.is_contiguous():
        raise ValueError("a bucket buffer must be contiguous")


# ---------------------------------------------------------------------------------------------
# Metadata and planning


_METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


@dataclasses.dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one tensor lives in a bucket: SGLang's ``FlattenedTensorMetadata``, same fields, same meanings.

    ``start_idx``/``end_idx``: byte offsets into the bucket's uint8 buffer. ``numel``: the tensor's
    **byte** count, as SGLang writes it (``end_idx - start_idx``), so
    ``numel == end_idx - start_idx == prod(shape) * dtype.itemsize``; the element count is
    :attr:`nelements`. Buckets rlperf packs start every tensor at a multiple of :data:`ALIGNMENT`;
    received metadata may start anywhere (SGLang's flattening is unpadded).
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


def _named_items(named_tensors) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, Mapping):
        return named_tensors.items()
    return named_tensors


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")


def _iter_planned(
    named_tensors, bucket_bytes: int
) -> Iterator[tuple[list[FlattenedTensorMetadata], list[torch.Tensor], int]]:
    """Yield (metadata, contiguous sources, buffer bytes) per bucket, as soon as each bucket closes.

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
        start = _align_up(end)
        if metas and start + nbytes > bucket_bytes:
            yield metas, srcs, end
            metas, srcs, start = [], [], 0
        metas.append(FlattenedTensorMetadata(name, tuple(t.shape), t.dtype, start, start + nbytes, nbytes))  # numel: bytes
        srcs.append(t)
        end = start + nbytes
    if metas:
        yield metas, srcs, end


def plan_buckets(named_tensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[FlattenedTensorMetadata]]:
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
    return [metas for metas, _, _ in _iter_planned(named_tensors, bucket_bytes)]


# ---------------------------------------------------------------------------------------------
# Buckets


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
        _check_buffer(buffer)
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
            _unpack(self.buffer, copies, offsets)
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
                _unpack(self.buffer, dsts, offsets)

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
        ranges do not overlap; with ``verify_checksum`` also hashes the buffer and compares (one
        extra read of the buffer).
        """
        if not isinstance(description, Mapping) or description.get("format") != DESCRIPTION_FORMAT:
            got = description.get("format") if isinstance(description, Mapping) else type(description).__name__
            raise ValueError(f"not a flattened-bucket description: format {got!r}, expected {DESCRIPTION_FORMAT!r}")
        _check_buffer(buffer)
        if description.get("nbytes") != buffer.numel():
            raise ValueError(f"description says {description.get('nbytes')!r} bytes but the buffer has {buffer.numel()}")
        tensors = description.get("tensors")
        if not isinstance(tensors, list):
            raise ValueError("description field 'tensors' must be a list")
        bucket = cls(buffer, [FlattenedTensorMetadata.from_dict(t) for t in tensors])
        checksum = description.get("checksum")
        if checksum is not None:
            try:
                expected = int(checksum, 16)
            except (TypeError, ValueError):
                raise ValueError(f"description checksum must be hex digits, got {checksum!r}") from None
            if verify_checksum:
                actual = bucket.compute_checksum()
                if actual != expected:
                    raise ValueError(f"bucket checksum mismatch: description {expected:016x}, buffer {actual:016x}")
            else:
                bucket._checksum = expected
        return bucket


def flatten_buckets(named_tensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[FlattenedBucket]:
    """Pack named tensors into uint8 buckets, one multi-tensor copy launch per bucket.

    Parameters
    ----------
    named_tensors : iterable of (str, Tensor) or mapping str -> Tensor
        Any dtypes in :data:`DTYPES`, any shapes (zero-size included), one device; non-contiguous
        tensors are made contiguous first. Names must be unique.
    bucket_bytes : int
        Bucket size limit in bytes (default 512 MiB); see :func:`plan_buckets`.

    Returns
    -------
    list of :class:`FlattenedBucket` (empty for an empty input), buffers on the tensors' device.
    The checksum is not computed here (it would read every bucket again); ask
    :attr:`FlattenedBucket.checksum` when it is needed.
    """
    buckets = []
    for metas, srcs, nbytes in _iter_planned(named_tensors, bucket_bytes):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=srcs[0].device)
        _pack(srcs, buffer, [m.start_idx for m in metas])
        buckets.append(FlattenedBucket(buffer, metas, _checked=True))
    return buckets
