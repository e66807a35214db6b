"""Launch-choice sweep for the tree node of a split-K product (a tuning tool, not a benchmark of record).

    python -m rlperf.bench.tree_node_sweep [--tokens 8192] [--json PATH]

The megatron backend's tree numerics compute a row-parallel layer's forward (``o_proj``, ``down``:
``x @ w.T`` with K cut into 8 leaves) and a column-parallel layer's input gradient (``qkv``,
``gate_up``: ``dx = g @ w``, N cut into 8 leaves) as one launch per tree node
(``rlperf.kernels.tree_reduce._tree_node``). This times every entry of ``TREE_NODE_TILES`` on the
Qwen3-0.6b layer shapes at one micro-batch's token count, next to cuBLAS's product of the same
operands (bf16 out) and rlperf's batch-invariant matmul without the tree (the plain mode's product), in
the same run, prints each as a ratio to cuBLAS (> 1: faster), and checks that every entry's bits equal
a launch per leaf plus the tree's adds. ``TREE_NODE_TILE`` is then chosen by hand, with the numbers in
bench/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse

import torch

from .harness import cuda_time, geomean, sweep_candidate, write_sweep_json

LEAVES = 8
# name: (K reduced in the tree, N of the output) at the 0.6b shape: a = [tokens, K], b = [N, K]
SHAPES = {"o_proj fwd": (2048, 1024), "down fwd": (3072, 1024), "qkv dx": (4096, 1024), "gate_up dx": (6144, 1024)}


def main(argv=None) -> int:
    from rlperf import kernels as K
    from rlperf.kernels import tree_reduce as T

    p = argparse.ArgumentParser(prog="python -m rlperf.bench.tree_node_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="rows M of the product (default 8192: one micro-batch)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tree_node_sweep: needs a CUDA device")
        return 2
    m = args.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, ratios = [], {name: [] for name in T.TREE_NODE_TILES}
    with K.use_backend("triton"):
        for shape, (k, n) in SHAPES.items():
            a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            b = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
            cublas = cuda_time(lambda: a @ b.T).median_ms
            plain = cuda_time(lambda: T._matmul_out(a, b, torch.bfloat16)).median_ms
            T.FUSED_LEAF_PRODUCTS = False  # the per-leaf path: the bits every tile must give
            try:
                per_leaf_ms = cuda_time(lambda: T._tree_node(a, b, LEAVES)).median_ms
                want = T._tree_node(a, b, LEAVES)
            finally:
                T.FUSED_LEAF_PRODUCTS = True
            print(f"\n== {shape}: [{m}, {k}] x [{n}, {k}].T, {LEAVES} leaves; cuBLAS {cublas:.3f} ms, rlperf plain "
                  f"matmul {plain:.3f} ms ({cublas / plain:.3f}x), a launch per leaf {per_leaf_ms:.3f} ms "
                  f"({cublas / per_leaf_ms:.3f}x)")
            for name in T.TREE_NODE_TILES:
                ms, same = sweep_candidate(lambda: T._tree_node(a, b, LEAVES, tile=name), want,
                                           lambda fn: cuda_time(fn).median_ms)
                if isinstance(ms, str):  # a config that does not compile here (shared memory, registers)
                    print(f"  {name:22s} {ms}")
                    continue
                ratios[name].append(cublas / ms)
                rows.append({"shape": shape, "tokens": m, "tile": name, "ms": ms, "cublas_ms": cublas,
                             "plain_ms": plain, "per_leaf_ms": per_leaf_ms, "vs_cublas": cublas / ms,
                             "bits_equal_per_leaf": same})
                print(f"  {name:22s} {ms:8.3f} ms  {cublas / ms:6.3f}x cuBLAS  bits {'equal' if same else 'DIFFER'}")
    print("\ngeomean over the shapes, vs cuBLAS:")
    for name, r in ratios.items():
        if len(r) == len(SHAPES):
            print(f"  {name:22s} {geomean(r):.3f}x")
    write_sweep_json(args.json, rows)
    return 0 if all(r["bits_equal_per_leaf"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
