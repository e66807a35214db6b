"""``rlperf train --profile-step-start/-end --profile-target``: torch.profiler traces of a window of steps.

Short CPU runs of the embedded task (2 prompts x 2 samples, 3 rollouts, one thread). Each trace must
exist, load as Chrome JSON, hold ops, and lie inside the target phase's slices of the phase timeline
(both on the wall clock; between phase sessions the loop spends time exporting, so a stray op from a
neighbouring phase would fall outside). Bad windows exit 2 before any step.
"""
import argparse
import contextlib
import gzip
import io
import json
import re
from pathlib import Path

import pytest

from rlperf.cli import main
from rlperf.telemetry.trainer_trace import TARGETS, check_profile_args, trace_name

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--num-threads", "1",
         "--no-progress"]
SLACK_NS = 2_000_000  # torch's clock -> wall-clock conversion vs time.time_ns(); measured agreement is ~µs
BACKWARD = "autograd::engine::evaluate_function"
OPTIMIZER_STEP = "Optimizer.step#AdamW.step"


def _main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _timeline_slices(out: Path) -> list[tuple[str, int, int, int]]:
    """(phase, step, start_ns, end_ns) of the run's phase timeline (.pftrace or .json.gz)."""
    (path,) = [p for p in out.iterdir() if p.name.startswith("timeline.")]
    if path.suffix == ".pftrace":
        from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

        stack, out_slices = [], []
        for p in Trace.FromString(path.read_bytes()).packet:
            e = p.track_event
            if p.HasField("track_event") and e.type == TrackEvent.TYPE_SLICE_BEGIN:
                stack.append((e.name, {a.name: a.int_value for a in e.debug_annotations}["step"], p.timestamp))
            elif p.HasField("track_event") and e.type == TrackEvent.TYPE_SLICE_END:
                name, step, start = stack.pop()
                out_slices.append((name, step, start, p.timestamp))
        assert not stack
        return out_slices
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    base = doc["baseTimeNanoseconds"]
    return [(e["name"], e["args"]["step"], base + round(e["ts"] * 1e3), base + round((e["ts"] + e["dur"]) * 1e3))
            for e in doc["traceEvents"] if e["ph"] == "X"]


def _load_trace(path: Path):
    """(events, base ns) of a torch Chrome trace; ops as (name, start_ns, end_ns)."""
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"], doc["baseTimeNanoseconds"]


def _ops(events, base):
    return [(e["name"], base + round(e["ts"] * 1e3), base + round((e["ts"] + e["dur"]) * 1e3))
            for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]


def _assert_within(ops, lo, hi, what):
    outside = [o for o in ops if o[1] < lo - SLACK_NS or o[2] > hi + SLACK_NS]
    assert not outside, f"{what}: {len(outside)} of {len(ops)} ops outside the phase, e.g. {outside[:3]}"


@pytest.fixture(scope="module")
def phase_run(tmp_path_factory):
    """Gates on, then 3 rollouts; traces of train_log_probs and train_actor for steps 0 and 1."""
    out = tmp_path_factory.mktemp("phase_run")
    code, err = _main(["train", "--output-dir", str(out), "--num-rollout", "3", *SMALL, "--profile-step-start", "0",
                       "--profile-step-end", "2", "--profile-target", "train_log_probs", "train_actor"])
    assert code == 0, err
    return out, err


@pytest.fixture(scope="module")
def overall_run(tmp_path_factory):
    """3 rollouts, train_overall traced for step 1 only; saves a checkpoint (the resume test loads it)."""
    out = tmp_path_factory.mktemp("overall_run")
    code, err = _main(["train", "--skip-gates", "--output-dir", str(out), "--num-rollout", "3", *SMALL,
                       "--save", str(out / "ckpt"), "--profile-step-start", "1", "--profile-step-end", "2"])
    assert code == 0, err
    return out, err


def test_phase_targets_write_one_trace_per_step_inside_their_phase(phase_run):
    out, err = phase_run
    expected = {trace_name(t, k, k) for t in ("train_log_probs", "train_actor") for k in (0, 1)}
    assert {p.name for p in out.glob("torch_trace_*")} == expected
    # the gates' first step ran before the loop on a run of its own and traced nothing
    assert len(re.findall(r"torch trace of \w+ -> ", err)) == 4
    slices = _timeline_slices(out)
    assert sorted((n, s) for n, s, _, _ in slices) == sorted(
        [("weight_sync", -1)] + [(n, k) for k in range(3) for n in ("rollout", "log_prob", "train", "weight_sync")])
    for target, phase in (("train_log_probs", "log_prob"), ("train_actor", "train")):
        for k in (0, 1):
            events, base = _load_trace(out / trace_name(target, k, k))
            names = {e.get("name") for e in events}
            ops = _ops(events, base)
            assert len(ops) > 100, f"{target} step {k}: only {len(ops)} ops"
            assert f"{target} step {k}" in names
            ((lo, hi),) = [(a, b) for n, s, a, b in slices if n == phase and s == k]
            _assert_within(ops, lo, hi, f"{target} step {k}")
            has_backward = any(n.startswith(BACKWARD) for n in names if n)
            # log-probs are a forward pass only; the actor's phase is forward + backward + AdamW
            assert has_backward == (target == "train_actor") and (OPTIMIZER_STEP in names) == (target == "train_actor")


def test_train_overall_traces_the_whole_window_and_nothing_else(overall_run):
    out, err = overall_run
    assert [p.name for p in out.glob("torch_trace_*")] == [trace_name("train_overall", 1, 1)]
    assert trace_name("train_overall", 1, 1) == "torch_trace_train_overall_step1.json.gz"
    events, base = _load_trace(out / trace_name("train_overall", 1, 1))
    names = {e.get("name") for e in events}
    assert "train_overall step 1" in names and "train_overall step 0" not in names
    assert OPTIMIZER_STEP in names and any(n.startswith(BACKWARD) for n in names if n)
    slices = _timeline_slices(out)
    step1 = [(a, b) for n, s, a, b in slices if s == 1]
    assert {n for n, s, _, _ in slices if s == 1} == {"rollout", "log_prob", "train", "weight_sync"}
    ops = _ops(events, base)
    _assert_within(ops, min(a for a, _ in step1), max(b for _, b in step1), "train_overall step 1")
    # ops of every phase of step 1 are in it
    for n, s, a, b in slices:
        if s == 1:
            assert any(a - SLACK_NS <= o[1] and o[2] <= b + SLACK_NS for o in ops), f"no op of {n} in the trace"


def test_resumed_run_counts_steps_from_its_first_and_checks_the_window(overall_run, tmp_path):
    out, _ = overall_run
    # resumed at rollout 3 with --num-rollout 4: one step, so the window 0..1 is past its end
    code, err = _main(["train", "--skip-gates", "--output-dir", str(tmp_path), "--num-rollout", "4", *SMALL,
                       "--load", str(out / "ckpt"), "--profile-step-start", "0", "--profile-step-end", "2"])
    assert code == 2 and "past this run's 1 steps" in err, err
    assert not (tmp_path / "metrics.jsonl").exists() and not list(tmp_path.glob("torch_trace_*"))


@pytest.mark.parametrize("flags, message", [
    (["--profile-step-start", "2", "--profile-step-end", "2"], "must be greater than --profile-step-start"),
    (["--profile-step-start", "2", "--profile-step-end", "1"], "must be greater than --profile-step-start"),
    (["--profile-step-start", "-1", "--profile-step-end", "1"], "--profile-step-start must be >= 0"),
    (["--profile-step-start", "1"], "give both --profile-step-start and --profile-step-end"),
    (["--profile-step-end", "1"], "give both --profile-step-start and --profile-step-end"),
    (["--profile-target", "train_actor"], "--profile-target needs a window"),
    (["--profile-step-start", "1", "--profile-step-end", "4"], "ends past this run's 3 steps"),
    (["--profile-step-start", "0", "--profile-step-end", "1", "--profile-target", "train_overall", "train_actor"],
     "train_overall already covers"),
    (["--profile-step-start", "0", "--profile-step-end", "1", "--profile-target", "train_log_probs",
      "--debug-rollout-only"], "runs no training phase"),
])
def test_bad_windows_exit_2_before_any_step(tmp_path, flags, message):
    code, err = _main(["train", "--output-dir", str(tmp_path), "--num-rollout", "3", *SMALL, *flags])
    assert code == 2 and message in err, err
    assert "gate" not in err and not (tmp_path / "metrics.jsonl").exists()


def test_unknown_target_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse: exit 2 naming the choices
        main(["train", "--output-dir", str(tmp_path), "--profile-step-start", "0", "--profile-step-end", "1",
              "--profile-target", "train_critic"])
    assert exc.value.code == 2 and "invalid choice: 'train_critic'" in capsys.readouterr().err
    ns = argparse.Namespace(profile_step_start=0, profile_step_end=1, profile_target=["train_critic"], num_rollout=3)
    with pytest.raises(ValueError, match="--profile-target train_critic: unknown"):  # a namespace skips argparse
        check_profile_args(ns)
    ns.profile_target = None
    check_profile_args(ns)
    assert ns.profile_target == ["train_overall"] and "train_overall" in TARGETS
