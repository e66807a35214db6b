"""Tile-config sweep for the backward's products (a tuning tool, not a benchmark of record).

    python -m rlperf.bench.weight_grad_sweep [--tokens 3976] [--json PATH]

Invariant mode differentiates a linear layer ``y = x @ w.T`` with ``rlperf.kernels.gemm.weight_grad``
(``dw = g.T @ x``, the rows summed in fixed 64-row blocks) and ``input_grad`` (``dx = g @ w`` through
the row-invariant matmul). This times, on the Qwen3-0.6b layer shapes at one micro-batch's token
count, every candidate ``weight_grad`` config (TMA loads and pointer loads) and ``input_grad`` config
(reading w in place; the default also through a copy of ``w.T`` as before) next to cuBLAS's
``g.T @ x`` and ``g @ w`` in the same run, and prints each as a ratio to cuBLAS (> 1: faster), marking
a config whose bits differ from the default's on the same input ("other bits"). A config is then chosen
by hand (``weight_grad_config``: a function of the dtype, never of the token count; ``input_grad``'s in
``kernels/gemm.py``'s table, per shape), with the numbers in bench/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse

import torch

from .harness import geomean, sweep_candidate, tile_candidates, write_sweep_json
from .matmul import graph_time

# (N, K) of w [N, K] in the 0.6b layer: qkv, o_proj, gate_up, down
SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
# weight_grad tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M is the rows of the sum per step
CANDIDATES = tile_candidates(
    (64, 128, 128, 8, 3), (64, 128, 128, 8, 4), (64, 128, 128, 8, 5), (64, 128, 128, 4, 3),
    (64, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 8, 5), (64, 256, 128, 8, 3), (64, 128, 256, 8, 3),
    (32, 128, 128, 4, 4), (32, 128, 128, 4, 6), (32, 128, 128, 8, 5),
)
# input_grad tiles (dx = g @ w, w read in place as the [K, N] operand): (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
INPUT_GRAD_CANDIDATES = tile_candidates(
    (64, 128, 128, 4, 4), (64, 128, 64, 4, 6), (64, 256, 64, 4, 4), (64, 256, 64, 8, 4), (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 5), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
    (128, 128, 128, 8, 3), (128, 64, 128, 4, 4),
)


def _gpu_ms(fn) -> float:
    """Median GPU milliseconds of one ``fn()`` call, by CUDA-graph replay (L2 flushed before each): the
    train step replays its micro-steps as graphs, and an eager timing of a 30 us product would measure the
    host's launch path (descriptors, config lookup) instead."""
    return graph_time(fn, warmup=3, reps=30).median_ms


def main(argv=None) -> int:
    from rlperf.kernels.gemm import MatmulConfig, input_grad, launch, launch_weight_grad

    p = argparse.ArgumentParser(prog="python -m rlperf.bench.weight_grad_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=3976, help="rows M of g and x (default 3976: a 4096-bucket micro-batch)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("weight_grad_sweep: needs a CUDA device")
        return 2
    dt, m = torch.bfloat16, args.tokens
    rows, ratios = [], {}
    dx_ratios, dw_ratios, dx_cfg_ratios = [], [], {}
    for shape, (n, k) in SHAPES.items():
        g = torch.randn(m, n, device="cuda", dtype=dt)
        x = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
        cublas_dw = _gpu_ms(lambda: g.t() @ x)
        cublas_dx = _gpu_ms(lambda: g @ w)
        ours_dx = _gpu_ms(lambda: input_grad(g, w))
        dx_ratios.append(cublas_dx / ours_dx)
        row = {"shape": shape, "N": n, "K": k, "M": m, "cublas_dw_ms": cublas_dw, "cublas_dx_ms": cublas_dx,
               "input_grad_ms": ours_dx, "input_grad_vs_cublas": cublas_dx / ours_dx}
        copy_dx = _gpu_ms(lambda: launch(g, w.t().contiguous(), None, dt))
        row["input_grad_via_wT_copy_ms"] = copy_dx
        base_dx, base_dw = input_grad(g, w), launch_weight_grad(g, x, dt)
        ours_dw = _gpu_ms(lambda: launch_weight_grad(g, x, dt))
        dw_ratios.append(cublas_dw / ours_dw)
        row["weight_grad_ms"] = ours_dw
        timed = []  # (candidate, ms or the failure, same bits as the default), in sweep order
        for name, (bm, bn, bk, warps, stages) in INPUT_GRAD_CANDIDATES.items():
            cfg = MatmulConfig(bm, bn, bk, 8, warps, stages)
            ms, same = sweep_candidate(lambda: launch(g, w, None, dt, config=cfg, w_kn=True), base_dx, _gpu_ms)
            if not isinstance(ms, str):
                dx_cfg_ratios.setdefault(name, []).append(cublas_dx / ms)
            row["input_grad " + name] = {"ms": ms, "same_bits_as_default": same}
            timed.append(("dx " + name, ms, same))
        for name, (bm, bn, bk, warps, stages) in CANDIDATES.items():
            cfg = MatmulConfig(bm, bn, bk, 1, warps, stages)
            for tma, tag in ((None, ""), (False, " ptr")):
                ms, same = sweep_candidate(lambda: launch_weight_grad(g, x, dt, config=cfg, tma=tma), base_dw, _gpu_ms)
                if not isinstance(ms, str):
                    ratios.setdefault(name + tag, []).append(cublas_dw / ms)
                row[name + tag] = {"ms": ms, "same_bits_as_default": same}
                timed.append(("dw " + name + tag, ms, same))
        rows.append(row)
        print(f"{shape:8s} N={n} K={k} M={m}: cuBLAS dw {cublas_dw:.3f} ms, dx {cublas_dx:.3f} ms; input_grad "
              f"{ours_dx:.3f} ms ({cublas_dx / ours_dx:.2f}x), weight_grad {ours_dw:.3f} ms ({cublas_dw / ours_dw:.2f}x); "
              + ", ".join((f"{c} {v:.3f}" if isinstance(v, float) else f"{c} {v}") + ("" if same in (True, None) else " (other bits)")
                          for c, v, same in timed)
              + f"; input_grad through a copy of w.T {copy_dx:.3f}", flush=True)
    print(f"input_grad (the table's configs) vs cuBLAS g @ w, geomean: {geomean(dx_ratios):.3f}x")
    print(f"weight_grad (the table's configs) vs cuBLAS g.T @ x, geomean: {geomean(dw_ratios):.3f}x")
    for name, r in dx_cfg_ratios.items():
        if len(r) == len(SHAPES):
            print(f"input_grad {name} vs cuBLAS g @ w, geomean over {len(r)} shapes: {geomean(r):.3f}x")
    for name, r in ratios.items():
        if len(r) == len(SHAPES):
            print(f"weight_grad {name} vs cuBLAS g.T @ x, geomean over {len(r)} shapes: {geomean(r):.3f}x")
    write_sweep_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
