"""The rollout benchmark's (``rlperf bench rollout``) measuring logic, on the tiny model on CPU (the
timings themselves mean nothing here)."""
import re

import pytest
import torch

import rlperf.kernels as K
from rlperf.bench.harness import BenchRow
from rlperf.bench.rollout import (decode_case, floor_ms, prefill_case, prefill_engine, queue_prefill,
                                  read_sglang_decode_ms, sglang_decode_ms, sglang_mem_fraction, summarize,
                                  transformers_decode_ms)
from rlperf.model import preset
from rlperf.rollout.flashinfer_attention import FlashInferUnavailable
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.kv_cache import bytes_per_token


def test_decode_and_prefill_cases_run_the_engine_as_described(one_thread):
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    with K.use_backend("reference"):
        d = decode_case(model, batch=3, prompt_len=20, new_tokens=12, steps=4, warmup=2, graph_bs=4)
        assert d["ms"] > 0 and not d["graph"]  # CPU: the padded path runs, nothing is captured
        # 20 prompt tokens cached by the prefill; the first warm-up step also launches the next one
        # ahead (the engine's overlap), so 3 decode forwards are launched by then and timed step k's
        # forward reads 23 + k tokens
        assert d["kv_mean"] == 20 + 3 + (4 + 1) / 2
        off = decode_case(model, batch=3, prompt_len=20, new_tokens=12, steps=4, warmup=2, graph_bs=4,
                          overlap_schedule=False)
        assert off["kv_mean"] == 20 + 2 + (4 + 1) / 2  # one forward per warm-up step
        replayed: list[bool] = []
        assert prefill_case(model, batch=2, prompt_len=16, reps=1, replayed=replayed) > 0
        assert replayed == [False]  # nothing captured on the CPU
        engine = prefill_engine(model, batch=2, prompt_len=16)
        assert engine.prefill_graphs is None  # CPU: prefill graphs are serve's default on CUDA only
        for seed in range(2):  # each queued batch is prefilled whole by one step, the one before aborted
            queue_prefill(engine, 2, 16, seed=seed)
            assert len(engine.waiting) == 2 and not engine.running and engine.kv.num_free_pages == engine.kv.num_pages
            engine.step()
            assert [len(r.output_ids) for r in engine.running] == [1, 1]
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
            BenchRow("rollout", "decode B=64 overlap", "overlapped step", 2.0, "step-by-step", 2.2),
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
    assert s["decode_B=64_overlap_vs_step_by_step"] == pytest.approx(1.1)


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


# --- the SGLang variants (issue #36 item 4): fast, deterministic flashinfer / triton, SGLang + rlperf's plugin ---

def test_each_sglang_variant_builds_its_exact_command():
    import sys

    from rlperf.bench.rollout import sglang_variant_argv

    common = ["--model-path", "M", "--load-format", "dummy", "--batch-size", "16", "1", "64", "256", "--input-len", "512",
              "--output-len", "256"]

    def argv(variant, extra=()):
        return sglang_variant_argv(variant, "M", (16, 1, 64, 256), 512, 256, "R", extra=extra)

    sglang = [sys.executable, "-m", "sglang.bench_one_batch"]
    assert argv("fast") == [*sglang, *common, "--attention-backend", "flashinfer", "--result-filename", "R"]
    assert argv("det-flashinfer") == [*sglang, *common, "--attention-backend", "flashinfer", "--result-filename", "R",
                                      "--enable-deterministic-inference"]
    assert argv("det-triton", ["--mem-fraction-static", "0.8"]) == [
        *sglang, *common, "--attention-backend", "triton", "--result-filename", "R", "--enable-deterministic-inference",
        "--mem-fraction-static", "0.8"]
    # the plugin: SGLang's bench_one_batch loads no plugins, so rlperf's module loads them and then runs it
    assert argv("plugin") == [sys.executable, "-m", "rlperf.bench.sglang_anchor", *common, "--attention-backend",
                              "rlperf", "--result-filename", "R", "--page-size", "128",
                              "--enable-deterministic-inference"]


def test_the_variant_flag_takes_known_names_in_run_order(capsys):
    import argparse

    from rlperf.bench.sglang_anchor import parse_sglang_variants
    from rlperf.cli import main

    assert parse_sglang_variants("plugin, fast,plugin") == ("fast", "plugin")
    assert parse_sglang_variants("all") == ("fast", "det-flashinfer", "det-triton", "plugin")
    assert parse_sglang_variants("none") == ()
    for bad, why in (("", "expected SGLang variants"), ("fast,det", "unknown SGLang variant(s) det: choose from fast, "
                                                                     "det-flashinfer, det-triton, plugin")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(why)):
            parse_sglang_variants(bad)
    with pytest.raises(SystemExit) as e:
        main(["bench", "rollout", "--sglang-variants", "fast,sglang-fast"])
    assert e.value.code == 2
    assert "argument --sglang-variants: unknown SGLang variant(s) sglang-fast" in capsys.readouterr().err
    assert main(["bench", "matmul", "--sglang-variants", "fast"]) == 2
    assert "--sglang-variants goes with the rollout benchmark alone" in capsys.readouterr().err
    assert main(["bench", "rollout", "--quick", "--sglang-variants", "fast"]) == 2
    assert "--quick runs none" in capsys.readouterr().err


def test_the_transformers_anchor_flag_goes_with_the_full_rollout_run_alone(capsys):
    from rlperf.cli import main

    for argv in (["bench", "matmul", "--no-transformers-anchor"], ["bench", "rollout", "--quick", "--no-transformers-anchor"]):
        assert main(argv) == 2
        assert "--no-transformers-anchor goes with the full rollout run alone" in capsys.readouterr().err


def test_rlperfs_plugin_is_found_by_its_entry_point(monkeypatch):
    from importlib.metadata import EntryPoint

    import rlperf.bench.sglang_anchor as sa

    eps = [EntryPoint("other", "other_pkg.plugin:register", "sglang.srt.plugins"),
           EntryPoint("rlperf", "rlperf.sglang_plugin:register", "sglang.srt.plugins")]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [ep for ep in eps if ep.group == group])
    assert sa.rlperf_plugin_entry_points() == ["rlperf"]
    eps.pop()
    assert sa.rlperf_plugin_entry_points() == []


def test_sglang_results_give_decode_and_prefill(tmp_path):
    import json

    from rlperf.bench.rollout import read_sglang_results

    f = tmp_path / "result.jsonl"
    row = {"batch_size": 16, "input_len": 512, "output_len": 256, "prefill_latency": 0.031,
           "median_decode_latency": 0.002}
    f.write_text(json.dumps(row) + "\n" + json.dumps({**row, "batch_size": 1, "prefill_latency": 0.004}) + "\n")
    assert read_sglang_results(f, 512, 256) == {"decode": {16: 2.0, 1: 2.0}, "prefill": {16: 31.0, 1: 4.0}}


def _fake_sglang_env(monkeypatch):
    import os

    pytest.importorskip("sglang")  # the anchor looks for the package before it starts anything
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SGLANG), os.environ.get("PYTHONPATH", "")]))
    for var in ("FAKE_SGLANG_FAIL", "FAKE_SGLANG_FAIL_BACKEND", "FAKE_SGLANG_PLUGIN", "SGLANG_PLUGINS"):
        monkeypatch.delenv(var, raising=False)


def test_every_variant_runs_as_its_own_process_and_a_failed_one_leaves_a_row_saying_why(monkeypatch, capsys, tmp_path):
    """All four variants through real processes (the stand-in SGLang of tests/loop/fake_sglang: decode
    step (1 + B/64) ms, prefill (2 + B/8) ms; x3 deterministic flashinfer, x4 triton, x2 rlperf's backend),
    the triton one out of memory: its rows say so in one line and the others are measured; the plugin's
    rows against the deterministic and fast modes carry the issue's targets; the markdown rows, summary,
    targets and the bench plot take them."""
    import json
    import math

    import rlperf.bench.rollout as ro
    from rlperf.bench.harness import ratio_target, write_json
    from rlperf.bench.run import _markdown_section
    from rlperf.plots.bench import read_bench, write_bench_plot

    _fake_sglang_env(monkeypatch)
    monkeypatch.setenv("FAKE_SGLANG_FAIL_BACKEND", "triton")
    monkeypatch.setenv("FAKE_SGLANG_PLUGIN", "rlperf")  # the stand-in's plugin registers --attention-backend rlperf
    monkeypatch.setattr(ro, "rlperf_plugin_entry_points", lambda: ["rlperf"])
    ours = {1: 2.0, 16: 2.5, 64: 4.0}
    rows = ro.sglang_anchor_rows(preset("tiny"), ("fast", "det-flashinfer", "det-triton", "plugin"), (1, 16, 64),
                                 ours, 10.0, prefill_work=1e9, prompt_len=24, new_tokens=5)
    out = capsys.readouterr().out
    assert "rollout: sglang deterministic triton: did not run" in out and "torch.OutOfMemoryError" in out

    def row(case, kernel, anchor):
        return next(r for r in rows if (r.case, r.kernel, r.anchor) == (case, kernel, anchor))

    fast, det, plugin = (lambda b: 1 + b / 64), (lambda b: 3 * (1 + b / 64)), (lambda b: 2 * (1 + b / 64))
    for b in (1, 16, 64):
        case = f"decode B={b} prompt 24"
        assert row(case, "engine step", "sglang fast").anchor_ms == pytest.approx(fast(b))
        assert row(case, "engine step", "sglang deterministic").anchor_ms == pytest.approx(det(b))
        assert row(case, "engine step", "sglang rlperf plugin").anchor_ms == pytest.approx(plugin(b))
        failed = row(case, "engine step", "sglang deterministic triton")
        assert math.isnan(failed.anchor_ms) and failed.extra["anchor_unavailable"].startswith(
            "RuntimeError: sglang.bench_one_batch exited 1: torch.OutOfMemoryError: CUDA out of memory")
        vs_det, vs_fast = row(case, "sglang rlperf plugin", "sglang deterministic"), row(case, "sglang rlperf plugin",
                                                                                          "sglang fast")
        assert vs_det.ratio == pytest.approx(1.5) and vs_det.extra["target"] == 1.0
        assert vs_fast.ratio == pytest.approx(0.5) and vs_fast.extra["target"] == 0.9
        assert f"rollout: {case}: sglang rlperf plugin {plugin(b):.3f} ms, sglang fast {fast(b):.3f} ms, ratio 0.500 " \
               f"(target >= 0.9: missed)" in out
    pre = row("prefill 16x24", "invariant step", "sglang fast")
    assert pre.anchor_ms == pytest.approx(4.0) and pre.work == 1e9  # the 16-batch's prefill: (2 + 16/8) ms
    assert row("prefill 16x24", "sglang rlperf plugin", "sglang deterministic").ratio == pytest.approx(1.5)
    assert "target" not in row("prefill 16x24", "sglang rlperf plugin", "sglang fast").extra
    assert len(rows) == 4 * 4 + 2 * 4  # every variant: 3 decode rows + prefill; the plugin against 2 anchors

    s = ro.summarize(rows)
    assert s["decode_B=64_vs_sglang_fast"] == pytest.approx(fast(64) / 4.0)
    assert s["plugin_decode_B=64_vs_sglang_deterministic"] == pytest.approx(1.5)
    assert s["plugin_decode_B=1_vs_sglang_fast"] == pytest.approx(0.5)
    assert s["prefill_vs_sglang_rlperf_plugin"] == pytest.approx(0.8)  # (2 x 4 ms) / 10 ms
    assert math.isnan(s["decode_B=16_vs_sglang_deterministic_triton"])

    dicts = [r.to_dict() for r in rows]
    targets = {(d["case"], d["anchor"]): ratio_target(d) for d in dicts if d["kernel"] == "sglang rlperf plugin"}
    assert targets[("decode B=64 prompt 24", "sglang fast")] == 0.9
    assert targets[("decode B=1 prompt 24", "sglang deterministic")] == 1.0
    assert targets[("prefill 16x24", "sglang fast")] is None
    assert ratio_target({"bench": "rollout", "case": "decode B=256 prompt 512", "kernel": "sglang rlperf plugin",
                         "anchor": "sglang fast"}) is None  # >= 0.9x fast mode only at B <= 64
    assert ratio_target({"bench": "rollout", "case": "decode B=256 prompt 512", "kernel": "sglang rlperf plugin",
                         "anchor": "sglang deterministic"}) == 1.0

    section = _markdown_section("rollout", rows, {}, s)
    line = next(ln for ln in section.splitlines() if ln.startswith("| decode B=1 prompt 24 | engine step")
                and "triton" in ln)
    assert "sglang deterministic triton (did not run: RuntimeError: sglang.bench_one_batch exited 1" in line

    path = tmp_path / "bench-rollout.json"
    write_json(path, rows, {"card": "cpu", "commit": "abc"}, {"rollout": s})
    assert len(read_bench(path)["rows"]) == len(rows) and json.loads(path.read_text())["rows"][0]["bench"] == "rollout"
    png = write_bench_plot([path], tmp_path / "bench.png", target=ratio_target, html=False)
    assert png.stat().st_size > 20_000


def test_a_plugin_that_did_not_run_names_why_on_the_plugins_side(monkeypatch, capsys):
    """rlperf's plugin not installed: no process starts, and every row of the plugin says so in one line
    (as the anchor of rlperf's engine, as the kernel of its target rows); installed but not loaded by
    SGLang, SGLang's parser refuses the backend and the row quotes it; the others ran all the same."""
    import math

    import rlperf.bench.rollout as ro
    from rlperf.bench.run import _markdown_section

    monkeypatch.setattr(ro, "rlperf_plugin_entry_points", lambda: [])
    calls = []

    def measure(cfg, batches, prompt_len, new_tokens, variant):
        calls.append((variant, batches))
        if variant == "plugin":
            return ro.sglang_run(cfg, batches, prompt_len, new_tokens, variant=variant)
        return {"decode": {b: 1.0 for b in batches if b != 64}, "prefill": {b: 5.0 for b in batches},
                "missing": {64: "sglang.bench_one_batch measured no batch 64 (skipping (64, 24, 5) due to max "
                                "batch size limit)"}}

    pytest.importorskip("sglang")
    rows = ro.sglang_anchor_rows(preset("tiny"), ("plugin", "fast"), (1, 16, 64), {1: 2.0, 16: 2.0, 64: 2.0}, 10.0,
                                 prompt_len=24, new_tokens=5, measure=measure)
    assert calls == [("fast", (16, 1, 64)), ("plugin", (16, 1, 64))]  # run order; the prefill's batch first
    out = capsys.readouterr().out
    assert "rollout: sglang rlperf plugin: did not run (0 s): RuntimeError: rlperf's SGLang plugin is not installed" in out
    assert "no target rows against sglang deterministic (det-flashinfer not in --sglang-variants)" in out
    mine = [r for r in rows if r.kernel == "sglang rlperf plugin"]
    assert len(mine) == 4 and all(math.isnan(r.kernel_ms) and "not installed" in r.extra["kernel_unavailable"]
                                  for r in mine)
    row_64 = next(r for r in mine if r.case.startswith("decode B=64"))  # a batch the anchor skipped: its reason too
    assert row_64.extra["anchor_unavailable"].endswith("due to max batch size limit)")
    section = _markdown_section("rollout", rows, {}, {})
    line = next(ln for ln in section.splitlines() if ln.startswith("| decode B=1 prompt 24 | sglang rlperf plugin"))
    assert "| sglang rlperf plugin (did not run: RuntimeError: rlperf's SGLang plugin is not installed" in line
    assert "\n" not in line and line.endswith("| nan | sglang fast | 1.0000 | nan | - | - |")

    _fake_sglang_env(monkeypatch)  # installed, but this SGLang has not loaded it: its parser refuses the backend
    monkeypatch.setattr(ro, "rlperf_plugin_entry_points", lambda: ["rlperf"])
    with pytest.raises(RuntimeError, match=r"rlperf.bench.sglang_anchor exited 2: .*error: argument "
                                           r"--attention-backend: invalid choice: 'rlperf'"):
        ro.sglang_run(preset("tiny"), (1,), 24, 5, variant="plugin")
    monkeypatch.setenv("FAKE_SGLANG_PLUGIN", "rlperf")
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else")  # the run names rlperf's entry points alone
    assert ro.sglang_run(preset("tiny"), (1,), 24, 5, variant="plugin")["decode"] == pytest.approx({1: 2 * (1 + 1 / 64)})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds nothing
    except FileNotFoundError:
        return False


def test_run_process_group_kills_what_the_command_leaves_running(tmp_path):
    """SGLang's bench_one_batch left its scheduler process running after an out-of-memory exit: the
    command's whole group is killed when it ends, its output (larger than a pipe's buffer) comes back
    whole, and a timeout gives None instead of waiting for the leftover's pipes."""
    import os
    import subprocess
    import sys
    import time

    from rlperf.bench.rollout import run_process_group

    leftover = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
                "print(p.pid, flush=True); print('x' * 200000); sys.exit(1)")
    t0 = time.monotonic()
    done = run_process_group([sys.executable, "-c", leftover], 30, dict(os.environ))
    assert isinstance(done, subprocess.CompletedProcess) and done.returncode == 1
    assert time.monotonic() - t0 < 20 and done.stdout.count("x") == 200000
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    t0 = time.monotonic()
    assert run_process_group([sys.executable, "-c", "import time; time.sleep(30)"], 0.5, dict(os.environ)) is None
    assert time.monotonic() - t0 < 10
    # a SIGTERM to the measuring process (a device call's timeout) still takes the group down
    script = ("import os, sys; from rlperf.bench.rollout import run_process_group; "
              "run_process_group([sys.executable, '-c', " + repr(leftover.replace("sys.exit(1)", "import time; time.sleep(60)")) +
              "], 60, dict(os.environ))")
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 30
    children = []
    while not children and time.monotonic() < deadline:  # the command's own child, then its leftover
        time.sleep(0.1)
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == bench.pid]
    assert children, "the command did not start"
    grandchildren = []
    while not grandchildren and time.monotonic() < deadline:
        time.sleep(0.1)
        grandchildren = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) in children]
    assert grandchildren, "the command's child did not start"
    bench.terminate()
    assert bench.wait(20) == 128 + 15
    deadline = time.monotonic() + 5
    while any(map(_alive, children + grandchildren)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, children + grandchildren))


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None
