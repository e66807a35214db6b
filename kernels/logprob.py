"""Log-softmax and per-token log-probs / entropy over the vocabulary, batch-invariant.

Formulas (logits [..., V] of any float dtype, temperature T > 0, math in float32)::

    z_j      = float32(logits_j) * float32(1 / T)
    lse      = log sum_j exp(z_j)
    log_softmax_j = z_j - lse
    logp     = z_target - lse
    entropy  = -sum_j p_j log p_j = lse - sum_j p_j z_j

Reduction order (the contract :mod:`rlperf.kernels.fused_lm_head` follows too): one program owns a
row and walks V in chunks of ``BLOCK_V`` columns, in increasing column order, keeping float32
running values in *raw logit units* (before the temperature): ``m`` (max), ``s`` (sum of exp) and
``t`` (exp-weighted sum of shifted logits). With ``c = float32(log2(e) / T)``::

    m = -inf; s = 0; t = 0
    for each chunk C:                                     # masked columns read as x = -inf
        m_new = max(m, max_{j in C} x_j)
        r     = m_new if m_new > -inf else 0              # finite reference point
        a     = exp2((m - r) * c)                         # rescales the earlier chunks
        e_j   = exp2(x_j * c - r * c)                     # = exp((x_j - r) / T), one FMA + ex2
        t     = a * (t + (m - r) * s) + sum_{j in C} e_j * (x_j - r)    # (m - r) := 0 while m = -inf
        s     = a * s + sum_{j in C} e_j
        m     = m_new
    lse = m / T + log(s);  logp = (x_target - m) / T - log(s)
    entropy = log(s) - (t / s) / T;  log_softmax_j = (x_j - m) / T - log(s)

(``/ T`` is a multiply by ``float32(1 / T)``.) Working in raw units with one fused multiply-add
per element keeps the fused lm-head kernel's epilogue short; max commutes with the positive scale.
``sum_{j in C}`` / ``max_{j in C}`` are single ``tl.sum`` / ``tl.max`` reductions of one chunk.
``BLOCK_V`` and ``num_warps`` are constants (not functions of the number of rows), so a row's bits
never depend on the batch. Asking for the entropy does not change the log-prob bits.

A target outside ``[0, V)`` yields NaN (checked in the kernel, without a host sync).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .autograd import with_recompute_backward
from .dispatch import route
from .reference import logprob as _ref

BLOCK_V = 4096   # vocabulary chunk of the online update (fixed: batch invariance)
NUM_WARPS = 8
LOG2E = 1.4426950408889634


def scales(T: float) -> tuple[float, float]:
    """(1 / T, log2(e) / T): the two per-call constants of the online update (rounded to float32
    when passed to a kernel)."""
    return 1.0 / T, LOG2E / T


@triton.jit
def online_lse_update(m, s, t, x, c, WITH_ENTROPY: tl.constexpr):
    """One chunk of the online log-sum-exp / entropy update (module docstring).

    x: [R, C] float32 raw logits with masked columns at -inf; c = log2(e) / T; m, s, t: [R].
    """
    m_new = tl.maximum(m, tl.max(x, axis=1))
    r = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2((m - r) * c)
    e = tl.exp2(x * c - (r * c)[:, None])
    if WITH_ENTROPY:
        d = tl.where(m == float("-inf"), 0.0, m - r)
        ez = e * tl.where(e > 0.0, x - r[:, None], 0.0)  # 0, not 0 * -inf, for masked columns
        t = a * (t + d * s) + tl.sum(ez, axis=1)
    s = a * s + tl.sum(e, axis=1)
    return m_new, s, t


@triton.jit
def _row_stats(x_row, V, c, BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """Running (m, s, t) of one row (raw units), shape [1] each."""
    cols = tl.arange(0, BLOCK)[None, :]
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    t = tl.zeros([1], tl.float32)
    for start in range(0, V, BLOCK):
        col = start + cols
        x = tl.load(x_row + col, mask=col < V, other=float("-inf")).to(tl.float32)
        m, s, t = online_lse_update(m, s, t, x, c, WITH_ENTROPY)
    return m, s, t


@triton.jit
def _token_logprobs_kernel(
    x_ptr, tgt_ptr, logp_ptr, ent_ptr, V, stride_x, inv_t, c,
    BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    m, s, t = _row_stats(x_row, V, c, BLOCK, WITH_ENTROPY)
    log_s = tl.log(s)
    one = tl.arange(0, 1)
    tgt = tl.load(tgt_ptr + row + one)
    valid = (tgt >= 0) & (tgt < V)
    x_t = tl.load(x_row + tl.where(valid, tgt, 0)).to(tl.float32)
    tl.store(logp_ptr + row + one, tl.where(valid, (x_t - m) * inv_t - log_s, float("nan")))
    if WITH_ENTROPY:
        tl.store(ent_ptr + row + one, log_s - (t / s) * inv_t)


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, V, stride_x, stride_y, inv_t, c, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    m, s, t = _row_stats(x_row, V, c, BLOCK, False)
    m2 = m[:, None]
    log_s = tl.log(s)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    for start in range(0, V, BLOCK):
        col = start + cols
        x = tl.load(x_row + col, mask=col < V, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + col, (x - m2) * inv_t - log_s, mask=col < V)


def _check_temperature(temperature) -> float:
    if isinstance(temperature, torch.Tensor) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a Python float > 0, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature}")
    return float(temperature)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V > 0, got {list(logits.shape)}")
    x = logits.reshape(-1, logits.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-softmax of ``logits / temperature`` over the last dim.

    Args:
        logits: [..., V] (usually [N, V]) float16/bfloat16/float32; the math is float32.
        temperature: Python float > 0.

    Returns:
        [..., V] float32.
    """
    T = _check_temperature(temperature)
    how = route("log_softmax", logits.device, (logits,))
    if how == "autograd":  # the kernel call inside checks the logits
        return with_recompute_backward(lambda x: log_softmax(x, T), lambda x: torch.log_softmax(x.float() / T, dim=-1),
                                       logits)
    x = _rows(logits)
    if how == "stock":
        return torch.log_softmax(logits.float() / T, dim=-1)
    if how == "reference":
        return _ref.log_softmax(logits, T)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] > 0:
        _log_softmax_kernel[(x.shape[0],)](
            x, y, x.shape[1], x.stride(0), y.stride(0), *scales(T), BLOCK=BLOCK_V, num_warps=NUM_WARPS
        )
    return y.reshape(logits.shape)


def _torch_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, T: float, return_entropy: bool):
    logp_all = torch.log_softmax(logits.float() / T, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).nan_to_num(0.0).sum(-1)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False
):
    """Log-prob of each row's target token (and the row's entropy), without a [N, V] float32 copy.

    Args:
        logits: [..., V] (usually [N, V]) float16/bfloat16/float32.
        targets: [...] integer token ids in [0, V) (NaN log-prob otherwise).
        temperature: Python float > 0; the distribution is ``softmax(logits / temperature)``.
        return_entropy: also return the entropy of that distribution.

    Returns:
        logp [...] float32, and entropy [...] float32 when ``return_entropy``.
    """
    T = _check_temperature(temperature)
    how = route("token_logprobs", logits.device, (logits,))
    if how == "autograd":  # the kernel call inside checks logits and targets
        return with_recompute_backward(lambda x: token_logprobs(x, targets, T, return_entropy),
                                       lambda x: _torch_token_logprobs(x, targets, T, return_entropy), logits)
    x = _rows(logits)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets must have shape {list(logits.shape[:-1])}, got {list(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if targets.device != logits.device:
        raise ValueError(f"targets on {targets.device}, logits on {logits.device}")
    if how == "stock":
        return _torch_token_logprobs(logits, targets, T, return_entropy)
    if how == "reference":
        return _ref.token_logprobs(logits, targets, T, return_entropy)
    n = x.shape[0]
    tgt = targets.reshape(-1).to(torch.int64).contiguous()
    logp = torch.empty(n, dtype=torch.float32, device=x.device)
    ent = torch.empty(n if return_entropy else 1, dtype=torch.float32, device=x.device)
    if n > 0:
        _token_logprobs_kernel[(n,)](
            x, tgt, logp, ent, x.shape[1], x.stride(0), *scales(T),
            BLOCK=BLOCK_V, WITH_ENTROPY=return_entropy, num_warps=NUM_WARPS,
        )
    logp = logp.reshape(targets.shape)
    return (logp, ent.reshape(targets.shape)) if return_entropy else logp
