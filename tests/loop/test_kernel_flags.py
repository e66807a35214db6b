"""``--mode`` and ``--kernel-backend``: one definition for serve, train and gate; train and gate run
every phase under the policy they name; an impossible choice exits 2 naming the flag."""
import json
import sys

import pytest

import rlperf.kernels as K
from rlperf.cli import build_parser, main
from rlperf.kernels import KernelPolicy
from rlperf.loop import METRICS_FILE
from rlperf.rollout.args import KERNEL_BACKENDS, KERNEL_MODES


@pytest.fixture
def probe(tmp_path, monkeypatch, request):
    """``--custom-rm-path`` of a reward function (called in the rollout phase) that records the kernel
    policy it runs under; returns (flag value, the list of policies seen)."""
    name = f"kernel_policy_probe_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "import rlperf.kernels as K\nSEEN = []\n\n\ndef reward(args, sample):\n"
        "    SEEN.append(K.current_policy())\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{name}.reward", lambda: sys.modules[name].SEEN
    sys.modules.pop(name, None)


def _train(tmp_path, probe_path, *flags):
    # which kernel policy the run's steps see, not what they learn: 4 prompts x 4 samples a rollout
    return main(["train", "--output-dir", str(tmp_path / "out"), "--no-progress", "--custom-rm-path", probe_path,
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16", *flags])


def test_flag_values_are_the_kernels_own():
    assert KERNEL_MODES == K.MODES
    assert KERNEL_BACKENDS == ("auto", *K.BACKENDS)


def test_serve_train_and_gate_take_the_same_kernel_flags():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = {}
    for command in ("serve", "train", "gate"):
        actions = {a.dest: a for a in sub[command]._actions}
        flags[command] = [(actions[d].option_strings, actions[d].choices, actions[d].default)
                          for d in ("mode", "kernel_backend")]
    assert flags["serve"] == flags["train"] == flags["gate"]
    assert flags["train"][0] == (["--mode"], KERNEL_MODES, "invariant")


def test_train_fast_mode(tmp_path, probe):
    path, seen = probe
    assert _train(tmp_path, path, "--mode", "fast", "--num-rollout", "2") == 0  # first-step gates, then 2 steps
    lines = (tmp_path / "out" / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["rollout_id"] for line in lines] == [0, 1]
    assert seen() and set(seen()) == {KernelPolicy("fast", "reference")}  # CPU: auto is the reference
    assert K.current_policy() == K.default_policy()  # nothing leaks out of the run


def test_train_reference_backend(tmp_path, probe):
    path, seen = probe
    assert _train(tmp_path, path, "--kernel-backend", "reference", "--num-rollout", "1", "--skip-gates") == 0
    assert seen() and set(seen()) == {KernelPolicy("invariant", "reference")}


def test_gate_runs_under_the_kernel_flags(tmp_path, probe):
    path, seen = probe
    report = tmp_path / "gate.json"
    code = main(["gate", "--output-dir", str(tmp_path / "out"), "--custom-rm-path", path, "--mode", "fast",
                 "--kernel-backend", "reference", "--report-json", str(report)])
    assert code == 0
    assert seen() and set(seen()) == {KernelPolicy("fast", "reference")}
    config = json.loads(report.read_text())["config"]
    assert config["mode"] == "fast" and config["kernel_backend"] == "reference"


@pytest.mark.parametrize("command", ["train", "gate"])
@pytest.mark.parametrize("flags, flag", [(["--mode", "quick"], "--mode"),
                                         (["--kernel-backend", "cublas"], "--kernel-backend")])
def test_unknown_value_exits_2_naming_the_flag(command, flags, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, *flags])
    assert exc.value.code == 2
    assert f"argument {flag}: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "gate"])
@pytest.mark.parametrize("flags, interpret, message", [
    (["--kernel-backend", "triton", "--device", "cpu"], "1",
     "--kernel-backend triton on cpu: backend 'triton' needs CUDA"),
    (["--kernel-backend", "interpreter", "--device", "cpu"], "0",
     "--kernel-backend interpreter on cpu: backend 'interpreter' needs TRITON_INTERPRET=1"),
])
def test_backend_the_device_cannot_run_exits_2(tmp_path, command, flags, interpret, message, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    K.refresh_environment()
    try:
        assert main([command, "--output-dir", str(out), *flags]) == 2
    finally:
        monkeypatch.undo()
        K.refresh_environment()
    assert message in capsys.readouterr().err
    assert not (out / METRICS_FILE).exists()  # no step ran
