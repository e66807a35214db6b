"""The seeded init's values: a counter-based, approximately normal draw computed on the tensor's device.

Element ``i`` (flat, row-major index) of matrix number ``k`` of a model initialized from ``seed`` is a
function of ``(seed, k, i)`` alone, built from 32-bit integer arithmetic and one float32 multiply, so
CPU and CUDA produce the same bits, any chunking of the elements gives the same values, and no host
generator walks the weights one after another.

The formula (all integer arithmetic modulo 2**32, ``M = 0xFFFFFFFF``)::

    mix(x):  x ^= x >> 16;  x = x * 0x7FEB352D & M;  x ^= x >> 15;  x = x * 0x846CA68B & M;  x ^= x >> 16
             (a bijection of 32-bit integers)

    s0, s1 = seed & M, (seed >> 32) & M          (seed taken modulo 2**64)
    h, r   = i // 2**31, i % 2**31                 (segment and offset: every counter fits 32 bits)
    a      = mix(mix(mix(mix(s0 ^ 0x9E3779B9) ^ s1) ^ k) ^ h)
    b      = mix(a ^ 0x5BD1E995)
    w_j    = mix(mix((2 * r + j) ^ a) ^ b)         for j = 0, 1
    S      = (w_0 & 0xFFFF) + (w_0 >> 16) + (w_1 & 0xFFFF) + (w_1 >> 16) - 131070
    value  = float32(S) * C,   C = float32(std * sqrt(3 / (65536**2 - 1)))

``S`` is the sum of four uniform integers on ``[0, 65535]`` (the 16-bit halves of two hash words)
minus its mean: an Irwin–Hall sum, symmetric about 0, variance ``4 * (65536**2 - 1) / 12``, kurtosis
``3 - 6/20`` (a normal's is 3), and bounded: ``|S| <= 131070 < 2**24``, so ``float32(S)`` is exact
and no value lies beyond ``sqrt(12) * std`` (~3.46 std). ``C`` makes the variance ``std**2`` up to
float32's rounding of ``C``; ``value`` is one correctly rounded float32 product, the same bits on
every IEEE-754 device. The keys ``a`` and ``b`` enter two rounds of ``mix``, so no XOR or shift of
the counters turns one matrix's words into another's (with one round, ``mix(c ^ a)``, two matrices
whose keys differ in a few low bits would hold the same words in swapped places).

In torch the integer steps run on int64 tensors and every product is masked with ``M``; the
multiplier ``0x846CA68B`` (above 2**31) is applied as ``0x846CA68B - 2**32``, equal modulo 2**32, so
no product of a 32-bit value leaves the int64 range.
"""
from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
MIX_MUL = (0x7FEB352D, 0x846CA68B)
"""The two multipliers of :func:`mix32`."""
SEED_SALT = 0x9E3779B9
"""XORed into the seed's low word before its first mix (``mix32(0) == 0``)."""
KEY_SALT = 0x5BD1E995
"""XORed into the first key to give the second."""
SEGMENT = 1 << 31
"""Elements per counter segment: the counters ``2 r + j`` of one segment fit 32 bits."""
HALF_RANGE = 65536
"""Each of the four uniform integers lies in ``[0, HALF_RANGE)``."""
SUM_MEAN = 2 * (HALF_RANGE - 1)
"""The mean of the sum of the four uniform integers (131070)."""
SUM_VARIANCE = (HALF_RANGE ** 2 - 1) / 3
"""The variance of that sum: 4 x (65536**2 - 1) / 12."""
CHUNK_ELEMENTS = {"cpu": 1 << 16, "cuda": 1 << 24}
"""Elements drawn per step by device type (others: the cuda value). A step holds ~32 bytes per element
at its peak (two int64 words per element and an int64 temporary of the same size), so a step of 2**24
elements holds ~0.5 GiB on a GPU; 2**16 keeps a CPU step in the caches."""

_MUL_SIGNED = tuple(c - (1 << 32) if c >= 1 << 31 else c for c in MIX_MUL)
"""The multipliers as int64 operands of absolute value < 2**31: ``x * c`` for ``x < 2**32`` stays
inside int64, and the product is ``x * MIX_MUL`` modulo 2**32."""


def mix32(x: int) -> int:
    """The 32-bit integer hash ``mix`` of the module docstring, on a Python int in ``[0, 2**32)``."""
    x ^= x >> 16
    x = (x * MIX_MUL[0]) & MASK32
    x ^= x >> 15
    x = (x * MIX_MUL[1]) & MASK32
    x ^= x >> 16
    return x


def matrix_keys(seed: int, k: int, segment: int = 0) -> tuple[int, int]:
    """The keys ``(a, b)`` of matrix ``k`` and counter segment ``segment`` (module docstring) for ``seed``."""
    seed &= (1 << 64) - 1
    a = mix32(mix32((seed & MASK32) ^ SEED_SALT) ^ (seed >> 32))
    a = mix32(mix32(a ^ (k & MASK32)) ^ (segment & MASK32))
    return a, mix32(a ^ KEY_SALT)


def scale(std: float) -> float:
    """``C`` of the module docstring: ``std * sqrt(3 / (65536**2 - 1))`` rounded to float32 (a Python
    float holding a float32 value)."""
    return torch.tensor(std * math.sqrt(3 / (HALF_RANGE ** 2 - 1)), dtype=torch.float32).item()


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``mix`` in place on int64 ``x`` (values in ``[0, 2**32)``), ``tmp`` a scratch tensor like ``x``."""
    for shift, mul in ((16, _MUL_SIGNED[0]), (15, _MUL_SIGNED[1])):
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp).mul_(mul).bitwise_and_(MASK32)
    torch.bitwise_right_shift(x, 16, out=tmp)
    return x.bitwise_xor_(tmp)


def seeded_normal(seed: int, k: int, start: int, count: int, std: float = 1.0, device="cpu") -> torch.Tensor:
    """Values [count] float32 on ``device`` of elements ``start .. start + count - 1`` of matrix ``k``
    (module docstring), in one step: ``count`` should stay within some millions of elements (memory: ~32
    bytes per element) and the range within one segment of 2**31 elements (:func:`fill_seeded_normal_`
    splits both)."""
    if start < 0 or count < 0:
        raise ValueError(f"seeded_normal: start {start} and count {count} must be >= 0")
    segment, offset = divmod(start, SEGMENT)
    if offset + count > SEGMENT:
        raise ValueError(f"seeded_normal: elements {start} .. {start + count - 1} cross a segment of {SEGMENT}")
    x = torch.arange(2 * offset, 2 * (offset + count), dtype=torch.int64, device=device)  # [2 count]: 2 r + j
    tmp = torch.empty_like(x)
    a, b = matrix_keys(seed, k, segment)
    _mix32_(_mix32_(x.bitwise_xor_(a), tmp).bitwise_xor_(b), tmp)  # w_j
    torch.bitwise_right_shift(x, 16, out=tmp)
    x.bitwise_and_(0xFFFF).add_(tmp)  # per word: low half + high half
    del tmp
    total = x.view(count, 2).sum(dim=1)  # [count]: the four halves
    return total.sub_(SUM_MEAN).to(torch.float32).mul_(scale(std))


@torch.no_grad()
def fill_seeded_normal_(p: torch.Tensor, seed: int, k: int, std: float, chunk: int | None = None) -> torch.Tensor:
    """Write :func:`seeded_normal` of matrix ``k`` into ``p`` (any shape and dtype, contiguous) in place, on
    ``p``'s device, ``chunk`` elements at a time (default :data:`CHUNK_ELEMENTS` for the device): each
    float32 value is cast to ``p.dtype`` as it is written. A meta tensor is left as it is."""
    if p.device.type == "meta":
        return p
    if not p.is_contiguous():
        raise ValueError("fill_seeded_normal_: the tensor must be contiguous")
    step = CHUNK_ELEMENTS.get(p.device.type, CHUNK_ELEMENTS["cuda"]) if chunk is None else chunk
    if step < 1:
        raise ValueError(f"fill_seeded_normal_: chunk must be >= 1, got {step}")
    flat, n = p.view(-1), p.numel()
    start = 0
    while start < n:
        stop = min(start + step, n, (start // SEGMENT + 1) * SEGMENT)
        flat[start:stop].copy_(seeded_normal(seed, k, start, stop - start, std, p.device))
        start = stop
    return p
