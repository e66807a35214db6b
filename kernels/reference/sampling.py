"""Torch reference of seeded, batch-invariant sampling (float64 math, int64 hash arithmetic).

The noise for (seed, position, vocabulary index j) comes from a counter-based 32-bit hash that
:mod:`rlperf.kernels.sampling` implements identically in Triton (uint32 arithmetic there, int64
with explicit masking here), so both produce the same uniform variate bit for bit::

    fmix(h)  = h ^= h >> 16; h *= 0x7FEB352D; h ^= h >> 15; h *= 0x846CA68B; h ^= h >> 16   (mod 2^32)
    key      = fmix(fmix(fmix(fmix(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ pos_lo) ^ pos_hi)
    key2     = fmix(key ^ 0x85EBCA6B)
    h_j      = fmix(fmix(j ^ key) ^ key2)
    u_j      = (2 * (h_j >> 9) + 1) * 2^-24          # in (0, 1), exact in float32
    g_j      = -log(-log(u_j))                          # standard Gumbel

Sampling a row (temperature T, top_p, top_k)::

    T == 0:  token = argmax_j logits_j                  (lowest index on ties)
    else:    z = logits / T;   keep j iff logits_j >= thr
             token = argmax_{kept j} (z_j + g_j)        (Gumbel-max = a draw from softmax(z) over kept)

``thr`` = max(thr_k, thr_p), both over the full (unfiltered) distribution of the row, with
``sorted`` the row's float32 logits in descending order:
``thr_k = sorted[k - 1]`` when ``0 < top_k < V`` (else -inf); ``thr_p = sorted[c - 1]`` when
``top_p < 1`` (else -inf) with ``c = min(V, 1 + #{r : cumsum(softmax(sorted / T))_r < top_p})`` —
the smallest prefix whose mass reaches ``top_p``. Ties at the threshold are all kept.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
KEY2_SALT = 0x85EBCA6B
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for int64 ``a`` in [0, 2^32), without int64 overflow."""
    lo = a & 0xFFFF
    hi = a >> 16
    return (lo * c + (((hi * (c & 0xFFFF)) & 0xFFFF) << 16)) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, MUL1)
    h = h ^ (h >> 15)
    h = _mul32(h, MUL2)
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, key2) int64 in [0, 2^32) per row from int64 seeds and positions."""
    seeds, positions = seeds.long(), positions.long()
    key = fmix32((seeds & MASK32) ^ GOLDEN)
    key = fmix32(key ^ ((seeds >> 32) & MASK32))
    key = fmix32(key ^ (positions & MASK32))
    key = fmix32(key ^ ((positions >> 32) & MASK32))
    return key, fmix32(key ^ KEY2_SALT)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """[B, V] float64 uniform variates in (0, 1) (exactly the kernel's float32 values)."""
    key, key2 = row_keys(seeds, positions)
    j = torch.arange(V, dtype=torch.int64, device=seeds.device)
    h = fmix32(fmix32(j[None, :] ^ key[:, None]) ^ key2[:, None])
    return (((h >> 9) << 1) | 1).double() * 2.0**-24


def thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B] float64 logit thresholds (module docstring); -inf where no filter applies."""
    B, V = logits.shape
    x = logits.float().double()
    srt = torch.sort(x, dim=-1, descending=True).values
    thr = torch.full((B,), float("-inf"), dtype=torch.float64, device=logits.device)
    k = top_k.long()
    has_k = (k > 0) & (k < V)
    thr_k = srt.gather(1, (k.clamp(1, V) - 1)[:, None]).squeeze(1)
    thr = torch.where(has_k, thr_k, thr)
    T = torch.where(temperature > 0, temperature.double(), torch.ones_like(temperature, dtype=torch.float64))
    cs = torch.softmax(srt / T[:, None], dim=-1).cumsum(-1)
    count = ((cs < top_p.double()[:, None]).sum(-1) + 1).clamp(max=V)
    thr_p = srt.gather(1, (count - 1)[:, None]).squeeze(1)
    return torch.where(top_p < 1, torch.maximum(thr, thr_p), thr)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Tokens [B] int64; every parameter a [B] tensor (the op layer expands scalars)."""
    B, V = logits.shape
    x = logits.float().double()
    greedy = temperature == 0
    T = torch.where(greedy, torch.ones_like(temperature), temperature).double()
    g = -torch.log(-torch.log(uniform(seeds, positions, V)))
    thr = thresholds(logits, temperature, top_p, top_k)
    keys = torch.where(x >= thr[:, None], x / T[:, None] + g, torch.full_like(x, float("-inf")))
    keys = torch.where(greedy[:, None], x, keys)
    # argmax with the lowest index on ties: first position holding the row maximum
    best = keys.max(dim=-1, keepdim=True).values
    idx = torch.arange(V, device=logits.device).expand(B, V)
    return torch.where(keys == best, idx, V).min(dim=-1).values
