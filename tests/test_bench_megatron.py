"""``python -m rlperf.bench.megatron --summary``: the targets from the run files present, and no verdict
on a pair of runs of which one did not run."""
import json

from rlperf.bench.megatron import summary


def _run(folder, name, tokens_per_s, log_probs, grads, abs_diff=None, gpu_busy_ms=None):
    doc = {"train_tokens_per_s": tokens_per_s, "gpu": "NVIDIA H100 80GB HBM3", "log_prob_digests": log_probs,
           "grad_digests": grads}
    if gpu_busy_ms is not None:
        doc["gpu_busy_ms"] = gpu_busy_ms
    if abs_diff is not None:
        doc["train_rollout_logprob_abs_diff"] = abs_diff
    (folder / f"{name}.json").write_text(json.dumps(doc))


def test_summary_compares_the_runs_present_and_leaves_missing_pairs_unjudged(tmp_path):
    _run(tmp_path, "tree-0.6b-tp1", 10_000.0, ["a", "b"], ["g"], abs_diff=0.0)
    _run(tmp_path, "tree-0.6b-tp2", 12_000.0, ["a", "b"], ["g"], abs_diff=0.0)
    _run(tmp_path, "tree-0.6b-tp2-dp2", 18_000.0, ["a", "b"], ["other"], abs_diff=0.0)
    s = summary(str(tmp_path))
    assert s["bits_0.6b_tp1_vs_tp2"] == {"log_probs": True, "grads": True}
    assert s["bits_0.6b_tp1_vs_tp2_dp2"] == {"log_probs": True, "grads": False}  # measured and different
    assert s["bits_0.6b_tp1_vs_pp2"] == {"log_probs": None, "grads": None}  # pp2 did not run: no verdict
    assert s["bits_1.7b_tp1_vs_tp2"] == {"log_probs": None, "grads": None}
    assert s["tp2_dp2_on_4_over_tp2_on_2_0.6b (>= 1.7)"] == 1.5
    assert s["target3_tp2_over_tp1_1.7b (>= 1.6)"] is None
    assert s["engine_abs_diff"] == {"tree-0.6b-tp1": 0.0, "tree-0.6b-tp2": 0.0, "tree-0.6b-tp2-dp2": 0.0}
    assert s["gpus"] == ["NVIDIA H100 80GB HBM3"]


def test_summary_names_the_fused_tree_nodes_ab_and_the_transformer_engine_anchor(tmp_path):
    _run(tmp_path, "fsdp-0.6b-tp1", 60_000.0, ["a"], ["g"])
    _run(tmp_path, "tree-0.6b-tp1", 12_000.0, ["a"], ["g"], abs_diff=0.0)
    _run(tmp_path, "tree-0.6b-tp1-perleaf", 10_000.0, ["a"], ["g"], abs_diff=0.0)
    _run(tmp_path, "te-0.6b-tp1", 48_000.0, [], [])  # TE's run has no digests: its numerics are not rlperf's
    s = summary(str(tmp_path))
    assert s["fused_tree_node_over_per_leaf_tp1_0.6b"] == 1.2
    assert s["bits_0.6b_fused_vs_per_leaf"] == {"log_probs": True, "grads": True}
    assert s["tree_tp1_over_transformer_engine_tp1_0.6b"] == 0.25
    assert s["fsdp_over_transformer_engine_tp1_0.6b"] == 1.25


def test_summary_compares_the_steps_gpu_work_where_both_runs_profiled_a_step(tmp_path):
    _run(tmp_path, "fsdp-0.6b-tp1", 60_000.0, ["a"], ["g"], gpu_busy_ms=100.0)
    _run(tmp_path, "tree-0.6b-tp1", 40_000.0, ["a"], ["g"], abs_diff=0.0, gpu_busy_ms=130.0)
    _run(tmp_path, "tree-0.6b-tp2", 40_000.0, ["a"], ["g"], abs_diff=0.0)  # no --kernel-table
    s = summary(str(tmp_path))
    assert s["gpu_busy_ms"] == {"fsdp-0.6b-tp1": 100.0, "tree-0.6b-tp1": 130.0}
    assert s["gpu_work_tree_tp1_over_fsdp_0.6b"] == 1.3
    (tmp_path / "fsdp-0.6b-tp1.json").unlink()
    assert summary(str(tmp_path))["gpu_work_tree_tp1_over_fsdp_0.6b"] is None
