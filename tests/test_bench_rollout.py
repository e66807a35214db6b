"""The rollout benchmark's (``rlperf bench rollout``) measuring logic, on the tiny model on CPU (the
timings themselves mean nothing here)."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.bench.harness import BenchRow
from rlperf.bench.rollout import (decode_case, floor_ms, prefill_case, read_sglang_decode_ms, sglang_decode_ms,
                                  sglang_mem_fraction, summarize, transformers_decode_ms)
from rlperf.model import preset
from rlperf.rollout.flashinfer_attention import FlashInferUnavailable
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
        with pytest.raises(FlashInferUnavailable, match="runs on CUDA devices"):  # the anchor row then says so
            decode_case(model, batch=3, prompt_len=20, new_tokens=12, steps=4, warmup=2, graph_bs=4,
                        attention_backend="flashinfer")
    fl, nbytes = floor_ms(model, 3, 25.0, bandwidth=1e9)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert nbytes == weights + 3 * 25.0 * bytes_per_token(model.cfg, torch.float32) and fl == nbytes / 1e9 * 1e3


def test_summarize_names_the_targets():
    rows = [BenchRow("rollout", "decode B=64 prompt 512", "engine step", 2.0, "memory floor", 1.5, extra={"tokens_per_s": 32000.0}),
            BenchRow("rollout", "prefill 16x512", "invariant step", 10.0, "fast step", 8.0, extra={"tokens_per_s": 819200.0}),
            BenchRow("rollout", "decode B=64 invariance cost", "invariant step", 2.0, "fast step", 3.0),
            BenchRow("rollout", "decode B=64 fast mode attention", "rlperf kernel", 2.0, "flashinfer attention", 2.4),
            BenchRow("rollout", "decode B=64 prompt 512", "engine step", 2.0, "transformers compiled", 5.0),
            BenchRow("rollout", "decode B=64 prompt 512", "engine step", 2.0, "sglang fast", 1.8),
            BenchRow("rollout", "decode B=64 prompt 512", "engine step", 2.0, "sglang deterministic", 4.0)]
    s = summarize(rows)
    assert s["decode_B=64_vs_transformers"] == 2.5
    assert s["decode_B=64_vs_sglang_fast"] == 0.9 and s["decode_B=64_vs_sglang_deterministic"] == 2.0
    assert s["decode_B=64_floor_ratio"] == 0.75 and s["decode_B=64_tokens_per_s"] == 32000.0
    assert s["prefill_invariance_ratio"] == 0.8 and s["decode_B=64_invariance_ratio"] == 1.5
    assert s["decode_B=64_fast_rlperf_attention_vs_flashinfer"] == 1.2


def test_the_transformers_anchor_times_decode_steps_of_its_own_qwen3(one_thread):
    """The anchor builds transformers' Qwen3 from rlperf's config and its generations run on CPU
    (eager: compilation is the GPU run's business) with the token counts asked for (it raises
    otherwise); the per-step time is a finite number (its sign is the CPU's load, not a property)."""
    import math

    ms = transformers_decode_ms(preset("tiny"), batch=2, prompt_len=8, steps=4, device="cpu", compile=False, reps=1)
    assert math.isfinite(ms)


FAKE_SGLANG = __import__("pathlib").Path(__file__).parent / "loop" / "fake_sglang"


def test_the_sglang_anchor_runs_bench_one_batch_on_the_same_shape(monkeypatch):
    """The SGLang anchor through a real process (``python -m sglang.bench_one_batch`` resolves to the
    stand-in in tests/loop/fake_sglang, which loads the model folder's tokenizer with transformers and
    writes SGLang's result lines): every batch's median decode step comes back in ms, the deterministic
    flag reaches it; a failed run and a skipped batch are errors that quote it."""
    import os

    import pytest

    pytest.importorskip("sglang")  # the anchor looks for the package before it starts anything
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SGLANG), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("FAKE_SGLANG_FAIL", raising=False)
    cfg = preset("tiny")
    fast = sglang_decode_ms(cfg, (1, 16, 64), prompt_len=24, new_tokens=5)
    assert fast == pytest.approx({1: 1 + 1 / 64, 16: 1.25, 64: 2.0})
    det = sglang_decode_ms(cfg, (1, 64), prompt_len=24, new_tokens=5, extra=["--enable-deterministic-inference"])
    assert det == pytest.approx({1: 3 * (1 + 1 / 64), 64: 6.0})
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "exit")
    with pytest.raises(RuntimeError, match="exited 1: .*out of memory"):
        sglang_decode_ms(cfg, (1,), prompt_len=24, new_tokens=5)
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "skip")
    with pytest.raises(RuntimeError, match=r"measured no batch \[64\]"):
        sglang_decode_ms(cfg, (1, 64), prompt_len=24, new_tokens=5)


def test_a_failed_anchor_process_is_named_by_its_error_line():
    from rlperf.bench.rollout import failure_line

    out = ("loading weights\nTraceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of "
           "memory. Tried to allocate 20.00 MiB.\n32.54 MiB is reserved by PyTorch but unallocated. If reserved\n")
    assert failure_line(out).startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB")
    assert failure_line("a\nb\n") == "a\nb"  # no error line: the tail


def test_an_anchor_that_did_not_run_is_one_short_table_cell():
    from rlperf.bench.run import UNAVAILABLE_CHARS, _markdown_section

    rows = [BenchRow("rollout", "decode B=1", "engine step", 2.5, "sglang fast", float("nan"),
                     extra={"anchor_unavailable": "RuntimeError: a | b\n" + "x" * 400})]
    section = _markdown_section("rollout", rows, {}, {})
    line = next(ln for ln in section.splitlines() if ln.startswith("| decode B=1"))
    assert "did not run: RuntimeError: a \\| b x" in line and "\n" not in line
    cell = line.split(" | ")[3]
    assert len(cell) <= len("sglang fast (did not run: )") + UNAVAILABLE_CHARS + 2 and cell.endswith("...)")
    assert line.endswith("| nan | nan | - | - |")  # no work measure: no rates


def test_sglangs_static_budget_is_a_share_of_the_free_memory():
    gib = 1 << 30
    assert sglang_mem_fraction(80 * gib, 80 * gib) == 0.8  # an empty GPU
    assert sglang_mem_fraction(40 * gib, 80 * gib) == 0.4  # half held by this process
    assert sglang_mem_fraction(int(79.2 * gib), 80 * gib) == 0.79  # rounded down
    with pytest.raises(ValueError, match="free 0 of"):
        sglang_mem_fraction(0, 80 * gib)


def test_sglang_results_of_another_shape_or_a_broken_line_are_not_read_as_this_one(tmp_path):
    import json

    import pytest

    f = tmp_path / "result.jsonl"
    row = {"batch_size": 4, "input_len": 512, "output_len": 256, "median_decode_latency": 0.002}
    f.write_text(json.dumps(row) + "\n" + json.dumps({**row, "batch_size": 8, "output_len": 32}) + "\n\n")
    assert read_sglang_decode_ms(f, 512, 256) == {4: 2.0}
    with pytest.raises(ValueError, match="holds no result for input 512, output 64"):
        read_sglang_decode_ms(f, 512, 64)
    f.write_text(json.dumps(row) + "\n" + '{"batch_size": 4, "input_len": 512}\n')
    with pytest.raises(ValueError, match="result.jsonl:2: not a bench_one_batch result"):
        read_sglang_decode_ms(f, 512, 256)
