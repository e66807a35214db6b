"""Torch references for causal attention over packed sequences and a paged KV cache (float64, obvious code).

Layout, shared with ``rlperf.kernels.attention``:

* packed tokens: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``; sequence ``b`` owns
  ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` and ``k[cu_seqlens_k[b]:cu_seqlens_k[b+1]]``.
* GQA: query head ``j`` reads KV head ``j // (Hq // Hkv)``.
* causal, aligned to the END: the ``n_b`` queries of sequence ``b`` are the last ``n_b`` of its
  ``L_b`` tokens, so query ``i`` sits at position ``L_b - n_b + i`` and sees keys ``0 .. L_b - n_b + i``.
* paged cache: ``k_cache [num_pages, page_size, Hkv, D]``; token ``p`` of sequence ``b`` lives in
  page ``page_table[b, p // page_size]`` at offset ``p % page_size``; a slot is
  ``page * page_size + offset``.

For each sequence: ``out = softmax(scale * q @ k^T + causal_mask) @ v`` with ``scale = D**-0.5`` by
default, computed in float64 and returned in float64.
"""
from __future__ import annotations

import torch


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention over packed sequences, float64. Returns ``[Tq, Hq, D]`` float64.

    ``cu_seqlens_q`` / ``cu_seqlens_k``: ``[B+1]`` offsets; each sequence needs ``n_b <= L_b``.
    """
    Tq, Hq, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    scale = D ** -0.5 if scale is None else scale
    cq = [int(x) for x in cu_seqlens_q]
    ck = [int(x) for x in cu_seqlens_k]
    out = torch.zeros(Tq, Hq, D, dtype=torch.float64, device=q.device)
    for b in range(len(cq) - 1):
        n, L = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if n == 0:
            continue
        if n > L:
            raise ValueError(f"sequence {b}: {n} queries but only {L} keys")
        qb = q[cq[b]:cq[b + 1]].double().transpose(0, 1)                     # [Hq, n, D]
        kb = k[ck[b]:ck[b + 1]].double().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)  # [Hq, L, D]
        vb = v[ck[b]:ck[b + 1]].double().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
        scores = scale * qb @ kb.transpose(1, 2)                             # [Hq, n, L]
        query_pos = torch.arange(L - n, L, device=q.device)[:, None]
        key_pos = torch.arange(L, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        out[cq[b]:cq[b + 1]] = (torch.softmax(scores, dim=-1) @ vb).transpose(0, 1)
    return out


def gather_kv_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read each sequence's first ``kv_lens[b]`` tokens out of the paged cache.

    Returns packed ``k, v [sum(kv_lens), Hkv, D]`` (cache dtype) and ``cu_seqlens_k [B+1]`` int32.
    """
    page_size = k_cache.shape[1]
    ks, vs, cu = [], [], [0]
    for b, L in enumerate(int(x) for x in kv_lens):
        pos = torch.arange(L, device=k_cache.device)
        pages = page_table[b].long()[pos // page_size]
        ks.append(k_cache[pages, pos % page_size])
        vs.append(v_cache[pages, pos % page_size])
        cu.append(cu[-1] + L)
    return torch.cat(ks), torch.cat(vs), torch.tensor(cu, dtype=torch.int32, device=k_cache.device)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention_ref` over K/V gathered from the paged cache. Returns ``[Tq, Hq, D]`` float64."""
    k, v, cu_k = gather_kv_ref(k_cache, v_cache, page_table, kv_lens)
    return attention_ref(q, k, v, cu_seqlens_q, cu_k, scale)


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``cache[slot // page_size, slot % page_size] = k[t]`` for every token whose slot is >= 0 (in place)."""
    page_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    k_cache[slots // page_size, slots % page_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // page_size, slots % page_size] = v[keep].to(v_cache.dtype)
