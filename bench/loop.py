"""Loop benchmark: the synthetic RL loop's step split, each phase next to its anchor from the same run.

A benchmark module in the ``rlperf bench`` protocol (``run(quick) -> list[BenchRow]``,
``summarize(rows) -> dict``), run as ``rlperf bench loop``. The loop is ``bench/device_e2e.sh``'s
``synthetic`` stage, run in this process through :class:`rlperf.loop.Run` (what ``rlperf train``
runs after its gates): qwen3-0.6b shape at random init, 8 prompts x 4 samples = 32 samples of up to
256 response tokens (a random-init model rarely stops), packed micro-batches, ``--true-on-policy-mode``,
the in-process engine. The first rollout compiles the kernels and captures the graphs, so the rows
describe the **last** rollout (``extra`` also has the mean over every rollout after the first).

Rows (``ratio`` = anchor ms / loop ms, as every row):

* **rollout**: ``perf/rollout_time`` against the **engine alone** generating the same samples (the
  last rollout's prompt ids, per-sample seeds and sampling parameters) in a fresh
  :class:`rlperf.rollout.engine.Engine` with ``rlperf serve``'s settings (its default
  :class:`EngineConfig`, CUDA graphs up to serve's default batch size, warmed up as serve warms up)
  over the loop engine's weights after the run. A ratio well below 1 is loop overhead around the
  engine. The weights moved by one update, so response lengths may differ slightly: ``extra`` has
  both token counts and both tokens/s.
* **train**: forward + backward + optimizer (``perf/train_time`` minus ``perf/log_prob_time``)
  against the time the **bf16 matmul peak** would need for the model FLOPs of the step,
  :func:`train_flops` (``6 N T`` + causal attention). The ratio is the MFU; the peak is cuBLAS's
  rate on an 8192^3 bf16 ``torch.matmul`` measured in the same run (:func:`matmul_peak`).
  ``extra`` (and the summary) also has the **launches per train micro-step** and per log-prob pass
  (:func:`train_launches`: kernels the GPU ran and launch calls the host made, a graph replay
  being one call), so a regression in host overhead shows.
* **step**: ``perf/step_time`` against the sum of its phases (rollout + log-prob + train + weight
  sync): the ratio is the share of the step the phases account for (1 - ratio: loop overhead);
  ``extra`` has the split and ``perf/tokens_per_sec``.
"""
from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch

from .harness import BenchRow, cuda_time, format_launches, launch_fields, measure_launches

MODEL = "qwen3-0.6b"
PROMPTS, SAMPLES_PER_PROMPT, RESPONSE_LEN = 8, 4, 256
WORDS = ("alpha", "beta", "gamma", "delta", "sigma", "omega", "tensor", "kernel", "policy", "reward")
PEAK_SIZE = 8192


def write_synthetic_prompts(path: Path, n: int = 64, seed: int = 0) -> Path:
    """``device_e2e.sh``'s synthetic prompt file: ``n`` records of 12 random words, label ``A``."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input": " ".join(rng.choice(WORDS) for _ in range(12)), "label": "A"}) + "\n")
    return path


def loop_flags(prompt_data: Path, output_dir: Path, *, model: str = MODEL, device: str = "cuda",
               prompts: int = PROMPTS, samples_per_prompt: int = SAMPLES_PER_PROMPT,
               response_len: int = RESPONSE_LEN, num_rollout: int = 3,
               cuda_graph_buckets: tuple[int, ...] | str = ()) -> list[str]:
    """``rlperf train`` flags of the synthetic loop (``device_e2e.sh``'s ``synthetic`` stage) with
    ``--cuda-graph-buckets``: ``()`` eager (``none``: this benchmark's default, the anchor a graphed run
    is compared with, although ``rlperf train``'s own default graphs these micro-steps), ``"auto"``
    ``rlperf train``'s default, or the token counts (graphed log-prob passes and micro-steps)."""
    graphs = (cuda_graph_buckets if isinstance(cuda_graph_buckets, str)
              else ",".join(map(str, cuda_graph_buckets)) or "none")
    return ["--cuda-graph-buckets", graphs] + ["--model", model, "--device", device, "--prompt-data", str(prompt_data), "--rm-type", "exact",
            "--rollout-batch-size", str(prompts), "--n-samples-per-prompt", str(samples_per_prompt),
            "--global-batch-size", str(prompts * samples_per_prompt), "--rollout-max-response-len", str(response_len),
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
            "--true-on-policy-mode", "--lr", "1e-6", "--num-rollout", str(num_rollout), "--no-progress",
            "--output-dir", str(output_dir)]


def matmul_params(cfg) -> int:
    """Weights that multiply every token: attention and MLP projections of every layer plus the
    lm-head (the embedding lookup multiplies nothing; norms are negligible)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer + h * cfg.vocab_size


def train_flops(cfg, seq_lens: list[int]) -> float:
    """Model FLOPs of forward + backward over sequences of ``seq_lens`` tokens:
    ``6 N T`` (:func:`matmul_params` N, T = sum of lengths) plus causal attention, ``QK^T`` and
    ``PV`` over the lower triangle: ``2 * 2 L^2 H D / 2`` forward per layer, times 3 with backward."""
    tokens = sum(seq_lens)
    attention = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * sum(L * L for L in seq_lens)
    return 6.0 * matmul_params(cfg) * tokens + attention


def matmul_peak(n: int = PEAK_SIZE) -> float:
    """cuBLAS bf16 matmul rate in FLOP/s: ``2 n^3 / t`` of an ``n x n @ n x n`` ``torch.matmul``."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = cuda_time(lambda: torch.matmul(a, b), warmup=5, reps=30, flush_l2=False)
    return 2 * n ** 3 / (t.median_ms * 1e-3)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def engine_alone(model, tokenizer, prompts: list[list[int]], params: list, max_total_tokens: int) -> dict:
    """Wall time of a fresh engine with ``rlperf serve``'s settings generating ``prompts`` (after
    serve's warm-up, which stays out of the time); seconds and response tokens.

    ``max_total_tokens``: the loop engine's KV-cache size, so both engines admit and retract alike
    (a cache sized to the bare need makes the anchor retract and re-prefill, which the loop never does)."""
    from rlperf.rollout.cuda_graph import default_max_bs
    from rlperf.rollout.engine import Engine, EngineConfig
    from rlperf.rollout.server import warmup_prompt_lengths

    engine = Engine(model, tokenizer, EngineConfig(max_total_tokens=max_total_tokens,
                                                   cuda_graph_max_bs=default_max_bs(model.device)))
    engine.warm_up(warmup_prompt_lengths(model.device))
    _sync(model.device)
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    _sync(model.device)
    return {"seconds": time.perf_counter() - t0, "tokens": sum(len(r.output_ids) for r in results)}


def last_rollout_requests(ns, samples) -> tuple[list[list[int]], list]:
    """The prompt ids and sampling parameters of ``samples``, rollout ``ns.num_rollout - 1`` (the
    seeds the loop drew: :func:`rlperf.loop.generation.sample_seed`)."""
    from rlperf.loop.generation import sample_seed, sampling_params_for

    k = ns.num_rollout - 1
    prompts = [list(s.tokens[:s.prompt_length]) for s in samples]
    return prompts, [sampling_params_for(ns, sample_seed(ns.seed, k, s.index)) for s in samples]


def train_launches(trainer, samples) -> dict:
    """Kernel launches (:func:`measure_launches`; None without CUDA) of one **train micro-step**
    (forward with grad, policy loss, backward, the float32 master-gradient accumulation) and one
    **log-prob pass** (forward without grad: what ``prepare`` runs per micro-batch) on the first
    micro-batch of the prepared ``samples``, each after one warm-up call; the gradients they leave
    are cleared. ``micro_batch_tokens``: that micro-batch's token count."""
    mb = trainer.micro_batches(samples)[0]
    with_rollout = trainer._check_prepared(samples)
    denom = trainer._loss_denominator(samples)

    def micro_step():
        trainer._micro_step(samples, mb, denom, with_rollout)
        trainer._accumulate_master_grads()

    def log_prob_pass():
        with torch.no_grad():
            trainer.forward_log_probs(mb)

    trainer._zero_grads()
    out = {"micro_step": measure_launches(micro_step), "log_prob": measure_launches(log_prob_pass),
           "micro_batch_tokens": mb.num_tokens}
    trainer._zero_grads()
    return out


def measure(flags: list[str]) -> dict:
    """Run the loop of ``flags`` in this process, then the engine alone on its last rollout; the
    metrics lines, the last rollout's sequence lengths and the anchor's measurement."""
    from rlperf.loop import Run, parse_train_args

    ns = parse_train_args(flags)
    run = Run(ns)
    history = run.run()
    samples = run.last_train_samples
    prompts, params = last_rollout_requests(ns, samples)
    engine_model = run.client.model  # the loop engine's weights (after the last sync)
    with run.kernels():
        anchor = engine_alone(engine_model, run.tokenizer, prompts, params, run.client.engine.kv.max_total_tokens)
        launches = train_launches(run.trainer, samples)
    return {"history": history, "launches": launches, "seq_lens": [s.total_length for s in samples],
            "response_tokens": sum(s.response_length for s in samples), "anchor": anchor, "cfg": run.model.cfg,
            "case": f"{len(samples)} samples x {ns.rollout_max_response_len} tokens, {ns.model}"
                    + (f", graphs {','.join(map(str, ns.cuda_graph_buckets))}" if ns.cuda_graph_buckets else "")}


def rows_from(m: dict, peak_flops: float) -> list[BenchRow]:
    """The three rows (module docstring) from :func:`measure`'s result and the measured peak FLOP/s."""
    history, case = m["history"], m["case"]
    last, steady = history[-1], history[1:] or history

    def mean(key):
        vals = [h[key] for h in steady if key in h]
        return sum(vals) / len(vals) if vals else float("nan")

    rollout_s, step_s = last["perf/rollout_time"], last["perf/step_time"]
    log_prob_s = last.get("perf/log_prob_time", 0.0)
    train_s = last["perf/train_time"] - log_prob_s
    sync_s = last.get("perf/update_weights_time", 0.0)
    anchor = m["anchor"]
    flops = train_flops(m["cfg"], m["seq_lens"])
    launches = m.get("launches") or {"micro_step": None, "log_prob": None, "micro_batch_tokens": 0}
    return [
        BenchRow("loop", f"rollout {case}", "loop rollout phase", rollout_s * 1e3, "engine alone (serve settings)",
                 anchor["seconds"] * 1e3, work=0.0,
                 extra={"response_tokens": m["response_tokens"], "anchor_response_tokens": anchor["tokens"],
                        "tokens_per_s": m["response_tokens"] / rollout_s,
                        "anchor_tokens_per_s": anchor["tokens"] / anchor["seconds"],
                        "mean_rollout_s": mean("perf/rollout_time")}),
        BenchRow("loop", f"train fwd+bwd+opt {case}", "loop train phase", train_s * 1e3,
                 f"bf16 matmul peak (cuBLAS {PEAK_SIZE}^3)", flops / peak_flops * 1e3, work=flops,
                 extra={"mfu": flops / peak_flops / train_s, "peak_TFLOPs": peak_flops / 1e12,
                        "tokens": sum(m["seq_lens"]), "log_prob_s": log_prob_s,
                        "micro_batch_tokens": launches["micro_batch_tokens"],
                        **launch_fields("micro_step", launches["micro_step"]),
                        **launch_fields("log_prob_pass", launches["log_prob"]),
                        "mean_train_s": mean("perf/train_time") - mean("perf/log_prob_time")
                        if any("perf/log_prob_time" in h for h in steady) else mean("perf/train_time")}),
        BenchRow("loop", f"step {case}", "loop step", step_s * 1e3, "sum of phases",
                 (rollout_s + last["perf/train_time"] + sync_s) * 1e3, work=0.0,
                 extra={"rollout_s": rollout_s, "log_prob_s": log_prob_s, "train_s": train_s, "sync_ms": sync_s * 1e3,
                        "peak_GiB": max((v for k, v in last.items() if k.startswith("memory/") and k.endswith("_peak_bytes")),
                                        default=0) / 2**30,
                        "abs_diff_max": max(h.get("train/train_rollout_logprob_abs_diff", 0.0) for h in history),
                        "tokens_per_s": last["perf/tokens_per_sec"], "mean_step_s": mean("perf/step_time"),
                        "mean_tokens_per_s": mean("perf/tokens_per_sec"), "rollouts": len(history)}),
    ]


def run(quick: bool = False, cuda_graph_buckets: tuple[int, ...] | str = ()) -> list[BenchRow]:
    """The rows (module docstring); ``cuda_graph_buckets``: ``rlperf bench loop --cuda-graph-buckets``
    (:func:`loop_flags`; default eager)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the loop benchmark needs a CUDA GPU")
    peak = matmul_peak()
    with tempfile.TemporaryDirectory(prefix="rlperf-bench-loop-") as tmp:
        data = write_synthetic_prompts(Path(tmp) / "synthetic.jsonl")
        m = measure(loop_flags(data, Path(tmp) / "run", num_rollout=2 if quick else 4,
                               cuda_graph_buckets=cuda_graph_buckets))
    print(f"loop: train micro-step ({m['launches']['micro_batch_tokens']} tokens): "
          f"{format_launches(m['launches']['micro_step'])}; log-prob pass: {format_launches(m['launches']['log_prob'])}")
    return rows_from(m, peak)


def summarize(rows) -> dict:
    out = {}
    for r in rows:
        if r.kernel == "loop rollout phase":
            out["rollout_vs_engine_ratio"] = r.ratio
            out["rollout_tokens_per_s"] = r.extra["tokens_per_s"]
        elif r.kernel == "loop train phase":
            out["train_mfu"] = r.ratio
            for key in ("micro_step_kernels", "micro_step_launch_calls", "log_prob_pass_kernels",
                        "log_prob_pass_launch_calls"):
                if key in r.extra:
                    out[key] = r.extra[key]
        elif r.kernel == "loop step":
            out["step_s"] = r.kernel_ms / 1e3
            out["step_phase_share"] = r.ratio
            out["peak_GiB"] = r.extra["peak_GiB"]
            out["abs_diff_max"] = r.extra["abs_diff_max"]
            out["tokens_per_s"] = r.extra["tokens_per_s"]
    return out
