"""Seeded, batch-invariant token sampling: per-request Gumbel-max with top-k / top-p filters.

Each request (row) carries its own ``seed`` and ``position``; the Gumbel noise of vocabulary entry
``j`` is a pure function of ``(seed, position, j)`` — a counter-based 32-bit hash, written out in
:mod:`rlperf.kernels.reference.sampling` and implemented identically here in uint32 arithmetic —
so a request's token never depends on the batch it is decoded in, on the row it sits in, or on the
backend (Triton and the torch reference draw the same uniform variates bit for bit).

Per row (full definition in the reference module)::

    T == 0 : token = argmax_j logits_j                 (greedy, lowest index on ties)
    T >  0 : keep j iff logits_j >= thr   (thr from top_k and top_p over the full distribution)
             token = argmax_{kept j} (logits_j / T + g_j),   g_j = -log(-log(u_j))

Filtering: the row's float32 logits are sorted (``torch.sort`` / ``torch.topk`` — exact value
permutations, so per-row results do not depend on the batch); ``thr_k`` is the k-th largest value;
``thr_p`` comes from one Triton program per row that walks the sorted row in fixed ``BLOCK``
chunks (online log-sum-exp as in :mod:`rlperf.kernels.logprob`, then a running ``tl.cumsum``).
The Gumbel-max pass compares exact maxima only, so its result is independent of chunking.

Modes: sampling runs these kernels in both ``invariant`` and ``fast`` mode — it is a small part of
a decode step, and a sampler that changes with the batch would break seeded reproducibility.
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from .dispatch import route
from .pipeline import grid_dependency_sync, launch_options
from .logprob import _row_stats
from .reference import sampling as _ref

NUM_WARPS = 4
SPLIT_BLOCKS = 2  # BLOCK-wide chunks per program: the vocabulary of a row is spread over programs (an
# argmax needs no fixed reduction order: max is exact and ties go to the lowest index whatever the
# split, so the token is the same as one program's pass), which keeps a small batch off one SM


def _block(V: int) -> int:
    return min(triton.next_power_of_2(V), 4096)


@triton.jit
def _fmix32(h):
    """lowbias32 finalizer on uint32 (wrapping multiplies)."""
    h = h ^ (h >> 16)
    h = h * tl.cast(0x7FEB352D, tl.uint32)
    h = h ^ (h >> 15)
    h = h * tl.cast(0x846CA68B, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _lo32(v):
    return (v & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def row_keys(seed, pos):
    """(key, key2) uint32 of a request from its int64 seed and position (reference docstring)."""
    key = _fmix32(_lo32(seed) ^ tl.cast(0x9E3779B9, tl.uint32))
    key = _fmix32(key ^ _lo32(seed >> 32))
    key = _fmix32(key ^ _lo32(pos))
    key = _fmix32(key ^ _lo32(pos >> 32))
    return key, _fmix32(key ^ tl.cast(0x85EBCA6B, tl.uint32))


@triton.jit
def uniform(j, key, key2):
    """float32 uniform variate in (0, 1) for vocabulary index ``j`` (int32) under (key, key2)."""
    h = _fmix32(_fmix32(j.to(tl.uint32) ^ key) ^ key2)
    return (((h >> 9) << 1) | 1).to(tl.float32) * 5.9604644775390625e-08  # * 2^-24: exact


@triton.jit
def _sample_kernel(
    x_ptr, temp_ptr, thr_ptr, seed_ptr, pos_ptr, best_ptr, idx_ptr, V, stride_x, num_splits,
    BLOCK: tl.constexpr, SPLIT: tl.constexpr,
):
    """Program (row, s): the best key and its lowest index over vocabulary columns
    [s * SPLIT, (s + 1) * SPLIT) of one row, in BLOCK chunks; partials go to best/idx [B, num_splits]."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    one = tl.arange(0, 1)
    x_row = x_ptr + row * stride_x
    temp = tl.load(temp_ptr + row + one)
    greedy = temp == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    thr = tl.load(thr_ptr + row + one)
    key, key2 = row_keys(tl.load(seed_ptr + row + one), tl.load(pos_ptr + row + one))
    cols = tl.arange(0, BLOCK)[None, :]
    best = tl.full([1], float("-inf"), tl.float32)
    best_i = tl.full([1], 2147483647, tl.int32)
    for start in range(split * SPLIT, split * SPLIT + SPLIT, BLOCK):
        c = start + cols
        live = c < V
        x = tl.load(x_row + c, mask=live, other=float("-inf")).to(tl.float32)
        g = -tl.log(-tl.log(uniform(c, key[:, None], key2[:, None])))
        sampled = tl.where(x >= thr[:, None], x * inv_t[:, None] + g, float("-inf"))
        k = tl.where(greedy[:, None], x, sampled)
        k = tl.where(live, k, float("-inf"))
        cmax = tl.max(k, axis=1)
        cidx = tl.min(tl.where(k == cmax[:, None], c, 2147483647), axis=1)
        better = (cmax > best) | ((cmax == best) & (best_i == 2147483647))  # strict: earlier chunks win ties
        best = tl.where(better, cmax, best)
        best_i = tl.where(better, cidx, best_i)
    out = row * num_splits + split
    tl.store(best_ptr + out + one, best)
    tl.store(idx_ptr + out + one, best_i)


@triton.jit
def _sample_combine_kernel(best_ptr, idx_ptr, out_ptr, num_splits, SPLITS: tl.constexpr):
    """One row: the split with the largest key, the lowest-indexed one on ties (splits hold
    increasing columns), so the token is the argmax over the whole row with ties to the lowest index."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS)
    live = s < num_splits
    b = tl.load(best_ptr + row * num_splits + s, mask=live, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_splits + s, mask=live, other=2147483647)
    m = tl.max(b, axis=0)
    tok = tl.min(tl.where(b == m, i, 2147483647), axis=0)
    # every key -inf (can only be a masked row): the lowest column, as one chunked pass would give
    tok = tl.where(tok == 2147483647, 0, tok)
    tl.store(out_ptr + row, tok.to(tl.int64))


@triton.jit
def _top_p_threshold_kernel(
    srt_ptr, temp_ptr, top_p_ptr, thr_ptr, V, stride_s,
    BLOCK: tl.constexpr,
):
    """thr_p of one row from its descending-sorted float32 logits (reference module docstring)."""
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    row = tl.program_id(0).to(tl.int64)
    one = tl.arange(0, 1)
    s_row = srt_ptr + row * stride_s
    temp = tl.load(temp_ptr + row + one)
    c2 = 1.4426950408889634 / tl.where(temp > 0.0, temp, 1.0)  # log2(e) / T
    p = tl.load(top_p_ptr + row + one)
    m, s, _t = _row_stats(s_row, V, c2, BLOCK, False)
    lse2 = m * c2 + tl.log2(s)  # log2 of the partition function, in the same scaled units
    cols = tl.arange(0, BLOCK)[None, :]
    run = tl.zeros([1], tl.float32)
    below = tl.zeros([1], tl.int32)
    for start in range(0, V, BLOCK):
        c = start + cols
        live = c < V
        x = tl.load(s_row + c, mask=live, other=0.0)
        e = tl.where(live, tl.exp2(x * c2[:, None] - lse2[:, None]), 0.0)
        cs = run[:, None] + tl.cumsum(e, axis=1)
        below += tl.sum(tl.where(live & (cs < p[:, None]), 1, 0), axis=1)
        run = tl.max(cs, axis=1)  # the cumulative sum is non-decreasing: its max is its last value
    count = tl.minimum(below + 1, V)
    thr = tl.load(s_row + count - 1)
    tl.store(thr_ptr + row + one, tl.where(p < 1.0, thr, float("-inf")))


_VALID = {  # per-row parameter -> which values sample() accepts
    "temperature": lambda t: torch.isfinite(t) & (t >= 0),
    "top_p": lambda t: (t > 0) & (t <= 1),
    "top_k": lambda t: t >= 0,
}


def check_sampling_rows(temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> None:
    """Raise the ``ValueError`` :func:`sample` raises for invalid per-row values, checked where the
    tensors are: a caller that builds them on the host checks them there (no device sync) and then
    calls :func:`sample` with ``check_values=False`` (the rollout engine does)."""
    B = temperature.shape[0]
    for name, value, dtype in (("temperature", temperature, torch.float32), ("top_p", top_p, torch.float32),
                               ("top_k", top_k, torch.int64)):
        _per_row(name, value, B, dtype, value.device, _VALID[name])


def _per_row(name, value, B, dtype, device, check, check_values: bool = True) -> torch.Tensor:
    """A Python scalar or a [B] tensor -> a [B] tensor of ``dtype`` on ``device``, validated."""
    if isinstance(value, torch.Tensor):
        if value.shape != (B,):
            raise ValueError(f"sample: {name} tensor must have shape [{B}], got {list(value.shape)}")
        if value.device != device:
            raise ValueError(f"sample: {name} on {value.device}, logits on {device}")
        if dtype == torch.int64 and (value.is_floating_point() or value.dtype == torch.bool):
            raise TypeError(f"sample: {name} must be integer, got {value.dtype}")
        t = value.to(dtype)
        bad = ~check(t) if check_values else None
        if bad is not None and bool(bad.any()):
            raise ValueError(f"sample: invalid {name} {value[bad][:4].tolist()} (row(s) {bad.nonzero()[:4, 0].tolist()})")
        return t.contiguous()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"sample: {name} must be a number or a [{B}] tensor, got {type(value).__name__}")
    if dtype == torch.int64 and not float(value).is_integer():
        raise TypeError(f"sample: {name} must be an integer, got {value}")
    t = torch.full((B,), value, dtype=dtype, device=device)
    if not bool(check(t).all()):
        raise ValueError(f"sample: invalid {name} {value}")
    return t


def _thresholds(x, temp, top_p, top_k, V, triton_path):
    """[B] float32 logit thresholds, -inf where no filter applies (one device sync to decide)."""
    B = x.shape[0]
    thr = torch.full((B,), float("-inf"), dtype=torch.float32, device=x.device)
    has_k = (top_k > 0) & (top_k < V)
    has_p = top_p < 1
    any_k, any_p = bool(has_k.any()), bool(has_p.any())
    if not (any_k or any_p):
        return thr
    xf = x.float()
    if any_p:
        srt = torch.sort(xf, dim=-1, descending=True).values
    else:
        kmax = int(torch.where(has_k, top_k, 0).max())
        srt = torch.topk(xf, kmax, dim=-1, largest=True, sorted=True).values
    if any_k:
        thr_k = srt.gather(1, (top_k.clamp(1, srt.shape[1]) - 1)[:, None]).squeeze(1)
        thr = torch.where(has_k, thr_k, thr)
    if any_p:
        thr_p = torch.empty(B, dtype=torch.float32, device=x.device)
        if triton_path:
            _top_p_threshold_kernel[(B,)](srt, temp, top_p, thr_p, V, srt.stride(0), BLOCK=_block(V), num_warps=NUM_WARPS,
                                          **launch_options(srt.device))
        thr = torch.maximum(thr, thr_p)
    return thr


def sample(
    logits: torch.Tensor,
    temperature,
    top_p,
    top_k,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    check_values: bool = True,
    filtered: bool | None = None,
) -> torch.Tensor:
    """Draw one token per row, reproducibly per (seed, position).

    Args:
        logits: [B, V] float16/bfloat16/float32.
        temperature: float >= 0 or [B] tensor; 0 means greedy (argmax, lowest index on ties).
        top_p: float in (0, 1] or [B] tensor; 1.0 disables. Keeps the smallest set of most
            likely tokens whose probability under ``softmax(logits / T)`` reaches ``top_p``.
        top_k: int >= 0 or [B] integer tensor; 0 or >= V disables. Keeps the ``top_k`` largest
            logits (all tokens tied with the k-th are kept).
        seeds: [B] integer tensor, the per-request seed.
        positions: [B] integer tensor, the index of the token being drawn in its sequence.
        check_values: validate the values of tensor ``temperature``/``top_p``/``top_k`` (a host
            sync each). False only for a caller that validated them already (the rollout engine
            checks every request's parameters when it is added): no sync, the same tokens.
        filtered: whether any row has ``top_p < 1`` or ``0 < top_k < V``, when the caller knows it
            from host values; None: find out on the device (a host sync). False skips the filters'
            work, which would keep every token anyway (the same tokens).

    Returns:
        tokens [B] int64. Both filters are computed on the unfiltered distribution and
        intersected; the draw is Gumbel-max over the survivors.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"sample: logits must be a [B, V] float tensor, got {getattr(logits, 'shape', logits)!r}")
    B, V = logits.shape
    if V == 0:
        raise ValueError("sample: logits must have V > 0 columns")
    dev = logits.device
    for name, t in (("seeds", seeds), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or t.shape != (B,):
            raise ValueError(f"sample: {name} must be a [{B}] integer tensor, got {getattr(t, 'shape', t)!r}")
        if t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"sample: {name} must be integer, got {t.dtype}")
        if t.device != dev:
            raise ValueError(f"sample: {name} on {t.device}, logits on {dev}")
    temp = _per_row("temperature", temperature, B, torch.float32, dev, _VALID["temperature"], check_values)
    tp = _per_row("top_p", top_p, B, torch.float32, dev, _VALID["top_p"], check_values)
    tk = _per_row("top_k", top_k, B, torch.int64, dev, _VALID["top_k"], check_values)
    if B == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    seeds, positions = seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    if route("sample", dev) == "reference":
        return _ref.sample(logits, temp, tp, tk, seeds, positions)
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    thr = (torch.full((B,), float("-inf"), dtype=torch.float32, device=dev) if filtered is False
           else _thresholds(x, temp, tp, tk, V, True))
    out = torch.empty(B, dtype=torch.int64, device=dev)
    block = _block(V)
    split = block * SPLIT_BLOCKS
    num_splits = triton.cdiv(V, split)
    best = torch.empty(B, num_splits, dtype=torch.float32, device=dev)
    idx = torch.empty(B, num_splits, dtype=torch.int32, device=dev)
    _sample_kernel[(B, num_splits)](x, temp, thr, seeds, positions, best, idx, V, x.stride(0), num_splits,
                                    BLOCK=block, SPLIT=split, num_warps=NUM_WARPS, **launch_options(x.device))
    _sample_combine_kernel[(B,)](best, idx, out, num_splits, SPLITS=triton.next_power_of_2(num_splits), num_warps=1,
                                 **launch_options(best.device))
    return out
