"""The price of batch invariance on a Qwen3-0.6B-shaped layer stack: invariant mode vs the fast path.

Cases (bf16, all 28 layers of the qwen3-0.6b shape):

* prefill: 8 sequences x 1024 tokens, packed varlen (the training forward);
* decode: 64 sequences, one new token each, against a paged KV cache of 1024 tokens per sequence.

Kernel = ``invariant`` mode (rlperf's Triton kernels); anchor = ``fast`` mode (cuBLAS, SDPA, torch
ops) in the same run, same weights and inputs. Both are captured in a CUDA graph when capture
works (as an engine would run them), else timed eagerly; ``extra['graph']`` says which. Target:
invariant mode costs <= 15% over the fast path, i.e. ratio (fast_ms / invariant_ms) >= 0.87.
``cases(quick)`` lists both for ``bench/test_microbench.py``, which times the eager calls.
"""
from __future__ import annotations

import functools

import torch

from rlperf import kernels as K
from rlperf.model import RopeTable, decoder_layer_paged, decoder_layer_prefill, init_layer_weights, preset

from .harness import BenchCase, BenchRow, Workload, by_workload, cuda_time, geomean

BENCH = "layers"
MODEL = "qwen3-0.6b"
DECODE = (64, 1024)  # sequences, cached tokens each (one new token each)
PREFILL = (8, 1024)  # sequences, tokens each (packed varlen)
KERNEL, ANCHOR = "invariant", "fast path"


def _graphed(fn):
    """A CUDA-graph replay of ``fn`` if it captures, else ``fn``; and whether capture worked."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, True
    except Exception as exc:  # capture is an optimisation; say so and time eagerly
        torch.cuda.synchronize()
        import traceback

        frame = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"layers bench: CUDA graph capture failed at {frame.filename}:{frame.lineno} "
              f"({type(exc).__name__}: {str(exc)[:100]}); timing eagerly")
        return fn, False


def _stack(cfg, layers, hidden, layer_fn):
    residual = None
    for w in layers:
        hidden, residual = layer_fn(hidden, residual, w)
    return hidden


def cases(quick: bool = False) -> list[BenchCase]:
    """Decode first: a failed capture (fast-mode prefill syncs on some torch builds) can leave the
    device in a state where the next capture fails too."""
    cfg = preset(MODEL)
    n_layers = 4 if quick else cfg.num_hidden_layers
    # weights read once per step + KV read, per layer: for the decode GB/s column
    with torch.device("meta"):  # the layer's real shapes, no memory
        w_bytes = n_layers * sum(t.numel() * t.element_size()
                                 for t in vars(init_layer_weights(cfg, torch.bfloat16, "meta")).values())
    b, ctx = DECODE
    kv_bytes = n_layers * 2 * b * (ctx + 1) * cfg.kv_size * 2
    b_p, seq = PREFILL
    t = b_p * seq
    flops = 2 * t * n_layers * (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
                                + 3 * cfg.hidden_size * cfg.intermediate_size)
    flops += n_layers * 4 * b_p * cfg.num_attention_heads * seq * seq * cfg.head_dim // 2
    return [
        BenchCase(BENCH, f"decode b={b} kv={ctx} L={n_layers}", KERNEL, ANCHOR,
                  setup=functools.partial(_decode_workload, n_layers), work=w_bytes + kv_bytes, unit="GB/s"),
        BenchCase(BENCH, f"prefill {b_p}x{seq} L={n_layers}", KERNEL, ANCHOR,
                  setup=functools.partial(_prefill_workload, n_layers), work=flops, unit="TFLOP/s"),
    ]


def _model(n_layers: int):
    cfg = preset(MODEL)
    gen = torch.Generator().manual_seed(0)
    layers = [init_layer_weights(cfg, torch.bfloat16, "cuda", generator=gen) for _ in range(n_layers)]
    return cfg, layers, RopeTable(cfg.head_dim, 8192, cfg.rope_theta, "cuda")


def _modes(fn) -> Workload:
    """``fn`` in invariant mode (the kernel) and in fast mode (the anchor)."""
    def in_mode(mode):
        with K.use_mode(mode):
            return fn()

    return Workload({KERNEL: functools.partial(in_mode, "invariant"), ANCHOR: functools.partial(in_mode, "fast")})


def _decode_workload(n_layers: int) -> Workload:
    cfg, layers, rope = _model(n_layers)
    dtype, dev = torch.bfloat16, "cuda"
    b, ctx = DECODE
    pages_per_seq = ctx // K.PAGE_SIZE + 1
    num_pages = b * pages_per_seq
    caches = [
        (torch.randn(num_pages, K.PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=dev),
         torch.randn(num_pages, K.PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=dev))
        for _ in range(n_layers)
    ]
    page_table = torch.randperm(num_pages, device=dev).to(torch.int32).reshape(b, pages_per_seq)
    kv_lens = torch.full((b,), ctx + 1, dtype=torch.int32, device=dev)
    positions = torch.full((b,), ctx, dtype=torch.int64, device=dev)
    slot_mapping = (page_table[:, ctx // K.PAGE_SIZE].to(torch.int64) * K.PAGE_SIZE + ctx % K.PAGE_SIZE)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
    hidden = torch.randn(b, cfg.hidden_size, dtype=dtype, device=dev)

    def decode():
        residual, h = None, hidden
        for w, cache in zip(layers, caches):
            h, residual = decoder_layer_paged(h, residual, w, cfg, rope, positions, cache, slot_mapping,
                                              page_table, cu_q, kv_lens)
        return h

    return _modes(decode)


def _prefill_workload(n_layers: int) -> Workload:
    cfg, layers, rope = _model(n_layers)
    b, seq = PREFILL
    t = b * seq
    hidden = torch.randn(t, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    positions = torch.arange(seq, device="cuda").repeat(b)
    cu = torch.arange(0, t + 1, seq, dtype=torch.int32, device="cuda")
    return _modes(lambda: _stack(cfg, layers, hidden,
                                 lambda h, r, w: decoder_layer_prefill(h, r, w, cfg, rope, positions, cu)))


def run(quick: bool = False) -> list[BenchRow]:
    rows = []
    for setup, group in by_workload(cases(quick)):
        w = setup()
        rows += [_compare(c, w) for c in group]
        del w
        torch.cuda.empty_cache()
    return rows


def _compare(case: BenchCase, w: Workload) -> BenchRow:
    times, graphs = {}, {}
    for side, name in (("invariant", case.kernel), ("fast", case.anchor)):
        step, graphs[side] = _graphed(w.calls[name])
        times[side] = cuda_time(step, warmup=3, reps=20).median_ms
    return case.row(times["invariant"], times["fast"], graph_invariant=graphs["invariant"], graph_fast=graphs["fast"],
                    overhead_pct=100.0 * (times["invariant"] / times["fast"] - 1.0))


def summarize(rows: list[BenchRow]) -> dict:
    out = {f"{r.case.split()[0]}_overhead_pct": r.extra["overhead_pct"] for r in rows}
    out["geomean_ratio"] = geomean([r.ratio for r in rows])
    return out
