"""The megatron backend's tensor-parallel-invariant numerics (rlperf/train/megatron/, kernels/tree_reduce.py).

Real rank processes (gloo, float32, the reference kernel backend) run the first RL step of the tiny
model at TP=1 (one process), TP=2 and PP=2 (two processes each): the old log-probs, the step's loss
and metrics, every gradient (under its Hugging Face name, gathered from the shards) and the weights
after the AdamW step must be the same bits in all three layouts, and the log-probs must equal rlperf's
own model in its tree mode (``reduction_leaves``), which is what the rollout engine computes: a TP=2
trainer stays exactly on-policy with a one-GPU engine.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")

import rlperf.kernels as K  # noqa: E402
from rlperf.kernels.tree_reduce import TREE_LEAVES  # noqa: E402
from rlperf.loop.placement import leave_process  # noqa: E402
from rlperf.model import preset  # noqa: E402
from rlperf.model.config import ModelConfig  # noqa: E402
from rlperf.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlperf.train import Sample, TrainArgs  # noqa: E402
from rlperf.train.batching import compute_log_probs  # noqa: E402

TIED = preset("tiny")
# untied, 2 layers: the head is a parameter of its own (on the last stage under PP)
UNTIED = ModelConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                     tie_word_embeddings=False)
LENGTHS = [(6, 3), (9, 5), (4, 1), (13, 7)]  # (total tokens, response tokens); 2 prompts x 2 samples


def _samples(cfg):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (n, r) in enumerate(LENGTHS):
        s = Sample(torch.randint(0, cfg.vocab_size, (n,), generator=g), r, reward=float(i % 2))
        s.rollout_log_probs = [-1.0] * r
        out.append(s)
    return out


def _args():
    # two micro-batches per step; clipping active (the grad norm enters the update)
    return TrainArgs(n_samples_per_prompt=2, micro_batch_size=2, lr=1e-2, clip_grad=0.5, entropy_coef=0.01)


def _rank(rank: int, world: int, tmp: str, tag: str, tp: int, pp: int, tied: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init-{tag}", rank=rank, world_size=world)
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.runtime import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from rlperf.train.megatron.trainer import MegatronTrainer

    cfg = TIED if tied else UNTIED
    try:
        initialize_model_parallel(ParallelLayout(tp, pp))
        with K.use_backend("reference"):
            weights = Qwen3ForCausalLM.random(cfg, seed=0, std=0.05).hf_state_dict()
            model = build_gpt_model(cfg)
            model.load_hf_tensors(weights)
            exported = dict(model.iter_hf_weights(bucket_bytes=4096))
            assert list(exported) == list(weights), "HF names out in hf_state_dict() order"
            assert all(torch.equal(exported[n], weights[n]) for n in weights), "HF weights round trip"
            trainer = MegatronTrainer(model, _args())
            samples = _samples(cfg)
            trainer.prepare(samples)
            metrics = trainer.train_step(samples)
            grads = dict(trainer.iter_hf_grads(bucket_bytes=4096))
            after = dict(trainer.iter_hf_weights(bucket_bytes=4096))
        if rank == 0:
            torch.save({"log_probs": [s.log_probs for s in samples], "metrics": metrics, "grads": grads,
                        "after": after}, f"{tmp}/{tag}.pt")
        dist.barrier()
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    leave_process(0)


def _run(tmp, tag, tp, pp, tied):
    world = tp * pp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp), tag, tp, pp, tied)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0, f"{tag}: rank exited with {p.exitcode}"
    return torch.load(f"{tmp}/{tag}.pt")


def _assert_same(a, b, what):
    assert a["metrics"] == b["metrics"], what
    for x, y in zip(a["log_probs"], b["log_probs"]):
        assert torch.equal(x, y), what
    assert list(a["grads"]) == list(b["grads"]), what
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), f"{what}: gradient {name}"
        assert torch.equal(a["after"][name], b["after"][name]), f"{what}: weight {name} after the step"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tp1_tp2_pp2_bit_identical(tmp_path, tied):
    one = _run(tmp_path, "tp1", 1, 1, tied)
    tp2 = _run(tmp_path, "tp2", 2, 1, tied)
    pp2 = _run(tmp_path, "pp2", 1, 2, tied)
    _assert_same(one, tp2, "TP=2 vs TP=1")
    _assert_same(one, pp2, "PP=2 vs TP=1")
    # the step did something, and the gradient norm was clipped
    assert one["metrics"]["train/grad_norm"] > 0.5
    assert any(not torch.equal(one["after"][n], w) for n, w in
               Qwen3ForCausalLM.random(TIED if tied else UNTIED, seed=0, std=0.05).hf_state_dict().items())
    # the trainer's old log-probs are the rlperf model's in tree mode, bit for bit (the engine's path)
    cfg = TIED if tied else UNTIED
    with K.use_backend("reference"):
        ref = Qwen3ForCausalLM.random(cfg, seed=0, std=0.05, )
        ref.reduction_leaves = TREE_LEAVES
        mine = compute_log_probs(ref, _samples(cfg), micro_batch_size=1)
        ref.reduction_leaves = None
        plain = compute_log_probs(ref, _samples(cfg), micro_batch_size=1)
    for x, y in zip(one["log_probs"], mine):
        assert torch.equal(x, y)
    # and the tree is a different order from the plain kernels (the test can tell the two apart)
    assert any(not torch.equal(x, y) for x, y in zip(one["log_probs"], plain))
