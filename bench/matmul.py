"""Batch-invariant matmul vs cuBLAS on the linear layers of Qwen3-0.6B/4B/8B.

For every model, its four fused linear shapes (nn.Linear layout, ``w`` [N, K]):

* ``qkv``     N = q + 2 kv, K = hidden
* ``o_proj``  N = hidden,   K = q
* ``gate_up`` N = 2 mlp,    K = hidden
* ``down``    N = hidden,   K = mlp

at M (tokens) in 1 ... 8192, bf16. Kernel = ``rlperf.kernels.matmul`` (invariant mode); anchor =
``torch.matmul(x, w.T)`` (cuBLAS) on the same inputs in the same run. Work = 2·M·N·K FLOPs; the
harness flushes L2 before every timed call, so weights come from HBM as they do in a model.

Two timings of each, both with the L2 flush: the row's ms are **CUDA-graph replays** of one call
(GPU time: how decode runs in a rollout engine, and what the kernel itself costs), and ``extra``
holds the **eager** event time of a plain Python call plus the host microseconds per call. The
eager time includes any host launch overhead beyond the ~60 us L2 flush that precedes each call:
Triton's launch path with two TMA descriptors costs ~50-80 us of host time on the lent machines'
CPUs against cuBLAS's ~15-20 us, so at small M the eager ratio measures the launch path, not
the kernel (bench/NOTES-matmul.md, run 2).
Small M is memory-bound (the weights are read once: floor = bytes / HBM bandwidth), large M
compute-bound (floor = FLOPs / tensor-core peak); ``extra`` holds that datasheet floor and the
fraction of it reached.

``summarize`` gives the geometric-mean ratio (cuBLAS ms / kernel ms) for M >= 1024 and for
M <= 64 (the targets: >= 0.90 and >= 0.75), per model, and one measured fact: whether cuBLAS itself
is batch-invariant (row 0 alone vs inside M = 2048).
``cases(quick)`` lists the (model, layer, M) pairs for ``bench/test_microbench.py``
(pytest-benchmark), which times the eager calls.
"""
from __future__ import annotations

import functools
import time

import torch

from .harness import BenchCase, BenchRow, Workload, cuda_time, geomean

BENCH = "matmul"

# Qwen3 configs: hidden, q (= heads * head_dim), kv (= kv_heads * head_dim), mlp (intermediate)
MODELS = {
    "qwen3-0.6b": dict(hidden=1024, q=2048, kv=1024, mlp=3072),
    "qwen3-4b": dict(hidden=2560, q=4096, kv=1024, mlp=9728),
    "qwen3-8b": dict(hidden=4096, q=4096, kv=1024, mlp=12288),
}
M_VALUES = (1, 16, 64, 256, 1024, 4096, 8192)
QUICK_CASES = (("qwen3-4b", "qkv"), ("qwen3-8b", "down"))
QUICK_M = (1, 64, 4096)

# Datasheet peaks (dense bf16 TFLOP/s, HBM TB/s) for the roofline floor; measured ceilings on the
# lent machines are a little lower (H100: ~800 TFLOP/s cuBLAS, ~3.0 TB/s copy).
_PEAKS = {"H200": (989.0, 4.8), "H100": (989.0, 3.35)}


def linear_shapes(model: str) -> list[tuple[str, int, int]]:
    """[(layer, N, K)] of ``model``'s fused linear layers."""
    c = MODELS[model]
    return [
        ("qkv", c["q"] + 2 * c["kv"], c["hidden"]),
        ("o_proj", c["hidden"], c["q"]),
        ("gate_up", 2 * c["mlp"], c["hidden"]),
        ("down", c["hidden"], c["mlp"]),
    ]


def _peaks() -> tuple[float, float]:
    name = torch.cuda.get_device_name()
    for key, peaks in _PEAKS.items():
        if key in name:
            return peaks
    return _PEAKS["H100"]


def cublas_invariance_fact(n: int = 4096, k: int = 4096, m: int = 2048) -> dict:
    """Row 0 of ``x @ w.T`` computed alone vs inside batches of growing M, for cuBLAS and rlperf."""
    import rlperf.kernels as K

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    alone_cublas = torch.matmul(x[:1], w.T)[0]
    alone_ours = K.matmul(x[:1], w)[0]
    first_differing_m = None
    for mm in (2, 8, 16, 32, 64, 128, 256, 512, 1024, m):
        if not torch.equal(torch.matmul(x[:mm], w.T)[0], alone_cublas):
            first_differing_m = mm
            break
    in_batch_cublas = torch.matmul(x, w.T)[0]
    return {
        "shape": f"bf16 M={m} N={n} K={k}",
        "cublas_row0_alone_equals_in_batch": bool(torch.equal(in_batch_cublas, alone_cublas)),
        "cublas_row0_max_abs_diff": float((in_batch_cublas.float() - alone_cublas.float()).abs().max()),
        "cublas_first_M_that_changes_row0": first_differing_m,
        "rlperf_row0_alone_equals_in_batch": bool(torch.equal(K.matmul(x, w)[0], alone_ours)),
    }


def graph_time(fn, *, warmup: int, reps: int):
    """:func:`cuda_time` of a CUDA-graph replay of one ``fn()`` call (L2 flushed before each)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (compilation, cuBLAS workspaces)
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    timing = cuda_time(graph.replay, warmup=warmup, reps=reps)
    del graph
    return timing


def host_us(fn, calls: int = 50) -> float:
    """Host microseconds per call (launch path only: no synchronization inside the loop)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def cases(quick: bool = False) -> list[BenchCase]:
    """One case per (model, layer, M): ``rlperf.matmul`` vs cuBLAS on the same bf16 inputs."""
    out = []
    for model in MODELS:
        for layer, n, k in linear_shapes(model):
            if quick and (model, layer) not in QUICK_CASES:
                continue
            for m in QUICK_M if quick else M_VALUES:
                out.append(BenchCase(
                    BENCH, f"{model} {layer} M={m} N={n} K={k}", "rlperf.matmul", "cublas",
                    setup=functools.partial(_workload, m, n, k), work=2.0 * m * n * k, unit="TFLOP/s",
                    params={"model": model, "layer": layer, "M": m, "N": n, "K": k},
                ))
    return out


def _workload(m: int, n: int, k: int) -> Workload:
    import rlperf.kernels as K

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    return Workload({"rlperf.matmul": lambda: K.matmul(x, w), "cublas": lambda: torch.matmul(x, w.T)})


def run(quick: bool = False) -> list[BenchRow]:
    peak_tflops, hbm_tbs = _peaks()
    reps, warmup = (10, 3) if quick else (30, 5)
    rows: list[BenchRow] = []
    for case in cases(quick):
        calls = case.setup().calls
        kernel_fn, anchor_fn = calls[case.kernel], calls[case.anchor]
        eager_k = cuda_time(kernel_fn, warmup=warmup, reps=reps)
        eager_a = cuda_time(anchor_fn, warmup=warmup, reps=reps)
        kernel = graph_time(kernel_fn, warmup=warmup, reps=reps)
        anchor = graph_time(anchor_fn, warmup=warmup, reps=reps)
        m, n, k = (case.params[d] for d in "MNK")
        flops = case.work
        nbytes = 2.0 * (m * k + n * k + m * n)
        floor_ms = max(flops / (peak_tflops * 1e12), nbytes / (hbm_tbs * 1e12)) * 1e3
        rows.append(case.row(
            kernel.median_ms, anchor.median_ms, kernel=f"{case.kernel}/graph", anchor=f"{case.anchor}/graph",
            bound="compute" if flops / (peak_tflops * 1e12) > nbytes / (hbm_tbs * 1e12) else "memory",
            floor_ms=floor_ms, roofline_fraction=floor_ms / kernel.median_ms,
            kernel_p20_p80_ms=[kernel.p20_ms, kernel.p80_ms], anchor_p20_p80_ms=[anchor.p20_ms, anchor.p80_ms],
            eager_kernel_ms=eager_k.median_ms, eager_anchor_ms=eager_a.median_ms,
            eager_ratio=eager_a.median_ms / eager_k.median_ms,
            host_us_kernel=host_us(kernel_fn), host_us_anchor=host_us(anchor_fn),
        ))
        del calls, kernel_fn, anchor_fn
    if rows:
        rows[0].extra["batch_invariance"] = cublas_invariance_fact()
    return rows


def summarize(rows: list[BenchRow]) -> dict:
    def gm(pred, eager=False):
        sel = [r.extra["eager_ratio"] if eager else r.ratio for r in rows if pred(r.extra)]
        return geomean(sel) if sel else float("nan")

    summary = {
        "ratio_geomean_M>=1024": gm(lambda e: e["M"] >= 1024),
        "ratio_geomean_M<=64": gm(lambda e: e["M"] <= 64),
        "ratio_geomean_all": gm(lambda e: True),
        "eager_ratio_geomean_M>=1024": gm(lambda e: e["M"] >= 1024, eager=True),
        "eager_ratio_geomean_M<=64": gm(lambda e: e["M"] <= 64, eager=True),
    }
    for model in MODELS:
        if any(r.extra["model"] == model for r in rows):
            summary[f"{model}_M>=1024"] = gm(lambda e, mo=model: e["model"] == mo and e["M"] >= 1024)
            summary[f"{model}_M<=64"] = gm(lambda e, mo=model: e["model"] == mo and e["M"] <= 64)
    fact = next((r.extra["batch_invariance"] for r in rows if "batch_invariance" in r.extra), None)
    if fact:
        summary["cublas_batch_invariant"] = fact["cublas_row0_alone_equals_in_batch"]
        summary["cublas_row0_max_abs_diff"] = fact["cublas_row0_max_abs_diff"]
        summary["cublas_first_M_that_changes_row0"] = fact["cublas_first_M_that_changes_row0"]
        summary["rlperf_batch_invariant"] = fact["rlperf_row0_alone_equals_in_batch"]
    return summary
