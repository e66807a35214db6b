"""Where the GPU time of a decode step, a prefill step and a train micro-step goes: a kernel table per case.

A tool for the decode-latency and train-MFU work of the GPU loop (``bench/BENCHMARKS.md``, loop
section), not a benchmark row: it prints, per case, the wall time of one step, the GPU time the
profiler saw inside it (wall - GPU = host time the GPU waited) and the kernels sorted by total GPU
time with their share of the step.

Cases (qwen3-0.6b shape, random bf16 weights, invariant mode unless ``--mode fast``):

* ``decode``: the rollout engine's decode step at batch ``--batch`` (prompt 512), replayed from CUDA
  graphs as ``rlperf serve`` runs it (warm-up steps first, then ``--steps`` profiled steps). With
  programmatic dependent launch (the default on SM 90+) kernel spans overlap: each holds its wait for
  the kernel before it (the table says so); ``RLPERF_PDL=0`` gives each kernel's own time;
* ``prefill``: the engine step that prefills ``--prompts`` prompts of 512 tokens at once (the rollout
  bench's ``prefill 16x512`` case: one chunk, replayed from the engine's prefill CUDA graph, or eagerly with
  ``--eager``), each profiled step prefilling fresh prompts queued on the warm engine before its timing;
* ``train``: one micro-step of the trainer's work on ``--tokens`` packed tokens (sequences of 512):
  forward to the fused log-prob, ``backward()`` of their sum — what ``perf/train_time`` repeats
  per micro-batch, without the optimizer;
* ``trace FILE ...``: the same table from a saved Chrome trace of the torch profiler (``.json`` or
  ``.json.gz``, e.g. what ``sglang.bench_one_batch --profile`` writes for SGLang's decode steps, with or
  without rlperf's plugin), its GPU time divided by ``--steps`` (the steps the trace covers). The GPU
  time is the sum of kernel, memcpy and memset durations; the trace's own span stands in for the wall.

* ``launch-floor``: what a decode step's kernel count costs before any work. The engine's graphed B = 1 decode
  step (the anchor: its ms and kernels per step, measured first), then one CUDA graph of that many launches of a
  kernel that only hands a counter on (each waits for the one before, as the step's kernels do; program 0 adds
  one to what the previous launch wrote) on ``--programs`` programs, with and without programmatic dependent
  launch. Its table gives us per launch and the graph's share of the step: the part of a step that fewer,
  fuller kernels (or one persistent kernel) could win back, and the part that is the kernels' own work;

* ``sglang``: real SGLang's decode steps at ``--batch`` (prompt 512) for each of ``--variants``
  (names of ``rlperf bench rollout --sglang-variants``: ``plugin`` is SGLang with rlperf's plugin):
  ``sglang.bench_one_batch --profile`` over ``--steps`` steps, its traces summarized as ``trace`` does,
  the step's median time (bench_one_batch's own, with a device sync per step) as the wall.

    python -m rlperf.bench.kernel_profile decode --batch 1 64
    python -m rlperf.bench.kernel_profile decode --batch 1 64 --by-launch  # each launch shape apart
    python -m rlperf.bench.kernel_profile prefill --prompts 16
    python -m rlperf.bench.kernel_profile train --tokens 8192
    python -m rlperf.bench.kernel_profile sglang --variants plugin fast --batch 1 64
    python -m rlperf.bench.kernel_profile launch-floor --programs 8 16 132
    python -m rlperf.bench.kernel_profile trace --steps 3 /tmp/prof_batch1_input512_output32_decode.trace.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import time

import torch
import triton
import triton.language as tl

from rlperf import kernels as K
from rlperf.kernels.pipeline import grid_dependency_sync, launch_options
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM

from .rollout import MODEL, PROMPT, decoding_engine, prefill_engine, queue_prefill


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


GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""The Chrome-trace categories of work on the GPU (torch profiler's export)."""


def launch_key(event: dict) -> str:
    """``name grid=[x, y, z] block=[x, y, z]``: one Chrome-trace kernel event's launch, so the launches of one
    kernel with different shapes (a step's products, for one) count apart. Events without a grid (copies,
    sets) keep their name."""
    args = event.get("args") or {}
    name = str(event.get("name", "?"))
    if "grid" not in args:
        return name
    return f"{name} grid={list(args['grid'])} block={list(args.get('block', []))}"


def trace_kernels(path, by_launch: bool = False) -> tuple[dict[str, list], float]:
    """``({name: [total us, calls]}, span us)`` of the GPU events (:data:`GPU_EVENT_CATEGORIES`) in the
    Chrome trace ``path`` (``.gz`` read as gzip); span: first start to last end of those events.
    ``by_launch``: keyed by :func:`launch_key` (name, grid and block) instead of the name.
    ValueError naming the file when it is not a trace or holds no GPU event."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a Chrome trace ({type(e).__name__}: {e})") from None
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    kernels: dict[str, list] = {}
    first, last = float("inf"), float("-inf")
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") not in GPU_EVENT_CATEGORIES:
            continue
        ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        d = kernels.setdefault(launch_key(e) if by_launch else str(e.get("name", "?")), [0.0, 0])
        d[0] += dur
        d[1] += 1
        first, last = min(first, ts), max(last, ts + dur)
    if not kernels:
        raise ValueError(f"{path}: no GPU events (categories {', '.join(GPU_EVENT_CATEGORIES)}): was the CUDA "
                         f"activity profiled?")
    return kernels, last - first


def _table(label: str, kernels: dict[str, list], wall_ms: float, steps: int, top: int, wall_what: str = "wall") -> None:
    """Print one case: ``kernels`` ``{name: [total us, calls]}`` over ``steps`` steps of ``wall_ms`` each."""
    gpu_ms = sum(v[0] for v in kernels.values()) / 1e3 / steps
    print(f"\n== {label}: {wall_what} {wall_ms:.3f} ms/step, GPU busy {gpu_ms:.3f} ms/step "
          f"({gpu_ms / wall_ms:.0%} of {wall_what}), {sum(v[1] for v in kernels.values()) / steps:.0f} kernels/step")
    print(f"{'ms/step':>9} {'share':>6} {'calls':>6}  kernel")
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        ms = us / 1e3 / steps
        print(f"{ms:9.4f} {ms / gpu_ms:6.1%} {n / steps:6.1f}  {name[:160]}")


def profile_kernels(fn, steps: int, prepare=None, by_launch: bool = False) -> tuple[dict[str, list], float]:
    """``({name: [total us, calls]}, wall ms per step)`` of ``steps`` calls of ``fn`` on the GPU: the
    wall time of unprofiled calls first (synchronized), then the torch profiler's CUDA events of as many
    profiled calls (kernels, copies and sets, by name). The calls run back to back in one timed span (an
    engine's overlapped decode steps keep one step in flight across calls); with ``prepare`` (called before
    each call of ``fn``, launching no GPU work) each call is timed alone and ``prepare`` stays outside.
    ``by_launch``: the kernels keyed by name, grid and block (:func:`launch_key`, read from the profile's
    Chrome trace), so that e.g. a decode step's products of different shapes are listed apart."""
    from torch.profiler import ProfilerActivity, profile

    wall = 0.0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        if prepare is not None:
            wall += time.perf_counter() - t0
            prepare()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        fn()
        if prepare is not None:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    wall_ms = (wall + time.perf_counter() - t0) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if prepare is not None:
                prepare()
            fn()
        torch.cuda.synchronize()
    if by_launch:
        import os
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlperf-profile-") as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            kernels, _ = trace_kernels(path, by_launch=True)
        return kernels, wall_ms
    kernels = {}
    for e in prof.events():
        # rlperf's own named ranges (``rlperf.decode``, ``rlperf.prefill``) also show on the GPU timeline:
        # spans over the step's kernels, not work of their own
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("rlperf."):
            d = kernels.setdefault(e.name, [0.0, 0])
            d[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            d[1] += 1
    return kernels, wall_ms


def top_kernels(kernels: dict[str, list], steps: int, top: int) -> list[dict]:
    """The ``top`` kernels of :func:`profile_kernels`' table by GPU time, per step:
    ``[{"name", "ms", "calls"}]`` (names cut at 160 characters)."""
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n[:160], "ms": us / 1e3 / steps, "calls": c / steps} for n, (us, c) in rows]


def _profile(label: str, fn, steps: int, top: int, prepare=None, by_launch: bool = False) -> None:
    kernels, wall_ms = profile_kernels(fn, steps, prepare, by_launch)
    _table(label, kernels, wall_ms, steps, top)
    if K.programmatic_launch(torch.device("cuda")):
        print("(kernels launched with programmatic dependent launch: a kernel starts while the one before it "
              "runs and waits there, so its span holds that wait and the spans overlap; RLPERF_PDL=0 gives "
              "each kernel's own time)")


@triton.jit
def _handoff_kernel(counter):
    """One link of a chain of launches: wait for the launch before (its write visible), then program 0 adds one
    to the counter it left. No other work: a chain of these costs what the launches alone cost."""
    grid_dependency_sync()
    if tl.program_id(0) == 0:
        tl.store(counter, tl.load(counter) + 1)


def launch_floor(launches: int, programs: int, pdl: bool, reps: int = 50) -> float:
    """ms of one CUDA-graph replay of ``launches`` chained :func:`_handoff_kernel` launches on ``programs``
    programs each, with programmatic dependent launch or without (``pdl``); checks that every link ran."""
    from .harness import cuda_time

    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    with K.use_programmatic_launch(pdl):
        options = launch_options(counter.device)

        def chain():
            for _ in range(launches):
                _handoff_kernel[(programs,)](counter, num_warps=4, **options)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile off the capture
            chain()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
    counter.zero_()
    graph.replay()
    torch.cuda.synchronize()
    if int(counter.item()) != launches:
        raise RuntimeError(f"launch-floor: {int(counter.item())} of {launches} links ran")
    return cuda_time(graph.replay, warmup=5, reps=reps, flush_l2=False).median_ms


def _launch_floor_case(model, programs: list[int], steps: int) -> None:
    """The ``launch-floor`` case (module docstring)."""
    from .rollout import decode_case

    with torch.no_grad():
        step = decode_case(model, 1, PROMPT, steps + 16, steps, graph_bs=1)
    if step["launches"] is None:  # the chain's length is the step's kernel count: no anchor, no floor
        raise SystemExit("launch-floor: the profiler could not count the decode step's kernels")
    count = step["launches"].kernels
    print(f"\n== launch floor: the anchor, the engine's graphed decode step at B=1: {step['ms']:.3f} ms, "
          f"{step['launches']}")
    print(f"{'programs':>8}  {'PDL':>3}  {'us/launch':>9}  {f'ms for {count}':>11}  {'x step':>6}")
    for n in programs:
        for pdl in (True, False):
            ms = launch_floor(count, n, pdl)
            print(f"{n:>8}  {'on' if pdl else 'off':>3}  {ms * 1e3 / count:9.2f}  {ms:11.3f}  {ms / step['ms']:6.3f}")


def _sglang_cases(variants, batches, steps: int, top: int, model: str) -> None:
    """The ``sglang`` case (module docstring): one ``bench_one_batch --profile`` process per variant."""
    import glob
    import os
    import tempfile

    from .rollout import sglang_run

    for variant in variants:
        with tempfile.TemporaryDirectory(prefix="rlperf-sglang-trace-") as tmp:
            os.environ["SGLANG_TORCH_PROFILER_DIR"] = tmp
            try:
                got = sglang_run(preset(model), batches, 512, 32 + steps, variant=variant,
                                 extra=["--profile", "--profile-stage", "decode", "--profile-steps", str(steps),
                                        "--profile-start-step", "16", "--profile-prefix", variant])
            except RuntimeError as e:
                print(f"\n== sglang {variant}: did not run: {e}")
                continue
            finally:
                os.environ.pop("SGLANG_TORCH_PROFILER_DIR", None)
            for b in batches:
                paths = sorted(glob.glob(os.path.join(tmp, f"{variant}_batch{b}_*decode*.trace.json*")))
                if not paths or b not in got["decode"]:
                    print(f"\n== sglang {variant} B={b}: no trace ({got['missing'].get(b, 'no decode result')})")
                    continue
                kernels, _ = trace_kernels(paths[0])
                _table(f"sglang {variant} decode B={b}", kernels, got["decode"][b], steps, top,
                       wall_what="median step")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlperf.bench.kernel_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=("decode", "prefill", "train", "trace", "sglang", "launch-floor"))
    p.add_argument("traces", nargs="*", metavar="FILE", help="trace: Chrome traces of the torch profiler (.json[.gz])")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="decode batch sizes (default: 1 64)")
    p.add_argument("--prompts", type=int, default=16, help="prefill: prompts of 512 tokens in the step (default: 16)")
    p.add_argument("--eager", action="store_true",
                   help="prefill: launch the step's kernels from Python, without the engine's prefill CUDA graphs")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="train micro-batch tokens (default: 8192)")
    p.add_argument("--steps", type=int, default=10, help="profiled steps per case (default: 10)")
    p.add_argument("--top", type=int, default=25, help="kernels listed per case (default: 25)")
    p.add_argument("--mode", choices=K.MODES, default="invariant")
    p.add_argument("--variants", nargs="+", default=["plugin", "fast"],
                   help="sglang: SGLang variants, names of rlperf bench rollout --sglang-variants (default: plugin fast)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--programs", type=int, nargs="+", default=[8, 16, 132],
                   help="launch-floor: programs per launch of the chain (default: 8 16 132)")
    p.add_argument("--by-launch", action="store_true",
                   help="list each kernel's launches by grid and block apart (e.g. a step's products by shape)")
    a = p.parse_intermixed_args(argv)
    if a.case == "trace":
        if not a.traces:
            p.error("trace: name at least one Chrome trace FILE")
        if a.steps < 1:
            p.error(f"--steps must be >= 1, got {a.steps}")
        for path in a.traces:
            try:
                kernels, span_us = trace_kernels(path, by_launch=a.by_launch)
            except ValueError as e:
                p.error(str(e))
            _table(str(path), kernels, span_us / 1e3 / a.steps, a.steps, a.top, wall_what="trace span")
        return
    if a.traces:
        p.error(f"{a.case} takes no FILE arguments (only trace does)")
    if a.steps < 1 or a.prompts < 1:
        p.error(f"--steps and --prompts must be >= 1, got {a.steps} and {a.prompts}")
    if min(a.programs) < 1:
        p.error(f"--programs must be >= 1, got {' '.join(map(str, a.programs))}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if a.case == "sglang":
        from .sglang_anchor import SGLANG_VARIANTS

        unknown = [v for v in a.variants if v not in SGLANG_VARIANTS]
        if unknown:
            p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(SGLANG_VARIANTS)}")
        _sglang_cases(a.variants, a.batch, a.steps, a.top, a.model)
        return
    model = Qwen3ForCausalLM.random(preset(a.model), seed=0, dtype=torch.bfloat16, device="cuda")
    with K.use_mode(a.mode):
        if a.case == "launch-floor":
            _launch_floor_case(model, a.programs, a.steps)
        elif a.case == "decode":
            with torch.no_grad():
                for b in a.batch:
                    engine = _engine(model, b)
                    _profile(f"decode B={b} ({a.mode}, graphs={bool(engine.graphs and engine.graphs.graphs)})",
                             engine.step, a.steps, a.top, by_launch=a.by_launch)
                    del engine
                    torch.cuda.empty_cache()
        elif a.case == "prefill":
            with torch.no_grad():
                # one warm engine: the untimed first step compiles (and captures), then each profiled step
                # prefills fresh prompts queued before it
                engine = prefill_engine(model, a.prompts, PROMPT, graphs=not a.eager)
                seeds = itertools.count()

                def queue():
                    queue_prefill(engine, a.prompts, PROMPT, seed=next(seeds))

                queue()
                engine.step()
                graphed = bool(engine.prefill_graphs and engine.prefill_graphs.graphs)
                _profile(f"prefill {a.prompts}x{PROMPT} ({a.mode}, {'graphed' if graphed else 'eager'})", engine.step,
                         a.steps, a.top, prepare=queue, by_launch=a.by_launch)
        else:
            for p_ in model.parameters():
                p_.requires_grad_(True)
            for t in a.tokens:
                step = _train_step(model, t)
                step()
                _profile(f"train micro-step {t} tokens ({a.mode})", step, a.steps, a.top, by_launch=a.by_launch)


if __name__ == "__main__":
    main()
