"""rlperf train --use-tensorboard --use-wandb --wandb-mode offline --plot on the embedded CPU task.

Every number of every metrics.jsonl line must come back, at its rollout_id, from the TensorBoard event
files (read with TensorBoard's own EventAccumulator) and from the offline W&B run (its .wandb file:
wandb's record framing, a header then 32 KiB blocks of length-prefixed chunks, each record a
``wandb.proto`` ``Record``). W&B never reaches the network: offline mode, and its server address points
at a closed local port.
"""
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from rlperf.cli import main
from rlperf.loop import METRICS_FILE
from rlperf.telemetry.loggers import STEP_KEY, scalar_metrics

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("matplotlib")


@pytest.fixture
def wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there: no network by mistake
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def read_tensorboard(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from the event files under ``log_dir`` (TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


WANDB_HEADER = 7  # b":W&B", a 2-byte magic, a 1-byte version
WANDB_BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list:
    """The ``wandb.proto`` records of an offline run's ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a .wandb file"
    pos, pieces, records = WANDB_HEADER, b"", []
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pieces = chunk if kind in (FULL, FIRST) else pieces + chunk
        if kind in (FULL, LAST):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pieces)
            records.append(rec)
    return records


def read_wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {metric: value} of the history rows of the offline run in ``run_dir``."""
    files = list(run_dir.glob("run-*.wandb"))
    assert len(files) == 1, files
    history = {}
    for rec in read_wandb_records(files[0]):
        if rec.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) if item.nested_key else item.key: json.loads(item.value_json)
                   for item in rec.history.item}
            history[rec.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
    return history


def test_tensorboard_and_offline_wandb_hold_every_metric(tmp_path, wandb_offline, png_ink):
    out = tmp_path / "run"
    code = main(["train", "--skip-gates", "--no-progress", "--num-rollout", "3", "--output-dir", str(out),
                 "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                 "--use-tensorboard", "--use-wandb", "--wandb-mode", "offline", "--wandb-project", "rlperf-test",
                 "--wandb-group", "ci", "--plot",
                 # which metrics reach the loggers, not what they learn: 4 prompts x 4 samples a rollout
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16"])
    assert code == 0
    lines = [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]
    assert [m[STEP_KEY] for m in lines] == [0, 1, 2]
    numbers = {m[STEP_KEY]: scalar_metrics(m) for m in lines}
    assert all(len(v) >= 15 for v in numbers.values())  # rewards, train/*, perf/*, memory/* of every step

    tb = read_tensorboard(out / "tensorboard")
    assert set(tb) == set().union(*numbers.values())
    for step, metrics in numbers.items():
        for name, value in metrics.items():  # event files hold float32
            assert tb[name][step] == np.float32(value), (name, step, tb[name][step], value)

    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    history = read_wandb_history(runs[0])
    assert sorted(history) == [0, 1, 2]
    for step, metrics in numbers.items():
        assert history[step] == metrics, step  # the same names, the same values (JSON round trip), no others

    # --plot: the picture of the run, redrawn at the checkpoint of rollout 2 and after the last one
    png = out / "plot.png"
    assert png.stat().st_size > 20_000 and (out / "plot.html").read_text().count("data:image/png;base64,") == 1
    # rlperf plot on the run draws the same panels: curves and areas in colour, not an empty canvas
    again = tmp_path / "again.png"
    assert main(["plot", str(out), "-o", str(again)]) == 0
    stats = png_ink(again)
    assert again.stat().st_size > 20_000 and stats["colored"] > 3000 and stats["colors"] > 200


def test_strings_and_the_step_are_not_scalars():
    m = {STEP_KEY: 4, "memory/kind": "cpu_rss", "sync/weights_checksum": None, "train/loss": 0.5,
         "rollout/total_tokens": 12, "flag": True, "perf/x": math.inf}
    assert scalar_metrics(m) == {"train/loss": 0.5, "rollout/total_tokens": 12, "perf/x": math.inf}
