"""The scale-out benchmark's pieces on CPU (bench/scaleout.py): a layout's row from its metrics, the
table with speedups and the target's verdict, and the refusals; the runs themselves need 4 GPUs."""
import pytest
import torch

from rlperf.bench import scaleout as S


def _metrics(tokens_per_s, diffs):
    return [{"rollout_id": i, "perf/tokens_per_sec": t, "perf/step_time": 10.0 / t, "perf/rollout_time": 1.0,
             "perf/train_time": 2.0, "perf/log_prob_time": 0.5, "perf/update_weights_time": 0.01, "rollout/total_tokens": 100,
             "train/train_rollout_logprob_abs_diff": d} for i, (t, d) in enumerate(zip(tokens_per_s, diffs))]


def test_a_layout_row_means_the_rollouts_after_the_first_and_keeps_every_abs_diff():
    row = S.summarize_layout(_metrics([1.0, 100.0, 300.0], [0.0, 0.0, 0.0]))
    assert row["tokens_per_s"] == 200.0 and row["sync_ms"] == 10.0 and row["rollouts"] == 3
    assert row["log_prob_s"] == 0.5
    assert row["abs_diff"] == [0.0, 0.0, 0.0]
    assert S.summarize_layout(_metrics([50.0], [0.0]))["tokens_per_s"] == 50.0  # one rollout: itself


def test_the_table_gives_each_layout_its_speedup_and_the_verdict():
    rows = {"1gpu": S.summarize_layout(_metrics([1.0, 100.0], [0.0, 0.0])),
            "dp2-engines2": S.summarize_layout(_metrics([1.0, 190.0], [0.0, 0.0])),
            "dp2": {"skipped": "needs 2 GPUs, 1 visible"}}
    text = S.report(rows)
    assert "| dp2-engines2 | 4 | 190 | 1.90x |" in text and "| 1gpu | 1 | 100 | 1.00x |" in text
    assert "| 2.000 | 0.500 | 10.0 |" in text  # train, log-prob, sync
    assert "dp2-engines2 / 1gpu tokens/s = 1.90x (target >= 1.8x: met)" in text
    assert "| dp2 | 2 | skipped: needs 2 GPUs, 1 visible |" in text
    assert text.endswith("abs diff exactly 0 at every step of every layout measured: yes")
    rows["dp2-engines2"] = S.summarize_layout(_metrics([1.0, 150.0], [0.0, 1e-3]))
    text = S.report(rows)
    assert "(target >= 1.8x: missed)" in text and text.endswith("measured: NO")


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "dp8"], "--layouts dp8: choose from 1gpu, dp2-engines2, dp2"),
    (["--num-rollout", "0"], "--num-rollout must be >= 1"),
    (["--train-flags", "--fsdp-gather 'step"], "--train-flags"),
    ([], "scaleout: needs CUDA GPUs"),
])
def test_what_cannot_run_exits_2(argv, message, capsys, tmp_path):
    if torch.cuda.is_available() and not argv:
        pytest.skip("the no-GPU refusal")
    assert S.main([*argv, "--output-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
