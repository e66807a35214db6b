"""Batch-invariant matmul (the GEMM behind ``rlperf.kernels.matmul`` and ``linear``):
``out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])`` (nn.Linear layout).

Shapes and dtypes: ``x`` [M, K] and ``w`` [N, K] of one dtype (bfloat16, float16 or float32),
``bias`` [N] (any float dtype, read as float32) or None -> ``out`` [M, N] of ``out_dtype``
(default ``x.dtype``; e.g. ``torch.float32`` for lm-head logits). Products accumulate in float32;
the bias is added to the float32 accumulator after the K loop, then the sum is cast once.
float32 inputs use ``tf32x3`` tensor-core products (three tf32 products per pair, about float32
accuracy; plain tf32 would lose 3 decimal digits, ``ieee`` would leave the tensor cores).

Invariance contract: the bits of ``out[m, :]`` depend only on ``x[m, :]``, ``w`` and ``bias`` —
never on M, on the other rows, or on where row m sits in the batch. The kernel guarantees it by
construction:

* one ``BLOCK_K`` per (dtype, N, K) and every tile a Hopper wgmma with 64 or 128 rows on its M side,
  so an output element is the same chain of k16 tensor-core steps in increasing K whatever the tile
  shape. The tile shape itself (:func:`matmul_config`) comes from at most three fixed configs of the
  shape, all with that ``BLOCK_K``: swapped 16-row tiles up to ``tiny_m_limit(N, K)`` rows (``TINY_M``,
  or 64 for a few shapes; w's rows on the wgmma's M side, x's rows on its N side: the same products in
  the same chain, operands on the other sides), narrow tiles up to ``small_m_limit(N, K)`` rows (64, or
  256 for a few shapes) and wide ones beyond.
  No autotune, no other dependence on M. On the GPU the tests prove the configs' bits equal across
  the edges (``tests/kernels/test_matmul.py``: M from 1 to 4097); under the interpreter each BLOCK_K
  tile's product is exact (float64) and rounded once into the float32 accumulator, so the shared
  BLOCK_K is what keeps the bits there;
* every tile runs the full K loop in one program, in increasing K order, into one float32
  accumulator: no split-K or stream-K, whose partial sums (and their number) would depend on
  how many tiles the launch has;
* an output element is computed by the same tensor-core instructions whatever the row's position
  in its tile; rows past M are zero-padded (TMA) or duplicates (pointer path) and never stored;
* the persistent grid (one program per SM, each walking tiles with a fixed stride) decides only
  *which* program computes a tile, never *how*.

On the GPU a (dtype, N, K) always takes the same load path (TMA descriptors when rows are 16-byte
aligned, masked pointer loads otherwise); inputs whose layout does not fit are copied first, so
the path never depends on a tensor's storage offset. Bits are proven on the GPU
(``tests/kernels/test_matmul.py``, marker ``gpu``); the CPU interpreter computes the tile product
in float64 through :func:`rlperf.kernels.tile_dot.dot_acc` (row-position invariant on any x86
BLAS) and proves the kernel's indexing and invariance, not the GPU's bits.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_mul_f32
from .autograd import matmul_with_grad
from .dispatch import mode, route
from .pipeline import grid_dependency_sync, launch_options, launch_with_fitting_stages, num_sms
from .tile_dot import dot_acc, kernel_store_dtype
from .reference.matmul import matmul_ref

try:  # host-side TMA descriptors: Triton >= 3.4 (the device has 3.6, CI 3.9)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer path only
    TensorDescriptor = None

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row-tiles walk the N tiles together, so a band of w stays in L2
    # while the programs of one wave reuse it. Only the tile->program mapping changes, not the math.
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % tiles_per_group) % group_m
    pid_n = (tile_id % tiles_per_group) // group_m
    return pid_m, pid_n


# M is never specialized (Triton would otherwise compile a separate kernel for M == 1): one
# compiled kernel per (dtype, N, K) config serves every batch size.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x, w, out, bias,  # x, w: pointers, or TMA tensor descriptors when USE_TMA
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, FLATTEN: tl.constexpr, W_KN: tl.constexpr = False, SWIGLU: tl.constexpr = False,
):
    # SWIGLU: w is [2N, K] = [gate | up] and out[m, n] = silu(g) * u of g = (x @ w[n].T), u = (x @ w[N + n].T),
    # each rounded to out's dtype first, with activation.py's formula: the bits of matmul then silu_mul.
    # Each accumulator sees the K loop a plain tile would, so g and u are the plain matmul's values.
    # W_KN: w is stored [K, N] (w_kn[k, n] = w[n, k]; the strides name its logical [N, K] axes), e.g.
    # a layer's weight [N_out, K_in] read as the [K_in, N_out] operand of dx = g @ w: its tiles load as
    # [BLOCK_K, BLOCK_N] and enter the dot untransposed, with no copy of w.T.
    # BLOCK_M < 64 (the tiny-M configs, :func:`_tiny_m_config`; never with SWIGLU or W_KN): the tile is
    # computed transposed, acc_t[n, m] = sum_k w[n, k] * x[m, k], w's BLOCK_N rows on the wgmma's 64-row
    # side and x's few rows on its narrow side (no 64-row padding of x). Each element is the same chain of
    # k16 steps over the same products, only the operands swap sides: the bits of the plain tile (GPU
    # tests; under the interpreter the float64 tile sums are exact either way).
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    SWAP_AB: tl.constexpr = BLOCK_M < 64
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    # Persistent: program p computes tiles p, p + P, p + 2P, ... (P programs <= #SMs), so the
    # next tile's loads overlap this tile's epilogue and there is no tail of tiny launches.
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        if not USE_TMA:
            # Rows past M / columns past N read row 0 / column 0 instead of masking: unmasked rows
            # keep the loads vectorized; those results are never stored.
            safe_m = tl.where(offs_m < M, offs_m, 0)
            safe_n = tl.where(offs_n < N, offs_n, 0)
            x_ptrs = x + safe_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
            if W_KN:
                w_ptrs = w + offs_k[:, None] * stride_wk + safe_n.to(tl.int64)[None, :] * stride_wn
            else:
                w_ptrs = w + safe_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
            if SWIGLU:
                u_ptrs = w + (N + safe_n).to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SWIGLU:
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The full K loop, in order, into one accumulator: the reduction order of out[m, n] is
        # fixed by BLOCK_K alone (no split-K).
        for ki in range(k_tiles):
            if USE_TMA:
                a = x.load([off_m, ki * BLOCK_K])  # out-of-bounds rows/cols arrive as zeros
                if W_KN:
                    b = w.load([ki * BLOCK_K, off_n])
                else:
                    b = w.load([off_n, ki * BLOCK_K])
                if SWIGLU:
                    bu = w.load([N + off_n, ki * BLOCK_K])
            else:
                k_mask = offs_k[None, :] < K - ki * BLOCK_K  # zero tail: adds exact zeros
                a = tl.load(x_ptrs, mask=k_mask, other=0.0)
                if W_KN:
                    b = tl.load(w_ptrs, mask=offs_k[:, None] < K - ki * BLOCK_K, other=0.0)
                else:
                    b = tl.load(w_ptrs, mask=k_mask, other=0.0)
                if SWIGLU:
                    bu = tl.load(u_ptrs, mask=k_mask, other=0.0)
                    u_ptrs += BLOCK_K * stride_wk
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K * stride_wk
            if W_KN:
                acc = dot_acc(a, b, acc, PRECISION)
            elif SWAP_AB:
                acc = dot_acc(b, a.T, acc, PRECISION)
            else:
                acc = dot_acc(a, b.T, acc, PRECISION)
            if SWIGLU:
                acc_u = dot_acc(a, bu.T, acc_u, PRECISION)
        out_ty = out.dtype.element_ty
        if SWAP_AB:  # acc is [BLOCK_N, BLOCK_M]: the same epilogue, transposed
            if HAS_BIAS:
                acc += tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
            o_ptrs = out + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None] * stride_on
            tl.store(o_ptrs, acc.to(out_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))
        else:
            if HAS_BIAS:  # after the K loop, in float32, before the single cast
                acc += tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            # 64-bit row offsets: M * N passes 2^31 for long-batch lm-head logits.
            o_ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
            if SWIGLU:  # silu_mul's formula on the rounded matmul outputs (activation.py)
                tl.store(o_ptrs, silu_mul_f32(acc.to(out_ty), acc_u.to(out_ty)).to(out_ty),
                         mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
            else:
                tl.store(o_ptrs, acc.to(out_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# --------------------------------------------------------------------------------------------
# Config table: per (dtype, N, K) one BLOCK_K and up to three tile shapes (swapped tiny-M, small-M, large-M)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tile shape and launch parameters of one (dtype, N, K) and M bucket (:func:`matmul_config`).

    ``BLOCK_K`` sets the K steps of the reduction and is the same in both buckets of a shape;
    ``BLOCK_M``/``BLOCK_N``/warps/stages decide how work is cut and scheduled. (On the H200 every
    wgmma config of the sweeps gave the same bits, BLOCK_K 64, 128 and 256 included; the contract
    keeps BLOCK_K fixed anyway, which the interpreter's exact tile products need.) ``flatten`` lets
    Triton software-pipeline across tiles of the persistent loop (the next tile's first loads overlap
    this tile's epilogue).
    """

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    flatten: bool = True


# Why these tiles (bf16/fp16; measured on an H200 by CUDA-graph replay, bench/NOTES-matmul.md):
# * BLOCK_M is 64 or 128, so every dot is a Hopper wgmma (m64 per warpgroup, k16 per step) whatever
#   the config: an output element is always the same chain of k16 steps in increasing K.
# * Large M (here: M > SMALL_M) is compute-bound: wide tiles (128x128, 128x256) reuse each loaded
#   tile most. The table below is the config each shape runs there.
# * Small M is memory-bound and has one row of tiles: N / BLOCK_N programs stream the weights, and
#   each streams at most ~60 GB/s (its wgmma also computes BLOCK_M - M padding rows), so narrow
#   tiles and BLOCK_M 64 win there (:func:`_small_m_config`, derived from the large config's BLOCK_K).
# * BLOCK_K 128 with 4 stages (BLOCK_M 64) keeps ~96 KB of weights in flight per SM; BLOCK_K 64
#   with 5-6 stages for the 128-row tiles (shared memory caps the product at ~200 KB).
_C = MatmulConfig
_TUNED_16BIT: dict[tuple[int, int], MatmulConfig] = {
    # (N, K): config for M > SMALL_M       # Qwen3 layer; sweep ratio to cuBLAS at M = 256 / 1024 / 4096 / 8192
    (4096, 1024): _C(64, 128, 128, 8, 4, 4),    # 0.6B qkv      0.99 0.91 0.89 0.87
    (1024, 2048): _C(64, 128, 128, 8, 4, 4),    # 0.6B o_proj   0.83 0.96 0.86 0.82
    (6144, 1024): _C(64, 128, 128, 8, 4, 4),    # 0.6B gate_up  0.85 0.89 0.87 0.84
    (1024, 3072): _C(64, 128, 128, 8, 4, 4),    # 0.6B down     0.75 0.95 0.82 0.78
    (6144, 2560): _C(128, 128, 64, 8, 8, 5),    # 4B qkv        0.82 0.97 0.94 0.91
    (2560, 4096): _C(128, 128, 64, 8, 8, 5),    # 4B o_proj     0.64 0.68 0.94 0.94
    (19456, 2560): _C(128, 128, 64, 8, 8, 6),   # 4B gate_up    0.90 0.99 0.95 0.94
    (2560, 9728): _C(64, 128, 128, 8, 4, 4),    # 4B down       0.85 0.72 0.78 0.80
    (6144, 4096): _C(128, 128, 64, 8, 8, 5),    # 8B qkv        0.81 0.97 0.94 0.92
    (4096, 4096): _C(128, 128, 64, 8, 8, 5),    # 8B o_proj     0.81 0.95 0.94 0.94
    (24576, 4096): _C(128, 128, 64, 8, 8, 6),   # 8B gate_up    0.94 0.93 0.96 0.95
    (4096, 12288): _C(128, 128, 64, 8, 8, 5),   # 8B down       0.70 0.95 0.90 0.92
    # The backward's input gradients dx = g @ w (:func:`input_grad`, w read in place as [K, N]): the
    # layer's (K_in, N_out). Ratio to cuBLAS g @ w at M = 3976 by CUDA-graph replay (H200, ``6135c75``,
    # ``python -m rlperf.bench.weight_grad_sweep``), the forward's default 64x128x128 tile -> this one:
    (1024, 4096): _C(128, 256, 64, 8, 8, 4),    # 0.6B qkv dx     0.77 -> 0.98
    (2048, 1024): _C(128, 256, 64, 8, 8, 4),    # 0.6B o_proj dx  0.88 -> 0.95
    (1024, 6144): _C(128, 256, 64, 8, 8, 4),    # 0.6B gate_up dx 0.77 -> 0.99
    (3072, 1024): _C(128, 256, 64, 8, 8, 4),    # 0.6B down dx    0.86 -> 0.97
}

# Batches of at most SMALL_M rows (decode) take the shape's small-M config. 64 is one BLOCK_M of the
# narrow tiles: up to there a launch has one row of tiles and is bound by how many programs stream w.
SMALL_M = 64
# Shapes whose narrow tiles stay ahead beyond SMALL_M rows take them up to this many rows (decode batches
# of up to 256 sequences): their wide large-M tiles leave few programs there. Sweep ratio to cuBLAS at
# M = 256 (H200, bench/NOTES-matmul.md run 7), large-M config -> narrow: 0.6B o_proj 0.853 -> 0.988,
# down 0.768 -> 0.947, gate_up 0.826 -> 0.870 (qkv: 1.001 -> 0.964, kept).
_SMALL_M_UP_TO = {(1024, 2048): 256, (1024, 3072): 256, (6144, 1024): 256}
# Batches of at most TINY_M rows take swapped tiles (:func:`_tiny_m_config`) where the shape has them.
TINY_M = 16
# Shapes whose swapped tiles stay ahead beyond TINY_M rows take them up to this many: the 0.6B narrow-N
# products, whose 64 x 64 small-M tiles leave 16 programs. `matmul_sweep --decode` at M = 64 (H200, weights
# rotated past the L2, bench/NOTES-matmul.md run 8), us, small-M tiles -> swapped: o_proj 6.45 -> 6.19, down
# 8.11 -> 7.72, bits equal (qkv 5.47 -> 6.83 and gate_up 6.45 -> 8.72: kept at TINY_M).
_TINY_M_UP_TO = {(1024, 2048): 64, (1024, 3072): 64}


def small_m_limit(N: int, K: int) -> int:
    """The most rows a batch of an [N, K] weight may have to take the shape's small-M config."""
    return _SMALL_M_UP_TO.get((N, K), SMALL_M)


def tiny_m_limit(N: int, K: int) -> int:
    """The most rows a batch of an [N, K] weight may have to take the shape's swapped tiny-M config (where it
    has one: :func:`_tiny_m_config`)."""
    return _TINY_M_UP_TO.get((N, K), TINY_M) if TINY_M else 0


@functools.lru_cache(maxsize=None)  # on every decode launch: one object per shape, not one per call
def _small_m_config(large: MatmulConfig, N: int) -> MatmulConfig:
    """The config for ``M <= SMALL_M``: the large config's BLOCK_K (the same reduction) in narrower
    tiles, so more programs stream the weights. Sweep ratios to cuBLAS at M = 1 / 16 / 64 (H200,
    bench/NOTES-matmul.md run 5), old single config -> this one: 0.6B down 0.74 0.75 0.77 -> 0.90 0.92
    0.99, 0.6B o_proj 1.39 0.78 0.77 -> 1.62 0.94 0.93, 8B down 0.51 0.50 0.57 -> 0.65 0.70 0.84."""
    if large.BLOCK_K >= 128:
        return MatmulConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=large.BLOCK_K, GROUP_M=8, num_warps=4, num_stages=6)
    if N >= 16384:  # wide layers (gate_up, lm-head): 256-wide tiles still leave >= 64 programs
        return MatmulConfig(BLOCK_M=64, BLOCK_N=256, BLOCK_K=large.BLOCK_K, GROUP_M=8, num_warps=4, num_stages=4)
    return MatmulConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=large.BLOCK_K, GROUP_M=8, num_warps=4, num_stages=8)


@functools.lru_cache(maxsize=None)
def _tiny_m_config(large: MatmulConfig, N: int) -> MatmulConfig | None:
    """The config for ``M <= TINY_M`` (16-bit, no SwiGLU epilogue, w in [N, K]), or None where the shape keeps
    its small-M config: 16 x 64 tiles computed transposed (``_matmul_kernel``'s SWAP_AB: w's 64 rows on the
    wgmma's M side, x's rows padded to 16, not 64), the large config's BLOCK_K. Measured for BLOCK_K 128
    below 16384 columns (H200, weights rotated past the L2, CUDA graphs, us at M = 1, small-M tiles ->
    these, bench/NOTES-matmul.md run 7): 0.6B qkv 6.1 -> 5.1, o_proj 6.4 -> 5.9, gate_up 7.8 -> 5.9, down
    8.1 -> 7.3; the same bits on all four."""
    if large.BLOCK_K != 128 or N >= 16384:
        return None
    return MatmulConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=large.BLOCK_K, GROUP_M=8, num_warps=4, num_stages=6)


def _default_config(dtype: torch.dtype, N: int, K: int) -> MatmulConfig:
    if dtype == torch.float32:
        # tf32 wgmma reads 4-byte elements: BLOCK_K 32 moves the same bytes per stage as 64 bf16.
        return MatmulConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
    if N >= 16384:
        # Wide layers (gate_up, lm-head)
        return MatmulConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
    # The all-rounder of the sweeps
    return MatmulConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)


def matmul_config(dtype: torch.dtype, N: int, K: int, M: int, swapped_ok: bool = True) -> MatmulConfig:
    """The tile config for ``dtype`` inputs ``x`` [M, K] and ``w`` [N, K]: the shape's large-M config; for
    ``M <= small_m_limit(N, K)`` its small-M config; for ``M <= tiny_m_limit(N, K)`` its swapped tiny-M config where it has
    one and ``swapped_ok`` (launches with the SwiGLU epilogue or a [K, N] w pass False). All of one shape share
    BLOCK_K. float32 (tf32x3) has one config."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"matmul: dtype {dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if dtype != torch.float32 and (N, K) in _TUNED_16BIT:
        large = _TUNED_16BIT[(N, K)]
    else:
        large = _default_config(dtype, N, K)
    if dtype == torch.float32 or M > small_m_limit(N, K):
        return large
    if M <= tiny_m_limit(N, K) and swapped_ok:
        tiny = _tiny_m_config(large, N)
        if tiny is not None:
            return tiny
    return _small_m_config(large, N)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

_INTERPRETER_PROGRAMS = 3  # a small persistent grid on CPU, so the tile-stride loop is exercised


@functools.lru_cache(maxsize=None)
def _tma_capable(index: int) -> bool:
    return TensorDescriptor is not None and torch.cuda.get_device_capability(index)[0] >= 9


_ELEMENT_SIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def use_tma(dtype: torch.dtype, K: int, device: torch.device) -> bool:
    """Whether rows of K ``dtype`` elements load through TMA descriptors on ``device``: TMA needs
    16-byte aligned rows and an SM 90+ GPU (the CPU interpreter emulates it). A function of (dtype, K,
    device) only, never of M."""
    if TensorDescriptor is None or (K * _ELEMENT_SIZE[dtype]) % 16:
        return False
    return device.type != "cuda" or _tma_capable(device.index if device.index is not None else torch.cuda.current_device())


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if a TMA descriptor can describe it (unit inner stride, 16-byte aligned base
    and row stride), else a fresh contiguous copy (fresh allocations are aligned)."""
    es = t.element_size()
    if t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0 and t.stride(0) >= t.shape[1]:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"matmul: x must be 2-D [M, K], got shape {tuple(x.shape)} (use linear() for [..., K])")
    if w.dim() != 2:
        raise ValueError(f"matmul: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul: x [M, K] = {tuple(x.shape)} and w [N, K] = {tuple(w.shape)} disagree on K")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"matmul: x dtype {x.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if w.dtype != x.dtype:
        raise TypeError(f"matmul: x dtype {x.dtype} and w dtype {w.dtype} differ")
    if x.device != w.device:
        raise ValueError(f"matmul: x on {x.device} and w on {w.device}")
    if bias is not None:
        if bias.shape != (w.shape[0],):
            raise ValueError(f"matmul: bias must have shape [N] = ({w.shape[0]},) for w {tuple(w.shape)}, "
                             f"got {tuple(bias.shape)}")
        if not bias.dtype.is_floating_point or bias.device != x.device:
            raise TypeError(f"matmul: bias must be a float tensor on {x.device}, got {bias.dtype} on {bias.device}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"matmul: out_dtype {out_dtype} not supported; expected one of {SUPPORTED_DTYPES}")


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T (+ bias[N])`` -> [M, N] of ``out_dtype`` (default ``x.dtype``).

    ``out``: optional [M, N] tensor of ``out_dtype`` (any strides) written in place and returned.
    Invariant mode: the persistent Triton kernel above (GPU or CPU interpreter), or the float64
    reference cast to ``out_dtype`` (CPU otherwise). Fast mode: ``F.linear`` (cuBLAS), not
    batch-invariant, except on CUDA for at most :data:`rlperf.kernels.dispatch.FAST_MODE_KERNEL_ROWS` rows,
    where the kernel is about as fast as cuBLAS or faster and keeps the launches chained. Differentiable in x, w and bias (:func:`rlperf.kernels.autograd.matmul_with_grad`);
    invariant mode's backward is :func:`invariant_linear_grads`, fast mode's torch's matmuls.
    """
    _check(x, w, bias, out_dtype)
    out_dtype = out_dtype or x.dtype
    how = route("matmul", x.device, (x, w, bias), rows=x.shape[0])
    if how == "autograd":
        if out is not None:
            raise ValueError("matmul: out= does not support autograd (an input requires grad)")
        # invariant mode's forward runs the kernel, and so does its backward (row-count invariant)
        grads = invariant_linear_grads if mode() == "invariant" else None
        return matmul_with_grad(lambda x, w, b: matmul(x, w, b, out_dtype), x, w, bias, grads)
    M, N = x.shape[0], w.shape[0]
    if out is not None and (out.shape != (M, N) or out.dtype != out_dtype or out.device != x.device):
        raise ValueError(f"matmul: out must be [M, N] = ({M}, {N}) of {out_dtype} on {x.device}, "
                         f"got {tuple(out.shape)} of {out.dtype} on {out.device}")
    if how == "stock":
        y = F.linear(x, w, bias).to(out_dtype)
    elif how == "reference":
        y = matmul_ref(x, w, bias).to(out_dtype)
    else:
        return launch(x, w, bias, out_dtype, out=out)
    if out is None:
        return y
    return out.copy_(y)


def launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           *, config: MatmulConfig | None = None, tma: bool | None = None,
           out: torch.Tensor | None = None, w_kn: bool = False, swiglu: bool = False) -> torch.Tensor:
    """Launch the Triton kernel directly: no routing, no autograd, no input checks (:func:`matmul`
    does those). CUDA tensors run compiled, CPU tensors under the interpreter (``TRITON_INTERPRET=1``).

    ``config``: the tile config (default :func:`matmul_config`'s, the one :func:`matmul` uses);
    ``tma=False`` forces the pointer path where TMA would be used. Both exist for tuning sweeps
    (``bench/matmul_sweep.py``): another config may give other bits. ``w_kn``: ``w`` is given as
    [K, N] (``x @ w``, e.g. a layer's [N_out, K_in] weight for ``dx = g @ w``), read in place.
    ``swiglu``: ``w`` is [2I, K] = [gate | up] and the result [M, I] is ``silu_mul(x @ w.T)``
    (:func:`linear_silu_mul`), in the tile config of the plain [2I, K] product.
    """
    M, K = x.shape
    N = w.shape[1] if w_kn else w.shape[0]
    out_dtype = out_dtype or x.dtype
    cfg = config if config is not None else matmul_config(x.dtype, N, K, M, swapped_ok=not (swiglu or w_kn))
    if cfg.BLOCK_M < 64 and (swiglu or w_kn):
        raise ValueError("launch: swapped tiles (BLOCK_M < 64) take neither swiglu nor w_kn")
    if swiglu:  # the plain product's config (its bits), over the I output columns
        if w_kn or bias is not None or N % 2:
            raise ValueError("launch: swiglu takes an [2I, K] w, without bias or w_kn")
        N //= 2
    interpreted = x.device.type != "cuda"
    # bf16 off the GPU: the kernel writes float32 and torch rounds (kernel_store_dtype); the
    # interpreter's tile products go through tile_dot.dot_acc
    kernel_out_dtype = kernel_store_dtype(out_dtype, x.device)
    if swiglu and kernel_out_dtype != out_dtype:  # the epilogue's roundings would be skipped
        raise ValueError("launch: swiglu with bfloat16 runs on the GPU only (the interpreter rounds bf16 unlike torch)")
    dst = out if out is not None and kernel_out_dtype == out_dtype else torch.empty(
        (M, N), dtype=kernel_out_dtype, device=x.device)
    if M > 0 and N > 0:
        # [K, N] rows are N long: TMA then needs N, not K, 16-byte aligned
        tma_path = (K > 0 and use_tma(x.dtype, K, x.device) and (not w_kn or use_tma(x.dtype, N, x.device))
                   and tma is not False)
        if tma_path:
            x, w = tma_ready(x), tma_ready(w)
            x_arg = TensorDescriptor.from_tensor(x, [cfg.BLOCK_M, cfg.BLOCK_K])
            w_arg = TensorDescriptor.from_tensor(w, [cfg.BLOCK_K, cfg.BLOCK_N] if w_kn else [cfg.BLOCK_N, cfg.BLOCK_K])
        else:
            x_arg, w_arg = x, w
        num_tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
        if interpreted:
            programs = _INTERPRETER_PROGRAMS
        else:
            programs = num_sms(x.device)
        programs = min(programs, num_tiles)
        # A wider output (float32 logits from a bf16 lm-head) needs a larger epilogue buffer in
        # shared memory: fewer stages then (kernels/pipeline.py; the bits stay).
        def run(stages):
            _matmul_kernel[(programs,)](
                x_arg, w_arg, dst, bias,
                M, N, K,
                x.stride(0), x.stride(1), *((w.stride(1), w.stride(0)) if w_kn else (w.stride(0), w.stride(1))),
                dst.stride(0), dst.stride(1),
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                HAS_BIAS=bias is not None, USE_TMA=tma_path,
                PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32", FLATTEN=cfg.flatten, W_KN=w_kn,
                SWIGLU=swiglu, num_warps=cfg.num_warps, num_stages=stages, **launch_options(x.device),
            )

        launch_with_fitting_stages(run, ("matmul", cfg, dst.dtype, w_kn, swiglu), cfg.num_stages)
    if dst is out:
        return out
    if out is not None:
        return out.copy_(dst)
    return dst if kernel_out_dtype == out_dtype else dst.to(out_dtype)



# --------------------------------------------------------------------------------------------
# Weight gradient: sums over the rows in a fixed order
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _weight_grad_kernel(
    dy, a, dw, rows_of_slot, segment_offsets, M, N, K,
    stride_dym, stride_dyn, stride_am, stride_ak, stride_we, stride_wn, stride_wk,
    SEGMENTED: tl.constexpr, GATHER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    # dw[e, n, k] = sum over the rows m of segment e (all M rows unless SEGMENTED), BLOCK_M rows at
    # a time in increasing m, of dy[m, n] * a[src(m), k]; src(m) = rows_of_slot[m] // TOP_K when
    # GATHER (an expert's slot reads its token's row), else m. One program per output tile runs the
    # whole row loop into one float32 accumulator: no split over the rows, so rows appended past the
    # end with dy = 0 (a micro-batch's padding) add exact zeros and change no bit. USE_TMA (dense
    # only): dy and a are TMA descriptors with [BLOCK_M, BLOCK_N] / [BLOCK_M, BLOCK_K] blocks; rows
    # past M arrive as zeros, as the pointer path's masked loads give them.
    grid_dependency_sync()  # a PDL launch (kernels/pipeline.py): the previous kernel's writes first
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    if SEGMENTED:
        start = tl.load(segment_offsets + e)
        end = tl.load(segment_offsets + e + 1)
    else:
        start = 0
        end = M
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        if USE_TMA:
            g = dy.load([m0, tl.program_id(1) * BLOCK_N])
            x = a.load([m0, tl.program_id(2) * BLOCK_K])
        else:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            valid = offs_m < end
            if GATHER:
                src = tl.load(rows_of_slot + offs_m, mask=valid, other=0) // TOP_K
            else:
                src = offs_m
            g = tl.load(dy + offs_m.to(tl.int64)[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                        mask=valid[:, None] & (offs_n[None, :] < N), other=0.0)
            x = tl.load(a + src.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        acc = dot_acc(tl.trans(g), x, acc, PRECISION)
    d_ptrs = dw + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    tl.store(d_ptrs, acc.to(dw.dtype.element_ty), mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


# Tiles of :func:`weight_grad` per 16-bit layer shape (N, K) of dw (else the default below). BLOCK_M, the
# rows summed per step, is 64 in every one: the order of the sum over the tokens is the same for every
# shape, so a tensor-parallel rank's shard of dw (another N or K) keeps its bits. Ratio to cuBLAS
# g.T @ x at M = 3976 by CUDA-graph replay (H200, ``6135c75``, ``python -m rlperf.bench.weight_grad_sweep``),
# default -> this tile:
_WEIGHT_GRAD_TUNED_16BIT: dict[tuple[int, int], MatmulConfig] = {
    (1024, 2048): _C(64, 128, 128, 1, 8, 4),    # 0.6B o_proj  0.68 -> 0.89
    (6144, 1024): _C(64, 128, 128, 1, 8, 4),    # 0.6B gate_up 0.74 -> 0.80
}


def weight_grad_config(dtype: torch.dtype, N: int | None = None, K: int | None = None) -> MatmulConfig:
    """The tile config of :func:`weight_grad` for ``dtype`` inputs and a [N, K] dw: BLOCK_M rows of the
    sum per step (64 for every 16-bit shape, 32 for float32), a [BLOCK_N, BLOCK_K] output tile per
    program. A function of the dtype and the shape only, never of M."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"weight_grad: dtype {dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if dtype == torch.float32:
        return MatmulConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
    return _WEIGHT_GRAD_TUNED_16BIT.get((N, K), MatmulConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=1,
                                                              num_warps=8, num_stages=3))


def launch_weight_grad(dy: torch.Tensor, a: torch.Tensor, out_dtype: torch.dtype, *, segments: int = 1,
                       segment_offsets: torch.Tensor | None = None, rows_of_slot: torch.Tensor | None = None,
                       top_k: int = 1, config: MatmulConfig | None = None, tma: bool | None = None) -> torch.Tensor:
    """``dw [segments, N, K]``: per segment, the sum over its rows of ``dy[m, :, None] * a[src(m), None, :]``
    in float32, in increasing m, rounded once to ``out_dtype`` (:func:`_weight_grad_kernel`).

    dy [M, N] and a [R, K] of one dtype. Dense (``segment_offsets`` None): one segment of all M rows,
    a [M, K]. Segmented: ``segment_offsets`` [segments + 1] int32 on the device (rows of segment e are
    ``offsets[e]:offsets[e+1]``); with ``rows_of_slot`` [M] row m reads ``a[rows_of_slot[m] // top_k]``
    (the MoE weight gradient: an expert's slots, each reading its token). No checks, no routing.
    Dense calls whose rows are 16-byte aligned load through TMA descriptors (a function of the dtype,
    N and K only); ``tma=False`` forces the pointer loads (for sweeps: another path may give other bits).
    """
    M, N = dy.shape
    K = a.shape[1]
    cfg = config if config is not None else weight_grad_config(dy.dtype, N, K)
    kernel_dtype = kernel_store_dtype(out_dtype, dy.device)
    dw = torch.empty(segments, N, K, dtype=kernel_dtype, device=dy.device)
    if N and K:
        grid = (segments, triton.cdiv(N, cfg.BLOCK_N), triton.cdiv(K, cfg.BLOCK_K))
        segmented = segment_offsets is not None
        tma_path = (not segmented and rows_of_slot is None and M > 0 and tma is not False
                   and use_tma(dy.dtype, N, dy.device) and use_tma(dy.dtype, K, dy.device))
        dy_arg, a_arg = dy, a
        if tma_path:
            dy_arg = TensorDescriptor.from_tensor(tma_ready(dy), [cfg.BLOCK_M, cfg.BLOCK_N])
            a_arg = TensorDescriptor.from_tensor(tma_ready(a), [cfg.BLOCK_M, cfg.BLOCK_K])
        _weight_grad_kernel[grid](
            dy_arg, a_arg, dw, rows_of_slot if rows_of_slot is not None else dw,
            segment_offsets if segmented else dw,
            M, N, K, dy.stride(0), dy.stride(1), a.stride(0), a.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
            SEGMENTED=segmented, GATHER=rows_of_slot is not None, TOP_K=top_k,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
            PRECISION="tf32x3" if dy.dtype == torch.float32 else "tf32", USE_TMA=tma_path,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(dw.device),
        )
    return dw.to(out_dtype)


def weight_grad(dy: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dy [M, N].T @ x [M, K]`` -> [N, K] of ``out_dtype`` (default x's): the weight gradient of
    ``y = x @ w.T``, summed over the M rows in a fixed order that no other row count changes (rows
    past a micro-batch's real tokens, with dy = 0, add exact zeros). dy is cast to x's dtype."""
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"weight_grad: dy must be [M, N] and x [M, K], got {tuple(dy.shape)} and {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"weight_grad: dtype {x.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    return launch_weight_grad(dy.to(x.dtype), x, out_dtype or x.dtype)[0]


def input_grad(dy: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dy [M, N] @ w [N, K]`` -> [M, K] of ``out_dtype`` (default w's): the input gradient of
    ``y = x @ w.T`` through the batch-invariant kernel (``w.T`` as its [K, N] weight), so a row's
    bits depend on that row of dy and on w only. dy is cast to w's dtype; w is read in place
    (``launch(..., w_kn=True)``), never copied."""
    return launch(dy.to(w.dtype), w, None, out_dtype or w.dtype, w_kn=True)


def invariant_linear_grads(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, need_x: bool, need_w: bool):
    """(dx, dw) of ``y = x @ w.T`` for upstream ``g`` by :func:`input_grad` and :func:`weight_grad`:
    neither depends on how many rows the batch has (the backward of invariant mode's matmul)."""
    dx = input_grad(g, w, x.dtype) if need_x else None
    dw = weight_grad(g, x, w.dtype) if need_w else None
    return dx, dw


SWIGLU_EPILOGUE_MAX_ROWS = 0
"""The most rows (tokens) for which :func:`linear_silu_mul` takes its one fused launch; above, the two
calls. 0: never, by default. Measured on an H100 (``python -m rlperf.bench.fusion_ab``, 0.6b shape,
invariant mode, CUDA-graph decode): with the epilogue, decode steps took 2.86 / 3.36 / 5.16 ms at B =
1 / 16 / 64 against 2.57 / 2.98 / 5.23 ms with the two calls (one GPU alone, 2026-11-27; a run beside
three other GPUs' work agreed: 0.85x / 0.83x / 0.85x with the two calls), and at B=256 and in prefill
it cost more still (15.0 against 12.9 ms, 46.7 against 29.0 ms). The launch it saves is worth less than
the epilogue's wider tiles cost. Re-measured on an H200 with the swapped small-batch tiles, which its launches
cannot take (``fusion_ab --variants 'both fusions'``, 2026-11-30): 1.449 / 1.606 / 2.552 / 6.688 ms at B = 1 /
16 / 64 / 256 against 1.306 / 1.457 / 2.428 / 6.399 without it. Both forms give the same bits, so the limit
changes no token; the fused form stays for the A/B bench and its bit tests, which raise the limit."""


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``silu_mul(linear(x, w))``: x [..., K], w [2I, K] = [gate | up] -> [..., I], the MLP's first half.

    On the Triton kernels without autograd (the engine's steps, the trainer's log-prob passes), for at
    most :data:`SWIGLU_EPILOGUE_MAX_ROWS` rows, it is one launch: the matmul kernel's SwiGLU epilogue
    rounds each product to x's dtype and applies :func:`rlperf.kernels.silu_mul`'s formula, in the
    plain [2I, K] product's tile config, so it gives the bits of the two calls. With more rows, with
    autograd (the train step keeps the [..., 2I] product for the backward), in fast mode, on the
    reference backend and for bfloat16 under the CPU interpreter (whose bf16 rounding differs from
    torch's) it is the two calls.
    """
    from .activation import silu_mul

    if x.dim() < 1 or w.dim() != 2 or w.shape[0] % 2:
        raise ValueError(f"linear_silu_mul: x [..., K] and w [2I, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    flat = x.reshape(-1, x.shape[-1])
    _check(flat, w, None, None)
    how = route("matmul", x.device, (x, w), rows=flat.shape[0])
    fused = how in ("triton", "interpreter") and route("silu_mul", x.device, (x,)) in ("triton", "interpreter") \
        and not (x.device.type != "cuda" and x.dtype == torch.bfloat16) and flat.shape[0] <= SWIGLU_EPILOGUE_MAX_ROWS
    if not fused:
        return silu_mul(linear(x, w))
    return launch(flat, w, swiglu=True).reshape(*x.shape[:-1], w.shape[0] // 2)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] @ w[N, K].T (+ bias)`` -> [..., N]: leading dims flattened onto :func:`matmul`'s M."""
    if x.dim() < 1:
        raise ValueError(f"linear: x must have at least 1 dim [..., K], got shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    y = matmul(x.reshape(-1, x.shape[-1]), w, bias, out_dtype)
    return y.reshape(*lead, w.shape[0])
