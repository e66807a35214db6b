"""rlperf.telemetry.loggers: flags into a LoggerConfig (usage errors name the flag), rank 0 alone logs,
the fan-out closes every logger, --plot redraws at a checkpoint. The end-to-end run that reads the
TensorBoard and W&B files back is tests/loop/test_metrics_loggers.py."""
import argparse
import json

import pytest

from rlperf.cli import main
from rlperf.telemetry import loggers as L


def _config(tmp_path, *flags, env=None):
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", default=str(tmp_path))
    L.add_logger_arguments(p)
    return L.logger_config_from(p.parse_args(list(flags)))


@pytest.fixture
def no_wandb_key(monkeypatch, tmp_path):
    monkeypatch.delenv(L.WANDB_KEY_ENV, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_no_flags_no_loggers(tmp_path):
    cfg = _config(tmp_path)
    assert cfg == L.LoggerConfig()
    assert L.open_loggers(cfg).loggers == []


def test_defaults_under_the_output_dir(tmp_path, no_wandb_key):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    cfg = _config(tmp_path, "--use-tensorboard", "--use-wandb", "--wandb-mode", "offline", "--wandb-group", "g", "--plot")
    assert cfg.tensorboard_dir == tmp_path / L.TENSORBOARD_SUBDIR and cfg.plot_dir == tmp_path
    assert (cfg.wandb.project, cfg.wandb.group, cfg.wandb.mode, cfg.wandb.directory) == ("rlperf", "g", "offline", tmp_path)
    assert cfg.wandb.api_key is None and cfg.wandb.config["wandb_group"] == "g"


@pytest.mark.parametrize("flag,package", [("--use-tensorboard", "tensorboard"), ("--use-wandb", "wandb"),
                                          ("--plot", "matplotlib")])
def test_a_missing_package_exits_2_with_the_pip_command(tmp_path, monkeypatch, capsys, flag, package):
    monkeypatch.setattr(L, "package_installed", lambda name: name != package)
    extra = ["--wandb-mode", "offline"] if package == "wandb" else []
    assert main(["train", "--skip-gates", "--output-dir", str(tmp_path), flag, *extra]) == 2
    err = capsys.readouterr().err
    assert f"{flag} needs the {package} package" in err and f"pip install 'rlperf[" in err and f"pip install {package}" in err
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing ran


def test_the_key_never_comes_from_argv(tmp_path, capsys):
    assert main(["train", "--skip-gates", "--output-dir", str(tmp_path), "--use-wandb", "--wandb-key", "abc123"]) == 2
    err = capsys.readouterr().err
    assert "--wandb-key" in err and "--wandb-key-file" in err and L.WANDB_KEY_ENV in err and "abc123" not in err


def test_key_file_errors_name_the_flag(tmp_path, no_wandb_key):
    pytest.importorskip("wandb")
    with pytest.raises(ValueError, match=r"--wandb-key-file .*missing"):
        _config(tmp_path, "--use-wandb", "--wandb-key-file", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"--wandb-key-file .*empty"):
        _config(tmp_path, "--use-wandb", "--wandb-key-file", str(tmp_path / "empty"))
    (tmp_path / "key").write_text("secret-key\n")
    cfg = _config(tmp_path, "--use-wandb", "--wandb-key-file", str(tmp_path / "key"))
    assert cfg.wandb.api_key == "secret-key" and "secret-key" not in repr(cfg)
    assert not any("secret-key" == v for v in cfg.wandb.config.values())
    with pytest.raises(ValueError, match=r"--wandb-mode online needs an API key.*--wandb-key-file"):
        _config(tmp_path, "--use-wandb")
    with pytest.raises(ValueError, match="--tensorboard-dir needs --use-tensorboard"):
        _config(tmp_path, "--tensorboard-dir", str(tmp_path))


class _Recorder:
    def __init__(self, fail_close=False):
        self.calls, self.fail_close = [], fail_close

    def log(self, metrics, step):
        self.calls.append(("log", step, dict(metrics)))

    def checkpoint(self, iteration):
        self.calls.append(("checkpoint", iteration))

    def close(self):
        self.calls.append(("close",))
        if self.fail_close:
            raise RuntimeError("close failed")


def test_fan_out_passes_the_same_dict_and_closes_all():
    a, b, c = _Recorder(), _Recorder(fail_close=True), _Recorder()
    fan = L.FanOut([a, b, c])
    fan.log({"rollout_id": 3, "train/loss": 1.0}, step=3)
    fan.checkpoint(4)
    with pytest.raises(RuntimeError, match="close failed"):
        fan.close()
    for r in (a, b, c):
        assert r.calls == [("log", 3, {"rollout_id": 3, "train/loss": 1.0}), ("checkpoint", 4), ("close",)]


def test_only_rank_0_logs(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = L.LoggerConfig(tensorboard_dir=tmp_path / "tb")
    assert L.open_loggers(cfg, rank=1).loggers == [] and not (tmp_path / "tb").exists()
    fan = L.open_loggers(cfg, rank=0)
    assert [type(x) for x in fan.loggers] == [L.TensorBoardLogger]
    fan.close()


def test_plot_logger_redraws_at_a_checkpoint_and_at_the_end(tmp_path):
    pytest.importorskip("matplotlib")
    lines = [{"rollout_id": k, "rollout/raw_reward": 0.25 + 0.1 * k, "perf/step_time": 1.0, "perf/rollout_time": 0.4,
              "perf/train_time": 0.5} for k in range(3)]
    metrics = tmp_path / "metrics.jsonl"
    plot = L.PlotLogger(tmp_path)
    png = tmp_path / L.PLOT_FILE
    for k, m in enumerate(lines):
        with open(metrics, "a") as f:
            f.write(json.dumps(m) + "\n")
        plot.log(m, step=k)
        if k == 1:
            assert not png.exists()
            plot.checkpoint(2)
            assert png.exists() and (tmp_path / "plot.html").exists()
            first = png.read_bytes()
    plot.close()  # rollout 2 came after the last checkpoint: drawn again
    assert png.read_bytes() != first
    drawn = png.stat().st_mtime_ns
    plot.close()  # nothing new: not redrawn
    assert png.stat().st_mtime_ns == drawn


def test_a_picture_that_cannot_be_drawn_does_not_stop_the_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    plot = L.PlotLogger(tmp_path)
    plot.log({"rollout_id": 0}, step=0)
    plot.checkpoint(1)
    err = capsys.readouterr().err
    assert "--plot: could not draw" in err and "metrics.jsonl:1: not JSON" in err
    assert not (tmp_path / L.PLOT_FILE).exists()
