"""The ``rlperf._C`` multi-tensor copies behind every bucket, or the pure-torch fallback.

``rlperf._C`` (csrc/) registers ``torch.ops.rlperf.multi_tensor_pack`` / ``multi_tensor_unpack`` (one
launch copies many tensors into or out of one uint8 buffer; CUDA: 16-byte vectorized chunks spread
over all SMs; CPU: threads over chunks) and ``bucket_checksum`` (:mod:`rlperf.sync.checksum`).
Without the extension (``RLPERF_NO_EXTENSION=1``, no compiler, a device it was built without) the
same bytes come from one torch copy per tensor, with one warning per process.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

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


def copy_backend(device: torch.device | str = "cpu") -> str:
    """What runs the bucket copies and checksums for tensors on ``device``: ``"extension"``
    (rlperf._C) or ``"torch"`` (the fallback). Not the kernels' backend (:func:`rlperf.kernels.backend`)."""
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


def use_extension(device: torch.device) -> bool:
    """Whether the copies and the checksum on ``device`` run in ``rlperf._C``; warns once when it
    cannot (unless the fallback was asked for with :func:`use_torch_fallback`)."""
    global _warned_fallback
    if _force_torch:
        return False
    if extension_available(device):
        return True
    if not _warned_fallback:
        _warned_fallback = True
        reason = f"import failed: {_EXTENSION_ERROR}" if _extension is None else f"built without {device.type} kernels"
        warnings.warn(
            f"rlperf._C is not usable ({reason}); rlperf.sync falls back to pure torch "
            "(one copy per tensor, slower). Rebuild with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def multi_tensor_pack(srcs: list[torch.Tensor], buffer: torch.Tensor, offsets: list[int], chunk_bytes: int = 0) -> None:
    """buffer[offsets[i] : offsets[i] + nbytes(srcs[i])] = bytes of srcs[i]; every other byte = 0."""
    if use_extension(buffer.device):
        torch.ops.rlperf.multi_tensor_pack(srcs, buffer, offsets, chunk_bytes)
        return
    buffer.zero_()
    for t, off in zip(srcs, offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            buffer[off : off + nbytes].copy_(t.reshape(-1).view(torch.uint8))


def multi_tensor_unpack(buffer: torch.Tensor, dsts: list[torch.Tensor], offsets: list[int], chunk_bytes: int = 0) -> None:
    """bytes of dsts[i] = buffer[offsets[i] : offsets[i] + nbytes(dsts[i])]."""
    if use_extension(buffer.device):
        torch.ops.rlperf.multi_tensor_unpack(buffer, dsts, offsets, chunk_bytes)
        return
    for t, off in zip(dsts, offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            t.view(-1).view(torch.uint8).copy_(buffer[off : off + nbytes])
