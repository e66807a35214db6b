"""Tile-config sweep for ``rlperf.kernels.matmul`` (a tuning tool, not a benchmark of record).

    python -m rlperf.bench.matmul_sweep [--json PATH] [--reps N]

Times every candidate :class:`MatmulConfig` on every (N, K) of ``bench/matmul.py`` at every M,
next to cuBLAS, and prints per (N, K) and config the geometric-mean ratio (cuBLAS / kernel) over
small (M <= 64), middle (M = 256) and large (M >= 1024) batches. Per (N, K) it marks the best config
for M > 64 (``*``: geomean over M = 256 and the large batches), which goes into ``_TUNED_16BIT`` in
``kernels/gemm.py`` by hand, and the best for M <= 64 among the configs with that BLOCK_K (``s``: the
contract keeps BLOCK_K per shape; ``_small_m_config`` derives the small-M config from it), with the
numbers in ``bench/NOTES-matmul.md``.

It also records whether different configs give the same bits on one input (which config knobs
change the reduction order on this GPU): the evidence behind the two-bucket contract, which the GPU
tests then prove for the configs in use.

    python -m rlperf.bench.matmul_sweep --decode [--configs a,b] [--copies 16]

times the decode-size products instead: the 0.6B layer shapes and its lm head at M = 1, 16, 64 and
256, each product launched on ``--copies`` copies of its weight in turn inside one CUDA graph (so the
weight streams from HBM, not the L2, and launches overlap as in a decode step), microseconds per
product for cuBLAS, the shipped ``matmul`` and every candidate of ``DECODE_CANDIDATES`` with the shape's
BLOCK_K; each candidate's output is compared bit for bit with the shipped ``matmul``'s on the same rows.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from .harness import cuda_time, environment, geomean
from .matmul import M_VALUES, MODELS, graph_time, linear_shapes

# name: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, flatten, tma). Rounds 1-2 (bench/NOTES-matmul.md)
# tried 16 + 16 configs with eager timing, which host launch overhead polluted at small M; round 3
# times the leaders of both rounds by CUDA-graph replay (GPU time).
CANDIDATES = {
    "m128n256k64w8s3": (128, 256, 64, 8, 3, True, True),
    "m128n256k64w8s4": (128, 256, 64, 8, 4, True, True),
    "m128n128k64w8s4": (128, 128, 64, 8, 4, True, True),
    "m128n128k64w8s5": (128, 128, 64, 8, 5, True, True),
    "m128n128k64w4s4": (128, 128, 64, 4, 4, True, True),
    "m128n64k128w4s4": (128, 64, 128, 4, 4, True, True),
    "m64n256k64w4s4": (64, 256, 64, 4, 4, True, True),
    "m64n256k64w8s4": (64, 256, 64, 8, 4, True, True),
    "m64n128k64w4s4": (64, 128, 64, 4, 4, True, True),
    "m64n128k64w4s6": (64, 128, 64, 4, 6, True, True),
    "m64n128k128w4s4": (64, 128, 128, 4, 4, True, True),
    "m64n64k128w4s6": (64, 64, 128, 4, 6, True, True),
    "m64n64k64w4s8": (64, 64, 64, 4, 8, True, True),
    "m128n256k64w8s3p": (128, 256, 64, 8, 3, True, False),
    # round 4 (exploration for later tuning, run next to the chosen configs)
    "m64n128k128w4s3": (64, 128, 128, 4, 3, True, True),
    "m64n128k128w4s5": (64, 128, 128, 4, 5, True, True),
    "m64n128k128w8s4": (64, 128, 128, 8, 4, True, True),
    "m128n128k128w8s3": (128, 128, 128, 8, 3, True, True),
    "m128n128k64w8s6": (128, 128, 64, 8, 6, True, True),
    "m64n128k64w4s8": (64, 128, 64, 4, 8, True, True),
    "m128n256k64w8s4p": (128, 256, 64, 8, 4, True, False),
    # round 5: narrow tiles for the small-M bucket (M <= 64), where one row of tiles leaves N / BLOCK_N
    # programs to stream the weights
    "m64n32k128w4s8": (64, 32, 128, 4, 8, True, True),
    "m64n16k128w4s8": (64, 16, 128, 4, 8, True, True),
    "m64n32k256w4s4": (64, 32, 256, 4, 4, True, True),
    "m64n64k128w4s5": (64, 64, 128, 4, 5, True, True),
    "m64n32k64w4s10": (64, 32, 64, 4, 10, True, True),
    # round 7: swapped tiles (BLOCK_M < 64: w's 64 rows on the wgmma's M side, x's rows padded to 16) for
    # batches of at most 16 rows
    "m16n64k128w4s4": (16, 64, 128, 4, 4, True, True),
    "m16n64k128w4s6": (16, 64, 128, 4, 6, True, True),
    "m16n64k128w4s8": (16, 64, 128, 4, 8, True, True),
    "m16n64k64w4s8": (16, 64, 64, 4, 8, True, True),     # the BLOCK_K-64 shapes (not yet in this sweep; --decode
                                                         # timed the 6-stage form on the lm head: run 8)
    "m16n64k64w4s12": (16, 64, 64, 4, 12, True, True),
}


# --decode candidates (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K is the shape's. Hopper picks the
# product instruction from the tile: wgmma (m64nNk16) when the dot's M side is a multiple of 64 with 4k warps,
# else mma.sync (m16n8k16): BLOCK_M < 64 swaps the operands (w's BLOCK_N rows on the M side), so 16 x 16 and
# 16 x 32 tiles, and 64 x 16 with 2 warps, run mma.sync (compiled for SM 90 under Triton 3.6: 60-82 registers).
DECODE_CANDIDATES = {
    "m16n64w4s6": (16, 64, 4, 6),     # the shipped tiny-M tile (wgmma, swapped)
    "m16n32w1s8": (16, 32, 1, 8),     # mma.sync, one warp
    "m16n32w2s8": (16, 32, 2, 8),
    "m16n32w4s8": (16, 32, 4, 8),
    "m16n16w1s8": (16, 16, 1, 8),
    "m16n16w1s12": (16, 16, 1, 12),
    "m64n64w4s6": (64, 64, 4, 6),     # the shipped small-M tile (wgmma)
    "m64n32w4s8": (64, 32, 4, 8),     # wgmma n32
    "m64n16w4s8": (64, 16, 4, 8),     # wgmma n16
    "m64n16w2s8": (64, 16, 2, 8),     # mma.sync
}
DECODE_SHAPES = (("qkv", 4096, 1024), ("o_proj", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
                 ("lm_head", 151936, 1024))
DECODE_M = (1, 16, 64, 256)


def decode_sweep(mm, names: list[str], copies: int, reps: int) -> list[dict]:
    """us per product at decode sizes (module docstring), and each candidate's bits against ``matmul``."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for layer, n, k in DECODE_SHAPES:
        ws = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16() for _ in range(copies)]
        block_k = mm.matmul_config(torch.bfloat16, n, k, 4096).BLOCK_K
        for m in DECODE_M:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ref = mm.matmul(x, ws[0])
            fns = {"cublas": lambda w: torch.matmul(x, w.T), "shipped": lambda w: mm.matmul(x, w)}
            for name in names:
                bm, bn, warps, stages = DECODE_CANDIDATES[name]
                cfg = mm.MatmulConfig(bm, bn, block_k, 8, warps, stages)
                fns[name] = lambda w, cfg=cfg: mm.launch(x, w, None, torch.bfloat16, config=cfg, tma=True)
            base = None
            for name, fn in fns.items():
                try:
                    same = None if name == "cublas" else bool(torch.equal(fn(ws[0]), ref))
                    t = graph_time(lambda: [fn(w) for w in ws], warmup=3, reps=reps).median_ms * 1e3 / copies
                except Exception as e:  # out of shared memory at this BLOCK_K, compile error: record, go on
                    print(f"{layer} M={m} {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                base = t if name == "shipped" else base
                row = dict(layer=layer, N=n, K=k, M=m, config=name, us=t, bits_equal=same)
                rows.append(row)
                ratio = f"{base / t:6.3f}x shipped" if base else ""
                print(f"{layer:<8} M={m:<4} {name:<12} {t:8.2f} us  {ratio}  bits {'-' if same is None else same}",
                      flush=True)
        ws = None
    return rows


def diagnose(mm, reps: int) -> list[dict]:
    """Where small-M time goes: event time with L2 flush (the harness), the same launch replayed from
    a CUDA graph (no host overhead), and host microseconds per call (launch overhead alone)."""
    from .harness import flush_l2_cache

    flush = cuda_time(flush_l2_cache, warmup=3, reps=reps, flush_l2=False)
    print(f"L2 flush itself: {flush.median_ms * 1e3:.1f} us", flush=True)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n, k, m in ((4096, 1024, 1), (2560, 9728, 1), (24576, 4096, 64), (4096, 4096, 4096)):
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        fns = {"cublas": lambda: torch.matmul(x, w.T)}
        for name in ("m128n128k64w8s4", "m128n256k64w8s3p", "m64n128k64w4s6", "m128n256k64w8s3"):
            c = CANDIDATES[name]
            cfg = mm.MatmulConfig(*c[:3], 8, *c[3:6])
            fns[name] = (lambda cfg=cfg, tma=c[6]: mm.launch(x, w, None, torch.bfloat16, config=cfg, tma=tma))
        fns["matmul()"] = lambda: mm.matmul(x, w)
        for name, fn in fns.items():
            event = cuda_time(fn, warmup=3, reps=reps)
            fn()
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # warm on the side stream too (cuBLAS workspaces)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            replay = cuda_time(graph.replay, warmup=3, reps=reps)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                fn()
            host_us = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
            row = dict(N=n, K=k, M=m, fn=name, event_us=event.median_ms * 1e3, graph_us=replay.median_ms * 1e3,
                       host_us=host_us)
            rows.append(row)
            print(f"diag N={n} K={k} M={m} {name:<18} event {row['event_us']:7.1f} us  graph {row['graph_us']:7.1f} us"
                  f"  host {host_us:6.1f} us/call", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="results/matmul-sweep.json", help="where the results go (default: %(default)s)")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per case (default: %(default)s)")
    p.add_argument("--configs", default="",
                   help="comma-separated subset of candidate names (CANDIDATES, or DECODE_CANDIDATES with --decode)")
    p.add_argument("--diag", action="store_true", help="first time host overhead vs graph replay on four cases")
    p.add_argument("--decode", action="store_true",
                   help="time DECODE_CANDIDATES on the 0.6B decode products (M = 1..256) with bits against matmul")
    p.add_argument("--copies", type=int, default=16, help="--decode: weight copies per graph (L2 rotation)")
    args = p.parse_args(argv)

    from rlperf.kernels import gemm as mm
    if args.decode:
        wanted = [n for n in args.configs.split(",") if n]
        unknown = sorted(set(wanted) - set(DECODE_CANDIDATES))
        if unknown:
            p.error(f"--configs: not in DECODE_CANDIDATES: {', '.join(unknown)} (known: {', '.join(DECODE_CANDIDATES)})")
        if args.copies < 1:
            p.error("--copies must be at least 1")
        info = environment()
        print(f"# decode sweep on {info['card']} | triton {info['triton']} | torch {info['torch']}", flush=True)
        rows = decode_sweep(mm, wanted or list(DECODE_CANDIDATES), args.copies, args.reps)
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(environment=info, decode=rows), indent=1))
        print(f"decode sweep: {args.json}")
        return 0
    names = [n for n in CANDIDATES if not args.configs or n in args.configs.split(",")]
    configs = {n: mm.MatmulConfig(*CANDIDATES[n][:3], 8, *CANDIDATES[n][3:6]) for n in names}
    use_tma = {n: CANDIDATES[n][6] for n in names}

    info = environment()
    print(f"# sweep on {info['card']} | triton {info['triton']} | torch {info['torch']}", flush=True)
    diag = diagnose(mm, args.reps) if args.diag else []
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []  # dicts: model, layer, N, K, M, config, ms (None: failed)
    failed: dict[str, str] = {}
    bits: dict = {}
    t0 = time.time()
    for model in MODELS:
        for layer, n, k in linear_shapes(model):
            w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
            x_all = torch.randn(max(M_VALUES), k, device="cuda", generator=gen).bfloat16()
            for m in M_VALUES:
                x = x_all[:m]
                t = graph_time(lambda: torch.matmul(x, w.T), warmup=3, reps=args.reps)
                results.append(dict(model=model, layer=layer, N=n, K=k, M=m, config="cublas", ms=t.median_ms))
                for name, cfg in configs.items():
                    if name in failed:
                        continue
                    try:
                        t = graph_time(lambda: mm.launch(x, w, None, torch.bfloat16, config=cfg, tma=use_tma[name]),
                                       warmup=3, reps=args.reps)
                        ms = t.median_ms
                    except Exception as e:  # out of shared memory, compile error: record, skip config
                        failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
                        print(f"config {name} failed: {failed[name]}", flush=True)
                        continue
                    results.append(dict(model=model, layer=layer, N=n, K=k, M=m, config=name, ms=ms))
            # Which knobs change bits: every config on the same 300 rows vs the first config.
            if (model, layer) in (("qwen3-4b", "qkv"), ("qwen3-4b", "down")):
                x = x_all[:300]
                base = None
                for name, cfg in configs.items():
                    if name in failed:
                        continue
                    y = mm.launch(x, w, None, torch.bfloat16, config=cfg, tma=use_tma[name])
                    if base is None:
                        base = (name, y)
                    bits[f"{model} {layer} {name} == {base[0]}"] = bool(torch.equal(y, base[1]))
            print(f"{model} {layer} N={n} K={k} done ({time.time() - t0:.0f}s)", flush=True)
            w = x_all = None  # free before the next shape (the timed lambdas read these names)

    # Per (N, K) and config: geomean ratio over M groups.
    table = []
    groups = {"small": lambda m: m <= 64, "mid": lambda m: m == 256, "large": lambda m: m >= 1024}
    cublas = {(r["N"], r["K"], r["M"]): r["ms"] for r in results if r["config"] == "cublas"}
    print(f"\n{'shape':<26} {'config':<20} {'small':>6} {'mid':>6} {'large':>6}")
    for model in MODELS:
        for layer, n, k in linear_shapes(model):
            best = None
            for name in names:
                rs = {r["M"]: r["ms"] for r in results if r["config"] == name and r["N"] == n and r["K"] == k}
                if len(rs) != len(M_VALUES):
                    continue
                g = {gname: geomean([cublas[(n, k, m)] / rs[m] for m in rs if pred(m)]) for gname, pred in groups.items()}
                score = geomean([g["mid"], g["large"]])  # the large-M config serves every M > 64
                table.append(dict(model=model, layer=layer, N=n, K=k, config=name, **g, score=score))
                if best is None or score > best[1]:
                    best = (name, score, g)
            rows = [r for r in table if r["N"] == n and r["K"] == k and r["model"] == model]
            same_k = [r for r in rows if best and configs[r["config"]].BLOCK_K == configs[best[0]].BLOCK_K]
            best_small = max(same_k, key=lambda r: r["small"])["config"] if same_k else None
            for row in rows:
                mark = (" *" if best and row["config"] == best[0] else "") + (" s" if row["config"] == best_small else "")
                print(f"{model[6:]+' '+layer:<26} {row['config']:<20} {row['small']:6.3f} {row['mid']:6.3f} "
                      f"{row['large']:6.3f}{mark}")
    print("\nbits equal across configs:", json.dumps(bits, indent=0))
    print("failed configs:", json.dumps(failed, indent=0))
    payload = dict(environment=info, diag=diag, results=results, table=table, bits=bits, failed=failed)
    from pathlib import Path

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=1))
    print(f"sweep: {args.json} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
