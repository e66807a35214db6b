"""The loop benchmark's (``rlperf bench loop``) pieces on CPU: the FLOP count, the synthetic loop run
in-process on the tiny model, the engine-alone anchor on the same samples, and the rows' structure.
The timings mean nothing here; ``rlperf bench loop`` refuses to run without a GPU."""
import math

import pytest
import torch

import rlperf.kernels as K
from rlperf.bench import loop as L
from rlperf.bench.run import BENCHES
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM


def test_matmul_params_are_the_model_weights_that_multiply_tokens():
    cfg = preset("tiny")
    model = Qwen3ForCausalLM.random(cfg, seed=0)
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if cfg.tie_word_embeddings:  # the lm-head multiplies by the embedding table
        matrices += cfg.vocab_size * cfg.hidden_size
    assert L.matmul_params(cfg) == matrices


def test_train_flops_is_6nt_plus_causal_attention():
    cfg = preset("qwen3-0.6b")
    N = L.matmul_params(cfg)
    assert 0.55e9 < N < 0.8e9  # 0.6b: ~0.44b in the layers + 0.16b lm-head
    one = L.train_flops(cfg, [100])
    attn = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 100 ** 2
    assert one == 6 * N * 100 + attn
    # linear in tokens, quadratic in each sequence's length: two halves cost less attention than the whole
    assert L.train_flops(cfg, [50, 50]) == 6 * N * 100 + attn / 2
    assert L.train_flops(cfg, []) == 0


def test_rows_put_each_phase_next_to_its_anchor():
    cfg = preset("tiny")
    hist = [{"perf/rollout_time": 9.0, "perf/train_time": 9.0, "perf/step_time": 20.0, "perf/tokens_per_sec": 1.0},
            {"perf/rollout_time": 2.0, "perf/train_time": 1.5, "perf/log_prob_time": 0.5, "perf/update_weights_time": 0.1,
             "perf/step_time": 4.0, "perf/tokens_per_sec": 250.0}]
    m = {"history": hist, "seq_lens": [300, 200], "response_tokens": 400, "anchor": {"seconds": 1.0, "tokens": 380},
         "cfg": cfg, "case": "2 samples x 256 tokens, tiny"}
    peak = 1e15
    rows = L.rows_from(m, peak)
    assert [r.kernel for r in rows] == ["loop rollout phase", "loop train phase", "loop step"]
    assert all(r.bench == "loop" for r in rows)
    rollout, train, step = rows
    assert rollout.kernel_ms == 2000.0 and rollout.anchor_ms == 1000.0 and rollout.ratio == 0.5  # the last rollout
    assert rollout.extra["tokens_per_s"] == 200.0 and rollout.extra["anchor_tokens_per_s"] == 380.0
    flops = L.train_flops(cfg, [300, 200])
    assert train.kernel_ms == 1000.0 and train.work == flops  # train phase = train time minus log-prob passes
    assert math.isclose(train.ratio, flops / peak / 1.0) and math.isclose(train.extra["mfu"], train.ratio)
    assert math.isclose(train.rate(train.anchor_ms), peak / 1e12)  # the anchor runs at the measured peak
    assert step.kernel_ms == 4000.0 and math.isclose(step.anchor_ms, 3600.0) and step.extra["rollouts"] == 2
    s = L.summarize(rows)
    assert s["rollout_vs_engine_ratio"] == 0.5 and s["step_s"] == 4.0 and s["tokens_per_s"] == 250.0
    assert math.isclose(s["train_mfu"], train.ratio) and math.isclose(s["step_phase_share"], 0.9)


def test_registered_and_gpu_only(monkeypatch):
    assert BENCHES["loop"] == "rlperf.bench.loop"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):
        L.run(quick=True)


def test_the_synthetic_loop_and_its_anchor_run_on_the_tiny_model(tmp_path, one_thread):
    """``measure`` end to end on CPU: the loop runs in this process, and the engine alone generates
    the last rollout's samples (same prompts, seeds, lengths) with serve's settings."""
    data = L.write_synthetic_prompts(tmp_path / "synthetic.jsonl", n=8)
    flags = L.loop_flags(data, tmp_path / "run", model="tiny", device="cpu", prompts=2, samples_per_prompt=2,
                         response_len=6, num_rollout=2)
    m = L.measure(flags + ["--kernel-backend", "reference"])
    assert [h["rollout_id"] for h in m["history"]] == [0, 1]
    assert len(m["seq_lens"]) == 4 and m["anchor"]["seconds"] > 0
    # the same requests: a random tiny model stops rarely, so both generate close to 4 x 6 tokens
    assert 0 < m["anchor"]["tokens"] <= 24 and 0 < m["response_tokens"] <= 24
    rows = L.rows_from(m, peak_flops=1e12)
    assert len(rows) == 3 and all(r.kernel_ms > 0 and r.anchor_ms > 0 for r in rows)


def test_engine_alone_gives_the_loop_engines_tokens_for_the_same_weights(one_thread):
    """The anchor generates what the loop's engine generates from the same requests (seeds per sample)."""
    from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
    from rlperf.rollout.tokenizer import ByteTokenizer

    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    tok = ByteTokenizer(model.cfg.vocab_size)
    prompts = [[1, 2, 3], list(range(5, 30))]
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=s) for s in (3, 4)]
    with K.use_backend("reference"):
        got = L.engine_alone(model, tok, prompts, params, max_total_tokens=1024)
        want = Engine(model, tok, EngineConfig(max_total_tokens=1024)).generate(prompts, params)
    assert got["tokens"] == sum(len(r.output_ids) for r in want) and got["seconds"] > 0


def test_launches_per_micro_step_go_into_the_train_row_and_the_summary():
    from rlperf.bench.harness import LaunchCount

    cfg = preset("tiny")
    hist = [{"perf/rollout_time": 2.0, "perf/train_time": 1.5, "perf/log_prob_time": 0.5, "perf/step_time": 4.0,
             "perf/tokens_per_sec": 250.0}]
    m = {"history": hist, "seq_lens": [300, 200], "response_tokens": 400, "anchor": {"seconds": 1.0, "tokens": 380},
         "cfg": cfg, "case": "2 samples x 256 tokens, tiny",
         "launches": {"micro_step": LaunchCount(950, 948), "log_prob": LaunchCount(330, 1), "micro_batch_tokens": 500}}
    train = L.rows_from(m, 1e15)[1]
    assert train.extra["micro_step_kernels"] == 950 and train.extra["micro_step_launch_calls"] == 948
    assert train.extra["log_prob_pass_kernels"] == 330 and train.extra["log_prob_pass_launch_calls"] == 1
    assert train.extra["micro_batch_tokens"] == 500
    s = L.summarize(L.rows_from(m, 1e15))
    assert s["micro_step_kernels"] == 950 and s["log_prob_pass_launch_calls"] == 1
    m["launches"] = {"micro_step": None, "log_prob": None, "micro_batch_tokens": 500}  # no CUDA: nothing counted
    assert L.summarize(L.rows_from(m, 1e15))["micro_step_kernels"] == "n/a"
