"""rlperf plot: the run picture and the bench picture are drawn (pixel statistics, against an empty
canvas of the same panels), bad inputs exit 2 naming the path and line. The picture of a real
embedded run is checked in tests/loop/test_metrics_loggers.py."""
import json
import math

import pytest

from rlperf.cli import main

pytest.importorskip("matplotlib")

from rlperf.plots import PlotInputError, new_figure, read_metrics, save_png  # noqa: E402
from rlperf.plots.bench import read_bench  # noqa: E402
from rlperf.plots.runs import STEP_SPLIT  # noqa: E402

MIN_COLORED = 3000
"""Coloured pixels a drawn picture has at least (curves, areas, bars); an empty canvas has ~0."""


def _metrics_line(k: int, abs_diff: float = 0.0) -> dict:
    return {"rollout_id": k, "rollout/raw_reward": 0.25 + 0.05 * k, "rollout/response_length": 2.0 + k % 2,
            "perf/longest_sample_tokens_per_sec": 10.0 + k, "train/train_rollout_logprob_abs_diff": abs_diff * k,
            "train/ppo_kl": -1e-6 * k, "perf/rollout_time": 0.3, "perf/log_prob_time": 0.2, "perf/train_time": 1.0 + 0.1 * k,
            "perf/update_weights_time": 0.01, "perf/step_time": 1.6 + 0.1 * k, "perf/tokens_per_sec": 500.0 - k,
            "memory/train_peak_bytes": 2**29 + k * 2**20, "memory/kind": "cpu_rss", "sync/weights_checksum": "ab"}


def _write_run(path, n=7, abs_diff=0.0):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(_metrics_line(k, abs_diff)) + "\n" for k in range(n)))
    return path


def test_the_ink_check_fails_on_an_empty_canvas(tmp_path, png_ink):
    fig = new_figure(15, 7.2)
    for i in range(6):
        ax = fig.add_subplot(2, 3, i + 1)
        ax.set_title("empty")
        ax.grid(True, alpha=0.3)
    stats = png_ink(save_png(fig, tmp_path / "empty.png"))
    assert stats["colored"] < 50


def test_one_run_draws_every_panel(tmp_path, png_ink, capsys):
    run = _write_run(tmp_path / "runA")
    assert main(["plot", str(run)]) == 0
    png, html = run / "plot.png", run / "plot.html"
    assert capsys.readouterr().out.split() == [str(png), str(html)]
    stats = png_ink(png)
    assert png.stat().st_size > 30_000 and stats["colored"] > MIN_COLORED and stats["colors"] > 200
    rgb = stats["rgb"]
    # every stacked phase is there in its colour (C0..C3 of matplotlib's palette)
    palette = {"C0": (0.122, 0.467, 0.706), "C1": (1.0, 0.498, 0.055), "C2": (0.173, 0.627, 0.173), "C3": (0.839, 0.153, 0.157)}
    for name, c in list(palette.items())[:len(STEP_SPLIT)]:
        close = (abs(rgb - c).max(axis=-1) < 0.12).sum()
        assert close > 100, (name, close)  # the weight sync band is thin (0.01 s of 1.6 s)
    assert "data:image/png;base64," in html.read_text()


def test_runs_overlay_and_labels(tmp_path, png_ink):
    a = _write_run(tmp_path / "a")
    b = _write_run(tmp_path / "b", n=5, abs_diff=1e-3)
    out = tmp_path / "both.png"
    assert main(["plot", str(a), str(b), "-o", str(out), "--label", "base", "--label", "tuned", "--no-html"]) == 0
    assert out.exists() and not out.with_suffix(".html").exists()
    one = tmp_path / "one.png"
    assert main(["plot", str(a), "-o", str(one), "--no-html"]) == 0
    both, single = png_ink(out), png_ink(one)
    assert both["rgb"].shape[0] > single["rgb"].shape[0]  # a step-split panel per run: another row
    assert both["colored"] > single["colored"]
    assert main(["plot", str(a), str(b), "--label", "only-one"]) == 2


def _panel(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_panels_read_true_at_a_glance():
    """Issue #40 item 6, on the figure itself: the response length and peak memory start at 0 (one shorter
    answer is not a cliff), the longest-sample rate has an axis of its own (not a line flat at 0 beside
    thousands of tokens/s), a run whose KL and gap are all exactly 0 has no empty log axis and its zero
    marks are whole, and rollouts count 1..N as the console does."""
    from rlperf.plots.runs import draw_runs

    rows = [{**_metrics_line(k, abs_diff=1e-3), "rollout/response_length": 2.0 - (k == 3) / 128, "perf/tokens_per_sec": 2000.0 + k,
             "perf/longest_sample_tokens_per_sec": 14.0 + k % 2} for k in range(80)]
    fig = draw_runs({"run": rows})
    length = _panel(fig, "response length")
    assert length.get_ylim()[0] == 0.0 and 2.0 < length.get_ylim()[1] < 3.0
    assert _panel(fig, "peak memory (largest phase)").get_ylim()[0] == 0.0
    tps = _panel(fig, "throughput")
    (longest,) = [ax for ax in fig.axes if ax is not tps and ax.bbox.bounds == tps.bbox.bounds]  # its twin
    (dashed,) = longest.get_lines()
    assert dashed.get_linestyle() == "--" and max(dashed.get_ydata()) > 0.5 * longest.get_ylim()[1]
    (solid,) = tps.get_lines()
    assert list(solid.get_xdata()[[0, -1]]) == [1, 80]  # rollout k/80 on the console is x = k
    assert 2080 < tps.get_ylim()[1] < 3000 and tps.get_ylim()[0] == 0.0

    gap = _panel(fig, "KL and train/rollout log-prob gap")
    assert gap.get_yscale() == "log" and len(gap.get_lines()) == 2  # the nonzero values of both series
    strip = fig.axes[fig.axes.index(gap) + 1]
    zero_rows = [t.get_text() for t in strip.get_yticklabels()]
    assert sorted(zero_rows) == ["logprob abs diff = 0 (1/80)", "|ppo_kl| = 0 (1/80)"]  # rollout 1 of each is 0
    low, high = strip.get_ylim()
    assert low <= -0.5 and high >= len(zero_rows) - 0.5  # every row of marks inside the strip, whole

    zeros = [{**r, "train/ppo_kl": 0.0, "train/train_rollout_logprob_abs_diff": 0.0} for r in rows]
    gap = _panel(draw_runs({"run": zeros}), "KL and train/rollout log-prob gap")
    assert gap.get_yscale() == "linear" and not gap.get_yticks().size and not gap.get_lines()
    assert [t.get_text() for t in gap.texts] == ["every value is exactly 0\n(marked below)"]


def test_bench_bars(tmp_path, png_ink, capsys):
    rows = [{"bench": "matmul", "case": f"M={m}", "kernel": "rlperf.matmul", "anchor": "cuBLAS", "kernel_ms": 1.0,
             "anchor_ms": r, "ratio": r, "extra": {"M": m}} for m, r in ((16, 0.7), (1024, 0.93), (4096, 0.95))]
    rows.append({"bench": "sync", "case": "in-process", "kernel": "in-process", "anchor": "d2d copy", "ratio": 0.49,
                 "extra": {}})
    rows.append({"bench": "sync", "case": "cold", "kernel": "x", "anchor": "y", "ratio": float("nan"), "extra": {}})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"environment": {"card": "card", "commit": "abc"}, "summary": {}, "rows": rows}))
    assert main(["plot", str(path)]) == 0
    png = tmp_path / "bench.png"
    assert capsys.readouterr().out.split()[0] == str(png)
    stats = png_ink(png)
    assert png.stat().st_size > 20_000 and stats["colored"] > MIN_COLORED
    red = ((stats["rgb"][..., 0] > 0.9) & (stats["rgb"][..., 1] < 0.15) & (stats["rgb"][..., 2] < 0.15)).sum()
    assert red > 50  # the matmul rows' target ticks (ratio_target: 0.75 at M <= 64, 0.90 at M >= 1024)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": rows[:2]}))
    assert main(["plot", str(path), str(other), "-o", str(tmp_path / "two.png")]) == 0


def test_usage_errors_name_the_path_and_line(tmp_path, capsys):
    def err(*args):
        assert main(["plot", *map(str, args)]) == 2
        return capsys.readouterr().err

    assert f"{tmp_path / 'missing'}: no such file or directory" in err(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert f"{tmp_path / 'empty' / 'metrics.jsonl'}: cannot read" in err(tmp_path / "empty")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert "no metrics lines" in err(run)
    (run / "metrics.jsonl").write_text(json.dumps(_metrics_line(0)) + "\n{broken\n")
    assert f"{run / 'metrics.jsonl'}:2: not JSON" in err(run)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    assert f"{run / 'metrics.jsonl'}:1: not a metrics line" in err(run)
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [\n  {"bench": "x"\n')
    assert f"{bad}:3: not JSON" in err(bad)
    bad.write_text(json.dumps({"rows": [{"bench": "x", "case": "c", "kernel": "k", "anchor": "a", "ratio": 1.0},
                                        {"bench": "x", "case": "c"}]}))
    assert f"{bad}: rows[1] lacks kernel, anchor, ratio" in err(bad)
    bad.write_text(json.dumps({"summary": {}}))
    assert "not an rlperf bench result" in err(bad)
    assert "not both" in err(run, bad)


def test_a_line_being_written_is_left_out(tmp_path):
    run = _write_run(tmp_path / "r", n=3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"rollout_id": 3, "rollout/raw_')
    assert [m["rollout_id"] for m in read_metrics(run)] == [0, 1, 2]
    with pytest.raises(PlotInputError):
        read_bench(tmp_path / "nope.json")


def test_bench_targets_are_ratios_where_stated():
    from rlperf.bench.harness import ratio_target

    assert ratio_target({"bench": "matmul", "extra": {"M": 4096}}) == 0.90
    assert ratio_target({"bench": "matmul", "extra": {"M": 8}}) == 0.75
    assert ratio_target({"bench": "matmul", "extra": {"M": 256}}) is None
    assert math.isclose(ratio_target({"bench": "logprob", "kernel": "fused_logprob fwd", "anchor": "lm-head matmul"}),
                        1 / 1.10)
    assert ratio_target({"bench": "sync", "kernel": "in-process", "anchor": "d2d copy"}) is None
