"""The engine's FlashInfer attention (``rlperf serve --mode fast --attention-backend flashinfer``).

On the CPU a stand-in of FlashInfer's two wrappers computes what FlashInfer's documentation says a
plan describes (CSR page table ``indptr / indices / last_page_len``, causal queries aligned to the end
of each sequence's keys, a fixed batch in CUDA-graph mode) in float64: the engine's plans, padding rows
and graph buffers are checked against rlperf's paged-attention reference through it. The real library
runs in the GPU tests.
"""
import types

import pytest
import torch

import rlperf.kernels as K
from rlperf.cli import main
from rlperf.kernels.reference.attention import paged_attention_ref
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.flashinfer_attention import FlashInferAttention, paged_kv_layout
from rlperf.rollout.tokenizer import ByteTokenizer

CFG = preset("tiny")


class _Wrapper:
    """FlashInfer's paged wrappers as documented: ``plan`` takes the CSR page table (and ``qo_indptr`` for
    prefill), ``run(q, (k_cache, v_cache))`` attends in NHD layout; graph mode keeps a fixed batch."""

    calls: list = []

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, **_):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.graph, self.buffers = use_cuda_graph, (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                                                    paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            assert all(b is not None and b.dtype == torch.int32 for b in self.buffers)

    def _plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, page, causal, q_data_type, kv_data_type):
        assert all(t.dtype == torch.int32 for t in (qo_indptr, indptr, indices, last))
        assert q_data_type == kv_data_type and hq % hkv == 0
        if self.graph:  # a fixed batch: the buffers' sizes
            ptr_buf, idx_buf, last_buf = self.buffers
            assert len(last) == len(last_buf) and len(indptr) == len(ptr_buf) and len(indices) <= len(idx_buf)
            ptr_buf.copy_(indptr)
            idx_buf[:len(indices)].copy_(indices)
            last_buf.copy_(last)
        self.plan_args = (qo_indptr.tolist(), indptr.tolist(), indices.tolist(), last.tolist(), hq, hkv, page, causal)
        _Wrapper.calls.append(("plan", type(self).__name__, self.graph, len(last)))

    def run(self, q, paged_kv_cache):
        qo, indptr, indices, last, hq, hkv, page, causal = self.plan_args
        k_cache, v_cache = paged_kv_cache
        assert q.shape[0] == qo[-1] and q.shape[1] == hq and k_cache.shape[1:3] == (page, hkv)
        out = torch.empty_like(q)
        for b in range(len(last)):
            pages = indices[indptr[b]:indptr[b + 1]]
            n_kv = (len(pages) - 1) * page + last[b]
            k = k_cache[pages].flatten(0, 1)[:n_kv].double().repeat_interleave(hq // hkv, dim=1)
            v = v_cache[pages].flatten(0, 1)[:n_kv].double().repeat_interleave(hq // hkv, dim=1)
            qb = q[qo[b]:qo[b + 1]].double()
            s = torch.einsum("qhd,khd->hqk", qb, k) * q.shape[-1] ** -0.5
            if causal:  # query i is token n_kv - n_q + i: it sees keys 0..that token
                n_q = qb.shape[0]
                s = s.masked_fill(torch.arange(n_kv)[None, :] > torch.arange(n_kv - n_q, n_kv)[:, None], float("-inf"))
            out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
        _Wrapper.calls.append(("run", type(self).__name__, self.graph, q.shape[0]))
        return out


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type=None,
             kv_data_type=None):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, False,
                   q_data_type, kv_data_type)


class _Prefill(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, causal=False, q_data_type=None, kv_data_type=None):
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                   head_dim_qk, page_size, causal, q_data_type, kv_data_type)


STAND_IN = types.SimpleNamespace(decode=types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Decode),
                                 prefill=types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Prefill))


@pytest.fixture(autouse=True)
def _reference_backend():
    _Wrapper.calls.clear()
    with K.use_backend("reference"):
        yield


def test_paged_kv_layout_is_the_csr_form_of_the_page_table():
    indptr, indices, last = paged_kv_layout([[7, 3, 9], [4, 0, 0], [5, 6, 0]], [33, 1, 32], page_size=16)
    assert indptr == [0, 3, 4, 6] and indices == [7, 3, 9, 4, 5, 6] and last == [1, 1, 16]
    with pytest.raises(ValueError, match="sequence 1: kv_len 40 needs 3 page"):
        paged_kv_layout([[1, 2, 3], [4, 5]], [3, 40], page_size=16)
    with pytest.raises(ValueError, match="kv_len 0"):
        paged_kv_layout([[1]], [0], page_size=16)
    with pytest.raises(ValueError, match="2 page-table rows for 1 sequences"):
        paged_kv_layout([[1], [2]], [1], page_size=16)


@pytest.mark.parametrize("q_lens, kv_lens", [([1, 1, 1], [17, 1, 300]), ([5, 1, 16], [133, 9, 16]), ([3], [3]),
                                             ([130], [260])], ids=["decode", "mixed", "prefill", "chunk"])
def test_planned_steps_attend_like_rlperfs_paged_attention(q_lens, kv_lens):
    """Odd lengths, pages out of order: the plan of a decode step and of a chunked / mixed step give
    the reference's attention (float32 against float64)."""
    g = torch.Generator().manual_seed(0)
    P, hq, hkv, d = K.PAGE_SIZE, CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
    k_cache, v_cache = (torch.randn(12, P, hkv, d, generator=g) for _ in range(2))
    perm = torch.randperm(12, generator=g).tolist()
    table, at = [], 0
    for n in kv_lens:
        used = -(-n // P)
        table.append(perm[at:at + used] + [0] * (4 - used))
        at += used
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=g)
    attn = FlashInferAttention(CFG, P, torch.float32, "cpu", fi=STAND_IN)
    attn.plan_step(table, cu, kv_lens)
    got = attn(q, k_cache, v_cache)
    want = paged_attention_ref(q, k_cache, v_cache, torch.tensor(table, dtype=torch.int32),
                               torch.tensor(cu, dtype=torch.int32), torch.tensor(kv_lens, dtype=torch.int32))
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    decode = all(n == 1 for n in q_lens)
    assert _Wrapper.calls[0][:2] == ("plan", "_Decode" if decode else "_Prefill")


def test_graph_plans_pad_to_the_bucket_and_refuse_a_batch_too_large():
    attn = FlashInferAttention(CFG, 16, torch.float32, "cpu", max_pages=3, fi=STAND_IN)
    attn.plan_graph(4, [[2, 5], [7]], [20, 3])
    wrapper = attn.graph_decode[4]
    indptr, indices, last = (b.tolist() for b in wrapper.buffers)
    assert indptr == [0, 2, 3, 4, 5] and indices[:5] == [2, 5, 7, 0, 0] and last == [4, 3, 1, 1]
    attn.plan_graph(4, [[1]], [1])  # re-planned into the same wrapper and buffers between replays
    assert attn.graph_decode[4] is wrapper and wrapper.buffers[0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="5 sequences do not fit the graph bucket 4"):
        attn.plan_graph(4, [[1]] * 5, [1] * 5)
    with pytest.raises(RuntimeError, match="no plan"):
        FlashInferAttention(CFG, K.PAGE_SIZE, torch.float32, "cpu", fi=STAND_IN)(torch.zeros(1, 4, 8), None, None)


def _engine(model, attention, **kw):
    cfg = {"max_total_tokens": 4096, "cuda_graph_max_bs": 4, **kw}
    return Engine(model, ByteTokenizer(CFG.vocab_size), EngineConfig(**cfg), attention=attention)


def _generate(engine, prompts):
    return [(r.output_ids, r.output_logprobs) for r in engine.generate(prompts, SamplingParams(max_new_tokens=6,
                                                                                                 temperature=0.0))]


def test_fast_mode_engine_with_flashinfer_attention_generates_like_rlperfs_kernel():
    """Greedy decoding on the tiny model: prefill chunks (eager plans), decode steps through the padded
    graph path (graph plans, 3 sequences in bucket 4), the same tokens as rlperf's attention and log-probs
    within float32 rounding; invariant mode never calls FlashInfer and keeps its bits."""
    model = Qwen3ForCausalLM.random(CFG, seed=0, std=0.1)
    prompts = [[(7 * i) % 256 for i in range(200)], list(range(50, 53)), list(range(100, 121))]  # 200: 2 pages
    with K.use_mode("fast"):
        plain = _generate(_engine(model, None), prompts)
        flash = _generate(_engine(model, FlashInferAttention(CFG, K.PAGE_SIZE, torch.float32, "cpu", max_pages=8,
                                                             fi=STAND_IN), chunked_prefill_size=32), prompts)
    assert [t for t, _ in flash] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(flash, plain):
        assert a == pytest.approx(b, abs=1e-4)
    kinds = {(c[0], c[1], c[2]) for c in _Wrapper.calls}
    assert {("plan", "_Prefill", False), ("plan", "_Decode", True), ("run", "_Decode", True)} <= kinds
    assert any(c[:3] == ("plan", "_Decode", True) and c[3] == 4 for c in _Wrapper.calls)  # padded to the bucket
    _Wrapper.calls.clear()
    with K.use_mode("invariant"):
        kernel = _generate(_engine(model, None), prompts)
        kept = _generate(_engine(model, FlashInferAttention(CFG, K.PAGE_SIZE, torch.float32, "cpu", max_pages=8,
                                                            fi=STAND_IN)), prompts)
    assert kept == kernel and not _Wrapper.calls


@pytest.mark.parametrize("flags, message", [
    ([], "runs with --mode fast only (got --mode invariant)"),
    (["--mode", "fast", "--device", "cpu"], "runs on CUDA devices (--device cpu)"),
])
def test_serve_refuses_flashinfer_where_it_cannot_run(flags, message, capsys):
    assert main(["serve", "--attention-backend", "flashinfer", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---- GPU: the real library ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("q_lens, kv_lens", [([1] * 64, [4096] * 64), ([1, 1, 1], [17, 1, 4000]),
                                             ([512, 1, 37], [512, 700, 2000])], ids=["decode-64", "decode-odd", "mixed"])
def test_gpu_flashinfer_attention_matches_rlperfs_kernel(q_lens, kv_lens):
    """bf16, the qwen3-0.6b heads: FlashInfer's planned decode and prefill against rlperf's kernel."""
    pytest.importorskip("flashinfer")
    cfg = preset("qwen3-0.6b")
    P, hq, hkv, d = K.PAGE_SIZE, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = [-(-n // P) for n in kv_lens]
    k_cache, v_cache = (torch.randn(sum(pages) + 1, P, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    perm = (torch.randperm(sum(pages), generator=g, device="cuda") + 1).tolist()
    table, at = [], 0
    for n in pages:
        table.append(perm[at:at + n] + [0] * (max(pages) - n))
        at += n
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
    attn = FlashInferAttention(cfg, P, torch.bfloat16, "cuda")
    attn.plan_step(table, cu, kv_lens)
    got = attn(q, k_cache, v_cache)
    with K.use_backend("triton"):
        want = K.paged_attention(q, k_cache, v_cache, torch.tensor(table, dtype=torch.int32, device="cuda"),
                                 torch.tensor(cu, dtype=torch.int32, device="cuda"),
                                 torch.tensor(kv_lens, dtype=torch.int32, device="cuda"))
    # outputs are averages of unit-normal values (std ~ 0.02-1): a few bf16 units apart at most
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_fast_mode_engine_with_flashinfer_replays_graphs_like_its_eager_steps():
    """qwen3-0.6b shape (random weights, bf16): greedy tokens of the engine with FlashInfer attention
    through CUDA graphs agree with its eager steps' (no graphs) and with rlperf's attention's in most
    positions (random weights leave near-ties, and the graph wrappers' split-KV schedule may differ from
    the eager one's: not bit-equal)."""
    pytest.importorskip("flashinfer")
    cfg = preset("qwen3-0.6b")
    model = Qwen3ForCausalLM.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    prompts = [list(range(100 + i, 140 + 7 * i)) for i in range(5)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    out = {}
    with K.use_backend("triton"), K.use_mode("fast"):
        for name, kw in (("graphs", {"cuda_graph_max_bs": 8, "attention_backend": "flashinfer"}),
                         ("eager", {"attention_backend": "flashinfer"}), ("rlperf", {"cuda_graph_max_bs": 8})):
            engine = Engine(model, ByteTokenizer(cfg.vocab_size), EngineConfig(max_total_tokens=16384, **kw))
            out[name] = [r.output_ids for r in engine.generate(prompts, params)]
    total = sum(len(x) for x in out["rlperf"])
    assert all(len(x) == 16 for x in out["graphs"] + out["eager"])
    for other in ("eager", "rlperf"):
        same = sum(a == b for x, y in zip(out["graphs"], out[other]) for a, b in zip(x, y))
        assert same >= 0.8 * total, (other, out["graphs"], out[other])
