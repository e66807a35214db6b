"""``rlperf gate`` (and the gates ``rlperf train`` runs first) on bad usage: exit 2 naming the flag,
before the first step, never four failed gates or a crash after the table (issue #12, item 9)."""
import shutil

import pytest

from rlperf.cli import main as rlperf
from rlperf.loop import checkpoint as ckpt

CHEAP = ("--no-progress", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--num-rollout", "1")


def _gate(tmp_path, capsys, *flags, command="gate"):
    code = rlperf([command, "--output-dir", str(tmp_path / "out"), *CHEAP, *map(str, flags)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", ["gate", "train"])
@pytest.mark.parametrize("flag", ["--junit-xml", "--report-json"])
def test_unwritable_report_path_is_refused_before_the_step(tmp_path, capsys, command, flag):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    other = "--report-json" if flag == "--junit-xml" else "--junit-xml"
    code, out, err = _gate(tmp_path, capsys, flag, blocker / "r", other, tmp_path / "other", command=command)
    assert code == 2, err
    assert f"{flag} {blocker / 'r'}" in err and "Traceback" not in err
    assert "gates passed" not in out and not (tmp_path / "other").exists()  # no step ran, no report written
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_report_path_that_is_a_directory(tmp_path, capsys):
    (tmp_path / "dir").mkdir()
    code, out, err = _gate(tmp_path, capsys, "--junit-xml", tmp_path / "dir")
    assert code == 2 and f"--junit-xml {tmp_path / 'dir'}" in err, err


@pytest.mark.parametrize("flags", [("--rollout-top-p", "1.5"), ("--rollout-temperature", "1e300"),
                                   ("--rollout-top-k", "-5"), ("--lr", "nan"), ("--model", "bogus")])
def test_bad_loop_flag(tmp_path, capsys, flags):
    code, out, err = _gate(tmp_path, capsys, *flags)
    assert code == 2 and err.startswith(f"rlperf gate: {flags[0]}") and "FAIL" not in out, err


@pytest.mark.parametrize("command", ["gate", "train"])
def test_a_flag_refused_by_its_parser_exits_2_naming_it(tmp_path, capsys, command):
    """Flags whose values argparse checks (rlperf.flags) stop the command while parsing: exit 2, the
    flag named, no step run."""
    with pytest.raises(SystemExit) as exc:
        _gate(tmp_path, capsys, "--num-threads", "-1", command=command)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --num-threads: must be an integer >= 0, got -1" in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def save(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    assert rlperf(["train", *CHEAP, "--skip-gates", "--save", str(d / "save"), "--output-dir", str(d / "out")]) == 0
    return d / "save"


@pytest.mark.parametrize("flag", ["--load", "--ref-load"])
def test_truncated_checkpoint(tmp_path, capsys, save, flag):
    d = tmp_path / "broken"
    shutil.copytree(save, d)
    weights = d / "iter_0000001" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, out, err = _gate(tmp_path, capsys, flag, d)
    assert code == 2 and err.startswith(f"rlperf gate: {flag} {d}") and "model.safetensors" in err, err
    assert "FAIL" not in out


def test_pointer_on_a_missing_checkpoint(tmp_path, capsys, save):
    d = tmp_path / "broken"
    shutil.copytree(save, d)
    (d / ckpt.LATEST).write_text("5")
    code, out, err = _gate(tmp_path, capsys, "--load", d)
    assert code == 2 and err.startswith(f"rlperf gate: --load {d}") and "iteration 5" in err, err


def test_gate_writes_only_under_its_named_default_output_dir(tmp_path, capsys, monkeypatch):
    """Without --output-dir, `rlperf gate` writes into ./rlperf-gate (never ./rlperf-train) and says so."""
    monkeypatch.chdir(tmp_path)
    code = rlperf(["gate", "--device", "cpu", *CHEAP])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "rlperf gate: one rollout and one train step, then the gates; the step writes under rlperf-gate " \
           "(--output-dir)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rlperf-gate"]
    assert any((tmp_path / "rlperf-gate").iterdir())  # the first step's timeline
