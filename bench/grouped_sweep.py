"""Tile-config sweep for the MoE grouped GEMM (a tuning tool, not a benchmark of record).

    python -m rlperf.bench.grouped_sweep [--tokens 8192] [--json PATH]

Times every candidate :class:`rlperf.kernels.moe.GroupedMatmulConfig`, with TMA loads and with pointer
loads, on Qwen3-30B-A3B's expert products (``bench/moe.py``'s shape and router): ``gate_up`` and
``down`` over slot-ordered rows (the benchmark's rows), ``gate_up`` gathering its token rows (the model's
forward) and ``down``'s input gradient ``dy @ w_e`` (the backward, reading the weights transposed in
place). Each is printed as a ratio to ``torch._grouped_mm`` on the same sorted rows in the same run
(> 1: faster; GPU time, by CUDA-graph replay), and whether its bits equal the current default's (``same``): on Hopper every wgmma
config is expected to give the same bits, which is what lets the table change without changing a
token. The best config per shape goes into ``grouped_matmul_config`` by hand, with the numbers in
bench/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse

import torch

from .harness import geomean, sweep_candidate, tile_candidates, write_sweep_json
from .matmul import graph_time

# grouped GEMM tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), named by tile_candidates
CANDIDATES = tile_candidates(
    (64, 128, 64, 4, 4), (128, 256, 64, 8, 4), (128, 256, 128, 8, 2), (64, 128, 64, 4, 6), (64, 256, 64, 4, 4),
    (64, 256, 64, 8, 4), (64, 128, 128, 4, 4), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5),
    (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
)


def main(argv=None) -> int:
    import rlperf.kernels as K
    from rlperf.kernels.moe import GroupedMatmulConfig, _launch_grouped

    from .moe import EXPERTS, INTER, TOP_K, _inputs

    p = argparse.ArgumentParser(prog="python -m rlperf.bench.grouped_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens T routed to top-8 of 128 experts (default 8192)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per config (default 20)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("grouped_sweep: needs a CUDA device")
        return 2
    if not hasattr(torch, "_grouped_mm"):
        print("grouped_sweep: this torch has no torch._grouped_mm (the anchor)")
        return 2
    x, router, w_gate_up, w_down = _inputs(args.tokens)
    _, experts = K.moe_route(K.linear(x, router), TOP_K, True)
    plan = K.moe_plan(experts, EXPERTS)
    xs = x[plan.token_of_slot.long()].contiguous()
    h = torch.randn(xs.shape[0], INTER, device="cuda").bfloat16()
    dy = torch.randn(xs.shape[0], x.shape[1], device="cuda").bfloat16()
    offs = plan.expert_offsets[1:].contiguous()
    # (name, a, w [E, N, K] as the kernel reads it, gather, anchor)
    products = [
        ("gate_up", xs, w_gate_up, False, lambda: torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)),
        ("gate_up gather", x, w_gate_up, True, lambda: torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)),
        ("down", h, w_down, False, lambda: torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)),
        ("down dx", dy, w_down.transpose(1, 2), False, lambda: torch._grouped_mm(dy, w_down, offs=offs)),
    ]
    rows, ratios = [], {}

    def gpu_ms(fn) -> float:
        return graph_time(fn, warmup=3, reps=args.reps).median_ms

    for name, a, w, gather, anchor in products:
        anchor_ms = gpu_ms(anchor)
        base = _launch_grouped(a, w, plan, gather)
        row = {"product": name, "N": w.shape[1], "K": w.shape[2], "S": plan.num_slots, "grouped_mm_ms": anchor_ms}
        cells = []
        for cname, (bm, bn, bk, warps, stages) in CANDIDATES.items():
            cfg = GroupedMatmulConfig(bm, bn, bk, warps, stages)
            for tma, tag in ((None, ""), (False, " ptr")):
                key = cname + tag
                ms, same = sweep_candidate(lambda: _launch_grouped(a, w, plan, gather, config=cfg, tma=tma), base,
                                           gpu_ms)
                if isinstance(ms, str):
                    row[key] = ms
                    cells.append(f"{key} {ms}")
                    continue
                row[key] = {"ms": ms, "vs_grouped_mm": anchor_ms / ms, "same_bits_as_default": same}
                ratios.setdefault((name, key), anchor_ms / ms)
                cells.append(f"{key} {anchor_ms / ms:.3f}x{'' if same else ' (other bits)'}")
        rows.append(row)
        print(f"{name:15s} N={row['N']} K={row['K']} S={row['S']}: torch._grouped_mm {anchor_ms:.3f} ms; "
              + ", ".join(cells), flush=True)
    # the benchmark's target is the geomean over its two rows (gate_up and down on slot-ordered rows)
    for cname in CANDIDATES:
        for tag in ("", " ptr"):
            key = cname + tag
            bench = [ratios[(n, key)] for n in ("gate_up", "down") if (n, key) in ratios]
            allr = [ratios[(n, key)] for n, *_ in products if (n, key) in ratios]
            if len(bench) == 2:
                print(f"{key:22s} bench geomean (gate_up, down) {geomean(bench):.3f}x; all four {geomean(allr):.3f}x")
    write_sweep_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
