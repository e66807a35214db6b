"""rlperf.kernels.attention: accuracy against float64 and the prefill ≡ chunked prefill ≡ decode contract.

Every invariance check compares outputs with ``torch.equal`` (bits), never with a tolerance:

* varlen prefill (no cache) ≡ paged full prefill ≡ paged chunked prefill for several chunk sizes
  ≡ decode token by token (chunk size 1);
* over random lengths, shuffled non-contiguous page tables, and batch compositions that change
  every step (sequences join and leave, their order is shuffled, a sequence runs alone).

The cache starts as NaN and each chunk's K/V is written just before the chunk attends, so a kernel
that reads a slot past ``kv_lens`` (a future token, a free page) produces NaN. Outputs are
assembled into NaN-filled tensors, so a query the kernel never wrote fails too.

CPU runs the Triton kernels in the interpreter with fp32/fp16 tiles (its bf16 ``tl.dot`` is wrong);
the ``gpu`` tests prove the same in bf16/fp16 on the real MMA units with production shapes.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import rlperf.kernels as K
from rlperf.kernels.attention import _key_sum
from rlperf.kernels.reference.attention import (
    attention_ref,
    gather_kv_ref,
    paged_attention_ref,
    write_kv_cache_ref,
)

def page_size() -> int:
    return K.PAGE_SIZE  # a lazy attribute: importing rlperf.kernels.attention imports Triton


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def cu_of(lens, device) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_tokens(lens, hq, hkv, d, dtype, device):
    """Random q [T,Hq,D], k/v [T,Hkv,D] for packed sequences of ``lens`` tokens, and cu_seqlens."""
    T = sum(lens)
    q = torch.randn(T, hq, d, device=device).to(dtype)
    k = torch.randn(T, hkv, d, device=device).to(dtype)
    v = torch.randn(T, hkv, d, device=device).to(dtype)
    return q, k, v, cu_of(lens, device)


class PagedCache:
    """A NaN-filled paged cache whose sequences own shuffled, non-contiguous pages (plus free NaN pages)."""

    def __init__(self, lens, hkv, d, dtype, device, free_pages=3):
        P = page_size()
        need = [-(-n // P) for n in lens]
        num_pages = sum(need) + free_pages
        perm = torch.randperm(num_pages).tolist()
        # unused table entries point at a free (NaN) page: a read of them would show up as NaN
        self.page_table = torch.full((len(lens), max(need) + 1), perm[-1], dtype=torch.int32)
        i = 0
        for b, n in enumerate(need):
            self.page_table[b, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
            i += n
        self.page_table = self.page_table.to(device)
        self.k = torch.full((num_pages, P, hkv, d), float("nan"), dtype=dtype, device=device)
        self.v = torch.full_like(self.k, float("nan"))
        self._table = self.page_table.cpu()

    def slots(self, b: int, start: int, end: int) -> torch.Tensor:
        P = page_size()
        pos = torch.arange(start, end)
        return (self._table[b].long()[pos // P] * P + pos % P)



def filled_cache(k, v, lens) -> PagedCache:
    """A :class:`PagedCache` holding every sequence's whole K/V (k, v packed as ``make_tokens`` gives them)."""
    cache = PagedCache(lens, k.shape[1], k.shape[2], k.dtype, k.device)
    K.write_kv_cache(k, v, cache.k, cache.v,
                     torch.cat([cache.slots(b, 0, n) for b, n in enumerate(lens)]).to(k.device))
    return cache


def run_varlen(q, k, v, lens):
    return K.varlen_attention(q, k, v, cu_of(lens, q.device))


def run_chunked(q, k, v, lens, chunk, shuffle=True, cache=None, prompt=0):
    """Paged attention, each sequence fed ``chunk`` queries per step (chunk=None: the whole sequence
    at once); every step batches the sequences that still have tokens, in a shuffled order, and
    writes their new K/V into the cache just before attending. ``prompt > 0``: the first step of
    a sequence feeds all but its last ``prompt`` tokens (prefill, then decode the rest)."""
    device = q.device
    cu = cu_of(lens, "cpu").tolist()
    cache = cache or PagedCache(lens, k.shape[1], k.shape[2], k.dtype, device)
    out = torch.full_like(q, float("nan"))
    done = [0] * len(lens)
    while any(done[b] < lens[b] for b in range(len(lens))):
        active = [b for b in range(len(lens)) if done[b] < lens[b]]
        if shuffle:
            active = [active[i] for i in torch.randperm(len(active)).tolist()]
        rows, slots, n_q, kv = [], [], [], []
        for b in active:
            start = done[b]
            end = lens[b] if chunk is None else min(lens[b], start + chunk)
            if start == 0 and prompt and lens[b] > prompt:
                end = lens[b] - prompt
            rows.append(torch.arange(cu[b] + start, cu[b] + end))
            slots.append(cache.slots(b, start, end))
            n_q.append(end - start)
            kv.append(end)
            done[b] = end
        rows = torch.cat(rows).to(device)
        K.write_kv_cache(k[rows], v[rows], cache.k, cache.v, torch.cat(slots).to(device))
        out[rows] = K.paged_attention(
            q[rows], cache.k, cache.v, cache.page_table[torch.tensor(active, device=device)],
            cu_of(n_q, device), torch.tensor(kv, dtype=torch.int32, device=device),
        )
    return out


def key_sum_in_stated_order(p: torch.Tensor) -> torch.Tensor:
    """``p [R, 128]`` float32 -> ``[R]``, one float32 addition at a time in the order ``_key_sum`` states:
    with ``k = 8 i + 2 L + j``, the chains ``s_L`` over ascending ``k``, then ``(s_0 + s_2) + (s_1 + s_3)``."""
    chains = []
    for L in range(4):
        s = torch.zeros(p.shape[0], dtype=torch.float32)
        for i in range(16):
            for j in range(2):
                s = s + p[:, 8 * i + 2 * L + j]
        chains.append(s)
    return (chains[0] + chains[2]) + (chains[1] + chains[3])


def spread_exp2_values(rows: int, seed: int) -> torch.Tensor:
    """``[rows, 128]`` float32 in [0, 1] over 24 binades, like a block's ``exp2`` values: sums of them in
    different orders round differently."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, 128, generator=g) * torch.exp2(-24 * torch.rand(rows, 128, generator=g))


@triton.jit
def _key_sum_rows(P, OUT, R: tl.constexpr):
    rows = tl.arange(0, R)
    p = tl.load(P + rows[:, None] * 128 + tl.arange(0, 128)[None, :])
    tl.store(OUT + rows, _key_sum(p))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------------------------------------
# CPU (Triton interpreter)
# ---------------------------------------------------------------------------------------------

# (dtype, atol, rtol) against the float64 reference. fp32: interpreter dots are fp32, so only
# accumulation/exp rounding (~1e-6). fp16: inputs are exact, P is rounded to fp16 before P@V
# (2^-11 relative) and the output is rounded to fp16.
CPU_TOLS = [(torch.float32, 2e-5, 2e-5), (torch.float16, 2e-3, 5e-3)]


@pytest.mark.parametrize("dtype,atol,rtol", CPU_TOLS)
def test_accuracy_vs_float64(interpreter, dtype, atol, rtol):
    P = page_size()
    lens = [1, 7, 33, 127, P + 1, 2 * P + 5]
    q, k, v, cu = make_tokens(lens, 4, 2, 64, dtype, "cpu")
    ref = attention_ref(q, k, v, cu, cu)
    out = run_varlen(q, k, v, lens)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    # paged, with a chunk that leaves partial pages and a scale that is not the default
    cache = PagedCache(lens, 2, 64, dtype, "cpu")
    out_p = run_chunked(q, k, v, lens, chunk=40, cache=cache)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    torch.testing.assert_close(out_p.double(), ref, atol=atol, rtol=rtol)
    ref_s = paged_attention_ref(q, cache.k, cache.v, cache.page_table, cu, kv_lens, scale=0.3)
    out_s = K.paged_attention(q, cache.k, cache.v, cache.page_table, cu, kv_lens, scale=0.3)
    torch.testing.assert_close(out_s.double(), ref_s, atol=atol, rtol=rtol)


def test_queries_are_the_last_positions(interpreter):
    """n_b < kv_lens[b] in one call: queries sit at the end of the sequence, causal mask aligned there."""
    lens, n_q = [70, 129, 5], [3, 64, 5]
    q, k, v, _ = make_tokens(lens, 4, 2, 64, torch.float32, "cpu")
    cache = PagedCache(lens, 2, 64, torch.float32, "cpu")
    cu_all = cu_of(lens, "cpu").tolist()
    rows = []
    for b, L in enumerate(lens):
        K.write_kv_cache(k[cu_all[b]:cu_all[b] + L], v[cu_all[b]:cu_all[b] + L], cache.k, cache.v, cache.slots(b, 0, L))
        rows += list(range(cu_all[b] + L - n_q[b], cu_all[b] + L))
    qs = q[rows]
    cu_q, kv_lens = cu_of(n_q, "cpu"), torch.tensor(lens, dtype=torch.int32)
    out = K.paged_attention(qs, cache.k, cache.v, cache.page_table, cu_q, kv_lens)
    ref = attention_ref(qs, k, v, cu_q, cu_of(lens, "cpu"))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_write_kv_cache_round_trip(interpreter):
    P = page_size()
    hkv, d, T = 2, 64, 2 * P + 9
    k = torch.randn(T, hkv, d, dtype=torch.float16)
    v = torch.randn(T, hkv, d, dtype=torch.float16)
    kc = torch.full((5, P, hkv, d), float("nan"), dtype=torch.float16)
    vc = torch.full_like(kc, float("nan"))
    slots = torch.randperm(5 * P)[:T]
    slots[3] = -1  # padding token: skipped
    K.write_kv_cache(k, v, kc, vc, slots)
    kr, vr = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    write_kv_cache_ref(k, v, kr, vr, slots)
    assert torch.equal(kc.isnan(), kr.isnan()) and torch.equal(kc.nan_to_num(), kr.nan_to_num())
    assert torch.equal(vc.isnan(), vr.isnan()) and torch.equal(vc.nan_to_num(), vr.nan_to_num())
    keep = slots >= 0
    s = slots[keep]
    assert torch.equal(kc[s // P, s % P], k[keep]) and torch.equal(vc[s // P, s % P], v[keep])
    assert int(kc.isnan().any(-1).any(-1).sum()) == 5 * P - int(keep.sum())  # nothing else touched
    # read back through a page table, the way attention does
    table = torch.arange(5, dtype=torch.int32)[None]
    kg, vg, cu_k = gather_kv_ref(kc, vc, table, torch.tensor([5 * P], dtype=torch.int32))
    assert cu_k.tolist() == [0, 5 * P] and torch.equal(kg[s], k[keep]) and torch.equal(vg[s], v[keep])


# chunks of 16 start and end on page boundaries (P is a multiple of 16) and split the 33-token sequence
# 16 + 16 + 1; chunks of 33 start and end inside pages and cross them, as any other odd size does (a
# chunk of 5 ran the same paths in 2.7x the interpreter time)
@pytest.mark.parametrize("dtype,chunks", [(torch.float16, (None, 16, 33)), (torch.float32, (None, 33))])
def test_prefill_chunked_decode_bit_identical(interpreter, dtype, chunks):
    """varlen ≡ paged full prefill ≡ chunks of 16 and 33 ≡ prefill then decode token by token
    (across page boundaries) — bit for bit, in batches that change and reshuffle every step."""
    P = page_size()
    lens = [1, 7, 33, P - 1, P, P + 1, 2 * P + 3]
    q, k, v, _ = make_tokens(lens, 4, 2, 64, dtype, "cpu")
    base = run_varlen(q, k, v, lens)
    assert not base.isnan().any()
    for chunk in chunks:
        out = run_chunked(q, k, v, lens, chunk)
        assert torch.equal(out, base), f"chunk={chunk}: max diff {(out.double() - base.double()).abs().max()}"
    out = run_chunked(q, k, v, lens, chunk=1, prompt=12)  # decode positions P-12..P+1 and 2P-9..2P+3
    assert torch.equal(out, base), f"decode: max diff {(out.double() - base.double()).abs().max()}"


def test_decode_from_first_token_bit_identical(interpreter):
    """Pure decode: every position from 0, one query per step, equals the varlen prefill."""
    P = page_size()
    lens = [P + 2, 3, 20]
    q, k, v, _ = make_tokens(lens, 4, 2, 64, torch.float16, "cpu")
    assert torch.equal(run_chunked(q, k, v, lens, chunk=1), run_varlen(q, k, v, lens))


def test_page_prefetch_and_masked_pointer_loads_bit_identical(interpreter):
    """Reading each block's page one block ahead (``PREFETCH_PAGE``) and loading masked blocks by pointers
    in a TMA launch (``MASKED_PTR``: rows past ``kv_len`` never read) load the same K/V: decode rows and a
    paged prefill across pages equal the varlen prefill's."""
    from rlperf.kernels.attention import _CONFIG, _DECODE_CONFIG, attention_forward

    P = page_size()
    lens = [2 * P + 3, 1, P, 40]
    q, k, v, cu = make_tokens(lens, 4, 2, 64, torch.float16, "cpu")
    base = run_varlen(q, k, v, lens)
    cache = filled_cache(k, v, lens)
    kv = torch.tensor(lens, dtype=torch.int32)
    last = (cu[1:] - 1).long()
    step = torch.arange(len(lens) + 1, dtype=torch.int32)
    for extra in ({"PREFETCH_PAGE": True}, {"MASKED_PTR": True}, {"PREFETCH_PAGE": True, "MASKED_PTR": True}):
        out = attention_forward(q[last], cache.k, cache.v, step, kv, cache.page_table, config={**_DECODE_CONFIG, **extra})
        assert torch.equal(out, base[last]), extra
        out = attention_forward(q, cache.k, cache.v, cu, kv, cache.page_table, config={**_CONFIG, **extra})
        assert torch.equal(out, base), extra


def test_decode_launch_finds_each_sequence_without_the_search(interpreter):
    """A launch with as many queries as sequences (T == B) first tries the one-query-per-sequence tile
    numbering and checks it (``GUESS_ONE_QUERY``): a decode step of 70 sequences (tile numbers crossing
    two BLOCK_Q boundaries) and T == B batches that are not one query each (the check fails, the search
    runs) give the varlen prefill's rows, and no row is left unwritten."""
    from rlperf.kernels.attention import _DECODE_CONFIG, attention_forward

    gen = torch.Generator().manual_seed(11)
    lens = [39] + [int(x) for x in torch.randint(2, 40, (69,), generator=gen).tolist()]
    q, k, v, cu = make_tokens(lens, 2, 1, 16, torch.float16, "cpu")
    base = run_varlen(q, k, v, lens)
    cache = filled_cache(k, v, lens)
    kv = torch.tensor(lens, dtype=torch.int32)
    last = (cu[1:] - 1).long()
    out = attention_forward(q[last], cache.k, cache.v, torch.arange(len(lens) + 1, dtype=torch.int32), kv,
                            cache.page_table, config=_DECODE_CONFIG)
    assert torch.equal(out, base[last])
    # T == B, but not one query each: sequence 0's 35 queries take two tiles, so the guess is wrong for
    # the programs after them (f(b) = b + 1 for b = 1..34), and right by chance in the short batch
    for n_q in ([35] + [0] * 34 + [1] * 5, [2, 0, 1, 0, 3, 0]):
        B = len(n_q)
        rows = torch.cat([torch.arange(int(cu[b + 1]) - n, int(cu[b + 1])) for b, n in enumerate(n_q)])
        out = attention_forward(q[rows], cache.k, cache.v, cu_of(n_q, "cpu"), kv[:B], cache.page_table[:B],
                                config=_DECODE_CONFIG)
        assert torch.equal(out, base[rows]), n_q


@pytest.mark.parametrize("dtype,hq,hkv,d", [(torch.float16, 4, 2, 64), (torch.float32, 8, 2, 32),
                                             (torch.float16, 3, 3, 16), (torch.float16, 20, 1, 16)])
def test_decode_with_keys_on_m_bit_identical(interpreter, dtype, hq, hkv, d):
    """The decode launch with keys on the MMA's M side (``KEYS_ON_M``: queries as columns, padded to 16 or
    to the next power of two of G, here G = 2, 4, 1 and 20) equals the varlen prefill's rows: one query per
    sequence across page boundaries, with the page read ahead and masked pointer loads, and T == B batches
    that are not one query each (a sequence's queries in turn, none for others)."""
    from rlperf.kernels.attention import _DECODE_CONFIG, attention_forward

    P = page_size()
    lens = [2 * P + 3, 1, P, 40, P + 1]
    q, k, v, cu = make_tokens(lens, hq, hkv, d, dtype, "cpu")
    base = run_varlen(q, k, v, lens)
    cache = filled_cache(k, v, lens)
    kv = torch.tensor(lens, dtype=torch.int32)
    last = (cu[1:] - 1).long()
    step = torch.arange(len(lens) + 1, dtype=torch.int32)
    for extra in ({}, {"PREFETCH_PAGE": True, "MASKED_PTR": True}):
        cfg = {**_DECODE_CONFIG, "KEYS_ON_M": True, **extra}
        out = attention_forward(q[last], cache.k, cache.v, step, kv, cache.page_table, config=cfg)
        assert torch.equal(out, base[last]), extra
    n_q = [3, 0, 1, 0, 1]
    rows = torch.cat([torch.arange(int(cu[b + 1]) - n, int(cu[b + 1])) for b, n in enumerate(n_q)])
    out = attention_forward(q[rows], cache.k, cache.v, cu_of(n_q, "cpu"), kv, cache.page_table,
                            config={**_DECODE_CONFIG, "KEYS_ON_M": True})
    assert torch.equal(out, base[rows])


def test_key_sum_adds_in_its_stated_order(interpreter):
    """A block's softmax sum (``_key_sum``) is the stated chain of float32 additions, bit for bit, on
    values whose sums in other orders round differently (the plain sum disagrees in some rows)."""
    p = spread_exp2_values(64, seed=3)
    out = torch.empty(64)
    _key_sum_rows[(1,)](p, out, R=64)
    want = key_sum_in_stated_order(p)
    assert not torch.equal(want, p.sum(1)), "the values do not tell summation orders apart"
    assert torch.equal(out, want)


def test_batch_composition_bit_identical(interpreter):
    """A sequence's rows do not depend on its neighbours or its place in the batch."""
    lens = [127, 1, 33, 64, 7]
    q, k, v, cu = make_tokens(lens, 4, 2, 64, torch.float16, "cpu")
    base = run_varlen(q, k, v, lens)
    c = cu.tolist()
    for b in (0, 2, 4):
        s = slice(c[b], c[b + 1])
        alone = run_varlen(q[s], k[s], v[s], [lens[b]])
        assert torch.equal(alone, base[s])
        alone_paged = run_chunked(q[s], k[s], v[s], [lens[b]], chunk=None)
        assert torch.equal(alone_paged, base[s])
    order = [3, 0, 4, 2, 1]
    idx = torch.cat([torch.arange(c[b], c[b + 1]) for b in order])
    reordered = run_varlen(q[idx], k[idx], v[idx], [lens[b] for b in order])
    assert torch.equal(reordered, base[idx])


def test_gqa_group_sizes(interpreter):
    """MHA (G=1) and wider groups (G=4) pack into the M tile correctly."""
    lens = [9, 70]
    for hq, hkv in ((2, 2), (8, 2)):
        q, k, v, cu = make_tokens(lens, hq, hkv, 32, torch.float32, "cpu")
        out = run_varlen(q, k, v, lens)
        torch.testing.assert_close(out.double(), attention_ref(q, k, v, cu, cu), atol=2e-5, rtol=2e-5)
        assert torch.equal(run_chunked(q, k, v, lens, chunk=3), out)


def _check_load_paths(tokens, lens):
    from rlperf.kernels import attention as A

    q, k, v, cu = tokens
    cache = PagedCache(lens, k.shape[1], k.shape[2], k.dtype, q.device)
    run_chunked(q, k, v, lens, chunk=None, cache=cache)  # fills the cache
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    outs = []
    for tma in (False, True):
        cfg = dict(A._CONFIG, TMA=tma)
        assert A._tma_views_ok(k, v, False) and A._tma_views_ok(cache.k, cache.v, True)
        outs.append(A.attention_forward(q, k, v, cu, config=cfg))
        outs.append(A.attention_forward(q, cache.k, cache.v, cu, kv_lens, cache.page_table, config=cfg))
        outs.append(A.attention_forward(q[-1:], cache.k, cache.v, cu_of([1], q.device), kv_lens[-1:],
                                        cache.page_table[-1:], config=cfg))
    assert not outs[0].isnan().any()
    for o in outs[1:]:
        assert torch.equal(o, outs[0][-o.shape[0]:] if o.shape[0] == 1 else outs[0])


def test_tma_and_pointer_loads_bit_identical(interpreter):
    """K/V through tensor descriptors or through pointers: the same bits (varlen, paged, decode)."""
    lens = [3, page_size() + 5, 40]
    _check_load_paths(make_tokens(lens, 4, 2, 64, torch.float16, "cpu"), lens)


def test_fast_mode_and_reference_backend_match_reference():
    lens = [5, 40]
    q, k, v, cu = make_tokens(lens, 4, 2, 64, torch.float32, "cpu")
    ref = attention_ref(q, k, v, cu, cu)
    with K.use_mode("fast"):
        torch.testing.assert_close(run_varlen(q, k, v, lens).double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(run_varlen(q[:10], k[:10], v[:10], [5, 5]).double(),
                                   attention_ref(q[:10], k[:10], v[:10], cu_of([5, 5], "cpu"), cu_of([5, 5], "cpu")),
                                   atol=1e-5, rtol=1e-5)
        for chunk in (None, 1, 7):
            torch.testing.assert_close(run_chunked(q, k, v, lens, chunk).double(), ref, atol=1e-5, rtol=1e-5)
    with K.use_backend("reference"):
        assert torch.equal(run_varlen(q, k, v, lens), ref.float())
        assert torch.equal(run_chunked(q, k, v, lens, chunk=None), ref.float())


def test_bad_arguments(interpreter):
    q, k, v, cu = make_tokens([8], 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="int32"):
        K.varlen_attention(q, k, v, cu.long())
    with pytest.raises(ValueError, match="multiple"):
        K.varlen_attention(q[:, :3], k, v, cu)
    with pytest.raises(ValueError, match="dtypes"):
        K.varlen_attention(q.half(), k, v, cu)
    bad_cache = torch.zeros(2, page_size() // 2, 2, 64)
    with pytest.raises(ValueError, match="page size"):
        K.paged_attention(q, bad_cache, bad_cache, torch.zeros(1, 2, dtype=torch.int32), cu,
                          torch.tensor([8], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# GPU: production shapes, bf16 and fp16, the real MMA units
# ---------------------------------------------------------------------------------------------

# bf16: 8 mantissa bits on inputs, P and output (2^-9 relative each); fp16: 11 bits.
# float32: the dots run in tf32 (10-bit mantissa, like fp16); its K/V tiles need the reduced pipeline
GPU_TOLS = [(torch.bfloat16, 1.5e-2, 1.5e-2), (torch.float16, 2e-3, 4e-3), (torch.float32, 2e-3, 4e-3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", GPU_TOLS)
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8)])
def test_gpu_prefill_chunked_decode_bit_identical(dtype, atol, rtol, d, hq, hkv):
    gen = torch.Generator().manual_seed(1000 + d + hq)
    lens = [1, 2000, 127, 1024, 129] + torch.randint(2, 2000, (3,), generator=gen).tolist()
    q, k, v, cu = make_tokens(lens, hq, hkv, d, dtype, "cuda")
    base = run_varlen(q, k, v, lens)
    assert not base.isnan().any()
    ref = attention_ref(q, k, v, cu, cu)
    torch.testing.assert_close(base.double(), ref, atol=atol, rtol=rtol)
    assert rel_err(base, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
    for chunk in (None, 5, 16, 33, 300):
        out = run_chunked(q, k, v, lens, chunk)
        assert torch.equal(out, base), f"chunk={chunk}: max diff {(out.double() - base.double()).abs().max()}"
    out = run_chunked(q, k, v, lens, chunk=1, prompt=70)  # prefill, then 70 decode steps per sequence
    assert torch.equal(out, base), f"decode: max diff {(out.double() - base.double()).abs().max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_batch_composition_bit_identical(dtype):
    lens = [1500, 1, 333, 64, 2047, 900]
    q, k, v, cu = make_tokens(lens, 32, 8, 128, dtype, "cuda")
    base = run_varlen(q, k, v, lens)
    c = cu.tolist()
    for b in range(len(lens)):
        s = slice(c[b], c[b + 1])
        assert torch.equal(run_varlen(q[s], k[s], v[s], [lens[b]]), base[s])
        assert torch.equal(run_chunked(q[s], k[s], v[s], [lens[b]], chunk=None), base[s])
    order = [4, 2, 0, 5, 1, 3]
    idx = torch.cat([torch.arange(c[b], c[b + 1], device="cuda") for b in order])
    assert torch.equal(run_varlen(q[idx], k[idx], v[idx], [lens[b] for b in order]), base[idx])
    # many decode streams at once (a serving batch) vs the same streams in a tiny batch
    many = [int(x) for x in torch.randint(1, 3000, (48,)).tolist()]
    q2, k2, v2, _ = make_tokens(many, 32, 8, 128, dtype, "cuda")
    big = run_chunked(q2, k2, v2, many, chunk=700)
    ref2 = run_varlen(q2, k2, v2, many)
    assert torch.equal(big, ref2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8), (32, 4)])
def test_gpu_decode_pipeline_depth_bit_identical(dtype, hq, hkv):
    """Decode takes its pipeline depth from its grid (2 stages up to one program per SM, else 1): a
    decode step of 48 sequences (48 x Hkv programs) and of each sequence alone (Hkv programs) equal the
    prefill rows, and so does every depth, page read-ahead and masked-load choice forced on the same
    launch, with the 64-row tile and with the keys on the MMA's M side (4 and 8 warps), at G = 4, 2, 8."""
    from rlperf.kernels.attention import _DECODE_CONFIG, attention_forward

    many = [int(x) for x in torch.randint(1, 1500, (48,), generator=torch.Generator().manual_seed(5)).tolist()]
    q, k, v, cu = make_tokens(many, hq, hkv, 128, dtype, "cuda")
    base = run_varlen(q, k, v, many)
    batched = run_chunked(q, k, v, many, chunk=1, prompt=3)  # three decode steps of all 48 at once
    assert torch.equal(batched, base)
    for b in (0, 17, 47):
        s = slice(int(cu[b]), int(cu[b + 1]))
        assert torch.equal(run_chunked(q[s], k[s], v[s], [many[b]], chunk=1, prompt=2), base[s])
    cache = PagedCache(many, hkv, 128, dtype, "cuda")
    rows = torch.cat([torch.arange(int(cu[b]), int(cu[b + 1])) for b in range(len(many))]).cuda()
    K.write_kv_cache(k[rows], v[rows], cache.k, cache.v,
                     torch.cat([cache.slots(b, 0, many[b]) for b in range(len(many))]).cuda())
    last = (cu[1:] - 1).long()
    kv = torch.tensor(many, dtype=torch.int32, device="cuda")
    step = torch.arange(len(many) + 1, dtype=torch.int32, device="cuda")
    loads = ((False, False), (True, False), (True, True))  # (page read ahead, masked pointer loads)
    launches = [(False, 4, stages, *ld) for stages in (1, 2, 3) for ld in loads]
    launches += [(True, 4, stages, *ld) for stages in (1, 2, 3) for ld in loads[::2]] + [(True, 8, 2, False, True)]
    for keys_on_m, warps, stages, prefetch, masked_ptr in launches:
        cfg = {**_DECODE_CONFIG, "num_stages": stages, "PREFETCH_PAGE": prefetch, "MASKED_PTR": masked_ptr,
               "KEYS_ON_M": keys_on_m, "num_warps": warps}
        out = attention_forward(q[last], cache.k, cache.v, step, kv, cache.page_table, config=cfg)
        assert torch.equal(out, base[last]), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fast_mode_accuracy(dtype):
    lens = [700, 1, 1300]
    q, k, v, cu = make_tokens(lens, 32, 8, 128, dtype, "cuda")
    ref = attention_ref(q, k, v, cu, cu)
    with K.use_mode("fast"):
        assert rel_err(run_varlen(q, k, v, lens), ref) < 1e-2
        for chunk in (None, 300):
            assert rel_err(run_chunked(q, k, v, lens, chunk), ref) < 1e-2
        assert rel_err(run_chunked(q, k, v, lens, chunk=1, prompt=20), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_tma_and_pointer_loads_bit_identical(dtype, d):
    """The K/V load path (TMA descriptors or pointers) does not change a bit, in either layout."""
    _check_load_paths(make_tokens([1, 2000, 127, 700], 32, 8, d, dtype, "cuda"), [1, 2000, 127, 700])


def _strided_like_model(lens, hq, hkv, d, dtype, device):
    """q/k/v as the model makes them: q and v are strided views of one fused qkv projection, k a
    fresh contiguous tensor, so K and V have different row strides."""
    T = sum(lens)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=device).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(T, hq, d), k.reshape(T, hkv, d).contiguous(), v.reshape(T, hkv, d), cu_of(lens, device)


def test_strided_views_give_the_contiguous_bits(interpreter):
    lens = [3, 70, 130]
    q, k, v, cu = _strided_like_model(lens, 4, 2, 64, torch.float16, "cpu")
    assert v.stride(0) != k.stride(0)
    out = K.varlen_attention(q, k, v, cu)
    assert torch.equal(out, K.varlen_attention(q.contiguous(), k, v.contiguous(), cu))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_strided_views_give_the_contiguous_bits(dtype):
    lens = [3, 130, 257, 1000]
    q, k, v, cu = _strided_like_model(lens, 16, 8, 128, dtype, "cuda")
    out = K.varlen_attention(q, k, v, cu)
    assert torch.equal(out, K.varlen_attention(q.contiguous(), k, v.contiguous(), cu))
    assert torch.equal(out, run_chunked(q.contiguous(), k, v.contiguous(), lens, chunk=1, prompt=40))


@triton.jit
def _score_tile_sums(Q, KEYS, P, TL_SUM, KEY_SUM, qk_scale, M: tl.constexpr, D: tl.constexpr):
    """One row tile as the attention kernels build it: scores ``q @ k^T`` ``[M, 128]`` from the MMA, their
    ``exp2`` against the row max (stored in ``P``), then the row sums by ``tl.sum`` and by ``_key_sum``."""
    rows = tl.arange(0, M)
    cols = tl.arange(0, D)
    keys = tl.arange(0, 128)
    q = tl.load(Q + rows[:, None] * D + cols[None, :])
    k = tl.load(KEYS + keys[:, None] * D + cols[None, :])
    s = tl.dot(q, tl.trans(k))
    p = tl.math.exp2(s * qk_scale - (tl.max(s, 1) * qk_scale)[:, None])
    tl.store(P + rows[:, None] * 128 + keys[None, :], p)
    tl.store(TL_SUM + rows, tl.sum(p, 1))
    tl.store(KEY_SUM + rows, _key_sum(p))


@pytest.mark.gpu
def test_gpu_key_sum_adds_in_its_stated_order():
    """The stated chain of additions on the GPU too (``_key_sum`` on a loaded, non-MMA tile)."""
    p = spread_exp2_values(64, seed=3)
    out = torch.empty(64, device="cuda")
    _key_sum_rows[(1,)](p.cuda(), out, R=64)
    assert torch.equal(out.cpu(), key_sum_in_stated_order(p))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,warps", [(64, 4), (128, 8)])
def test_gpu_key_sum_is_tl_sum_on_row_tiles(dtype, rows, warps):
    """On the row tiles of the prefill and decode launches (64 rows on 4 warps, 128 on 8: wgmma tiles),
    ``_key_sum`` gives ``tl.sum``'s bits, on values whose sums in another order (adjacent pairs first, as the
    tree of before) differ: the row tiles kept the bits they had when they summed with ``tl.sum``. (The
    keys-on-M launch runs the same ``_key_sum``; the decode tests prove its rows equal the row tile's.)"""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(rows, 128, generator=g).to(dtype).cuda()
    k = torch.randn(128, 128, generator=g).to(dtype).cuda()
    p = torch.empty(rows, 128, device="cuda")
    by_tl_sum = torch.empty(rows, device="cuda")
    by_key_sum = torch.empty(rows, device="cuda")
    _score_tile_sums[(1,)](q, k, p, by_tl_sum, by_key_sum, 128 ** -0.5 * 1.4426950408889634, M=rows, D=128,
                           num_warps=warps)
    p = p.cpu()
    pairs_first = p
    while pairs_first.shape[1] > 1:
        pairs_first = pairs_first[:, 0::2] + pairs_first[:, 1::2]
    assert not torch.equal(pairs_first[:, 0], key_sum_in_stated_order(p)), "the values do not tell orders apart"
    assert torch.equal(by_key_sum.cpu(), key_sum_in_stated_order(p))
    assert torch.equal(by_key_sum, by_tl_sum)
