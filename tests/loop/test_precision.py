"""--precision (bf16 compute on float32 masters), the in-process engine's CUDA graphs and
--engine-weights: flags on the CPU, the loop on the CPU in bf16 (reference backend), and the
GPU run the issue asks for (marker gpu): bf16 true on-policy, exact, with CUDA-graph decode."""
import json

import pytest
import torch

from rlperf.loop import METRICS_FILE
from rlperf.loop.args import UsageError
from rlperf.loop.resolve import parse_train_args
from rlperf.loop.runner import Run

VOLATILE = ("perf/", "memory/")


def _stable(m):
    return {k: v for k, v in m.items() if not k.startswith(VOLATILE)}


def _ns(tmp, *flags):
    return parse_train_args(["--output-dir", str(tmp), "--no-progress", *flags])


# the CPU runs compare bits, not learning: 4 prompts x 4 samples a rollout instead of the embedded 8 x 16
SMALL = ("--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16")


def _saved_dtypes(model_dir):
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return {t.dtype for t in tensors.values()}, json.loads((model_dir / "config.json").read_text())["torch_dtype"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults")
def test_precision_flags_on_cpu(tmp_path):
    assert _ns(tmp_path).precision == "fp32"  # auto: fp32 on CPU
    assert _ns(tmp_path, "--bf16").precision == "bf16"
    assert _ns(tmp_path, "--precision", "bf16").precision == "bf16"
    assert _ns(tmp_path, "--bf16", "--fp32").precision == "fp32"  # the last one wins
    ns = _ns(tmp_path)
    assert ns.engine_weights == "buckets"  # auto on CPU
    assert _ns(tmp_path, "--engine-weights", "shared").engine_weights == "shared"
    with pytest.raises(UsageError, match="--engine-weights shared needs sync mode"):
        _ns(tmp_path, "--engine-weights", "shared", "--async")
    with pytest.raises(UsageError, match="--sglang-cuda-graph-max-bs"):
        _ns(tmp_path, "--sglang-cuda-graph-max-bs", "-1")


def test_bf16_on_the_interpreter_is_refused(tmp_path, interpreter):
    with pytest.raises(UsageError, match="--precision bf16 on CPU needs the reference backend"):
        _ns(tmp_path, "--bf16", "--device", "cpu", "--kernel-backend", "interpreter")


def test_bf16_loop_on_cpu_is_true_on_policy_and_saves_float32_masters(tmp_path):
    run = Run(_ns(tmp_path / "o", "--bf16", "--device", "cpu", "--true-on-policy-mode", "--num-rollout", "2",
                  "--save", str(tmp_path / "ckpt"), *SMALL))
    assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())  # compute weights
    assert all(p.dtype == torch.float32 for p in run.trainer.master_model.parameters())  # masters
    assert all(p.dtype == torch.bfloat16 for p in run.client.model.parameters())  # the engine runs bf16
    hist = run.run()
    assert [m["train/train_rollout_logprob_abs_diff"] for m in hist] == [0.0, 0.0]
    assert [m["train/ppo_kl"] for m in hist] == [0.0, 0.0]
    dtypes, saved = _saved_dtypes(tmp_path / "ckpt" / "iter_0000002" / "model")
    assert dtypes == {torch.float32} and saved == "float32"
    state = torch.load(tmp_path / "ckpt" / "iter_0000002" / "trainer.pt", weights_only=True)
    assert {s["exp_avg"].dtype for s in state["trainer"]["optimizer"]["state"].values()} == {torch.float32}


def test_bf16_resume_continues_identically(tmp_path):
    full = Run(_ns(tmp_path / "full", "--bf16", "--device", "cpu", "--num-rollout", "3", *SMALL)).run()
    Run(_ns(tmp_path / "first", "--bf16", "--device", "cpu", "--num-rollout", "2",
            "--save", str(tmp_path / "ckpt"), *SMALL)).run()
    rest = Run(_ns(tmp_path / "rest", "--bf16", "--device", "cpu", "--num-rollout", "3",
                   "--load", str(tmp_path / "ckpt"), *SMALL)).run()
    assert [m["rollout_id"] for m in rest] == [2]
    assert [_stable(m) for m in rest] == [_stable(m) for m in full[2:]]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shared_engine_weights_equal_buckets(tmp_path, precision):
    """The engine on the trainer's own compute weights gives the bits of the engine with a bucket-loaded copy."""
    runs = {}
    for mode in ("buckets", "shared"):
        run = Run(_ns(tmp_path / mode, f"--precision={precision}", "--device", "cpu", "--num-rollout", "2",
                      "--engine-weights", mode, *SMALL))
        assert (run.client.model is run.model) == (mode == "shared")
        runs[mode] = run.run()
        assert runs[mode][-1]["sync/weights_checksum"] == json.loads(
            (tmp_path / mode / METRICS_FILE).read_text().splitlines()[-1])["sync/weights_checksum"]
    assert [_stable(m) for m in runs["shared"]] == [_stable(m) for m in runs["buckets"]]


# ---- GPU (the lead runs these on the device) -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("engine_weights", ["shared", "buckets"])
def test_gpu_bf16_true_on_policy_with_cuda_graphs(tmp_path, engine_weights, capsys):
    """bf16 on CUDA by default; 3 rollouts of true on-policy give abs diff exactly 0 at every step; the
    in-process engine is bf16 and replays decode steps from CUDA graphs; the checkpoint holds float32
    masters. Prints the phase times so the two --engine-weights modes can be compared."""
    from rlperf.rollout.cuda_graph import DEFAULT_MAX_BS

    ns = _ns(tmp_path / "o", "--device", "cuda", "--true-on-policy-mode", "--num-rollout", "3",
             "--engine-weights", engine_weights, "--save", str(tmp_path / "ckpt"))
    assert ns.precision == "bf16"
    run = Run(ns)
    assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())
    assert all(p.dtype == torch.float32 for p in run.trainer.master_model.parameters())
    engine = run.client.engine
    assert all(p.dtype == torch.bfloat16 for p in run.client.model.parameters())
    assert engine.graphs is not None and engine.graphs.capture
    assert engine.graphs.max_bs == min(DEFAULT_MAX_BS, engine.config.max_running_requests)  # serve's default
    hist = run.run()
    assert [m["train/train_rollout_logprob_abs_diff"] for m in hist] == [0.0, 0.0, 0.0]
    assert engine.graphs.graphs, "no decode step was replayed from a CUDA graph"
    assert len({m["sync/weights_checksum"] for m in hist}) == 3
    dtypes, saved = _saved_dtypes(tmp_path / "ckpt" / "iter_0000003" / "model")
    assert dtypes == {torch.float32} and saved == "float32"
    with capsys.disabled():
        for m in hist:
            print(f"\n[{engine_weights}] rollout {m['rollout_id']}: rollout_time {m['perf/rollout_time']:.3f}s "
                  f"train_time {m['perf/train_time']:.3f}s update_weights_time {m['perf/update_weights_time']:.4f}s "
                  f"response_length {m['rollout/response_length']:.1f}")


@pytest.mark.gpu
def test_gpu_fp32_flag_keeps_float32_and_eager_decode(tmp_path):
    run = Run(_ns(tmp_path / "o", "--device", "cuda", "--fp32", "--sglang-cuda-graph-max-bs", "0",
                  "--true-on-policy-mode", "--num-rollout", "2"))
    assert run.model is run.trainer.master_model and all(p.dtype == torch.float32 for p in run.model.parameters())
    assert run.client.engine.graphs is None
    hist = run.run()
    assert [m["train/train_rollout_logprob_abs_diff"] for m in hist] == [0.0, 0.0]


@pytest.mark.gpu
def test_gpu_embedded_task_learns_through_the_cli(tmp_path):
    """``rlperf train --device cuda`` on the embedded task (gates first, bf16, CUDA-graph decode) ends
    with a mean reward >= 0.8 over its last 5 rollouts, true on-policy at every step."""
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlperf", "train", "--device", "cuda", "--true-on-policy-mode",
                           "--no-progress", "--output-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]
    rewards = [m["rollout/raw_reward"] for m in lines]
    print(f"\nembedded task on CUDA: rewards of the last 5 rollouts {rewards[-5:]}")
    assert len(rewards) == 80 and sum(rewards[-5:]) / 5 >= 0.8, rewards
    assert all(m["train/train_rollout_logprob_abs_diff"] == 0.0 for m in lines)
