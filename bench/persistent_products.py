"""Does one persistent kernel beat the decode step's chained product launches? A measurement for the persistent
decode kernel (the megakernel route): the 4 x L layer products of a Qwen3-0.6B decode step at one row (qkv
4096 x 1024, o_proj 1024 x 2048, gate_up 6144 x 1024, down 1024 x 3072, bf16 on the GPU) in one launch, against
the same chain of shipped :func:`rlperf.kernels.linear` launches replayed from one CUDA graph with programmatic
dependent launch (the engine's decode graphs launch so), same process, same weights.

The persistent kernel (:func:`_persistent_products`): one program per SM; the chain's 64-row output tiles, in
order (layer, product, tile), are handed out round-robin, each computed as the shipped kernel's swapped tile
(``acc_t[n, m] = sum_k w[n, k] x[m, k]``, 16 x rows on the wgmma's narrow side, BLOCK_K 128: the same k16
chain, so the same bits; the run checks every output). A tile first waits until every tile of the product
before it is done: one int32 counter per (layer, product), bumped with release semantics after a tile's
stores, polled with acquire semantics. A program only ever waits for tiles earlier in the order, which
programs earlier in their own order compute, so with every program resident nothing deadlocks. Counters are
never reset: launch ``e`` waits for ``e x tiles``. ``--prefetch`` also asks the L2 for the tile's weight rows
before the wait.

The chain's inputs are the previous product's outputs (o_proj reads qkv's first 2048 columns, down gate_up's
first 3072); attention, the norms and SiLU-mul are left out, as the question is the products' own cost. Output:
both times, their ratio (> 1: the persistent kernel is faster) and whether the bits are equal. On the CPU under
Triton's interpreter (fp16, one program, no timing) it checks the bits only.

    python -m rlperf.bench.persistent_products --layers 28 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

import rlperf.kernels as K
from rlperf.kernels.tile_dot import dot_acc

HIDDEN, Q_WIDTH, INTER = 1024, 2048, 3072
SHAPES = ((4096, HIDDEN), (HIDDEN, Q_WIDTH), (2 * INTER, HIDDEN), (HIDDEN, INTER))
"""(N, K) of qkv, o_proj, gate_up and down (the 0.6B layer)."""
KERNEL_SHAPE = {"H": HIDDEN, "QKV_N": SHAPES[0][0], "Q_W": Q_WIDTH, "GU_N": SHAPES[2][0], "INTER": INTER}
""":func:`_persistent_products`' shape constexprs, from the above."""
BLOCK_N, BLOCK_M, BLOCK_K = 64, 16, 128  # the shipped swapped tile at M <= 16 (kernels/gemm.py, _tiny_m_config)


@triton.jit
def _prefetch_rows(w, n0, K: tl.constexpr, BN: tl.constexpr):
    """Ask the L2 for rows n0 .. n0 + BN of the [*, K] bf16 weight w: one prefetch per 128-byte line."""
    for k0 in tl.static_range(0, K, 1024):  # every K here is a multiple of 1024
        ptrs = w + n0.to(tl.int64) * K + tl.arange(0, BN)[:, None] * K + k0 + tl.arange(0, 16)[None, :] * 64
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _swapped_tile(w, x, out, n0, K: tl.constexpr, N: tl.constexpr, LDX: tl.constexpr, BN: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr):
    """out[m, n0 + n] = sum_k w[n0 + n, k] x[m, k] for the BM rows of x (row stride LDX): one k16 chain over K."""
    offs_n = n0 + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for ki in range(K // BK):
        wt = tl.load(w + offs_n.to(tl.int64)[:, None] * K + (ki * BK + offs_k)[None, :])
        # x was written by other programs of this launch: read past the (incoherent) L1
        xt = tl.load(x + offs_m[:, None] * LDX + (ki * BK + offs_k)[None, :], cache_modifier=".cg")
        acc = dot_acc(wt, xt.T, acc)
    tl.store(out + offs_m[None, :] * N + offs_n[:, None], acc.to(out.dtype.element_ty))


@triton.jit
def _wait_for(counters, c, need):
    got = tl.atomic_add(counters + c, 0, sem="acquire")
    while got < need:
        got = tl.atomic_add(counters + c, 0, sem="acquire")


@triton.jit
def _persistent_products(x0, w_qkv, w_o, w_gu, w_down, out_qkv, out_o, out_gu, out_down, counters, epoch, n_layers,
                         BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr,
                         H: tl.constexpr, QKV_N: tl.constexpr, Q_W: tl.constexpr, GU_N: tl.constexpr,
                         INTER: tl.constexpr):
    """The chain of module docstring in one launch (shapes: :data:`KERNEL_SHAPE`). w_*: [L, N, K]; out_*: [L, BM,
    N]; x0: [BM, H]; counters: [L * 4] int32, counter 4 l + p counts the finished tiles of layer l's product p
    over all launches."""
    T_QKV: tl.constexpr = QKV_N // BN
    T_O: tl.constexpr = H // BN
    T_GU: tl.constexpr = GU_N // BN
    T_DOWN: tl.constexpr = H // BN
    PER_LAYER: tl.constexpr = T_QKV + T_O + T_GU + T_DOWN
    for task in range(tl.program_id(0), n_layers * PER_LAYER, tl.num_programs(0)):
        layer = task // PER_LAYER
        t = task % PER_LAYER
        if t < T_QKV:  # qkv: x = the previous layer's down output (x0 for layer 0)
            n0 = t * BN
            w = w_qkv + layer.to(tl.int64) * QKV_N * H
            if PREFETCH:
                _prefetch_rows(w, n0, H, BN)
            if layer > 0:
                _wait_for(counters, (layer - 1) * 4 + 3, epoch * T_DOWN)
                x = out_down + (layer - 1) * BM * H
            else:
                x = x0
            _swapped_tile(w, x, out_qkv + layer * BM * QKV_N, n0, H, QKV_N, H, BN, BM, BK)
            c = layer * 4
        elif t < T_QKV + T_O:  # o_proj: x = qkv's first Q_W columns
            n0 = (t - T_QKV) * BN
            w = w_o + layer.to(tl.int64) * H * Q_W
            if PREFETCH:
                _prefetch_rows(w, n0, Q_W, BN)
            _wait_for(counters, layer * 4, epoch * T_QKV)
            _swapped_tile(w, out_qkv + layer * BM * QKV_N, out_o + layer * BM * H, n0, Q_W, H, QKV_N, BN, BM, BK)
            c = layer * 4 + 1
        elif t < T_QKV + T_O + T_GU:  # gate_up: x = o_proj's output
            n0 = (t - T_QKV - T_O) * BN
            w = w_gu + layer.to(tl.int64) * GU_N * H
            if PREFETCH:
                _prefetch_rows(w, n0, H, BN)
            _wait_for(counters, layer * 4 + 1, epoch * T_O)
            _swapped_tile(w, out_o + layer * BM * H, out_gu + layer * BM * GU_N, n0, H, GU_N, H, BN, BM, BK)
            c = layer * 4 + 2
        else:  # down: x = gate_up's first INTER columns
            n0 = (t - T_QKV - T_O - T_GU) * BN
            w = w_down + layer.to(tl.int64) * H * INTER
            if PREFETCH:
                _prefetch_rows(w, n0, INTER, BN)
            _wait_for(counters, layer * 4 + 2, epoch * T_GU)
            _swapped_tile(w, out_gu + layer * BM * GU_N, out_down + layer * BM * H, n0, INTER, H, GU_N, BN, BM, BK)
            c = layer * 4 + 3
        tl.debug_barrier()  # every thread's stores of the tile are issued before the release
        tl.atomic_add(counters + c, 1, sem="release")


class ProductChain:
    """The chain's weights (seeded, [L, N, K] per product, std K^-1/2), its input row (padded to 16 rows) and
    outputs, run either way."""

    def __init__(self, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.layers = layers
        self.weights = [torch.randn(layers, n, k, device=device, dtype=dtype, generator=g) * k ** -0.5
                        for n, k in SHAPES]
        self.x0 = torch.zeros(BLOCK_M, HIDDEN, device=device, dtype=dtype)
        self.x0[0] = torch.randn(HIDDEN, device=device, dtype=dtype, generator=g)
        self.outs = [torch.zeros(layers, BLOCK_M, n, device=device, dtype=dtype) for n, _ in SHAPES]
        self.counters = torch.zeros(layers * 4, device=device, dtype=torch.int32)
        self.epoch = 0
        self.programs = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1

    def persistent(self, prefetch: bool = False) -> None:
        """One launch of the persistent kernel (outputs in ``self.outs``)."""
        self.epoch += 1
        _persistent_products[(self.programs,)](
            self.x0, *self.weights, *self.outs, self.counters, self.epoch, self.layers,
            BN=BLOCK_N, BM=BLOCK_M, BK=BLOCK_K, PREFETCH=prefetch, **KERNEL_SHAPE, num_warps=4,
            num_stages=4 if self.x0.is_cuda else 1)

    def chain(self) -> list[list[torch.Tensor]]:
        """The shipped kernels, one launch a product, on the input row alone: per layer [qkv, o, gate_up, down]."""
        x, res = self.x0[:1], []
        for layer in range(self.layers):
            q = K.linear(x, self.weights[0][layer])
            o = K.linear(q[:, :Q_WIDTH], self.weights[1][layer])
            gu = K.linear(o, self.weights[2][layer])
            x = K.linear(gu[:, :INTER], self.weights[3][layer])
            res.append([q, o, gu, x])
        return res

    def same_bits(self, ref: list[list[torch.Tensor]]) -> bool:
        """Whether the persistent kernel's last outputs (row 0) equal ``ref`` (:meth:`chain`) bit for bit."""
        return all(torch.equal(self.outs[p][layer, 0], ref[layer][p][0])
                   for layer in range(self.layers) for p in range(len(SHAPES)))


def _median_ms(fn, reps: int = 30) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlperf.bench.persistent_products",
                                description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28, help="layers in the chain (default 28, Qwen3-0.6B's)")
    p.add_argument("--rounds", type=int, default=2, help="timing rounds, each timing all three variants (default 2)")
    a = p.parse_args(argv)
    if a.layers < 1 or a.rounds < 1:
        p.error(f"--layers and --rounds must be >= 1, got {a.layers} and {a.rounds}")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not torch.cuda.is_available() and not interpreted:
        print("persistent_products: needs a CUDA GPU, or TRITON_INTERPRET=1 for the bit check alone", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() and not interpreted else "cpu"
    chain = ProductChain(a.layers, device, torch.bfloat16 if device == "cuda" else torch.float16)
    chain.persistent()
    ref = chain.chain()
    same = chain.same_bits(ref)
    print(f"persistent kernel vs the shipped chain at one row, {a.layers} layers: bits {'EQUAL' if same else 'DIFFER'}")
    if device != "cuda":
        return 0 if same else 1
    from rlperf.kernels.pipeline import use_programmatic_launch
    from rlperf.rollout.cuda_graph import capture

    with use_programmatic_launch(True):
        graph, _, _ = capture(chain.chain)
    wbytes = sum(w.numel() * w.element_size() for w in chain.weights)
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}; weights {wbytes / 1e6:.0f} MB, "
          f"{4 * a.layers} products, {chain.programs} programs")
    for r in range(a.rounds):
        shipped = _median_ms(graph.replay)
        plain = _median_ms(chain.persistent)
        pre = _median_ms(lambda: chain.persistent(prefetch=True))
        print(f"round {r + 1}: shipped chain (one graph, PDL) {shipped:.3f} ms ({wbytes / shipped / 1e6:.0f} GB/s) | "
              f"persistent {plain:.3f} ms, ratio {shipped / plain:.3f} | persistent + L2 prefetch {pre:.3f} ms, "
              f"ratio {shipped / pre:.3f}")
    same = chain.same_bits(ref)
    print(f"after the timed launches: bits {'EQUAL' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
