"""The rollout benchmark's (``rlperf bench rollout``) measuring logic, on the tiny model on CPU (the
timings themselves mean nothing here)."""
import torch

import rlperf.kernels as K
from rlperf.bench.harness import BenchRow
from rlperf.bench.rollout import decode_case, floor_ms, prefill_case, summarize, transformers_decode_ms
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.kv_cache import bytes_per_token


def test_decode_and_prefill_cases_run_the_engine_as_described(one_thread):
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    with K.use_backend("reference"):
        d = decode_case(model, batch=3, prompt_len=20, new_tokens=12, steps=4, warmup=2, graph_bs=4)
        assert d["ms"] > 0 and not d["graph"]  # CPU: the padded path runs, nothing is captured
        # 20 prompt tokens cached by the prefill, +1 per warm-up step; timed step k reads 22 + k tokens
        assert d["kv_mean"] == 20 + 2 + (4 + 1) / 2
        assert prefill_case(model, batch=2, prompt_len=16, reps=1) > 0
    fl, nbytes = floor_ms(model, 3, 25.0, bandwidth=1e9)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert nbytes == weights + 3 * 25.0 * bytes_per_token(model.cfg, torch.float32) and fl == nbytes / 1e9 * 1e3


def test_summarize_names_the_targets():
    rows = [BenchRow("rollout", "decode B=64 prompt 512", "engine step", 2.0, "memory floor", 1.5, extra={"tokens_per_s": 32000.0}),
            BenchRow("rollout", "prefill 16x512", "invariant step", 10.0, "fast step", 8.0, extra={"tokens_per_s": 819200.0}),
            BenchRow("rollout", "decode B=64 invariance cost", "invariant step", 2.0, "fast step", 3.0),
            BenchRow("rollout", "decode B=64 prompt 512", "engine step", 2.0, "transformers compiled", 5.0)]
    s = summarize(rows)
    assert s["decode_B=64_vs_transformers"] == 2.5
    assert s["decode_B=64_floor_ratio"] == 0.75 and s["decode_B=64_tokens_per_s"] == 32000.0
    assert s["prefill_invariance_ratio"] == 0.8 and s["decode_B=64_invariance_ratio"] == 1.5


def test_the_transformers_anchor_times_decode_steps_of_its_own_qwen3(one_thread):
    """The anchor builds transformers' Qwen3 from rlperf's config and its generations run on CPU
    (eager: compilation is the GPU run's business) with the token counts asked for (it raises
    otherwise); the per-step time is a finite number (its sign is the CPU's load, not a property)."""
    import math

    ms = transformers_decode_ms(preset("tiny"), batch=2, prompt_len=8, steps=4, device="cpu", compile=False, reps=1)
    assert math.isfinite(ms)
