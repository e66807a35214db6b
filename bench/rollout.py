"""Rollout-engine benchmark: decode step time against the memory floor, prefill throughput, invariance cost.

A benchmark module in the ``rlperf bench`` protocol (``run(quick) -> list[BenchRow]``,
``summarize(rows) -> dict``), run as ``rlperf bench rollout``. It measures the engine
(:mod:`rlperf.rollout.engine`) from outside, as a tool: the product never imports it.

Cases (qwen3-0.6b shape, random bf16 weights, byte prompts, ``ignore_eos``):

* **decode** at batch 1, 16, 64, 256 (prompt 512, 256 new tokens): the wall time of one
  :meth:`Engine.step` when every request is decoding (host scheduling, H2D copies, the forward,
  sampling, log-probs — what a decode step costs), averaged over ``steps`` consecutive steps.
  Anchor: the **memory floor** of that step, ``(weight bytes + KV bytes read) / copy bandwidth``,
  with KV bytes = batch x mean cached tokens x bytes per token and the copy bandwidth measured in
  the same run (a 1 GiB device-to-device copy: 2 x bytes / time). Ratio = floor / step; the
  target is >= 0.5 at batch 64 (step <= 2x the floor). Decode uses CUDA graphs
  (``cuda_graph_max_bs``) unless ``graphs=False``; ``extra`` has tokens/s and whether graphs ran.
* **prefill**: one step that prefills 16 x 512 fresh prompt tokens on a warm engine (its prefill CUDA
  graphs captured, as ``rlperf serve``'s are after its warm-up); anchor: the same step in fast mode, also
  replayed from its prefill graphs. ``extra``: ``eager_ms`` and ``fast_eager_ms``, the invariant and fast
  steps without prefill graphs; ``graph`` / ``graph_fast``, whether each timed step replayed a graph.
* **invariance cost**: the batch-64 decode step in invariant mode vs fast mode, both replayed from
  CUDA graphs (fast mode: rlperf's matmul kernel up to 64 rows and cuBLAS above, the log-probs folded from
  the step's logits as in invariant mode; decode attention is rlperf's kernel in both modes).
* **overlap**: the batch-64 invariant decode step with the engine's overlap (its default: the next graphed
  step launched before this one's tokens are read) vs the same engine reading every step's tokens before
  the next launch (``EngineConfig.overlap_schedule=False``, ``rlperf serve --disable-overlap-schedule``).
  Ratio > 1: the overlap hides host work.
* **fast mode attention**: the batch-64 fast-mode decode step with rlperf's attention kernel vs the
  same step with FlashInfer's (``--attention-backend flashinfer``), both graphed. Ratio > 1: rlperf's
  kernel is faster.
* **against transformers** (the full run only): the same decode shapes on transformers' own
  ``Qwen3ForCausalLM`` (same config, bf16, random weights), greedy ``generate`` with a static KV cache,
  whose decoding forward transformers compiles (``torch.compile``, CUDA graphs): a decode step's time
  is the difference of two generations' wall times over the difference of their new tokens (the
  prefill and compilation cancel). Ratio > 1: rlperf's engine step is faster. An anchor that cannot
  run on this transformers/torch is recorded with the reason, not dropped.
* **against real SGLang** (the full run only): the same decode shapes and the prefill on SGLang's own
  engine (:func:`sglang_run`: ``python -m sglang.bench_one_batch`` on the same model shape, dummy
  weights, CUDA graphs; the median decode step of ``NEW`` steps after a prompt of ``PROMPT``, and the
  prefill of its ``PREFILL_BATCH`` x ``PROMPT`` batch, which its warm-up ran first), one process per
  variant of :data:`rlperf.bench.sglang_anchor.SGLANG_VARIANTS` (``--sglang-variants``, default all):
  ``sglang fast`` (SGLang's default mode, FlashInfer attention), ``sglang deterministic``
  (``--enable-deterministic-inference``, FlashInfer), ``sglang deterministic triton`` (the same with
  ``--attention-backend triton``) and ``sglang rlperf plugin`` (SGLang with rlperf's plugin:
  ``--attention-backend rlperf --page-size 128 --enable-deterministic-inference``, started through
  ``python -m rlperf.bench.sglang_anchor``, which loads SGLang's plugins first). Each is the anchor of
  rlperf's engine step and prefill (ratio >= 1: rlperf's invariant engine is no slower). The plugin's
  decode step and prefill are also the kernel of rows against ``sglang deterministic`` (target >= 1.0 at
  every batch) and ``sglang fast`` (target >= 0.9 at batch <= 64). A variant that cannot run (SGLang or
  the plugin missing, out of memory, a backend refused) leaves its rows with the reason in one line
  (``anchor_unavailable``, ``kernel_unavailable``) and the other variants still run.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from rlperf import kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.cuda_graph import default_max_prefill_tokens
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.kv_cache import bytes_per_token
from rlperf.rollout.tokenizer import ByteTokenizer

from .harness import BenchRow, cuda_time, format_launches, launch_fields, measure_launches
from .sglang_anchor import (PLUGIN_TARGETS, PLUGIN_VARIANT, SGLANG_ANCHOR_MODULE, SGLANG_BENCH_MODULE, SGLANG_VARIANTS,
                            plugin_target, rlperf_plugin_entry_points)

MODEL = "qwen3-0.6b"
PROMPT, NEW = 512, 256
BATCHES = (1, 16, 64, 256)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _requests(engine: Engine, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(0, 256, (prompt_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=i, ignore_eos=True))


def decoding_engine(model, batch: int, prompt_len: int, new_tokens: int, graph_bs: int = 0, warmup: int = 3,
                    attention_backend: str = "rlperf", overlap_schedule: bool = True,
                    fused_sampling: bool = False, logprob_from_logits_max_rows: int | None = None,
                    logprob_beside_sampler: bool = False) -> Engine:
    """An engine whose ``batch`` requests (byte prompts of ``prompt_len``) are all decoding: prefilled
    until each has its first token, then ``warmup`` decode steps (graph capture and kernel compilation
    stay out of what the caller times). ``attention_backend``: ``EngineConfig.attention_backend``
    (``flashinfer``: FlashInfer's attention in fast mode; FlashInferUnavailable where it cannot run);
    ``overlap_schedule``, ``fused_sampling``, ``logprob_from_logits_max_rows`` (None: the default),
    ``logprob_beside_sampler``: ``EngineConfig``'s."""
    P = K.PAGE_SIZE
    cfg = EngineConfig(max_running_requests=batch, chunked_prefill_size=max(8192, prompt_len),
                       max_total_tokens=batch * (-(-(prompt_len + new_tokens) // P) * P), cuda_graph_max_bs=graph_bs,
                       attention_backend=attention_backend, overlap_schedule=overlap_schedule,
                       fused_sampling=fused_sampling, logprob_beside_sampler=logprob_beside_sampler,
                       **({} if logprob_from_logits_max_rows is None
                          else {"logprob_from_logits_max_rows": logprob_from_logits_max_rows}))
    engine = Engine(model, ByteTokenizer(model.cfg.vocab_size), cfg)
    _requests(engine, batch, prompt_len, new_tokens)
    while any(not r.output_ids for r in engine.requests.values()) or engine.waiting:
        engine.step()
    for _ in range(warmup):
        engine.step()
    return engine


def decode_case(model, batch: int, prompt_len: int, new_tokens: int, steps: int, graph_bs: int = 0,
                warmup: int = 3, attention_backend: str = "rlperf", overlap_schedule: bool = True,
                fused_sampling: bool = False, logprob_from_logits_max_rows: int | None = None,
                logprob_beside_sampler: bool = False) -> dict:
    """Mean wall ms of a decode step of ``batch`` sequences, the mean cached tokens per sequence, and
    the kernel launches of one more decode step after the timed ones (:func:`measure_launches`: None
    without CUDA). With the engine's overlap (``EngineConfig.overlap_schedule``) the warm engine has a
    step in flight, finished on the GPU by the sync before the clock starts: each timed ``step()``
    launches one decode forward and reads the one before, so the clock spans ``steps`` forwards."""
    if steps + warmup + 2 > new_tokens:
        raise ValueError(f"{steps} timed + {warmup} warm-up steps + 1 counted step need more than {new_tokens} "
                         f"new tokens")
    engine = decoding_engine(model, batch, prompt_len, new_tokens, graph_bs, warmup, attention_backend, overlap_schedule,
                             fused_sampling, logprob_from_logits_max_rows, logprob_beside_sampler)
    kv_before = sum(r.num_cached for r in engine.running) / batch
    _sync(model.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(model.device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    if len(engine.running) != batch:
        raise RuntimeError(f"only {len(engine.running)} of {batch} requests decoded through the timed steps")
    kv_mean = kv_before + (steps + 1) / 2  # each step reads one more cached token than the last
    launches = measure_launches(engine.step, warmup=0)  # the engine is warm: the next step is a steady one
    return {"ms": ms, "kv_mean": kv_mean, "graph": bool(engine.graphs and engine.graphs.graphs), "launches": launches}


def prefill_engine(model, batch: int, prompt_len: int, graphs: bool = True) -> Engine:
    """An idle engine whose steps take ``batch`` prompts of ``prompt_len`` tokens in one prefill chunk
    (:func:`queue_prefill` queues them), replaying them from prefill CUDA graphs as ``rlperf serve`` does on
    CUDA (``graphs``; False, or off CUDA: eager)."""
    chunk = batch * prompt_len
    graph_tokens = default_max_prefill_tokens(model.device, chunk, batch) if graphs else 0
    return Engine(model, ByteTokenizer(model.cfg.vocab_size),
                  EngineConfig(max_running_requests=batch, chunked_prefill_size=chunk,
                               max_total_tokens=batch * (prompt_len + K.PAGE_SIZE),
                               cuda_graph_max_prefill_tokens=graph_tokens))


def queue_prefill(engine: Engine, batch: int, prompt_len: int, seed: int = 0) -> None:
    """Abort what ``engine`` holds (freeing its pages) and queue ``batch`` fresh prompts of ``prompt_len``
    tokens (2 new tokens each): its next step prefills them all at once."""
    engine.abort(None, "next prefill")
    _requests(engine, batch, prompt_len, 2, seed=seed)


def prefill_case(model, batch: int, prompt_len: int, reps: int, graphs: bool = True,
                 replayed: list[bool] | None = None) -> float:
    """Median wall ms of one engine step that prefills ``batch`` fresh prompts of ``prompt_len`` tokens, on
    one warm engine (:func:`prefill_engine`; the first step, untimed, compiles and captures). ``replayed``:
    a list that gets whether the steps replayed a prefill graph (captured one in this mode)."""
    engine = prefill_engine(model, batch, prompt_len, graphs)
    times = []
    for rep in range(reps + 1):
        queue_prefill(engine, batch, prompt_len, seed=rep)
        gc.collect()  # the previous requests' reference cycles, collected here rather than inside the timed step
        _sync(model.device)
        t0 = time.perf_counter()
        engine.step()
        _sync(model.device)
        if rep:
            times.append((time.perf_counter() - t0) * 1e3)
    if replayed is not None:
        g = engine.prefill_graphs
        replayed.append(g is not None and any(mode == K.mode() for mode, _, _ in g.graphs))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), CUDA events, median."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), warmup=3, reps=20, flush_l2=False)
    return 2 * nbytes / (t.median_ms * 1e-3)


def floor_ms(model, batch: int, kv_mean: float, bandwidth: float) -> tuple[float, float]:
    """(memory-floor ms, bytes) of a decode step: every weight once + the KV cache read."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = batch * kv_mean * bytes_per_token(model.cfg, model.embed_tokens.dtype)
    total = weight_bytes + kv_bytes
    return total / bandwidth * 1e3, total


def transformers_decode_ms(cfg, batch: int, prompt_len: int, steps: int, device="cuda", compile: bool = True,
                           reps: int = 3) -> float:
    """Mean ms of one decode step of transformers' ``Qwen3ForCausalLM`` built from rlperf's config
    ``cfg`` (random bf16 weights; float32 on CPU): greedy ``generate`` from ``batch`` prompts of
    ``prompt_len`` tokens with a static KV cache; transformers compiles the decoding forward itself
    when ``compile`` (its default for a static cache on CUDA). Generations of 8 and 8 + ``steps`` new
    tokens (after a warm-up one), each the fastest of ``reps``: the step is the difference of their
    wall times over ``steps`` (on a loaded CPU it can even come out negative: a timing, not a check)."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    hf_cfg = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                         rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                         max_position_embeddings=max(cfg.max_position_embeddings, prompt_len + steps + 16),
                         tie_word_embeddings=cfg.tie_word_embeddings)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    hf = HFQwen3(hf_cfg).to(device=device, dtype=dtype).eval()
    hf.generation_config.disable_compile = not compile
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def generate(new: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, cache_implementation="static", pad_token_id=0)
        _sync(device)
        if out.shape[1] != prompt_len + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - prompt_len} of {new} new tokens")
        return time.perf_counter() - t0

    generate(8 + steps)  # warm-up: compilation and graph capture
    short = min(generate(8) for _ in range(reps))
    long = min(generate(8 + steps) for _ in range(reps))
    return (long - short) * 1e3 / steps


SGLANG_MODES = {v.label: [*v.flags] for v in SGLANG_VARIANTS.values()}
"""The SGLang anchors' labels and the flags each adds to its attention backend's (``rlperf bench rollout``,
full run; :data:`rlperf.bench.sglang_anchor.SGLANG_VARIANTS` holds both)."""
PREFILL_BATCH = 16
"""The prefill row's batch (``prefill 16x512``): SGLang's is the prefill of its run at this batch."""


def sglang_bench_argv(model_dir, batches, prompt_len: int, new_tokens: int, result_file, *,
                      attention_backend: str = "flashinfer", extra=(), module: str = SGLANG_BENCH_MODULE) -> list[str]:
    """The command of one SGLang decode measurement: ``python -m sglang.bench_one_batch`` (or ``module``)
    on the model shape in ``model_dir`` (its ``config.json``; dummy weights), every batch of ``batches``
    with ``prompt_len`` prompt and ``new_tokens`` new tokens; results appended to ``result_file``."""
    return [sys.executable, "-m", module, "--model-path", str(model_dir), "--load-format", "dummy",
            "--batch-size", *map(str, batches), "--input-len", str(prompt_len),
            "--output-len", str(new_tokens), "--attention-backend", attention_backend,
            "--result-filename", str(result_file), *extra]


def sglang_variant_argv(variant: str, model_dir, batches, prompt_len: int, new_tokens: int, result_file,
                        extra=()) -> list[str]:
    """The command of the SGLang variant ``variant`` (a name of :data:`SGLANG_VARIANTS`): its attention
    backend and flags; the plugin's through :data:`SGLANG_ANCHOR_MODULE` (SGLang's plugins loaded first)."""
    v = SGLANG_VARIANTS[variant]
    return sglang_bench_argv(model_dir, batches, prompt_len, new_tokens, result_file,
                             attention_backend=v.attention_backend, extra=[*v.flags, *extra],
                             module=SGLANG_ANCHOR_MODULE if v.plugin else SGLANG_BENCH_MODULE)


def write_bench_model(cfg, model_dir) -> Path:
    """A folder SGLang can start from with dummy weights: ``config.json`` of the shape ``cfg`` (bf16) and a
    one-token word-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``): ``bench_one_batch``
    loads a tokenizer even though it feeds random token ids."""
    from tokenizers import Tokenizer, models

    from rlperf.model.qwen3 import config_to_hf

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config_to_hf(cfg, torch.bfloat16)))
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}))
    return model_dir


def read_sglang_results(result_file, prompt_len: int, new_tokens: int) -> dict[str, dict[int, float]]:
    """``{"decode": {batch: median decode step ms}, "prefill": {batch: prefill ms}}`` from the JSON lines
    ``sglang.bench_one_batch`` appends to its ``--result-filename`` (``batch_size``, ``input_len``,
    ``output_len``, ``median_decode_latency`` and ``prefill_latency`` in seconds: one prefill of the
    whole batch, then the decode steps); lines of other shapes are ignored. ValueError when the file
    holds none of this shape."""
    out: dict[str, dict[int, float]] = {"decode": {}, "prefill": {}}
    for n, line in enumerate(Path(result_file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if (r["input_len"], r["output_len"]) == (prompt_len, new_tokens):
                out["decode"][int(r["batch_size"])] = float(r["median_decode_latency"]) * 1e3
                if "prefill_latency" in r:
                    out["prefill"][int(r["batch_size"])] = float(r["prefill_latency"]) * 1e3
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{result_file}:{n}: not a bench_one_batch result ({type(e).__name__}: {e})") from None
    if not out["decode"]:
        raise ValueError(f"{result_file} holds no result for input {prompt_len}, output {new_tokens}")
    return out


def read_sglang_decode_ms(result_file, prompt_len: int, new_tokens: int) -> dict[int, float]:
    """``{batch: median decode step ms}`` of :func:`read_sglang_results`."""
    return read_sglang_results(result_file, prompt_len, new_tokens)["decode"]


SGLANG_FREE_SHARE = 0.8
"""The share of the GPU's free memory (at the anchor's start) that SGLang's static budget may take."""


def sglang_mem_fraction(free_bytes: int, total_bytes: int) -> float:
    """``--mem-fraction-static`` for an SGLang process on a GPU this process shares: SGLang reads it as a
    share of the whole GPU for its weights and KV pool, and needs the rest for activations, CUDA graphs
    and its deterministic mode's workspaces; whatever this process still holds (the caching allocator's
    pools, compiled anchors' graphs) is not free. :data:`SGLANG_FREE_SHARE` of the free memory, as a
    share of the total, rounded down to 0.01 (a run of the H100 bench with SGLang's own default ran out of
    memory in the deterministic mode)."""
    if total_bytes <= 0 or free_bytes <= 0:
        raise ValueError(f"GPU memory: free {free_bytes} of {total_bytes} bytes")
    return int(100 * SGLANG_FREE_SHARE * min(free_bytes, total_bytes) / total_bytes) / 100


def failure_line(output: str) -> str:
    """What a failed process's output says went wrong: its last line naming an error or exception
    (a Python traceback's last line, CUDA's out-of-memory message), else its last 600 characters."""
    for line in reversed(output.splitlines()):
        if re.search(r"(Error|Exception|error:)", line):
            return line.strip()[:600]
    return output[-600:].strip()


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def run_process_group(argv, timeout: float, env) -> subprocess.CompletedProcess | None:
    """Run ``argv`` in a process group of its own; its exit status and output once it exits, None past
    ``timeout`` s. When the command ends (or times out, or this process is interrupted) whatever its
    group still runs is killed: SGLang's ``bench_one_batch`` starts its scheduler as a child process,
    which outlived a failed parent on an H200 (an out-of-memory exit), kept 112 GiB of the GPU for the
    next commands and held the output pipes open (a wait for their end would have hung)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    # a SIGTERM (a device call's `timeout`) would end this process without the cleanup below: make it
    # an exception here while the group runs (signal handlers belong to the main thread)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    chunks: dict[str, str] = {}
    readers = [threading.Thread(target=lambda name=name, f=f: chunks.__setitem__(name, f.read()), daemon=True)
               for name, f in (("out", proc.stdout), ("err", proc.stderr))]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while a member lives
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for t in readers:  # the pipes close once every member is gone
            t.join()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return subprocess.CompletedProcess(argv, proc.returncode, chunks.get("out", ""), chunks.get("err", ""))


def sglang_run(cfg, batches, prompt_len: int, new_tokens: int, *, variant: str | None = None, extra=(),
               attention_backend: str = "flashinfer", timeout: float = 900.0) -> dict:
    """One real SGLang measurement (module docstring, "against real SGLang"): the model shape ``cfg``
    written by :func:`write_bench_model` into a temporary folder, one process of :func:`sglang_variant_argv`
    (``variant``, a name of :data:`SGLANG_VARIANTS`) or else of :func:`sglang_bench_argv`
    (``attention_backend``); ``extra`` flags after the variant's. On CUDA its ``--mem-fraction-static`` is
    sized to the GPU's free memory (:func:`sglang_mem_fraction`) unless ``extra`` names one. The plugin
    variant runs with ``SGLANG_PLUGINS`` naming rlperf's entry points alone.

    Returns ``{"decode": {batch: ms}, "prefill": {batch: ms}, "missing": {batch: why}}`` (``missing``: the
    batches the process measured no result for, e.g. one beyond its KV pool). RuntimeError naming the
    cause where nothing was measured: SGLang missing, rlperf's plugin not installed, the process's exit
    and its error line (:func:`failure_line`), its timeout."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("sglang is not installed (bench/pack_sglang.sh packs it for the GPU machines)")
    env = dict(os.environ)
    if variant is not None and SGLANG_VARIANTS[variant].plugin:
        names = rlperf_plugin_entry_points()
        if not names:
            raise RuntimeError("rlperf's SGLang plugin is not installed: no 'sglang.srt.plugins' entry point loads "
                               "rlperf (pip install -e . registers it)")
        env["SGLANG_PLUGINS"] = ",".join(names)
    extra = list(extra)
    if torch.cuda.is_available() and "--mem-fraction-static" not in extra:
        gc.collect()
        torch.cuda.empty_cache()
        extra += ["--mem-fraction-static", f"{sglang_mem_fraction(*torch.cuda.mem_get_info()):g}"]
    with tempfile.TemporaryDirectory(prefix="rlperf-sglang-") as tmp:
        model_dir, result = write_bench_model(cfg, Path(tmp, "model")), Path(tmp, "result.jsonl")
        if variant is None:
            argv = sglang_bench_argv(model_dir, batches, prompt_len, new_tokens, result,
                                     attention_backend=attention_backend, extra=extra)
        else:
            argv = sglang_variant_argv(variant, model_dir, batches, prompt_len, new_tokens, result, extra=extra)
        module = argv[2]
        proc = run_process_group(argv, timeout, env)
        if proc is None:
            raise RuntimeError(f"{module} did not finish within {timeout:g} s")
        output = proc.stdout + proc.stderr
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"{module} exited {proc.returncode}: {failure_line(output)}")
        got = read_sglang_results(result, prompt_len, new_tokens)
    got["missing"] = {}
    for b in batches:
        if b not in got["decode"]:  # SGLang prints "skipping (B, IN, OUT) due to max batch size limit"
            said = next((ln.strip() for ln in output.splitlines() if f"skipping ({b}," in ln), "no result line")
            got["missing"][b] = f"{module} measured no batch {b} ({said[:200]})"
    got["tail"] = output[-600:].strip()
    return got


def sglang_decode_ms(cfg, batches, prompt_len: int, new_tokens: int, *, extra=(), attention_backend: str = "flashinfer",
                     timeout: float = 900.0) -> dict[int, float]:
    """Median decode step ms of real SGLang per batch: :func:`sglang_run` with ``attention_backend`` and
    ``extra``; RuntimeError also when a batch has no result."""
    got = sglang_run(cfg, batches, prompt_len, new_tokens, extra=extra, attention_backend=attention_backend,
                     timeout=timeout)
    if got["missing"]:
        raise RuntimeError(f"{SGLANG_BENCH_MODULE} measured no batch {sorted(got['missing'])} (beyond its memory?): "
                           f"{got['tail']}")
    return got["decode"]


def _sglang_cell(result: dict, phase: str, batch: int) -> tuple[float, str | None]:
    """(ms, why not) of one SGLang variant's ``result`` (:func:`sglang_run`'s, or ``{"why": reason}``)."""
    if result.get("why"):
        return float("nan"), result["why"]
    if batch in result.get(phase, {}):
        return result[phase][batch], None
    return float("nan"), result.get("missing", {}).get(batch) or f"no {phase} result at batch {batch}"


def sglang_rows(results: dict, batches, ours_decode: dict, ours_prefill: float | None, prefill_work: float = 0.0,
                prompt_len: int = PROMPT) -> list[BenchRow]:
    """The rows of the SGLang variants in ``results`` (name of :data:`SGLANG_VARIANTS` -> what
    :func:`sglang_run` returned, or ``{"why": reason}`` where it raised), in the variants' run order:

    * per variant, rlperf's engine step (``ours_decode``: batch -> ms) against the variant's decode step at
      every batch, then rlperf's invariant prefill of :data:`PREFILL_BATCH` x ``prompt_len``
      (``ours_prefill``) against the variant's prefill of that batch;
    * with the plugin: its decode steps and prefill against each variant of :data:`PLUGIN_TARGETS` that ran
      (``extra["target"]``: the ratio the issue asks of that decode row).

    A measurement that did not happen is NaN with its reason in ``extra`` (``anchor_unavailable``, or
    ``kernel_unavailable`` where the plugin's side is missing), one line each."""
    cases = [(f"decode B={b} prompt {prompt_len}", "decode", b, ours_decode[b], "engine step", 0.0) for b in batches]
    if PREFILL_BATCH in batches and ours_prefill is not None:
        cases.append((f"prefill {PREFILL_BATCH}x{prompt_len}", "prefill", PREFILL_BATCH, ours_prefill, "invariant step",
                      prefill_work))
    rows = []
    for name in (n for n in SGLANG_VARIANTS if n in results):
        for case, phase, b, ours_ms, kernel, work in cases:
            ms, why = _sglang_cell(results[name], phase, b)
            rows.append(BenchRow("rollout", case, kernel, ours_ms, SGLANG_VARIANTS[name].label, ms, work=work,
                                 extra={"anchor_unavailable": why} if why else {}))
    if PLUGIN_VARIANT in results:
        for name in (n for n in PLUGIN_TARGETS if n in results):
            for case, phase, b, _, _, work in cases:
                ms, why = _sglang_cell(results[PLUGIN_VARIANT], phase, b)
                anchor_ms, anchor_why = _sglang_cell(results[name], phase, b)
                extra = {}
                if why:
                    extra["kernel_unavailable"] = why
                if anchor_why:
                    extra["anchor_unavailable"] = anchor_why
                target = plugin_target(SGLANG_VARIANTS[name].label, b) if phase == "decode" else None
                if target is not None:
                    extra["target"] = target
                rows.append(BenchRow("rollout", case, SGLANG_VARIANTS[PLUGIN_VARIANT].label, ms,
                                     SGLANG_VARIANTS[name].label, anchor_ms, work=work, extra=extra))
    return rows


def describe_row(r: BenchRow) -> str:
    """One printed line of an SGLang row: both times, the ratio and, where it has one, its target."""
    def ms(value: float, why: str | None) -> str:
        return f"{value:.3f} ms" if math.isfinite(value) else f"did not run ({' '.join(str(why).split())[:200]})"

    line = (f"rollout: {r.case}: {r.kernel} {ms(r.kernel_ms, r.extra.get('kernel_unavailable'))}, "
            f"{r.anchor} {ms(r.anchor_ms, r.extra.get('anchor_unavailable'))}")
    if math.isfinite(r.ratio):
        line += f", ratio {r.ratio:.3f}"
        if "target" in r.extra:
            line += f" (target >= {r.extra['target']:g}: {'met' if r.ratio >= r.extra['target'] else 'missed'})"
    return line


def sglang_anchor_rows(cfg, variants, batches, ours_decode: dict, ours_prefill: float | None, prefill_work: float = 0.0,
                       prompt_len: int = PROMPT, new_tokens: int = NEW, measure=None) -> list[BenchRow]:
    """Measure each SGLang variant of ``variants`` (names of :data:`SGLANG_VARIANTS`, run in that table's
    order) with ``measure`` (default :func:`sglang_run`; one process each, the prefill batch first so that
    SGLang's warm-up runs the prefill's shape) and return :func:`sglang_rows`. A variant that fails (SGLang
    or the plugin missing, out of memory, a backend refused) is printed and recorded with its reason; the
    others still run."""
    measure = measure or sglang_run
    order = tuple(b for b in batches if b == PREFILL_BATCH) + tuple(b for b in batches if b != PREFILL_BATCH)
    results = {}
    for name in (n for n in SGLANG_VARIANTS if n in variants):
        t0 = time.perf_counter()
        try:
            results[name] = measure(cfg, order, prompt_len, new_tokens, variant=name)
            print(f"rollout: {SGLANG_VARIANTS[name].label}: measured in {time.perf_counter() - t0:.0f} s")
        except Exception as e:  # an anchor that cannot run here is recorded, not dropped
            results[name] = {"why": " ".join(f"{type(e).__name__}: {str(e)[:300]}".split())}
            print(f"rollout: {SGLANG_VARIANTS[name].label}: did not run ({time.perf_counter() - t0:.0f} s): "
                  f"{results[name]['why']}")
    if PLUGIN_VARIANT in results:
        for name in PLUGIN_TARGETS:
            if name not in results:
                print(f"rollout: {SGLANG_VARIANTS[PLUGIN_VARIANT].label}: no target rows against "
                      f"{SGLANG_VARIANTS[name].label} ({name} not in --sglang-variants)")
    rows = sglang_rows(results, batches, ours_decode, ours_prefill, prefill_work, prompt_len)
    for r in rows:
        print(describe_row(r))
    return rows


def run(quick: bool = False, sglang_variants=None, transformers_anchor: bool = True) -> list:
    """The rows of the module docstring; ``sglang_variants``: the names of :data:`SGLANG_VARIANTS` to run
    (``--sglang-variants``; default all of them; the full run only); ``transformers_anchor``: False leaves
    out the compiled-transformers rows (``--no-transformers-anchor``)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the rollout benchmark needs a CUDA GPU")
    cfg = preset(MODEL)
    model = Qwen3ForCausalLM.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    bw = copy_bandwidth()
    batches = (1, 64) if quick else BATCHES
    steps = 8 if quick else 32
    rows = []
    with K.use_mode("invariant"):
        for b in batches:
            d = decode_case(model, b, PROMPT, NEW, steps, graph_bs=max(batches))
            fl, nbytes = floor_ms(model, b, d["kv_mean"], bw)
            rows.append(BenchRow("rollout", f"decode B={b} prompt {PROMPT}", "engine step", d["ms"], "memory floor", fl,
                                 work=nbytes, unit="GB/s",
                                 extra={"tokens_per_s": b / d["ms"] * 1e3, "graph": d["graph"], "kv_mean": d["kv_mean"],
                                        "copy_GBps": bw / 1e9, **launch_fields("decode_step", d["launches"])}))
            print(f"rollout: decode B={b}: {format_launches(d['launches'])} per decode step")
        pre_graph: list[bool] = []
        pre_inv = prefill_case(model, PREFILL_BATCH, PROMPT, reps=2 if quick else 5, replayed=pre_graph)
        pre_eager = prefill_case(model, PREFILL_BATCH, PROMPT, reps=2 if quick else 5, graphs=False)
        inv64 = decode_case(model, 64, PROMPT, NEW, steps, graph_bs=64)
        stepwise64 = decode_case(model, 64, PROMPT, NEW, steps, graph_bs=64, overlap_schedule=False)
    with K.use_mode("fast"):
        pre_fast = prefill_case(model, PREFILL_BATCH, PROMPT, reps=2 if quick else 5, replayed=pre_graph)
        pre_fast_eager = prefill_case(model, PREFILL_BATCH, PROMPT, reps=2 if quick else 5, graphs=False)
        fast64 = decode_case(model, 64, PROMPT, NEW, steps, graph_bs=64)
        try:  # the engine's fast mode with FlashInfer's attention (rlperf serve --attention-backend flashinfer)
            fi64, fi_extra = decode_case(model, 64, PROMPT, NEW, steps, graph_bs=64, attention_backend="flashinfer"), {}
        except Exception as e:  # an anchor that cannot run here is recorded, not dropped
            fi64, fi_extra = {"ms": float("nan")}, {"anchor_unavailable": f"{type(e).__name__}: {str(e)[:200]}"}
    flops = 2 * PREFILL_BATCH * PROMPT * sum(p.numel() for p in model.parameters())
    rows.append(BenchRow("rollout", f"prefill {PREFILL_BATCH}x{PROMPT}", "invariant step", pre_inv, "fast step", pre_fast,
                         work=flops, extra={"tokens_per_s": PREFILL_BATCH * PROMPT / pre_inv * 1e3,
                                            "eager_ms": pre_eager, "fast_eager_ms": pre_fast_eager,
                                            "graph": pre_graph[0], "graph_fast": pre_graph[1]}))
    rows.append(BenchRow("rollout", "decode B=64 invariance cost", "invariant step", inv64["ms"], "fast step", fast64["ms"],
                         work=0.0, extra={"graph": inv64["graph"], "graph_fast": fast64["graph"]}))
    rows.append(BenchRow("rollout", "decode B=64 overlap", "overlapped step", inv64["ms"], "step-by-step",
                         stepwise64["ms"], work=0.0, extra={"graph": inv64["graph"]}))
    rows.append(BenchRow("rollout", "decode B=64 fast mode attention", "rlperf kernel", fast64["ms"],
                         "flashinfer attention", fi64["ms"], work=0.0, extra=fi_extra))
    if not quick:
        ours = {r.case: r for r in rows if r.anchor == "memory floor"}
        for b in batches if transformers_anchor else ():
            case = f"decode B={b} prompt {PROMPT}"
            try:
                hf_ms, extra = transformers_decode_ms(cfg, b, PROMPT, steps), {}
            except Exception as e:  # an anchor that cannot run here is recorded, not dropped
                hf_ms, extra = float("nan"), {"anchor_unavailable": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(BenchRow("rollout", case, "engine step", ours[case].kernel_ms, "transformers compiled", hf_ms,
                                 work=0.0, extra=extra))
            print(f"rollout: decode B={b}: transformers compiled {hf_ms:.3f} ms, rlperf {ours[case].kernel_ms:.3f} ms")
        del model  # SGLang's engine runs in its own process on the same GPU
        torch.cuda.empty_cache()
        ours_decode = {b: ours[f"decode B={b} prompt {PROMPT}"].kernel_ms for b in batches}
        rows += sglang_anchor_rows(cfg, tuple(SGLANG_VARIANTS) if sglang_variants is None else sglang_variants,
                                   batches, ours_decode, pre_inv, flops)
    return rows


def summarize(rows) -> dict:
    out = {}
    plugin = SGLANG_VARIANTS[PLUGIN_VARIANT].label
    for r in rows:
        if r.anchor in SGLANG_MODES:  # rlperf's engine (or the plugin) against an SGLang variant
            prefix, anchor = ("plugin_" if r.kernel == plugin else ""), r.anchor.replace(" ", "_")
            if r.case.startswith("decode B="):
                out[f"{prefix}decode_{r.case.split()[1]}_vs_{anchor}"] = r.ratio
            else:
                out[f"{prefix}prefill_vs_{anchor}"] = r.ratio
        elif r.case.startswith("decode B=") and r.anchor == "memory floor":
            b = r.case.split()[1]
            out[f"decode_{b}_floor_ratio"] = r.ratio
            out[f"decode_{b}_tokens_per_s"] = r.extra["tokens_per_s"]
            if "decode_step_kernels" in r.extra:
                out[f"decode_{b}_kernels_per_step"] = r.extra["decode_step_kernels"]
                out[f"decode_{b}_launch_calls_per_step"] = r.extra["decode_step_launch_calls"]
        elif r.case.startswith("prefill"):
            out["prefill_tokens_per_s"] = r.extra["tokens_per_s"]
            out["prefill_invariance_ratio"] = r.ratio
        elif "invariance cost" in r.case:
            out["decode_B=64_invariance_ratio"] = r.ratio
        elif r.anchor == "step-by-step":
            out["decode_B=64_overlap_vs_step_by_step"] = r.ratio
        elif r.anchor == "flashinfer attention":
            out["decode_B=64_fast_rlperf_attention_vs_flashinfer"] = r.ratio
        elif r.anchor == "transformers compiled":
            out[f"decode_{r.case.split()[1]}_vs_transformers"] = r.ratio
    return out
