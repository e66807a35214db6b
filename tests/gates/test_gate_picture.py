"""rlperf gate --report-png: the first step's per-token train - rollout log-prob differences as a
picture, a flat line at 0 when they are bit-identical; a spread band when they are not."""
import json

import numpy as np
import pytest
import torch

from gate_records import healthy_record
from rlperf.gates.report import logprob_differences
from rlperf.gates.runner import main

pytest.importorskip("matplotlib")

C0 = np.array((0.122, 0.467, 0.706))  # matplotlib's first colour: the differences' line


def _returns(record):
    return lambda args: record


def _line_rows(png) -> int:
    """How many pixel rows the differences' line covers (1-3 for a flat line)."""
    from matplotlib.image import imread

    rgb = imread(str(png))[..., :3]
    rows = np.nonzero((np.abs(rgb - C0).max(axis=-1) < 0.1).any(axis=1))[0]
    assert rows.size, "no line drawn"
    return int(rows.max() - rows.min() + 1)


def test_differences_are_the_loss_tokens_train_minus_rollout():
    rec = healthy_record(true_on_policy=False, noise=0.01)
    diffs, starts = logprob_differences(rec)
    expected, offsets = [], []
    for s in rec.samples:
        offsets.append(len(expected))
        m = s.loss_mask_tensor() > 0
        expected += [float(a) - float(b) for a, b, keep in zip(s.log_probs, s.rollout_log_probs_tensor(), m) if keep]
    assert starts == offsets and diffs == pytest.approx(expected, abs=0, rel=0)
    assert min(diffs) > 0  # noise is subtracted from the rollout's


def test_flat_at_zero_when_the_gate_passes_spread_when_not(tmp_path, capsys):
    flat, spread = tmp_path / "flat.png", tmp_path / "spread.png"
    assert main(["--report-json", str(tmp_path / "g.json"), "--report-png", str(flat)],
                first_step=_returns(healthy_record())) == 0
    assert json.loads((tmp_path / "g.json").read_text())["passed"]
    assert main(["--report-png", str(spread), "--logprob-abs-diff-threshold", "0.001"],
                first_step=_returns(healthy_record(true_on_policy=False, noise=0.05))) == 1
    assert flat.stat().st_size > 5000 and spread.stat().st_size > 5000
    assert _line_rows(flat) <= 4 < 40 < _line_rows(spread)


def test_report_png_usage_errors_exit_2_before_the_step(tmp_path, monkeypatch, capsys):
    ran = []

    def step(args):
        ran.append(1)
        return healthy_record()

    (tmp_path / "dir.png").mkdir()
    assert main(["--report-png", str(tmp_path / "dir.png")], first_step=step) == 2
    assert "--report-png" in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["--report-png", str(tmp_path / "x.png")], first_step=step) == 2
    assert "pip install 'rlperf[plot]'" in capsys.readouterr().err and not ran
