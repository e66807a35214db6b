"""Where the GPU time of a decode step and of a train micro-step goes: a kernel table per case.

A tool for the decode-latency and train-MFU work of the GPU loop (``bench/BENCHMARKS.md``, loop
section), not a benchmark row: it prints, per case, the wall time of one step, the GPU time the
profiler saw inside it (wall - GPU = host time the GPU waited) and the kernels sorted by total GPU
time with their share of the step.

Cases (qwen3-0.6b shape, random bf16 weights, invariant mode unless ``--mode fast``):

* ``decode``: the rollout engine's decode step at batch ``--batch`` (prompt 512), replayed from CUDA
  graphs as ``rlperf serve`` runs it (warm-up steps first, then ``--steps`` profiled steps);
* ``train``: one micro-step of the trainer's work on ``--tokens`` packed tokens (sequences of 512):
  forward to the fused log-prob, ``backward()`` of their sum — what ``perf/train_time`` repeats
  per micro-batch, without the optimizer.

    python -m rlperf.bench.kernel_profile decode --batch 1 64
    python -m rlperf.bench.kernel_profile train --tokens 8192
"""
from __future__ import annotations

import argparse
import time

import torch

from rlperf import kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM

from .rollout import MODEL, decoding_engine


def _engine(model, batch: int, prompt_len: int = 512, new_tokens: int = 256):
    engine = decoding_engine(model, batch, prompt_len, new_tokens, graph_bs=batch, warmup=5)
    torch.cuda.synchronize()
    return engine


def _train_step(model, tokens: int, seq: int = 512):
    from rlperf.train.batching import micro_batch_log_probs, pack_micro_batches
    from rlperf.train.sample import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(max(1, tokens // seq)):
        ids = torch.randint(0, model.cfg.vocab_size, (seq,), generator=g).tolist()
        samples.append(Sample(tokens=ids, response_length=seq // 2, rollout_log_probs=[0.0] * (seq // 2)))
    (mb,) = pack_micro_batches(samples, max_tokens_per_gpu=tokens + seq, device="cuda")

    def step():
        lp = micro_batch_log_probs(model, mb, 1.0)
        lp.sum().backward()
        for p in model.parameters():
            p.grad = None

    return step


def _profile(label: str, fn, steps: int, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            d = kernels.setdefault(e.name, [0.0, 0])
            d[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            d[1] += 1
    gpu_ms = sum(v[0] for v in kernels.values()) / 1e3 / steps
    print(f"\n== {label}: wall {wall_ms:.3f} ms/step, GPU busy {gpu_ms:.3f} ms/step "
          f"({gpu_ms / wall_ms:.0%} of wall), {sum(v[1] for v in kernels.values()) / steps:.0f} kernels/step")
    print(f"{'ms/step':>9} {'share':>6} {'calls':>6}  kernel")
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        ms = us / 1e3 / steps
        print(f"{ms:9.4f} {ms / gpu_ms:6.1%} {n / steps:6.1f}  {name[:110]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlperf.bench.kernel_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=("decode", "train"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="decode batch sizes (default: 1 64)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="train micro-batch tokens (default: 8192)")
    p.add_argument("--steps", type=int, default=10, help="profiled steps per case (default: 10)")
    p.add_argument("--top", type=int, default=25, help="kernels listed per case (default: 25)")
    p.add_argument("--mode", choices=K.MODES, default="invariant")
    p.add_argument("--model", default=MODEL)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    model = Qwen3ForCausalLM.random(preset(a.model), seed=0, dtype=torch.bfloat16, device="cuda")
    with K.use_mode(a.mode):
        if a.case == "decode":
            with torch.no_grad():
                for b in a.batch:
                    engine = _engine(model, b)
                    _profile(f"decode B={b} ({a.mode}, graphs={bool(engine.graphs and engine.graphs.graphs)})",
                             engine.step, a.steps, a.top)
                    del engine
                    torch.cuda.empty_cache()
        else:
            for p_ in model.parameters():
                p_.requires_grad_(True)
            for t in a.tokens:
                step = _train_step(model, t)
                step()
                _profile(f"train micro-step {t} tokens ({a.mode})", step, a.steps, a.top)


if __name__ == "__main__":
    main()
