"""``rlperf train --model qwen3-moe-tiny`` on the CPU: true on-policy (abs diff exactly 0 at every
step) on the reference kernels and on the Triton MoE kernels under the interpreter, and the run learns."""
import json

from rlperf.loop import train

MOE = ("--no-progress", "--model", "qwen3-moe-tiny", "--device", "cpu")
CHEAP = ("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4")


def _abs_diffs(hist):
    return [m["train/train_rollout_logprob_abs_diff"] for m in hist]


def test_moe_true_on_policy_and_the_reward_rises(tmp_path):
    hist = train(["--output-dir", str(tmp_path), *MOE, "--true-on-policy-mode", "--num-rollout", "40", "--lr", "1e-3"])
    assert _abs_diffs(hist) == [0.0] * 40
    rewards = [m["rollout/raw_reward"] for m in hist]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert end >= start + 0.15, f"the MoE run did not learn: {rewards}"


def test_moe_true_on_policy_on_the_triton_kernels(tmp_path, interpreter):
    """The MoE kernels themselves (routing, permutation, grouped GEMM, combine and their backward)
    under the interpreter, engine and trainer alike. A prompt file instead of the embedded task: its
    format warm-up (60 supervised steps) would take most of an hour under the interpreter."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"question {i}?", "label": "A"}) + "\n" for i in range(2)))
    hist = train(["--output-dir", str(tmp_path / "out"), *MOE, *CHEAP, "--prompt-data", str(data),
                  "--rollout-max-response-len", "3", "--true-on-policy-mode", "--num-rollout", "2",
                  "--kernel-backend", "interpreter"])
    assert _abs_diffs(hist) == [0.0, 0.0]
