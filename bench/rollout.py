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
* **prefill**: one step that prefills 16 x 512 prompt tokens; anchor: the same step in fast mode.
* **invariance cost**: the batch-64 decode step in invariant mode vs fast mode, both replayed from
  CUDA graphs (fast mode: cuBLAS matmuls; decode attention is rlperf's kernel in both modes).
* **fast mode attention**: the batch-64 fast-mode decode step with rlperf's attention kernel vs the
  same step with FlashInfer's (``--attention-backend flashinfer``), both graphed. Ratio > 1: rlperf's
  kernel is faster.
* **against transformers** (the full run only): the same decode shapes on transformers' own
  ``Qwen3ForCausalLM`` (same config, bf16, random weights), greedy ``generate`` with a static KV cache,
  whose decoding forward transformers compiles (``torch.compile``, CUDA graphs): a decode step's time
  is the difference of two generations' wall times over the difference of their new tokens (the
  prefill and compilation cancel). Ratio > 1: rlperf's engine step is faster. An anchor that cannot
  run on this transformers/torch is recorded with the reason, not dropped.
* **against real SGLang** (the full run only): the same decode shapes on SGLang's own engine
  (:func:`sglang_decode_ms`: ``python -m sglang.bench_one_batch`` on the same model shape, dummy weights,
  its default CUDA graphs and FlashInfer attention; the median decode step of ``NEW`` steps after a
  prompt of ``PROMPT``), once in SGLang's default fast mode and once with
  ``--enable-deterministic-inference``. Ratio >= 1: rlperf's invariant engine step is no slower than
  SGLang's. Without SGLang (or when it fails) the rows stay, with the reason.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlperf import kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.kv_cache import bytes_per_token
from rlperf.rollout.tokenizer import ByteTokenizer

from .harness import BenchRow, cuda_time, format_launches, launch_fields, measure_launches

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
                    attention_backend: str = "rlperf") -> Engine:
    """An engine whose ``batch`` requests (byte prompts of ``prompt_len``) are all decoding: prefilled
    until each has its first token, then ``warmup`` decode steps (graph capture and kernel compilation
    stay out of what the caller times). ``attention_backend``: ``EngineConfig.attention_backend``
    (``flashinfer``: FlashInfer's attention in fast mode; FlashInferUnavailable where it cannot run)."""
    P = K.PAGE_SIZE
    cfg = EngineConfig(max_running_requests=batch, chunked_prefill_size=max(8192, prompt_len),
                       max_total_tokens=batch * (-(-(prompt_len + new_tokens) // P) * P), cuda_graph_max_bs=graph_bs,
                       attention_backend=attention_backend)
    engine = Engine(model, ByteTokenizer(model.cfg.vocab_size), cfg)
    _requests(engine, batch, prompt_len, new_tokens)
    while any(not r.output_ids for r in engine.requests.values()) or engine.waiting:
        engine.step()
    for _ in range(warmup):
        engine.step()
    return engine


def decode_case(model, batch: int, prompt_len: int, new_tokens: int, steps: int, graph_bs: int = 0,
                warmup: int = 3, attention_backend: str = "rlperf") -> dict:
    """Mean wall ms of a decode step of ``batch`` sequences, the mean cached tokens per sequence, and
    the kernel launches of one more decode step after the timed ones (:func:`measure_launches`: None
    without CUDA)."""
    if steps + warmup + 2 > new_tokens:
        raise ValueError(f"{steps} timed + {warmup} warm-up steps + 1 counted step need more than {new_tokens} "
                         f"new tokens")
    engine = decoding_engine(model, batch, prompt_len, new_tokens, graph_bs, warmup, attention_backend)
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


def prefill_case(model, batch: int, prompt_len: int, reps: int) -> float:
    """Median wall ms of one engine step that prefills ``batch`` prompts of ``prompt_len`` tokens."""
    times = []
    for rep in range(reps + 1):
        engine = Engine(model, ByteTokenizer(model.cfg.vocab_size),
                        EngineConfig(max_running_requests=batch, chunked_prefill_size=batch * prompt_len,
                                     max_total_tokens=batch * (prompt_len + K.PAGE_SIZE)))
        _requests(engine, batch, prompt_len, 2, seed=rep)
        _sync(model.device)
        t0 = time.perf_counter()
        engine.step()
        _sync(model.device)
        if rep:  # the first one compiles
            times.append((time.perf_counter() - t0) * 1e3)
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


SGLANG_MODES = {"sglang fast": [], "sglang deterministic": ["--enable-deterministic-inference"]}
"""The SGLang anchors' names and the flags that make each (``rlperf bench rollout``, full run)."""
SGLANG_BENCH_MODULE = "sglang.bench_one_batch"


def sglang_bench_argv(model_dir, batches, prompt_len: int, new_tokens: int, result_file, *,
                      attention_backend: str = "flashinfer", extra=()) -> list[str]:
    """The command of one SGLang decode measurement: ``python -m sglang.bench_one_batch`` on the model
    shape in ``model_dir`` (its ``config.json``; dummy weights, no tokenizer), every batch of ``batches``
    with ``prompt_len`` prompt and ``new_tokens`` new tokens; results appended to ``result_file``."""
    return [sys.executable, "-m", SGLANG_BENCH_MODULE, "--model-path", str(model_dir), "--load-format", "dummy",
            "--batch-size", *map(str, batches), "--input-len", str(prompt_len),
            "--output-len", str(new_tokens), "--attention-backend", attention_backend,
            "--result-filename", str(result_file), *extra]


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


def read_sglang_decode_ms(result_file, prompt_len: int, new_tokens: int) -> dict[int, float]:
    """``{batch: median decode step ms}`` from the JSON lines ``sglang.bench_one_batch`` appends to its
    ``--result-filename`` (``batch_size``, ``input_len``, ``output_len``, ``median_decode_latency`` in
    seconds); lines of other shapes are ignored. ValueError when the file holds none of this shape."""
    out = {}
    for n, line in enumerate(Path(result_file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if (r["input_len"], r["output_len"]) == (prompt_len, new_tokens):
                out[int(r["batch_size"])] = float(r["median_decode_latency"]) * 1e3
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{result_file}:{n}: not a bench_one_batch result ({type(e).__name__}: {e})") from None
    if not out:
        raise ValueError(f"{result_file} holds no result for input {prompt_len}, output {new_tokens}")
    return out


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


def sglang_decode_ms(cfg, batches, prompt_len: int, new_tokens: int, *, extra=(), attention_backend: str = "flashinfer",
                     timeout: float = 900.0) -> dict[int, float]:
    """Median decode step ms of real SGLang per batch (module docstring, "against real SGLang"): the
    model shape ``cfg`` written by :func:`write_bench_model` into a temporary folder, one
    :func:`sglang_bench_argv` process; on CUDA its ``--mem-fraction-static`` sized to the GPU's free
    memory (:func:`sglang_mem_fraction`) unless ``extra`` names one. RuntimeError naming the cause
    (SGLang missing, the process's exit and its error line (:func:`failure_line`), a batch it skipped)."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("sglang is not installed (bench/pack_sglang.sh packs it for the GPU machines)")
    extra = list(extra)
    if torch.cuda.is_available() and "--mem-fraction-static" not in extra:
        gc.collect()
        torch.cuda.empty_cache()
        extra += ["--mem-fraction-static", f"{sglang_mem_fraction(*torch.cuda.mem_get_info()):g}"]
    with tempfile.TemporaryDirectory(prefix="rlperf-sglang-") as tmp:
        model_dir, result = write_bench_model(cfg, Path(tmp, "model")), Path(tmp, "result.jsonl")
        argv = sglang_bench_argv(model_dir, batches, prompt_len, new_tokens, result,
                                 attention_backend=attention_backend, extra=extra)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{SGLANG_BENCH_MODULE} did not finish within {timeout:g} s") from None
        tail = (proc.stdout + proc.stderr)[-600:].strip()
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"{SGLANG_BENCH_MODULE} exited {proc.returncode}: {failure_line(proc.stdout + proc.stderr)}")
        got = read_sglang_decode_ms(result, prompt_len, new_tokens)
    missing = [b for b in batches if b not in got]
    if missing:
        raise RuntimeError(f"{SGLANG_BENCH_MODULE} measured no batch {missing} (beyond its memory?): {tail}")
    return got


def run(quick: bool = False) -> list:
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
        pre_inv = prefill_case(model, 16, PROMPT, reps=2 if quick else 5)
        inv64 = decode_case(model, 64, PROMPT, NEW, steps, graph_bs=64)
    with K.use_mode("fast"):
        pre_fast = prefill_case(model, 16, PROMPT, reps=2 if quick else 5)
        fast64 = decode_case(model, 64, PROMPT, NEW, steps, graph_bs=64)
        try:  # the engine's fast mode with FlashInfer's attention (rlperf serve --attention-backend flashinfer)
            fi64, fi_extra = decode_case(model, 64, PROMPT, NEW, steps, graph_bs=64, attention_backend="flashinfer"), {}
        except Exception as e:  # an anchor that cannot run here is recorded, not dropped
            fi64, fi_extra = {"ms": float("nan")}, {"anchor_unavailable": f"{type(e).__name__}: {str(e)[:200]}"}
    flops = 2 * 16 * PROMPT * sum(p.numel() for p in model.parameters())
    rows.append(BenchRow("rollout", f"prefill 16x{PROMPT}", "invariant step", pre_inv, "fast step", pre_fast, work=flops,
                         extra={"tokens_per_s": 16 * PROMPT / pre_inv * 1e3}))
    rows.append(BenchRow("rollout", "decode B=64 invariance cost", "invariant step", inv64["ms"], "fast step", fast64["ms"],
                         work=0.0, extra={"graph": inv64["graph"], "graph_fast": fast64["graph"]}))
    rows.append(BenchRow("rollout", "decode B=64 fast mode attention", "rlperf kernel", fast64["ms"],
                         "flashinfer attention", fi64["ms"], work=0.0, extra=fi_extra))
    if not quick:
        ours = {r.case: r for r in rows if r.anchor == "memory floor"}
        for b in batches:
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
        for anchor, flags in SGLANG_MODES.items():
            try:
                sgl, why = sglang_decode_ms(cfg, batches, PROMPT, NEW, extra=flags), None
            except Exception as e:  # an anchor that cannot run here is recorded, not dropped
                sgl, why = {}, f"{type(e).__name__}: {str(e)[:300]}"
            for b in batches:
                case = f"decode B={b} prompt {PROMPT}"
                extra = {"anchor_unavailable": why} if why else {}
                rows.append(BenchRow("rollout", case, "engine step", ours[case].kernel_ms, anchor,
                                     sgl.get(b, float("nan")), work=0.0, extra=extra))
                print(f"rollout: decode B={b}: {anchor} " + (f"{sgl[b]:.3f} ms" if b in sgl else f"unavailable ({why})")
                      + f", rlperf {ours[case].kernel_ms:.3f} ms")
    return rows


def summarize(rows) -> dict:
    out = {}
    for r in rows:
        if r.case.startswith("decode B=") and r.anchor == "memory floor":
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
        elif r.anchor == "flashinfer attention":
            out["decode_B=64_fast_rlperf_attention_vs_flashinfer"] = r.ratio
        elif r.anchor == "transformers compiled":
            out[f"decode_{r.case.split()[1]}_vs_transformers"] = r.ratio
        elif r.anchor in SGLANG_MODES:
            out[f"decode_{r.case.split()[1]}_vs_{r.anchor.replace(' ', '_')}"] = r.ratio
    return out
