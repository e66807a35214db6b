"""The FlashInfer anchors (rlperf.bench.flashinfer_anchors): a missing package is named; the paged-decode
plan describes rlperf's page table as FlashInfer reads it (CPU, with a recording stand-in for the library);
on a GPU with FlashInfer, its outputs match rlperf's kernels on the bench's shapes."""
import types

import pytest
import torch

from rlperf.bench import flashinfer_anchors as FI


def test_a_missing_flashinfer_is_named(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_flashinfer(name, *args, **kwargs):
        if name == "flashinfer":
            raise ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flashinfer)
    assert FI.flashinfer_or_reason() == (None, FI.NOT_INSTALLED)


def test_a_row_without_its_flashinfer_anchor_says_why():
    from rlperf.bench.harness import BenchRow
    from rlperf.bench.run import _markdown_section

    row = BenchRow("attention", "decode paged B=64 KV=4096", "rlperf.paged", 0.2, "flashinfer-paged", float("nan"),
                   1e9, "GB/s", {"phase": "decode", "anchor_unavailable": FI.NOT_INSTALLED})
    md = _markdown_section("attention", [row], {}, {})
    assert "| flashinfer-paged (flashinfer not installed) | nan |" in md


class _Recorder:
    def __init__(self, *args, **kwargs):
        self.init = (args, kwargs)

    def plan(self, *args, **kwargs):
        self.planned = (args, kwargs)

    def run(self, *args, **kwargs):
        return self


def test_paged_decode_plan_walks_each_sequences_pages_in_order():
    fi = types.SimpleNamespace(decode=types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Recorder))
    page, hkv, d = 4, 2, 8
    table = torch.tensor([[7, 2, 5], [1, 6, 0], [3, 4, 8]], dtype=torch.int32)  # 3 sequences, 3 pages each
    kv_lens = torch.tensor([9, 4, 1])  # 3 pages (last holds 1), 1 full page, 1 page (last holds 1)
    kc = torch.zeros(9, page, hkv, d)
    q = torch.zeros(3, 8, d)
    wrapper = FI.paged_decode(fi, q, kc, kc, table, kv_lens)()
    (indptr, indices, last, hq, hkv_, d_, page_), kw = wrapper.planned
    assert indptr.tolist() == [0, 3, 4, 5] and indices.tolist() == [7, 2, 5, 1, 3] and last.tolist() == [1, 4, 1]
    assert (hq, hkv_, d_, page_) == (8, hkv, d, page) and kw["q_data_type"] == q.dtype
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert wrapper.init[1]["use_tensor_cores"] is True  # 8 / 2 query heads per KV head
    with pytest.raises(ValueError, match="need up to 4 pages"):
        FI.paged_decode(fi, q, kc, kc, table, torch.tensor([13, 1, 1]))


@pytest.mark.gpu
def test_flashinfer_anchors_match_rlperfs_kernels_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fi, why = FI.flashinfer_or_reason()
    if fi is None:
        pytest.skip(why)
    import rlperf.kernels as K

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, L, hq, hkv, d = 3, 300, 32, 8, 128  # odd lengths: partial last pages
    q, k, v = (torch.randn(B * L, h, d, device="cuda", generator=gen).bfloat16() for h in (hq, hkv, hkv))
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device="cuda")
    ref = K.varlen_attention(q, k, v, cu)
    got = FI.ragged_prefill(fi, q, k, v, cu)()
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    page = K.PAGE_SIZE
    pages = -(-L // page)
    table = torch.randperm(B * pages, generator=gen, device="cuda").view(B, pages).to(torch.int32)
    kc = torch.zeros(B * pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.arange(L, device="cuda")
    slots = (table.long()[:, pos // page] * page + pos % page).reshape(-1)
    K.write_kv_cache(k, v, kc, vc, slots)
    qd = torch.randn(B, hq, d, device="cuda", generator=gen).bfloat16()
    kv_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    ref = K.paged_attention(qd, kc, vc, table, torch.arange(B + 1, dtype=torch.int32, device="cuda"), kv_lens)
    got = FI.paged_decode(fi, qd, kc, vc, table, kv_lens)()
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    logits = torch.randn(64, 1000, device="cuda", generator=gen)
    ids = FI.top_k_top_p_sampling(fi, logits, 0.8, 0.9, 20)()
    top20 = logits.topk(20, -1).indices
    assert ids.shape == (64,) and bool((top20 == ids.long()[:, None]).any(-1).all())
