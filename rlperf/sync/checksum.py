"""The 64-bit checksum of a bucket's bytes: the same bits on CPU, CUDA and the torch fallback.

Read the ``n`` bytes as little-endian uint64 words ``w_i`` (``i = 0 .. ceil(n/8) - 1``, the last one
zero-padded); ``S = sum_i mix64(w_i + (i+1)*G) mod 2^64`` with ``G = 0x9E3779B97F4A7C15`` and
``mix64`` the splitmix64 finalizer; checksum ``= mix64(S + n) mod 2^64``. Any change of one byte
changes it (``mix64`` is a bijection), word swaps change it (the index is mixed in), and integer sums
are order-free, so a parallel reduction gives the same bits every time. It detects corruption; it
is not cryptographic.

A receiver checks every bucket against the checksum in its description
(:meth:`rlperf.sync.buckets.FlattenedBucket.from_dict`); the checksum of a whole set of weights is
:func:`rlperf.sync.flatten.weights_checksum`.
"""
from __future__ import annotations

import torch

from .extension import use_extension

U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """The splitmix64 finalizer of ``z mod 2^64`` (a bijection of 64-bit integers)."""
    z &= U64
    z = ((z ^ (z >> 30)) * _MIX1) & U64
    z = ((z ^ (z >> 27)) * _MIX2) & U64
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
        total = (total + int(terms.sum().item())) & U64
    return mix64(total + n)


def check_buffer(buffer: torch.Tensor) -> None:
    """ValueError unless ``buffer`` is a 1-D contiguous ``torch.uint8`` tensor (a bucket's buffer)."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            "a bucket buffer must be a 1-D torch.uint8 tensor, got "
            + (f"{buffer.dtype} of shape {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor) else type(buffer).__name__)
        )
    if not buffer.is_contiguous():
        raise ValueError("a bucket buffer must be contiguous")


def bucket_checksum(buffer: torch.Tensor) -> int:
    """The 64-bit checksum (module docstring) of a 1-D contiguous uint8 ``buffer``, as an int in [0, 2^64).

    One read of the buffer (CUDA: one reduction kernel and a device-to-host sync; CPU: threads).
    """
    check_buffer(buffer)
    if use_extension(buffer.device):
        return torch.ops.rlperf.bucket_checksum(buffer) & U64
    return _checksum_torch(buffer)
