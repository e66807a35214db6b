"""The step-time table of an rlperf train run, from a real (short, CPU) run's metrics.jsonl."""
import json

from rlperf.bench import train_run
from rlperf.cli import main


def test_table_from_a_real_run(tmp_path, capsys):
    out = tmp_path / "run"
    # the table's arithmetic, not learning: 4 prompts x 4 samples a rollout
    assert main(["train", "--output-dir", str(out), "--no-progress", "--num-rollout", "2", "--skip-gates",
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16"]) == 0
    metrics = out / "metrics.jsonl"
    rows = [train_run.step_row(m) for m in train_run.load_metrics(metrics)]
    assert [r["rollout"] for r in rows] == [0, 1]
    for r, m in zip(rows, (json.loads(line) for line in metrics.read_text().splitlines())):
        assert r["step s"] >= r["rollout s"] > 0 and r["train s"] > 0 and r["tokens"] > 0
        assert abs(r["tokens/s"] - r["tokens"] / r["step s"]) < 1e-6 * r["tokens/s"]
        assert abs(r["log-prob s"] + r["train s"] - m["perf/train_time"]) < 1e-9
        assert r["peak train GiB"] > 0
    capsys.readouterr()
    assert train_run.main([str(metrics)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| rollout | step s") and len(table) == 2 + 2 + 1 and table[-1].startswith("| mean")


def test_bad_metrics_file_is_named(tmp_path, capsys):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"rollout_id": 0}\n{oops\n')
    assert train_run.main([str(bad)]) == 2
    assert "metrics.jsonl:2: not valid JSON" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert train_run.main([str(tmp_path / "empty.jsonl")]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_a_rollout_id_counts_once(tmp_path):
    """A file a resumed run wrote before resumes truncated it (issue #12): rollouts 1 and 2 twice."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"rollout_id": i, "perf/step_time": t} for i, t in ((0, 1.0), (1, 9.0), (2, 9.0), (1, 2.0), (2, 3.0))]
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    rows = [train_run.step_row(m) for m in train_run.load_metrics(path)]
    assert [(r["rollout"], r["step s"]) for r in rows] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert train_run.mean_row(rows)["step s"] == 2.0
