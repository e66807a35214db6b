"""Invariant attention vs torch SDPA (flash and cuDNN): causal prefill and paged decode.

Shapes (Qwen3-8B-like heads): 32 query heads, 8 KV heads, head_dim 128, bf16.

* prefill, causal: B=8 L=4096 and B=32 L=1024. Kernel = ``rlperf.kernels.varlen_attention`` on the
  packed ``[B*L, H, D]`` tokens (and, for B=8 L=4096, ``paged_attention`` full prefill from a
  shuffled paged cache). Anchors in the same run: ``F.scaled_dot_product_attention(is_causal=True)``
  under ``sdpa_kernel(FLASH_ATTENTION)`` and under ``sdpa_kernel(CUDNN_ATTENTION)``, on the same
  memory viewed as ``[B, H, L, D]``. GQA is passed to SDPA as ``enable_gqa=True`` when the backend
  takes it, otherwise as K/V expanded to 32 heads before timing (each row's ``extra['gqa']`` says
  which). Work = 4·B·Hq·L²·D / 2 FLOPs (causal).
* decode: B=64 sequences with 4096 tokens of KV each, one query each, paged cache (shuffled
  pages). Anchor: SDPA flash with q length 1 on dense ``[B, Hkv, 4096, D]`` K/V. Work = the KV
  bytes read (GB/s): B·4096·Hkv·D·2 tensors·2 bytes.

* backward, causal (Qwen3-0.6B heads: 16 query heads, 8 KV heads, D=128, bf16): 8192 tokens in
  sequences of 512. Kernel = the fixed-order Triton backward (``kernels/attention_backward.py``)
  behind ``varlen_attention``'s autograd; anchor = SDPA flash's backward on the same tokens as
  ``[B, H, L, D]``; each side times ``torch.autograd.grad`` of a forward recorded once. Work =
  10·B·Hq·L²·D / 2 FLOPs (the backward's five [L, L]·D products, causal; FlashAttention's 2.5x the
  forward). The row also says whether two runs gave the same gradient bits.

* FlashInfer anchors (:mod:`rlperf.bench.flashinfer_anchors`, when installed): its ragged causal
  prefill at B=8 L=4096 (target: rlperf >= 0.9x) and its paged decode at B=64 KV=4096 on rlperf's own
  paged cache (target >= 1.0x), in the same workloads as the SDPA anchors. Without FlashInfer these rows
  stay, their anchor time NaN and ``extra['anchor_unavailable']`` = "flashinfer not installed".

``summarize`` gives the ratios the targets are stated in: prefill vs cuDNN (>= 0.75) and decode
vs SDPA flash decode (>= 1.0), and the backward vs SDPA flash's backward.
``cases(quick)`` lists these kernel-anchor pairs for ``bench/test_microbench.py`` (pytest-benchmark).

``python -m rlperf.bench.attention --sweep`` times candidate launch configs (BLOCK_M, BLOCK_N,
warps, stages, TMA loads) on both workloads and checks, per config, that decode and chunked rows
equal the prefill rows bit for bit — how ``_CONFIG`` in ``kernels/attention.py`` was chosen.
``--test-config cfg.json -- <pytest args>`` runs the tests with a candidate config (tuning only).
``--sweep-backward`` times candidate backward configs (``BackwardConfig``) at the backward case.
``--sweep-decode`` times candidate decode-only launch configs (``_decode_config``'s) as a decode step runs
them: Qwen3-0.6B heads, one paged cache per layer (28), one CUDA graph of the 28 calls, at the batches
and KV lengths of ``rlperf bench rollout`` (:data:`DECODE_SWEEP_CASES`); each config's time is printed as
a ratio to the config decode runs today at that batch in the same run, with whether its rows equal that
config's bit for bit (whose rows equal the prefill's: the GPU tests of ``tests/kernels/test_attention.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json

import torch

from . import flashinfer_anchors as FI
from .harness import BenchCase, BenchRow, Workload, by_workload, call_names, cuda_time, geomean, time_calls

BENCH = "attention"
DEVICE = "cuda"  # a CPU dry run of the plumbing (tests) may point this elsewhere
HQ, HKV, D = 32, 8, 128
PREFILL_CASES = ((8, 4096), (32, 1024))
DECODE_CASE = (64, 4096)  # (B, KV length)
BACKWARD_CASE = (16, 512, 16, 8)  # (B, L, Hq, Hkv): Qwen3-0.6B's heads, 8192 tokens
_HBM_TBS = {"H200": 4.8, "H100": 3.35}  # datasheet, for the roofline fraction


def _hbm_tbs() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in _HBM_TBS.items() if k in name), _HBM_TBS["H100"])


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def _sdpa_fn(backend_name: str, q4, k4, v4, causal: bool):
    """A zero-argument SDPA call for ``backend_name`` ('flash' | 'cudnn') and how GQA was passed.

    Tries ``enable_gqa=True`` first; if the backend refuses it, expands K/V to Hq heads (outside the
    timed call). Returns (fn, gqa_description) or (None, reason) if the backend cannot run at all.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    g = q4.shape[1] // k4.shape[1]
    attempts = [("enable_gqa=True", k4, v4, True),
                ("K/V expanded to Hq heads", k4.repeat_interleave(g, 1), v4.repeat_interleave(g, 1), False)]
    errors = []
    for desc, kk, vv, gqa in attempts:
        def fn(kk=kk, vv=vv, gqa=gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, kk, vv, is_causal=causal, enable_gqa=gqa)
        try:
            fn()
            torch.cuda.synchronize()
            return fn, desc
        except RuntimeError as e:  # backend does not support this call
            errors.append(f"{desc}: {str(e).splitlines()[0][:120]}")
    return None, "; ".join(errors)


def _paged_cache(k: torch.Tensor, v: torch.Tensor, B: int, L: int, page: int, gen: torch.Generator):
    """Scatter packed K/V [B*L, Hkv, D] into a cache with shuffled pages; returns (kc, vc, page_table)."""
    import rlperf.kernels as K

    pages_per_seq = -(-L // page)
    num_pages = B * pages_per_seq
    perm = torch.randperm(num_pages, generator=gen, device=DEVICE)
    table = perm.view(B, pages_per_seq).to(torch.int32)
    kc = torch.empty(num_pages, page, *k.shape[1:], dtype=k.dtype, device=DEVICE)
    vc = torch.empty_like(kc)
    pos = torch.arange(L, device=DEVICE)
    slots = (table.long()[:, pos // page] * page + pos % page).reshape(-1)
    if page == K.PAGE_SIZE:
        K.write_kv_cache(k, v, kc, vc, slots)
    else:  # sweep configs with another page size
        kc.view(-1, *k.shape[1:])[slots] = k
        vc.view(-1, *v.shape[1:])[slots] = v
    return kc, vc, table


def cases(quick: bool = False) -> list[BenchCase]:
    """Prefill: each kernel (varlen; paged too for the first shape) against SDPA flash and cuDNN;
    decode: paged against SDPA flash on dense K/V."""
    out = []
    for i, (B, L) in enumerate(PREFILL_CASES[:1] if quick else PREFILL_CASES):
        setup = functools.partial(_prefill_workload, B, L, paged=i == 0)
        kernels = ("rlperf.varlen", "rlperf.paged") if i == 0 else ("rlperf.varlen",)
        for backend in ("flash", "cudnn"):
            for kernel in kernels:
                out.append(BenchCase(BENCH, f"prefill causal B={B} L={L}", kernel, f"sdpa-{backend}", setup=setup,
                                     work=4.0 * B * HQ * L * L * D / 2, unit="TFLOP/s",
                                     params={"B": B, "L": L, "phase": "prefill", "anchor_backend": backend}))
        if i == 0:
            out.append(BenchCase(BENCH, f"prefill causal B={B} L={L}", "rlperf.varlen", "flashinfer-ragged",
                                 setup=setup, work=4.0 * B * HQ * L * L * D / 2, unit="TFLOP/s",
                                 params={"B": B, "L": L, "phase": "prefill", "anchor_backend": "flashinfer"}))
    B, S = DECODE_CASE
    decode_setup = functools.partial(_decode_workload, B, S)
    for anchor, backend in (("sdpa-flash-dense", "flash"), ("flashinfer-paged", "flashinfer")):
        out.append(BenchCase(BENCH, f"decode paged B={B} KV={S}", "rlperf.paged", anchor, setup=decode_setup,
                             work=2.0 * B * S * HKV * D * 2, unit="GB/s",
                             params={"B": B, "S": S, "phase": "decode", "anchor_backend": backend}))
    B, L, hq, hkv = BACKWARD_CASE
    out.append(BenchCase(BENCH, f"backward causal B={B} L={L} Hq={hq}", "rlperf.varlen.bwd", "sdpa-flash.bwd",
                         setup=functools.partial(_backward_workload, B, L, hq, hkv),
                         work=10.0 * B * hq * L * L * D / 2, unit="TFLOP/s",
                         params={"B": B, "L": L, "Hq": hq, "Hkv": hkv, "phase": "backward", "anchor_backend": "flash"}))
    return out


def _add_sdpa(w: Workload, name: str, backend: str, q4, k4, v4, causal: bool) -> None:
    fn, gqa = _sdpa_fn(backend, q4, k4, v4, causal=causal)
    if fn is None:
        w.unavailable[name] = f"SDPA {backend} unavailable: {gqa}"
    else:
        w.calls[name] = fn
        w.info[name] = {"gqa": gqa}


def _prefill_workload(B: int, L: int, paged: bool) -> Workload:
    import rlperf.kernels as K

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    T = B * L
    q = torch.randn(T, HQ, D, device=DEVICE, generator=gen).bfloat16()
    k = torch.randn(T, HKV, D, device=DEVICE, generator=gen).bfloat16()
    v = torch.randn(T, HKV, D, device=DEVICE, generator=gen).bfloat16()
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEVICE)
    w = Workload({"rlperf.varlen": lambda: K.varlen_attention(q, k, v, cu)})
    if paged:
        kc, vc, table = _paged_cache(k, v, B, L, K.PAGE_SIZE, gen)
        kv_lens = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
        w.calls["rlperf.paged"] = lambda: K.paged_attention(q, kc, vc, table, cu, kv_lens)
    q4, k4, v4 = (x.view(B, L, -1, D).transpose(1, 2) for x in (q, k, v))
    for backend in ("flash", "cudnn"):
        _add_sdpa(w, f"sdpa-{backend}", backend, q4, k4, v4, causal=True)
    fi, why = FI.flashinfer_or_reason()
    if fi is None:
        w.unavailable["flashinfer-ragged"] = why
    else:
        w.calls["flashinfer-ragged"] = FI.ragged_prefill(fi, q, k, v, cu)
        w.fallible.add("flashinfer-ragged")  # a JIT compile that fails on this stack leaves the row out, named
        w.info["flashinfer-ragged"] = {"flashinfer": fi.__version__}
    return w


def _decode_workload(B: int, S: int) -> Workload:
    import rlperf.kernels as K

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(B, HQ, D, device=DEVICE, generator=gen).bfloat16()
    k = torch.randn(B * S, HKV, D, device=DEVICE, generator=gen).bfloat16()
    v = torch.randn(B * S, HKV, D, device=DEVICE, generator=gen).bfloat16()
    kc, vc, table = _paged_cache(k, v, B, S, K.PAGE_SIZE, gen)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
    kv_lens = torch.full((B,), S, dtype=torch.int32, device=DEVICE)
    k4, v4 = (x.view(B, S, HKV, D).transpose(1, 2).contiguous() for x in (k, v))  # dense [B, Hkv, S, D]
    del k, v
    w = Workload({"rlperf.paged": lambda: K.paged_attention(q, kc, vc, table, cu_q, kv_lens)})
    _add_sdpa(w, "sdpa-flash-dense", "flash", q[:, :, None, :], k4, v4, causal=False)
    fi, why = FI.flashinfer_or_reason()
    if fi is None:
        w.unavailable["flashinfer-paged"] = why
    else:
        w.calls["flashinfer-paged"] = FI.paged_decode(fi, q, kc, vc, table, kv_lens)
        w.fallible.add("flashinfer-paged")
        w.info["flashinfer-paged"] = {"flashinfer": fi.__version__}
    return w


def _backward_inputs(B: int, L: int, hq: int, hkv: int):
    """q, k, v [B*L, H, D] bf16 leaves that require grad, an upstream gradient and cu_seqlens."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    T = B * L
    q, k, v, dout = (torch.randn(T, h, D, device=DEVICE, generator=gen).bfloat16() for h in (hq, hkv, hkv, hq))
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEVICE)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout, cu


def _backward_workload(B: int, L: int, hq: int, hkv: int) -> Workload:
    import rlperf.kernels as K

    q, k, v, dout, cu = _backward_inputs(B, L, hq, hkv)
    with K.use_mode("invariant"):
        out = K.varlen_attention(q, k, v, cu)  # the training forward: saves the LSE for the backward
    w = Workload({"rlperf.varlen.bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)})
    q4, k4, v4 = (x.view(B, L, -1, D).transpose(1, 2) for x in (q, k, v))
    fn, gqa = _sdpa_fn("flash", q4, k4, v4, causal=True)
    if fn is None:
        w.unavailable["sdpa-flash.bwd"] = f"SDPA flash unavailable: {gqa}"
    else:
        out4 = fn()
        dout4 = dout.view(B, L, hq, D).transpose(1, 2)
        w.calls["sdpa-flash.bwd"] = lambda: torch.autograd.grad(out4, (q, k, v), dout4, retain_graph=True)
        w.info["sdpa-flash.bwd"] = {"gqa": gqa}
    return w


def _packed(out):
    """An SDPA output [B, H, Lq, D] as packed tokens [B*Lq, H, D] (rlperf's layout); others (and
    gradient tuples, already packed) as they are."""
    return out.transpose(1, 2).reshape(-1, HQ, D) if isinstance(out, torch.Tensor) and out.dim() == 4 else out


def _rel_err_any(x, ref) -> float:
    """:func:`_rel_err`, the worst over a tuple of gradients."""
    if isinstance(x, tuple):
        return max(_rel_err(a, b) for a, b in zip(x, ref))
    return _rel_err(x, ref)


def run(quick: bool = False) -> list[BenchRow]:
    reps, warmup = (10, 3) if quick else (30, 5)
    rows: list[BenchRow] = []
    for setup, group in by_workload(cases(quick)):
        w = setup()
        phase = group[0].params["phase"]
        n_reps = reps * 2 if phase == "decode" else reps
        times = time_calls(w, call_names(group), lambda fn: cuda_time(fn, warmup=warmup, reps=n_reps), BENCH)
        outs = {name: _packed(w.calls[name]()) for name in times}
        paged_bits_equal = None  # prefill from the paged cache vs varlen: the prefill = decode contract
        if "rlperf.varlen" in outs and "rlperf.paged" in outs:
            paged_bits_equal = bool(torch.equal(outs["rlperf.paged"], outs["rlperf.varlen"]))
        rerun_bits_equal = None  # the backward's contract: the same gradient bits on every run
        if "rlperf.varlen.bwd" in outs:
            rerun_bits_equal = all(torch.equal(a, b) for a, b in zip(w.calls["rlperf.varlen.bwd"](),
                                                                       outs["rlperf.varlen.bwd"]))
        for c in group:
            if c.kernel in times and c.anchor in w.unavailable and c.anchor.startswith("flashinfer"):
                # the row stays, saying why its anchor did not run ("flashinfer not installed")
                rows.append(c.row(times[c.kernel].median_ms, float("nan"), anchor_unavailable=w.unavailable[c.anchor]))
                continue
            if c.kernel not in times or c.anchor not in times:
                continue
            t, t_ref = times[c.kernel], times[c.anchor]
            extra = {**w.info[c.anchor], "rel_err_vs_anchor": _rel_err_any(outs[c.kernel], outs[c.anchor])}
            if phase == "decode":
                extra["hbm_fraction"] = c.work / (t.median_ms * 1e-3) / (_hbm_tbs() * 1e12)
            extra.update(kernel_p20_p80_ms=[t.p20_ms, t.p80_ms], anchor_p20_p80_ms=[t_ref.p20_ms, t_ref.p80_ms])
            if c.kernel == "rlperf.paged" and paged_bits_equal is not None:
                extra["bits_equal_varlen"] = paged_bits_equal
            if c.kernel == "rlperf.varlen.bwd":
                extra["bits_equal_rerun"] = rerun_bits_equal
            rows.append(c.row(t.median_ms, t_ref.median_ms, **extra))
        del w, outs
        torch.cuda.empty_cache()
    return rows


def summarize(rows: list[BenchRow]) -> dict:
    def sel(phase, kernel, backend):
        return [r.ratio for r in rows if r.extra["phase"] == phase and r.kernel == kernel and r.extra["anchor_backend"] == backend]

    summary = {
        "prefill_vs_cudnn_geomean": geomean(sel("prefill", "rlperf.varlen", "cudnn")),
        "prefill_vs_cudnn_min": min(sel("prefill", "rlperf.varlen", "cudnn"), default=float("nan")),
        "prefill_vs_flash_geomean": geomean(sel("prefill", "rlperf.varlen", "flash")),
        "decode_vs_flash": geomean(sel("decode", "rlperf.paged", "flash")),
        "backward_vs_flash": geomean(sel("backward", "rlperf.varlen.bwd", "flash")),
        "prefill_vs_flashinfer": geomean([x for x in sel("prefill", "rlperf.varlen", "flashinfer") if x == x]),
        "decode_vs_flashinfer": geomean([x for x in sel("decode", "rlperf.paged", "flashinfer") if x == x]),
    }
    dec = [r for r in rows if r.extra["phase"] == "decode"]
    if dec:
        summary["decode_ms"] = dec[0].kernel_ms
        summary["decode_GBps"] = dec[0].rate(dec[0].kernel_ms)
    paged = [r.extra["bits_equal_varlen"] for r in rows if "bits_equal_varlen" in r.extra]
    if paged:
        summary["paged_prefill_bits_equal_varlen"] = all(paged)
    rerun = [r.extra["bits_equal_rerun"] for r in rows if "bits_equal_rerun" in r.extra]
    if rerun:
        summary["backward_bits_equal_rerun"] = all(rerun)
    return summary


# ----------------------------------------------------------------------------------------------
# config sweep (tuning tool; not part of `rlperf bench`)
# ----------------------------------------------------------------------------------------------

SWEEP_CONFIGS = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA)
    (128, 128, 8, 3, True), (128, 128, 8, 3, False), (128, 128, 8, 2, True),
    (128, 64, 8, 3, True), (128, 64, 8, 3, False), (64, 64, 4, 3, False),
]


def _config(bm: int, bn: int, w: int, s: int, tma: bool, prefetch_page: bool = False, masked_ptr: bool = False,
            guess_one_query: bool = True, keys_on_m: bool = False) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "TMA": tma, "PREFETCH_PAGE": prefetch_page,
            "MASKED_PTR": masked_ptr, "GUESS_ONE_QUERY": guess_one_query, "KEYS_ON_M": keys_on_m}


_DECODE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "TMA", "PREFETCH_PAGE", "MASKED_PTR", "GUESS_ONE_QUERY",
                "KEYS_ON_M")


def _decode_label(c: tuple) -> str:
    """``c``: a :data:`DECODE_SWEEP` tuple."""
    if c[8]:  # keys on the M side: BLOCK_M and the one-query guess do not apply
        return (f"keys-on-M BN={c[1]} w={c[2]} s={c[3]} tma={int(c[4])} prefetch={int(c[5])} "
                f"masked_ptr={int(c[6])}")
    return (f"BM={c[0]} BN={c[1]} w={c[2]} s={c[3]} tma={int(c[4])} prefetch={int(c[5])} masked_ptr={int(c[6])} "
            f"guess={int(c[7])}")


def _bits_check(cfg: dict, gen: torch.Generator) -> bool:
    """Rows of a 1500-token prefill vs decode of its last 3 tokens and 200-token chunks, one config."""
    from rlperf.kernels.attention import attention_forward

    L, page = 1500, cfg["BLOCK_N"]
    q = torch.randn(L, HQ, D, device=DEVICE, generator=gen).bfloat16()
    k = torch.randn(L, HKV, D, device=DEVICE, generator=gen).bfloat16()
    v = torch.randn(L, HKV, D, device=DEVICE, generator=gen).bfloat16()
    full = attention_forward(q, k, v, torch.tensor([0, L], dtype=torch.int32, device=DEVICE), config=cfg)
    kc, vc, table = _paged_cache(k, v, 1, L, page, gen)
    ok = True
    for n_q, kv in ((1, L), (1, L - 1), (1, L - 2), (200, L), (200, 700)):
        o = attention_forward(q[kv - n_q:kv], kc, vc, torch.tensor([0, n_q], dtype=torch.int32, device=DEVICE),
                              torch.tensor([kv], dtype=torch.int32, device=DEVICE), table, config=cfg)
        ok &= bool(torch.equal(o, full[kv - n_q:kv]))
    return ok


def sweep(configs=SWEEP_CONFIGS, reps: int = 15) -> dict:
    """Time each config on prefill B=8 L=4096 (varlen and paged), B=32 L=1024 and decode B=64
    KV=4096, next to cuDNN prefill and SDPA flash decode. Among the configs whose bits check
    passes, return the one that meets the most targets (prefill >= 0.75 cuDNN at both lengths,
    decode <= flash decode), ties broken by the geometric mean of the three target ratios."""
    from rlperf.kernels.attention import attention_forward

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    B, L = PREFILL_CASES[0]
    T = B * L
    q = torch.randn(T, HQ, D, device=DEVICE, generator=gen).bfloat16()
    k = torch.randn(T, HKV, D, device=DEVICE, generator=gen).bfloat16()
    v = torch.randn(T, HKV, D, device=DEVICE, generator=gen).bfloat16()
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEVICE)
    lens_p = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
    flops = 4.0 * B * HQ * L * L * D / 2
    Bd, S = DECODE_CASE
    qd = torch.randn(Bd, HQ, D, device=DEVICE, generator=gen).bfloat16()
    kd = torch.randn(Bd * S, HKV, D, device=DEVICE, generator=gen).bfloat16()
    vd = torch.randn(Bd * S, HKV, D, device=DEVICE, generator=gen).bfloat16()
    cu_d = torch.arange(Bd + 1, dtype=torch.int32, device=DEVICE)
    lens_d = torch.full((Bd,), S, dtype=torch.int32, device=DEVICE)
    nbytes = 2.0 * Bd * S * HKV * D * 2

    q4, k4, v4 = (x.view(B, L, -1, D).transpose(1, 2) for x in (q, k, v))
    cudnn, _ = _sdpa_fn("cudnn", q4, k4, v4, causal=True)
    cudnn_ms = cuda_time(cudnn, warmup=2, reps=reps).median_ms if cudnn else float("nan")
    B2, L2 = PREFILL_CASES[1]  # same tokens, shorter sequences
    cu2 = torch.arange(0, T + 1, L2, dtype=torch.int32, device=DEVICE)
    q42, k42, v42 = (x.view(B2, L2, -1, D).transpose(1, 2) for x in (q, k, v))
    cudnn2, _ = _sdpa_fn("cudnn", q42, k42, v42, causal=True)
    cudnn2_ms = cuda_time(cudnn2, warmup=2, reps=reps).median_ms if cudnn2 else float("nan")
    flops2 = 4.0 * B2 * HQ * L2 * L2 * D / 2
    kd4, vd4 = (x.view(Bd, S, HKV, D).transpose(1, 2).contiguous() for x in (kd, vd))
    flash_dec, _ = _sdpa_fn("flash", qd[:, :, None, :], kd4, vd4, causal=False)
    flash_dec_ms = cuda_time(flash_dec, warmup=3, reps=reps * 2).median_ms if flash_dec else float("nan")
    del kd4, vd4
    print(f"anchors: cudnn prefill {cudnn_ms:.3f} ms ({flops / cudnn_ms / 1e9:.1f} TFLOP/s), "
          f"L={L2} {cudnn2_ms:.3f} ms ({flops2 / cudnn2_ms / 1e9:.1f}), "
          f"flash decode {flash_dec_ms:.4f} ms", flush=True)

    results = []
    caches = {}
    for c in configs:
        cfg = _config(*c)
        bn = cfg["BLOCK_N"]
        row = {"config": f"BM={c[0]} BN={c[1]} w={c[2]} s={c[3]} tma={int(c[4])}", "cfg": cfg}
        try:
            if bn not in caches:
                caches.clear()
                torch.cuda.empty_cache()
                caches[bn] = (_paged_cache(k, v, B, L, bn, gen), _paged_cache(kd, vd, Bd, S, bn, gen))
            (kc, vc, table), (kcd, vcd, table_d) = caches[bn]
            tp = cuda_time(lambda: attention_forward(q, k, v, cu, config=cfg), warmup=2, reps=reps)
            tp2 = cuda_time(lambda: attention_forward(q, k, v, cu2, config=cfg), warmup=2, reps=reps)
            tpp = cuda_time(lambda: attention_forward(q, kc, vc, cu, lens_p, table, config=cfg), warmup=2, reps=reps)
            td = cuda_time(lambda: attention_forward(qd, kcd, vcd, cu_d, lens_d, table_d, config=cfg),
                           warmup=3, reps=reps * 2)
            row.update(prefill_ms=tp.median_ms, prefill_tflops=flops / tp.median_ms / 1e9,
                       prefill2_tflops=flops2 / tp2.median_ms / 1e9,
                       paged_prefill_tflops=flops / tpp.median_ms / 1e9,
                       decode_ms=td.median_ms, decode_gbps=nbytes / td.median_ms / 1e6, bits_ok=_bits_check(cfg, gen))
            # target ratios (>= 1 meets the target): prefill L=4096 and L=1024 vs 0.75 cuDNN, decode vs flash
            ratios = [cudnn_ms / tp.median_ms / 0.75, cudnn2_ms / tp2.median_ms / 0.75, flash_dec_ms / td.median_ms]
            row["targets_met"] = sum(r >= 1.0 for r in ratios)
            row["score"] = geomean(ratios)
        except Exception as e:  # a config that does not compile or fit (shared memory, registers)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        results.append(row)
        print({k_: v_ for k_, v_ in row.items() if k_ != "cfg"}, flush=True)
    print(f"{'config':<30} {'prefill ms':>10} {'TFLOP/s':>8} {'L' + str(L2):>6} {'paged':>6} {'decode ms':>9} {'GB/s':>6} "
          f"{'met':>3} {'score':>6} bits")
    for r in results:
        if "error" in r:
            print(f"{r['config']:<30} {r['error']}")
        else:
            print(f"{r['config']:<30} {r['prefill_ms']:10.3f} {r['prefill_tflops']:8.1f} {r['prefill2_tflops']:6.1f} "
                  f"{r['paged_prefill_tflops']:6.1f} {r['decode_ms']:9.4f} {r['decode_gbps']:6.0f} "
                  f"{r['targets_met']:3d} {r['score']:6.3f} {r['bits_ok']}")
    ok = [r for r in results if r.get("bits_ok")]
    best = max(ok, key=lambda r: (r["targets_met"], r["score"])) if ok else None
    if best:
        print(f"best: {best['config']} ({best['targets_met']} of 3 targets met, geomean target ratio {best['score']:.3f})")
    return best["cfg"] if best else {}


DECODE_SWEEP = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA, PREFETCH_PAGE, MASKED_PTR, GUESS_ONE_QUERY,
    # KEYS_ON_M); BLOCK_N is the page size. The first two: the 64-row launches of the day (few / many programs).
    (64, 128, 4, 3, True, True, False, True, False), (64, 128, 4, 1, True, False, True, True, False),
    # keys on the MMA's M side (queries as 16 columns): a quarter of the score tile's registers and exp2s
    (64, 128, 4, 3, True, True, False, True, True), (64, 128, 4, 2, True, True, False, True, True),
    (64, 128, 4, 3, True, True, True, True, True), (64, 128, 4, 2, True, True, True, True, True),
    (64, 128, 4, 1, True, False, True, True, True), (64, 128, 4, 1, True, True, True, True, True),
    (64, 128, 4, 1, True, False, False, True, True), (64, 128, 8, 1, True, False, True, True, True),
    (64, 128, 8, 2, True, True, True, True, True), (64, 128, 4, 2, True, False, True, True, True),
    (64, 128, 4, 1, False, False, False, True, True),
]
DECODE_SWEEP_CASES = ((1, 540), (16, 540), (64, 540), (256, 540), (64, 4096))
"""(batch, KV length) of the decode sweep: ``rlperf bench rollout``'s decode (prompt 512 and a few dozen
new tokens) and the attention bench's long-context decode."""


def sweep_decode(configs=DECODE_SWEEP, cases=DECODE_SWEEP_CASES, hq: int = 16, hkv: int = 8, layers: int = 28,
                 reps: int = 20) -> dict:
    """Time decode-only launches of each config (module docstring, ``--sweep-decode``). Returns the config
    with the lowest geometric mean time over the cases among those whose bits equal those of the config
    decode runs today (``_decode_config``) on every case ({} when none): that config's rows equal the prefill's
    (``tests/kernels/test_attention.py``'s GPU tests), so equal bits carry the contract over."""
    from rlperf.kernels import PAGE_SIZE
    from rlperf.kernels.attention import _decode_config, attention_forward

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = {c: {"times": [], "same_bits": True} for c in configs}
    for B, L in cases:
        stack = []  # one (q, k_cache, v_cache, page_table) per layer: the graph reads ~layers x the KV bytes
        for _ in range(layers):
            k = torch.randn(B * L, hkv, D, device=DEVICE, generator=gen).bfloat16()
            v = torch.randn(B * L, hkv, D, device=DEVICE, generator=gen).bfloat16()
            stack.append((torch.randn(B, hq, D, device=DEVICE, generator=gen).bfloat16(),
                          *_paged_cache(k, v, B, L, PAGE_SIZE, gen)))
            del k, v
        cu = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
        lens = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
        nbytes = layers * 2.0 * B * L * hkv * D * 2
        current = _decode_config(B * hkv, torch.device(DEVICE))  # what paged_attention launches for this batch
        ref = attention_forward(stack[0][0], stack[0][1], stack[0][2], cu, lens, stack[0][3], config=current)
        base_ms = None
        for c in [tuple(current.get(k_, False) for k_ in _DECODE_KEYS)] + list(configs):
            cfg = _config(*c)
            try:
                def step(cfg=cfg):
                    for q, kc, vc, table in stack:
                        attention_forward(q, kc, vc, cu, lens, table, config=cfg)

                out = attention_forward(stack[0][0], stack[0][1], stack[0][2], cu, lens, stack[0][3], config=cfg)
                step()  # compile, and settle the stage count that fits
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                ms = cuda_time(graph.replay, warmup=3, reps=reps, flush_l2=True).median_ms / layers
                same = bool(torch.equal(out, ref))
                del graph
            except Exception as e:  # a config that does not compile or fit
                print(f"B={B} L={L} {c}: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
                if c in rows:
                    rows[c]["times"].append(float("nan"))
                continue
            if base_ms is None:
                base_ms = ms
                print(f"B={B} KV={L}: current {current} {ms * 1e3:.1f} us/call "
                      f"({nbytes / layers / ms / 1e6:.0f} GB/s)", flush=True)
                continue
            rows[c]["times"].append(ms)
            rows[c]["same_bits"] &= same
            print(f"B={B} KV={L} {_decode_label(c)}: {ms * 1e3:.1f} us/call "
                  f"({nbytes / layers / ms / 1e6:.0f} GB/s), {base_ms / ms:.3f}x the current config, "
                  f"bits {'equal' if same else 'DIFFER'}", flush=True)
        stack = None  # the KV pools go (a name, not a del: the timed closures above read it)
        torch.cuda.empty_cache()
    best, best_t = None, float("inf")
    for c, r in rows.items():
        t = geomean(r["times"]) if r["times"] and all(x == x for x in r["times"]) else float("nan")
        ok = r["same_bits"] and t == t  # the current decode config's rows equal the prefill's (GPU tests)
        print(f"{_decode_label(c)}: geomean {t * 1e3:.1f} us, "
              f"bits {'ok' if ok else 'NOT ok'}")
        if ok and t < best_t:
            best, best_t = c, t
    if best is None:
        return {}
    print(f"best decode config: {_decode_label(best)}")
    return _config(*best)


BACKWARD_SWEEP = [  # (BLOCK_KV, STEP_Q, BLOCK_Q, STEP_KV, num_warps, num_stages); the first is the default
    (128, 64, 128, 64, 8, 3), (128, 64, 128, 64, 8, 2), (128, 32, 128, 32, 4, 3), (128, 32, 128, 32, 8, 3),
    (128, 64, 64, 64, 8, 3), (64, 64, 64, 64, 4, 3), (64, 32, 128, 32, 4, 4),
]


def sweep_backward(configs=BACKWARD_SWEEP, reps: int = 15) -> dict:
    """Time each backward config (the launcher alone: delta, dk/dv and dq kernels) at
    :data:`BACKWARD_CASE` next to SDPA flash's backward, with two checks per config: two runs give
    the same bits, and the gradients stay close to the default config's. Returns the fastest config
    that passes both, as ``BackwardConfig`` fields."""
    import dataclasses

    from rlperf.kernels.attention import attention_forward
    from rlperf.kernels.attention_backward import BackwardConfig, attention_backward, backward_config

    B, L, hq, hkv = BACKWARD_CASE
    q, k, v, dout, cu = _backward_inputs(B, L, hq, hkv)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = attention_forward(q, k, v, cu, return_lse=True)
    flops = 10.0 * B * hq * L * L * D / 2
    q4, k4, v4 = (x.view(B, L, -1, D).transpose(1, 2).requires_grad_() for x in (q.clone(), k.clone(), v.clone()))
    fn, _ = _sdpa_fn("flash", q4, k4, v4, causal=True)
    flash_ms = float("nan")
    if fn is not None:
        out4 = fn()
        dout4 = dout.view(B, L, hq, D).transpose(1, 2)
        flash_ms = cuda_time(lambda: torch.autograd.grad(out4, (q4, k4, v4), dout4, retain_graph=True),
                             warmup=2, reps=reps).median_ms
    print(f"anchor: SDPA flash backward {flash_ms:.3f} ms ({flops / flash_ms / 1e9:.1f} TFLOP/s)", flush=True)
    base = attention_backward(q, k, v, out, lse, dout, cu, config=backward_config(q.dtype, D))
    results = []
    for c in configs:
        cfg = BackwardConfig(*c)
        row = {"config": "KV={} SQ={} Q={} SKV={} w={} s={}".format(*c), "cfg": dataclasses.asdict(cfg)}
        try:
            call = functools.partial(attention_backward, q, k, v, out, lse, dout, cu, config=cfg)
            t = cuda_time(call, warmup=2, reps=reps)
            g1, g2 = call(), call()
            row.update(ms=t.median_ms, tflops=flops / t.median_ms / 1e9, vs_flash=flash_ms / t.median_ms,
                       bits_rerun=all(torch.equal(a, b) for a, b in zip(g1, g2)),
                       rel_err_vs_default=max(_rel_err(a, b) for a, b in zip(g1, base)))
        except Exception as e:  # a config that does not compile or fit (shared memory, registers)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        results.append(row)
        print({k_: v_ for k_, v_ in row.items() if k_ != "cfg"}, flush=True)
    ok = [r for r in results if r.get("bits_rerun") and r["rel_err_vs_default"] < 1e-2]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    if best:
        print(f"best: {best['config']} {best['ms']:.3f} ms, {best['vs_flash']:.3f}x SDPA flash's backward")
    return best["cfg"] if best else {}


def _test_with_config(cfg: dict, pytest_args: list[str]) -> int:
    """Run pytest in this process with ``_CONFIG`` (and PAGE_SIZE) replaced: tuning only."""
    import pytest

    import rlperf.kernels as K
    from rlperf.kernels import attention as A

    A._CONFIG.update(cfg)
    A.PAGE_SIZE = K.PAGE_SIZE = A._CONFIG["BLOCK_N"]
    print(f"testing with {A._CONFIG}", flush=True)
    return pytest.main(pytest_args)


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="time the candidate launch configs")
    p.add_argument("--sweep-backward", action="store_true", help="time the candidate backward configs")
    p.add_argument("--sweep-decode", action="store_true", help="time the candidate decode-only configs (_DECODE_CONFIG)")
    p.add_argument("--best-json", metavar="PATH", help="with --sweep / --sweep-backward: write the best config here")
    p.add_argument("--test-config", metavar="PATH", help="run the pytest args after -- with this config (JSON)")
    p.add_argument("--quick", action="store_true")
    args, rest = p.parse_known_args()
    from .harness import format_table

    if args.sweep or args.sweep_backward or args.sweep_decode:
        best = sweep() if args.sweep else sweep_backward() if args.sweep_backward else sweep_decode()
        if args.best_json:
            with open(args.best_json, "w") as f:
                json.dump(best, f)
    elif args.test_config:
        with open(args.test_config) as f:
            raise SystemExit(_test_with_config(json.load(f), [a for a in rest if a != "--"]))
    else:
        rows = run(quick=args.quick)
        print(format_table(rows))
        print(summarize(rows))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        _main()
