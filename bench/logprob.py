"""Log-prob benchmark: fused lm-head log-prob (issue #3 item 1), plus the row-wise kernels.

Main workload (the Qwen3-4B head): hidden [8192, 2560], weight [151936, 2560], bf16, T = 1.

Rows (ratio = anchor ms / kernel ms; > 1 means faster than the anchor):

* ``fused_logprob`` forward vs the lm-head matmul alone (cuBLAS ``hidden @ weight.T``, bf16
  logits: the floor any log-prob path pays) and vs naive torch (logits -> float -> log_softmax ->
  gather); rate = 2·N·V·H FLOP.
* forward+backward (grads of hidden and weight) vs naive torch; rate counts 4 matmuls' FLOP
  (forward, the backward's recomputed logits, d hidden, d weight).
* a forward tile-config sweep (the op uses one fixed config per dtype: batch invariance), and the
  backward alone.
* row-wise kernels at rollout/training sizes: rmsnorm / add_rmsnorm vs HF's torch code,
  token_logprobs / log_softmax on [8192, 151936] bf16 logits vs torch, sample vs torch softmax +
  multinomial (rates in GB/s of the bytes each must move).

Extra peak memory: ``max_memory_allocated`` during the call minus what was allocated before it,
minus the gradients of hidden and weight (outputs every method must produce: 0.80 GB here).
"""
from __future__ import annotations

import gc

import torch

from .harness import BenchRow, cuda_time

BENCH = "logprob"
N, H, V = 8192, 2560, 151936


def _extra_peak_gib(fn, exclude_bytes: int = 0) -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base - exclude_bytes) / 2**30


def _third_party_losses() -> dict:
    """``name -> fn(hidden, weight, targets) -> summed CE loss`` for Liger-Kernel's fused linear
    cross-entropy and Apple's cut-cross-entropy, where importable (carried as wheels to the device)."""
    out = {}
    try:
        from cut_cross_entropy import linear_cross_entropy

        out["cut-cross-entropy"] = lambda h, w, t: linear_cross_entropy(h, w, t, reduction="sum")
    except ImportError as exc:
        print(f"logprob: cut-cross-entropy not installed ({exc}); no row")
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        out["liger"] = lambda h, w, t: liger(w, h, t)
    except ImportError as exc:
        print(f"logprob: liger-kernel not installed ({exc}); no row")
    return out


def run(quick: bool = False) -> list[BenchRow]:
    import rlperf.kernels as K

    from rlperf.kernels import fused_lm_head as FL
    n = 2048 if quick else N
    warmup, reps, heavy_reps = (2, 5, 3) if quick else (3, 20, 10)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(n, H, device=dev, generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(V, H, device=dev, generator=gen) * (2.0 / H**0.5)).to(torch.bfloat16)
    targets = torch.randint(0, V, (n,), device=dev, generator=gen)
    g_out = torch.randn(n, device=dev, generator=gen)
    grad_bytes = hidden.numel() * 2 + weight.numel() * 2
    flop = 2.0 * n * V * H
    case = f"N={n} H={H} V={V} bf16"
    rows: list[BenchRow] = []

    def row(kernel, t_kernel, anchor, t_anchor, work=flop, unit="TFLOP/s", case=case, **extra):
        rows.append(BenchRow(BENCH, case, kernel, t_kernel, anchor, t_anchor, work, unit, extra))

    # ---- correctness on the benchmark data (cheap, before timing)
    with torch.no_grad():
        lp = K.fused_logprob(hidden, weight, targets)
        naive = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(1, targets[:, None]).squeeze(1)
        max_diff = (lp - naive).abs().max().item()
        # does the unfused invariant path (matmul float32 logits -> token_logprobs) give the same bits?
        try:
            unfused = K.token_logprobs(K.matmul(hidden, weight, out_dtype=torch.float32), targets)
            same_bits = (unfused == lp).float().mean().item()
            unfused_diff = (unfused - lp).abs().max().item()
            del unfused
        except Exception as exc:  # the matmul op belongs to another module; report, don't fail
            same_bits, unfused_diff = float("nan"), repr(exc)[:80]
        del naive
    torch.cuda.empty_cache()
    print(f"logprob: fused vs naive bf16-logits max |diff| {max_diff:.3e}; "
          f"token_logprobs(matmul fp32) bits equal on {same_bits:.4f} of rows (max |diff| {unfused_diff})")

    # ---- forward
    timer = lambda fn, r=reps: cuda_time(fn, warmup=warmup, reps=r)  # noqa: E731
    t_mm = timer(lambda: hidden @ weight.t()).median_ms

    def naive_fwd():
        return torch.log_softmax((hidden @ weight.t()).float(), -1).gather(1, targets[:, None]).squeeze(1)

    def fused_fwd():
        with torch.no_grad():
            return K.fused_logprob(hidden, weight, targets)

    def fused_fwd_ent():
        with torch.no_grad():
            return K.fused_logprob(hidden, weight, targets, return_entropy=True)

    t_naive = timer(naive_fwd, heavy_reps).median_ms
    t_fused = timer(fused_fwd).median_ms
    t_fused_ent = timer(fused_fwd_ent).median_ms
    mem_fused = _extra_peak_gib(fused_fwd)
    mem_naive = _extra_peak_gib(naive_fwd)
    mem_mm = _extra_peak_gib(lambda: hidden @ weight.t())
    common = dict(max_abs_diff_vs_naive=max_diff, unfused_bits_equal_fraction=same_bits)
    row("fused_logprob fwd", t_fused, "lm-head matmul", t_mm, extra_peak_gib=mem_fused, anchor_extra_peak_gib=mem_mm, **common)
    row("fused_logprob fwd", t_fused, "naive torch fwd", t_naive, extra_peak_gib=mem_fused, anchor_extra_peak_gib=mem_naive)
    row("fused fwd+entropy", t_fused_ent, "lm-head matmul", t_mm)

    # ---- forward + backward
    h_req = hidden.clone().requires_grad_()
    w_req = weight.clone().requires_grad_()

    def fused_fb():
        h_req.grad = w_req.grad = None
        K.fused_logprob(h_req, w_req, targets).backward(g_out)

    def fused_fb_ent():
        h_req.grad = w_req.grad = None
        lp, ent = K.fused_logprob(h_req, w_req, targets, return_entropy=True)
        (lp * g_out + 0.01 * ent).sum().backward()

    def naive_fb():
        h_req.grad = w_req.grad = None
        logits = (h_req @ w_req.t()).float()
        torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1).backward(g_out)

    t_fb = timer(fused_fb, heavy_reps).median_ms
    t_fb_ent = timer(fused_fb_ent, heavy_reps).median_ms
    h_req.grad = w_req.grad = None
    mem_fb = _extra_peak_gib(fused_fb, grad_bytes)
    h_req.grad = w_req.grad = None
    mem_fb_naive = _extra_peak_gib(naive_fb, grad_bytes)
    h_req.grad = w_req.grad = None
    t_fb_naive = timer(naive_fb, heavy_reps).median_ms
    h_req.grad = w_req.grad = None
    card = torch.cuda.get_device_name()
    row("fused_logprob fwd+bwd", t_fb, "naive torch fwd+bwd", t_fb_naive, work=4 * flop,
        extra_peak_gib=mem_fb, anchor_extra_peak_gib=mem_fb_naive)
    row("fused fwd+bwd+entropy", t_fb_ent, "naive torch fwd+bwd", t_fb_naive, work=4 * flop)
    row("fused_logprob fwd+bwd", t_fb, "4 x lm-head matmul", 4 * t_mm, work=4 * flop)

    # ---- other fused linear-cross-entropy kernels, when installed (loss = -log-prob summed: the
    # same logits, log-sum-exp and gradients; forward under no_grad, fwd+bwd from a scalar loss)
    for name, make in _third_party_losses().items():
        try:
            def other_fwd(make=make):
                with torch.no_grad():
                    return make(hidden, weight, targets)

            def other_fb(make=make):
                h_req.grad = w_req.grad = None
                make(h_req, w_req, targets).backward()

            t_o = timer(other_fwd, heavy_reps).median_ms
            t_o_fb = timer(other_fb, heavy_reps).median_ms
            h_req.grad = w_req.grad = None
            mem_o = _extra_peak_gib(other_fwd)
            mem_o_fb = _extra_peak_gib(other_fb, grad_bytes)
            h_req.grad = w_req.grad = None
        except Exception as exc:  # a third-party kernel that does not run on this Triton is reported, not fatal
            print(f"logprob: anchor {name} failed: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        row("fused_logprob fwd", t_fused, f"{name} fwd", t_o, extra_peak_gib=mem_fused, anchor_extra_peak_gib=mem_o)
        row("fused_logprob fwd+bwd", t_fb, f"{name} fwd+bwd", t_o_fb, work=4 * flop,
            extra_peak_gib=mem_fb, anchor_extra_peak_gib=mem_o_fb)

    # ---- the backward alone (and its parts), and tile-config sweeps (the op keeps one config per dtype)
    inv_t = 1.0
    with torch.no_grad():
        logp, ent, lse = FL.fused_logprob_forward(hidden, weight, targets, inv_t)
    bwd = lambda cfg=None: FL.fused_logprob_backward(hidden, weight, targets, lse, ent, g_out, g_out, inv_t, config=cfg)  # noqa: E731
    t_bwd = timer(bwd, heavy_reps).median_ms
    row("backward alone", t_bwd, "3 x lm-head matmul", 3 * t_mm, work=3 * flop, mm_out_dtype=FL.mm_f32_uses_out_dtype())
    default = FL.fused_config(torch.bfloat16)
    chunk = max(default.BLOCK_N, FL.BWD_CHUNK_BYTES // (n * 2) // default.BLOCK_N * default.BLOCK_N)
    dl = torch.randn(n, chunk, device=dev, generator=gen).to(torch.bfloat16)
    gw = torch.empty_like(weight)
    n_chunks = -(-V // chunk)

    def mm_w():
        for v0 in range(0, V, chunk):
            v1 = min(V, v0 + chunk)
            torch.mm(dl[:, : v1 - v0].t(), hidden, out=gw[v0:v1])

    def mm_h():
        acc = torch.zeros(n, H, device=dev)
        for v0 in range(0, V, chunk):
            v1 = min(V, v0 + chunk)
            acc += FL.mm_f32(dl[:, : v1 - v0], weight[v0:v1])

    row("bwd part: d weight mm", timer(mm_w, heavy_reps).median_ms, "lm-head matmul", t_mm, chunks=n_chunks)
    row("bwd part: d hidden mm", timer(mm_h, heavy_reps).median_ms, "lm-head matmul", t_mm, chunks=n_chunks)
    del dl, gw
    C = FL.FusedConfig
    sweep = [
        default,
        C(128, 128, 64, 32, 8, 3),
        C(128, 256, 64, 16, 8, 3),
        C(128, 256, 64, 16, 8, 3, tma=True),
        C(128, 256, 64, 16, 8, 3, flatten=True, tma=True),
        C(128, 256, 64, 16, 8, 4, flatten=True, tma=True),
        C(128, 256, 128, 16, 8, 2, flatten=True, tma=True),
        C(128, 256, 64, 8, 8, 4, flatten=True, tma=True),
        C(128, 256, 64, 32, 8, 4, flatten=True, tma=True),
    ]
    bwd_sweep = [C(128, 256, 64, 16, 8, 3, tma=True), C(128, 256, 64, 16, 8, 4, tma=True),
                 C(128, 256, 128, 16, 8, 2, tma=True)]

    def tag(cfg):
        return (f"{cfg.BLOCK_M}x{cfg.BLOCK_N}x{cfg.BLOCK_K} s{cfg.SPLIT_TILES} w{cfg.num_warps} st{cfg.num_stages}"
                + (" fl" if cfg.flatten else "") + (" tma" if cfg.tma else ""))

    for i, cfg in enumerate([] if quick else sweep):
        fn = lambda cfg=cfg: FL.fused_logprob_forward(hidden, weight, targets, inv_t, config=cfg)  # noqa: E731
        try:
            bits = torch.equal(fn()[0], logp)
            t_cfg = timer(fn).median_ms
        except Exception as exc:  # a config may not fit shared memory / registers
            print(f"logprob sweep: {tag(cfg)} failed: {exc!r:.160}")
            continue
        row(f"fwd {tag(cfg)}", t_cfg, "lm-head matmul", t_mm, case="sweep " + case, default=i == 0, bits_equal_default=bits)
    for cfg in ([] if quick else bwd_sweep):
        try:
            t_cfg = timer(lambda cfg=cfg: bwd(cfg), heavy_reps).median_ms
        except Exception as exc:
            print(f"logprob bwd sweep: {tag(cfg)} failed: {exc!r:.160}")
            continue
        row(f"bwd {tag(cfg)}", t_cfg, "3 x lm-head matmul", 3 * t_mm, work=3 * flop, case="sweep " + case)
    del h_req, w_req
    gc.collect()
    torch.cuda.empty_cache()

    # ---- row-wise kernels
    x = torch.randn(n, H, device=dev, generator=gen, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w_norm = (torch.rand(H, device=dev, generator=gen) + 0.5).to(torch.bfloat16)

    def hf_rmsnorm(v):
        f = v.float()
        return w_norm * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(v.dtype)

    nbytes = 2 * x.numel() * 2
    row("rmsnorm", timer(lambda: K.rmsnorm(x, w_norm)).median_ms, "HF torch rmsnorm", timer(lambda: hf_rmsnorm(x)).median_ms,
        work=nbytes, unit="GB/s", case=f"[{n}, {H}] bf16")
    row("add_rmsnorm", timer(lambda: K.add_rmsnorm(x, r, w_norm)).median_ms, "torch add + HF rmsnorm",
        timer(lambda: hf_rmsnorm(x + r)).median_ms, work=2 * nbytes, unit="GB/s", case=f"[{n}, {H}] bf16")
    del x, r
    logits = hidden @ weight.t()
    lbytes = logits.numel() * 2
    lcase = f"logits [{n}, {V}] bf16"
    torch_tlp = lambda: torch.log_softmax(logits.float(), -1).gather(1, targets[:, None])  # noqa: E731
    row("token_logprobs", timer(lambda: K.token_logprobs(logits, targets)).median_ms, "torch log_softmax+gather",
        timer(torch_tlp, heavy_reps).median_ms, work=lbytes, unit="GB/s", case=lcase)
    row("token_logprobs+ent", timer(lambda: K.token_logprobs(logits, targets, return_entropy=True)).median_ms,
        "torch log_softmax+gather", timer(torch_tlp, heavy_reps).median_ms, work=lbytes, unit="GB/s", case=lcase)
    row("log_softmax", timer(lambda: K.log_softmax(logits), heavy_reps).median_ms, "torch log_softmax",
        timer(lambda: torch.log_softmax(logits.float(), -1), heavy_reps).median_ms, work=lbytes * 3, unit="GB/s", case=lcase)
    del logits
    gc.collect()
    torch.cuda.empty_cache()
    B = 256
    sl = (torch.randn(B, V, device=dev, generator=gen) * 3).to(torch.bfloat16)
    seeds = torch.arange(B, device=dev)
    pos = torch.zeros(B, dtype=torch.long, device=dev)

    def torch_sample(T, top_p, top_k):
        z = sl.float() / T
        if top_k:
            kth = z.topk(top_k, -1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if top_p < 1:
            srt, idx = z.sort(-1, descending=True)
            cs = srt.softmax(-1).cumsum(-1)
            drop = (cs - srt.softmax(-1)) >= top_p
            z = z.scatter(1, idx, srt.masked_fill(drop, float("-inf")))
        return torch.multinomial(z.softmax(-1), 1)

    scase = f"sample B={B} V={V} bf16"
    for T, tp, tk in ((1.0, 1.0, 0), (0.8, 0.9, 50)):
        row(f"sample T{T} p{tp} k{tk}", timer(lambda: K.sample(sl, T, tp, tk, seeds, pos)).median_ms,
            "torch filter+multinomial", timer(lambda: torch_sample(T, tp, tk)).median_ms,
            work=sl.numel() * 2, unit="GB/s", case=scase)
    for rw in rows:
        rw.extra.setdefault("card", card)
    return rows


def summarize(rows: list[BenchRow]) -> dict:
    def find(kernel, anchor):
        return next(r for r in rows if r.kernel == kernel and r.anchor == anchor)

    fwd = find("fused_logprob fwd", "lm-head matmul")
    fb = find("fused_logprob fwd+bwd", "naive torch fwd+bwd")
    out = {
        "fwd_ms": fwd.kernel_ms,
        "lm_head_matmul_ms": fwd.anchor_ms,
        "fwd_over_matmul": fwd.kernel_ms / fwd.anchor_ms,
        "fwd_vs_naive": find("fused_logprob fwd", "naive torch fwd").ratio,
        "fwd_extra_peak_gib": fwd.extra["extra_peak_gib"],
        "fwd_bwd_ms": fb.kernel_ms,
        "fwd_bwd_vs_naive": fb.ratio,
        "fwd_bwd_extra_peak_gib": fb.extra["extra_peak_gib"],
        "target_fwd_1.10x_matmul": "met" if fwd.kernel_ms <= 1.10 * fwd.anchor_ms else "missed",
        "target_extra_peak_0.5GiB": "met" if max(fwd.extra["extra_peak_gib"], fb.extra["extra_peak_gib"]) <= 0.5 else "missed",
    }
    for r in rows:
        if r.kernel == "fused_logprob fwd+bwd" and r.anchor.endswith(" fwd+bwd") and r.anchor != "naive torch fwd+bwd":
            name = r.anchor.removesuffix(" fwd+bwd")
            out[f"fwd_bwd_over_{name}"] = r.kernel_ms / r.anchor_ms
            out[f"{name}_fwd_bwd_extra_peak_gib"] = r.extra["anchor_extra_peak_gib"]
            if name == "cut-cross-entropy":
                out["target_fwd_bwd_0.85x_cce_same_run"] = "met" if r.kernel_ms <= 0.85 * r.anchor_ms else "missed"
    # the fwd+bwd target is 0.85 x cut-cross-entropy's 36.5 ms, measured on an H200 in the issue
    if "H200" in str(fwd.extra.get("card", "")):
        out["fwd_bwd_over_cce_h200_issue"] = fb.kernel_ms / 36.5
        out["target_fwd_bwd_0.85x_cce"] = "met" if fb.kernel_ms <= 0.85 * 36.5 else "missed"
    return out
