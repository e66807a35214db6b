"""The reports (table, JSON, JUnit XML) and `rlperf gate`'s flags and exit codes.

The end-to-end tests run a real first step of the tiny model (rollout log-probs, Trainer.prepare,
one train step, each phase's peak RSS measured) as the first-step hook, so each gate is shown to
fail on the fault it exists for: a perturbed reference model, a non-invariant rollout path, a
memory limit set too low.
"""
import contextlib
import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

import rlperf.kernels as K
from gate_records import ENGINE_URLS, GiB, healthy_record, layout_record
from rlperf.gates import FirstStepGate, FirstStepRecord, GateOptions, PhaseMemory
from rlperf.gates.runner import main
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.telemetry import PhaseMeter
from rlperf.train import Sample, Trainer, compute_log_probs, frozen_copy, train_args_from

GATE_NAMES = ["kl_zero", "logprob_abs_diff", "oom_headroom", "sanity"]


def _junit(path):
    root = ET.parse(path).getroot()
    (suite,) = root.findall("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == GATE_NAMES and suite.get("tests") == "4"
    failed = [n for n, c in cases.items() if c.find("failure") is not None]
    assert suite.get("failures") == str(len(failed)) == root.get("failures")
    return cases, failed


# -- reports on hand-built records ----------------------------------------------------------------------

def test_reports_of_a_healthy_record(tmp_path):
    report = FirstStepGate().check(healthy_record(), seconds=1.25)
    assert report.passed and report.exit_code == 0 and report.failed == []
    report.write_json(tmp_path / "r.json")
    report.write_junit(tmp_path / "r.xml")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["passed"] is True and [g["name"] for g in data["gates"]] == GATE_NAMES
    assert data["seconds"] == 1.25 and data["config"]["max_tokens_per_gpu"] == 4096
    cases, failed = _junit(tmp_path / "r.xml")
    assert failed == [] and all(c.find("system-out") is not None for c in cases.values())
    table = report.table()
    assert table.count("PASS") == 4 and "all gates passed" in table


def test_reports_mark_the_failed_gates(tmp_path):
    record = healthy_record()
    record.samples[1].ref_log_probs[0] -= 1.0
    record.first_micro_step["train/loss"] = math.nan
    report = FirstStepGate().check(record)
    assert report.exit_code == 1 and report.failed == ["kl_zero", "sanity"]
    report.write_json(tmp_path / "r.json")
    report.write_junit(tmp_path / "r.xml")
    data = json.loads((tmp_path / "r.json").read_text())  # strict JSON although a value is NaN
    assert data["passed"] is False and data["failed"] == ["kl_zero", "sanity"]
    sanity = data["gates"][3]
    assert sanity["measured"] == {"train/loss": "nan"} and sanity["hint"]
    cases, failed = _junit(tmp_path / "r.xml")
    assert failed == ["kl_zero", "sanity"]
    msg = cases["kl_zero"].find("failure").get("message")
    assert "sample 1, response token 0" in msg
    table = report.table()
    assert table.count("FAIL") == 3 and "kl_zero: try:" in table and "FAILED: kl_zero, sanity" in table


def test_the_junit_of_a_whole_layout_has_one_testcase_per_gate(tmp_path):
    """Two ranks and two engines, one engine over its limit: still one testcase per gate (not one per rank
    or engine); oom_headroom's failure names the engine, and its details list both engines."""
    report = FirstStepGate().check(layout_record(engine_peaks_gib=(75, 20)))
    report.write_junit(tmp_path / "r.xml")
    cases, failed = _junit(tmp_path / "r.xml")  # exactly the four gates, in order
    assert failed == ["oom_headroom"]
    failure = cases["oom_headroom"].find("failure")
    assert failure.get("message").startswith(f"engine {ENGINE_URLS[0]}: peak 75 GiB")
    details = json.loads(failure.text.splitlines()[-1])
    assert [(e["url"], e["peak_bytes"]) for e in details["measured"]["engines"]] == [(ENGINE_URLS[0], 75 * GiB),
                                                                                    (ENGINE_URLS[1], 20 * GiB)]
    assert all(len(c.findall("failure")) + len(c.findall("system-out")) == 1 for c in cases.values())


def test_cpu_engines_are_held_to_the_memory_limit(tmp_path):
    """On the CPU the engines are processes of this host: --memory-limit holds them as it holds the trainer."""
    def cpu_record():
        record = layout_record(engine_peaks_gib=(5.5, 1), ranks=1)
        record.memory_kind, record.capacity_bytes, record.probe = "cpu_rss", None, None
        record.phases = [PhaseMemory(p.phase, GiB) for p in record.phases]
        for e in record.engines:
            e.kind, e.capacity_bytes, e.device = "cpu_rss", 1024 * GiB, "cpu"  # as an engine reports MemTotal
        return record

    assert main([], first_step=_returns(cpu_record())) == 0  # each engine against the capacity it reported
    record = cpu_record()
    assert main(["--memory-limit", "6GiB", "--report-json", str(tmp_path / "g.json")], first_step=_returns(record)) == 1
    assert [e.capacity_bytes for e in record.engines] == [6 * GiB, 6 * GiB]
    gate = json.loads((tmp_path / "g.json").read_text())["gates"][2]
    assert gate["message"] == (f"engine {ENGINE_URLS[0]}: peak 5.5 GiB (91.7% of 6 GiB cpu_rss) exceeds 5.4 GiB "
                               f"(headroom 0.1); its KV pool is 16 GiB")


def test_a_gate_that_raises_is_reported_failed_and_the_others_still_run():
    record = healthy_record()
    record.samples = record.samples + ["not a sample"]
    report = FirstStepGate().check(record)
    assert "raised" in report.results[0].message and not report.results[0].passed
    assert report.results[2].passed  # oom_headroom does not read the samples


# -- rlperf gate: flags and exit codes -------------------------------------------------------------------

def _returns(record):
    return lambda args: record


def test_command_exit_0_and_writes_both_reports(tmp_path, capsys):
    j, x = tmp_path / "out" / "gate.json", tmp_path / "out" / "gate.xml"
    code = main(["--report-json", str(j), "--junit-xml", str(x)], first_step=_returns(healthy_record()))
    assert code == 0 and "all gates passed" in capsys.readouterr().out
    assert json.loads(j.read_text())["passed"] is True and _junit(x)[1] == []


def test_command_exit_1_names_the_failed_gate(tmp_path):
    record = healthy_record(true_on_policy=False, noise=0.02)
    code = main(["--logprob-abs-diff-threshold", "0.001", "--junit-xml", str(tmp_path / "g.xml")],
                first_step=_returns(record))
    assert code == 1 and _junit(tmp_path / "g.xml")[1] == ["logprob_abs_diff"]


@pytest.mark.parametrize("argv", [["--oom-headroom", "1.5"], ["--memory-limit", "lots"], ["--no-such-flag"],
                                  ["--advantage-estimator", "ppo"], ["--logprob-abs-diff-threshold", "-1"],
                                  ["--use-dynamic-batch-size"]])
def test_command_bad_usage_exits_2_before_any_step(argv, capsys):
    def first_step(args):
        raise AssertionError("no step may run on bad usage")

    assert main(argv, first_step=first_step) == 2
    assert capsys.readouterr().err


def test_command_help_explains_the_gates(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in GATE_NAMES + ["--junit-xml", "--report-json", "--memory-limit", "--oom-headroom",
                              "--logprob-abs-diff-threshold", "--max-tokens-per-gpu", "Exit codes"]:
        assert word in out


@pytest.mark.parametrize("error,oom", [(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), True),
                                       (RuntimeError("shape mismatch"), False)])
def test_command_first_step_that_crashes_exits_1(error, oom, tmp_path):
    def first_step(args):
        raise error

    assert main(["--junit-xml", str(tmp_path / "g.xml")], first_step=first_step) == 1
    cases, failed = _junit(tmp_path / "g.xml")
    assert failed == GATE_NAMES
    oom_msg = cases["oom_headroom"].find("failure").get("message")
    assert ("out of memory during the first step" in oom_msg) == oom
    assert "--max-tokens-per-gpu" in cases["oom_headroom"].find("failure").text or not oom


# -- end to end: a real first step of the tiny model -------------------------------------------------------

CFG = preset("tiny")
SHAPES = [(6, 3), (9, 5), (13, 7), (8, 2), (33, 1), (17, 16)]  # 3 prompts x 2 samples


def tiny_first_step(perturb_reference=False, fast_rollout=False):
    """One rollout's log-probs, the actor's recompute, the reference's, one train step; each phase's peak RSS."""

    def first_step(args) -> FirstStepRecord:
        targs = train_args_from(args)
        with K.use_backend("reference"):  # differentiable on CPU
            model = Qwen3ForCausalLM.random(CFG, seed=0, std=0.05)
            g = torch.Generator().manual_seed(1)
            samples = [Sample(torch.randint(0, CFG.vocab_size, (n,), generator=g), r, reward=float(i % 2))
                       for i, (n, r) in enumerate(SHAPES)]
            meter = PhaseMeter()
            with meter.phase("rollout"):
                # a non-invariant rollout engine: the fast (stock torch) path instead of the invariant kernels
                with K.use_mode("fast") if fast_rollout else contextlib.nullcontext():
                    rollout = compute_log_probs(model, samples)
            for s, lp in zip(samples, rollout):
                s.rollout_log_probs = lp
            ref = frozen_copy(model)
            if perturb_reference:
                with torch.no_grad():
                    next(ref.parameters()).mul_(1.001)
            trainer = Trainer(model, targs, ref_model=ref)
            with meter.phase("log_prob"):
                trainer.prepare(samples)
            with meter.phase("train"):
                metrics = trainer.train_step(samples)  # one micro-batch: the first micro-step is the step
            with meter.phase("weight_sync"):
                {k: v.clone() for k, v in model.state_dict().items()}
            phases = [PhaseMemory(name, peak) for name, peak in meter.peaks.items()]
        return FirstStepRecord(samples, dict(metrics), metrics, phases, capacity_bytes=None, memory_kind=meter.kind,
                               true_on_policy=True, config={"max_tokens_per_gpu": args.max_tokens_per_gpu})

    return first_step


TRAIN_FLAGS = ["--use-kl-loss", "--kl-loss-coef", "0.1", "--n-samples-per-prompt", "2", "--use-dynamic-batch-size",
               "--max-tokens-per-gpu", "1024", "--memory-limit", "1TiB"]


@pytest.mark.parametrize("fault,failed", [(None, []), ("perturb_reference", ["kl_zero"]),
                                          ("fast_rollout", ["logprob_abs_diff"]), ("memory_limit", ["oom_headroom"])])
def test_end_to_end_each_fault_fails_its_gate(fault, failed, tmp_path, capsys):
    argv = TRAIN_FLAGS + ["--junit-xml", str(tmp_path / "g.xml"), "--report-json", str(tmp_path / "g.json")]
    if fault == "memory_limit":
        argv += ["--memory-limit", "1MiB"]  # the last one wins
    kw = {fault: True} if fault in ("perturb_reference", "fast_rollout") else {}
    code = main(argv, first_step=tiny_first_step(**kw))
    assert code == (1 if failed else 0), capsys.readouterr().out
    cases, got = _junit(tmp_path / "g.xml")
    assert got == failed
    report = json.loads((tmp_path / "g.json").read_text())
    if fault == "perturb_reference":
        assert "sample 0, response token 0" in cases["kl_zero"].find("failure").get("message")
    if fault == "fast_rollout":
        assert report["gates"][1]["measured"]["mean_abs_diff"] > 0
    if fault == "memory_limit":
        assert cases["oom_headroom"].find("failure").get("message").startswith("phase rollout:")
        assert "(now 1024)" in cases["oom_headroom"].find("failure").text
    if fault is None:
        peaks = report["gates"][2]["measured"]["peaks_bytes"]
        assert set(peaks) == {"rollout", "log_prob", "train", "weight_sync"} and min(peaks.values()) > 0


def test_gate_options_reach_the_gates():
    record = healthy_record(true_on_policy=False, noise=0.02)
    assert FirstStepGate(GateOptions(logprob_abs_diff_threshold=0.05)).check(record).passed
    assert not FirstStepGate(GateOptions(logprob_abs_diff_threshold=0.0)).check(record).passed


# -- rlperf gate through the CLI and the loop's first-step hook (the embedded task on the tiny model) -------



@pytest.mark.parametrize("limit,failed", [("8GiB", []), ("1MiB", ["oom_headroom"])])
def test_rlperf_gate_end_to_end(limit, failed, tmp_path, capsys):
    from rlperf.cli import main as rlperf

    x = tmp_path / "gate.xml"
    code = rlperf(["gate", "--true-on-policy-mode", "--memory-limit", limit, "--output-dir", str(tmp_path / "run"),
                   "--no-progress", "--junit-xml", str(x), "--report-json", str(tmp_path / "gate.json")])
    out = capsys.readouterr().out
    assert code == (1 if failed else 0), out
    cases, got = _junit(x)
    assert got == failed
    report = json.loads((tmp_path / "gate.json").read_text())
    assert report["gates"][1]["measured"]["mean_abs_diff"] == 0.0  # true-on-policy: exactly 0
    if failed:
        assert cases["oom_headroom"].find("failure").get("message").startswith("phase rollout:")
    # where the first step's wall time went: its stages, in order, add up to it
    stages = report["stage_seconds"]
    assert list(stages) == ["setup", "step", "probe", "other"] and min(stages.values()) >= 0.0
    assert stages["setup"] > 0 and stages["step"] > 0 and stages["probe"] > 0
    assert sum(stages.values()) == pytest.approx(report["seconds"], rel=1e-6)
    setup = report["setup_seconds"]  # the setup stage's parts, in order, within it
    assert list(setup) == ["model", "data", "trainer", "engines"] and min(setup.values()) >= 0.0
    assert sum(setup.values()) <= stages["setup"]


def test_rlperf_gate_bad_loop_flags_exit_2(tmp_path, capsys):
    from rlperf.cli import main as rlperf

    code = rlperf(["gate", "--rollout-batch-size", "3", "--global-batch-size", "5", "--output-dir", str(tmp_path)])
    assert code == 2 and "batch relation" in capsys.readouterr().err


def test_rlperf_gate_missing_data_file_exits_2(tmp_path, capsys):
    from rlperf.cli import main as rlperf

    code = rlperf(["gate", "--prompt-data", str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path)])
    assert code == 2 and "nope.jsonl" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A --save directory after one training step of the embedded run (weights differ from the init)."""
    from rlperf.cli import main as rlperf

    d = tmp_path_factory.mktemp("ckpt")
    assert rlperf(["train", "--num-rollout", "1", "--save", str(d / "save"), "--output-dir", str(d / "out"),
                   "--no-progress"]) == 0
    return d / "save"


@pytest.mark.parametrize("same_weights", [False, True])
def test_rlperf_gate_reference_from_another_checkpoint_fails_kl_zero(same_weights, trained_checkpoint, tmp_path):
    from rlperf.cli import main as rlperf

    argv = ["gate", "--ref-load", str(trained_checkpoint), "--output-dir", str(tmp_path), "--no-progress",
            "--junit-xml", str(tmp_path / "g.xml")]
    if same_weights:
        argv += ["--load", str(trained_checkpoint)]  # actor and reference both the trained weights
    assert rlperf(argv) == (0 if same_weights else 1)
    cases, failed = _junit(tmp_path / "g.xml")
    assert failed == ([] if same_weights else ["kl_zero"])
    if not same_weights:
        assert "sample 0, response token 0" in cases["kl_zero"].find("failure").get("message")
