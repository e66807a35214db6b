"""The price of batch invariance on a Qwen3-0.6B-shaped layer stack: invariant mode vs the fast path.

Cases (bf16, all 28 layers of the qwen3-0.6b shape):

* prefill: 8 sequences x 1024 tokens, packed varlen (the training forward);
* decode: 64 sequences, one new token each, against a paged KV cache of 1024 tokens per sequence.

Kernel = ``invariant`` mode (rlperf's Triton kernels); anchor = ``fast`` mode (cuBLAS, SDPA, torch
ops; for products of at most 64 rows, such as the decode case's, fast mode runs rlperf's matmul kernel too:
``rlperf.kernels.dispatch.FAST_MODE_KERNEL_ROWS``) in the same run, same weights and inputs. Both are captured in a CUDA graph when capture
works (as an engine would run them), else timed eagerly; ``extra['graph']`` says which. Target:
invariant mode costs <= 15% over the fast path, i.e. ratio (fast_ms / invariant_ms) >= 0.87.
``cases(quick)`` lists both for ``bench/test_microbench.py``, which times the eager calls.

Row ops of one such layer (bf16, 8192 packed tokens; 2048 quick), timed eagerly as the training
step runs them, rate in GB/s of the bytes each call must move:

* ``rmsnorm`` / ``add_rmsnorm`` backward [T, 1024] and ``silu_mul`` backward [T, 2 x 3072]: the
  Triton backward vs the path it replaced, recompute the float32 torch formula and differentiate
  it with torch autograd (``rlperf.kernels.autograd.with_recompute_backward``);
* ``rmsnorm_rope`` on q [T, 16, 128] (a view of the qkv output), forward and backward: the fused
  kernel vs the unfused path (the rmsnorm kernel, then ``RopeTable.apply``'s torch formula; its
  backward through torch autograd and the recomputed float32 norm).
"""
from __future__ import annotations

import functools

import torch

from rlperf import kernels as K
from rlperf.model import RopeTable, decoder_layer_paged, decoder_layer_prefill, init_layer_weights, preset
from rlperf.rollout.cuda_graph import capture

from .harness import BenchCase, BenchRow, Workload, by_workload, cuda_time, geomean

BENCH = "layers"
MODEL = "qwen3-0.6b"
DECODE = (64, 1024)  # sequences, cached tokens each (one new token each)
PREFILL = (8, 1024)  # sequences, tokens each (packed varlen)
KERNEL, ANCHOR = "invariant", "fast path"


def _graphed(fn):
    """A CUDA-graph replay of ``fn`` if it captures, else ``fn``; and whether capture worked."""
    try:
        graph, _, _ = capture(fn)  # the engine's capture: two warm-up calls on a side stream, then the graph
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
                                 for t in vars(init_layer_weights(cfg, torch.bfloat16, "meta")).values()
                                 if t is not None)
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
    ] + _row_op_cases(quick)


ROW_TOKENS = {False: 8192, True: 2048}  # {quick: tokens} of the row-op cases


def _row_op_cases(quick: bool) -> list[BenchCase]:
    """The row ops' kernel-anchor pairs (module docstring); work = bytes each call moves (bf16)."""
    cfg = preset(MODEL)
    t, h, i, d, hq = ROW_TOKENS[quick], cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads
    setup = functools.partial(_row_ops_workload, t)

    def bwd(op, shape, nbytes):
        return BenchCase(BENCH, f"{op} bwd {shape}", f"{op} Triton bwd", f"{op} recompute bwd", setup=setup,
                         work=nbytes, unit="GB/s", params={"tokens": t})

    return [
        bwd("rmsnorm", f"[{t}, {h}]", 3 * t * h * 2),          # reads x, dy; writes dx
        bwd("add_rmsnorm", f"[{t}, {h}]", 4 * t * h * 2),      # reads s, dy, d residual; writes dx
        bwd("silu_mul", f"[{t}, 2x{i}]", 5 * t * i * 2),       # reads gate_up, dy; writes d gate_up
        BenchCase(BENCH, f"q norm+rope fwd [{t}, {hq}, {d}]", "rmsnorm_rope", "rmsnorm + torch rope", setup=setup,
                  work=2 * t * hq * d * 2, unit="GB/s", params={"tokens": t}),  # reads x; writes out
        bwd("rmsnorm_rope", f"[{t}, {hq}, {d}]", 3 * t * hq * d * 2),  # reads x, d out; writes dx
    ]


def _row_ops_workload(t: int) -> Workload:
    """Inputs of the row-op cases and, per op, the graph built once both ways (the kernel's autograd
    Function and the recompute path it replaced), so each timed call is one backward alone."""
    from rlperf.kernels.autograd import with_recompute_backward

    cfg = preset(MODEL)
    dev, dt, eps = "cuda", torch.bfloat16, cfg.rms_norm_eps
    h, i, d, hq = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, device=dev, generator=gen, dtype=dt).requires_grad_(grad)

    def hf_rmsnorm(v, w):  # HF Qwen3RMSNorm's formula (what the recompute path differentiates in fp32)
        f = v.float()
        return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(v.dtype)

    x, r, dy, dres = randn(t, h, grad=True), randn(t, h, grad=True), randn(t, h), randn(t, h)
    w = (torch.rand(h, device=dev, generator=gen) + 0.5).to(dt).requires_grad_(True)
    gate_up, dact = (randn(t, 2 * i) * 3).requires_grad_(True), randn(t, i)
    qkv = randn(t, (hq + 2 * cfg.num_key_value_heads) * d)
    q = qkv[:, : hq * d].reshape(t, hq, d).requires_grad_(True)  # a strided leaf, as the model's view
    wq = (torch.rand(d, device=dev, generator=gen) + 0.5).to(dt).requires_grad_(True)
    dq = randn(t, hq, d)
    rope = RopeTable(d, 8192, cfg.rope_theta, dev)
    positions = torch.arange(t, device=dev) % 1024

    with K.use_mode("invariant"):
        graphs = {
            "rmsnorm": ((K.rmsnorm(x, w, eps),), (with_recompute_backward(
                lambda x, w: K.rmsnorm(x, w, eps), hf_rmsnorm, x, w),), (x, w), (dy,)),
            "add_rmsnorm": (K.add_rmsnorm(x, r, w, eps), with_recompute_backward(
                lambda x, r, w: K.add_rmsnorm(x, r, w, eps),
                lambda x, r, w: (hf_rmsnorm(x + r, w), x + r), x, r, w), (x, r, w), (dy, dres)),
            "silu_mul": ((K.silu_mul(gate_up),), (with_recompute_backward(
                K.silu_mul, lambda g: torch.nn.functional.silu(g[:, :i]) * g[:, i:], gate_up),),
                (gate_up,), (dact,)),
            "rmsnorm_rope": ((K.rmsnorm_rope(q, wq, positions, rope.cos, rope.sin, eps),), (rope.apply(
                with_recompute_backward(lambda x, w: K.rmsnorm(x, w, eps), hf_rmsnorm, q, wq), positions),),
                (q, wq), (dq,)),
        }

    def backward(outs, inputs, grads):
        return torch.autograd.grad(outs, inputs, grads, retain_graph=True)

    calls = {}
    for op, (new, old, inputs, grads) in graphs.items():
        calls[f"{op} Triton bwd"] = functools.partial(backward, new, inputs, grads)
        calls[f"{op} recompute bwd"] = functools.partial(backward, old, inputs, grads)

    def fused():
        with torch.no_grad(), K.use_mode("invariant"):
            return K.rmsnorm_rope(q, wq, positions, rope.cos, rope.sin, eps)

    def unfused():
        with torch.no_grad(), K.use_mode("invariant"):
            return rope.apply(K.rmsnorm(q, wq, eps), positions)

    calls.update({"rmsnorm_rope": fused, "rmsnorm + torch rope": unfused})
    return Workload(calls)


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
        for c in group:
            if c.kernel == KERNEL:  # a layer stack: invariant vs fast mode, graphed where it captures
                rows.append(_compare(c, w))
            else:  # a row op: eager, as the training step runs it
                rows.append(c.row(cuda_time(w.calls[c.kernel]).median_ms, cuda_time(w.calls[c.anchor]).median_ms))
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
    stacks = [r for r in rows if r.kernel == KERNEL]
    out = {f"{r.case.split()[0]}_overhead_pct": r.extra["overhead_pct"] for r in stacks}
    out["geomean_ratio"] = geomean([r.ratio for r in stacks])
    out["row_ops_geomean_ratio"] = geomean([r.ratio for r in rows if r.kernel != KERNEL])
    return out
