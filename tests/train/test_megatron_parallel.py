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
                     num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=256,
                     tie_word_embeddings=False)


def _engine_samples(cfg, backend="reference"):
    """Four samples (2 prompts x 2) whose responses and rollout log-probs come from rlperf's engine on
    one process, in tree mode (``reduction_leaves``): what a one-GPU engine gives a TP=2 trainer."""
    from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
    from rlperf.rollout.tokenizer import ByteTokenizer

    with K.use_backend(backend):
        model = Qwen3ForCausalLM.random(cfg, seed=0, std=0.05, reduction_leaves=TREE_LEAVES)
        engine = Engine(model, ByteTokenizer(cfg.vocab_size), EngineConfig(max_total_tokens=1024))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9)]
        prompts = [p for p in prompts for _ in range(2)]
        params = [SamplingParams(max_new_tokens=m, temperature=1.0, ignore_eos=True, seed=i)
                  for i, m in enumerate((3, 6, 4, 2))]
        results = engine.generate(prompts, params)
    out = []
    for i, (p, r) in enumerate(zip(prompts, results)):
        s = Sample(torch.tensor(p + r.output_ids), len(r.output_ids), reward=float(i % 2))
        s.rollout_log_probs = list(r.output_logprobs)
        out.append(s)
    return out


def _args():
    # two micro-batches per step; clipping active (the grad norm enters the update)
    return TrainArgs(n_samples_per_prompt=2, micro_batch_size=2, lr=1e-2, clip_grad=0.5, entropy_coef=0.01)


def _rank(rank: int, world: int, tmp: str, tag: str, tp: int, pp: int, tied: bool, resume: str | None = None,
          backend: str = "reference") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init-{tag}", rank=rank, world_size=world)
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.runtime import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from rlperf.train.megatron.trainer import MegatronTrainer

    cfg = TIED if tied else UNTIED
    try:
        initialize_model_parallel(ParallelLayout(tp, pp))
        with K.use_backend(backend):
            weights = Qwen3ForCausalLM.random(cfg, seed=0, std=0.05).hf_state_dict()
            model = build_gpt_model(cfg)
            model.load_hf_tensors(weights)
            exported = dict(model.iter_hf_weights(bucket_bytes=4096))
            assert list(exported) == list(weights), "HF names out in hf_state_dict() order"
            assert all(torch.equal(exported[n], weights[n]) for n in weights), "HF weights round trip"
            trainer = MegatronTrainer(model, _args())
            samples = torch.load(f"{tmp}/samples-{'tied' if tied else 'untied'}-{backend}.pt", weights_only=False)
            if resume is not None:  # a checkpoint written at another layout: weights and AdamW state
                saved = torch.load(resume, weights_only=False)
                model.load_hf_tensors(saved["weights"])
                trainer.load_state_dict(saved["trainer"])
            trainer.prepare(samples)
            metrics = trainer.train_step(samples)
            grads = dict(trainer.iter_hf_grads(bucket_bytes=4096))
            after = dict(trainer.iter_hf_weights(bucket_bytes=4096))
            checkpoint = {"weights": trainer.gather_model(bucket_bytes=4096), "trainer": trainer.state_dict(4096)}
        if rank == 0:
            torch.save({"log_probs": [s.log_probs for s in samples], "metrics": metrics, "grads": grads,
                        "after": after}, f"{tmp}/{tag}.pt")
            checkpoint["weights"] = checkpoint["weights"].hf_state_dict()
            torch.save(checkpoint, f"{tmp}/{tag}-checkpoint.pt")
        dist.barrier()
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    leave_process(0)


def _run(tmp, tag, tp, pp, tied, resume=None, dp=1, backend="reference"):
    kind = f"{'tied' if tied else 'untied'}-{backend}"
    if not os.path.exists(f"{tmp}/samples-{kind}.pt"):
        torch.save(_engine_samples(TIED if tied else UNTIED, backend), f"{tmp}/samples-{kind}.pt")
    world = tp * pp * dp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp), tag, tp, pp, tied, resume, backend)) for r in range(world)]
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
    # true on-policy: the trainer's old log-probs at every layout are the engine's rollout log-probs
    samples = torch.load(f"{tmp_path}/samples-{'tied' if tied else 'untied'}-reference.pt", weights_only=False)
    for got in (one, tp2, pp2):
        assert got["metrics"]["train/train_rollout_logprob_abs_diff"] == 0.0
        for x, s in zip(got["log_probs"], samples):
            assert torch.equal(x, s.rollout_log_probs_tensor())
    # the tree is another order than the plain kernels: the plain model's log-probs differ (the test
    # can tell the two apart)
    with K.use_backend("reference"):
        plain = compute_log_probs(Qwen3ForCausalLM.random(TIED if tied else UNTIED, seed=0, std=0.05), samples,
                                  micro_batch_size=1)
    assert any(not torch.equal(x, y) for x, y in zip(one["log_probs"], plain))


def test_checkpoint_resumes_across_a_layout_change(tmp_path):
    # step 1 at TP=2, checkpoint (HF-named weights and AdamW moments), step 2 at PP=2 from it; and the
    # same two steps at TP=1 throughout: the second step's results are the same bits
    _run(tmp_path, "first-tp2", 2, 1, False)
    _run(tmp_path, "first-tp1", 1, 1, False)
    second_pp2 = _run(tmp_path, "second-pp2", 1, 2, False, resume=f"{tmp_path}/first-tp2-checkpoint.pt")
    second_tp1 = _run(tmp_path, "second-tp1", 1, 1, False, resume=f"{tmp_path}/first-tp1-checkpoint.pt")
    _assert_same(second_tp1, second_pp2, "resumed at PP=2 from TP=2 vs TP=1 throughout")
    saved = torch.load(f"{tmp_path}/first-tp1-checkpoint.pt", weights_only=False)["trainer"]["optimizer"]
    assert saved["step"] == 1.0 and set(saved["moments"]) == {"exp_avg", "exp_avg_sq"}
    assert any(t.abs().sum() > 0 for t in saved["moments"]["exp_avg_sq"].values())


def test_data_parallel_replicas_train_the_global_batch(tmp_path):
    # 2 data-parallel replicas (TP=1): each computes half of the samples; log-probs are the same bits
    # (batch invariance), the summed gradient is the one-process gradient up to float32 rounding (the
    # replicas' sums are added in replica order, not micro-batch by micro-batch)
    one = _run(tmp_path, "one", 1, 1, False)
    dp2 = _run(tmp_path, "dp2", 1, 1, False, dp=2)
    for x, y in zip(one["log_probs"], dp2["log_probs"]):
        assert torch.equal(x, y)
    for k, v in one["metrics"].items():
        assert dp2["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for name, g in one["grads"].items():
        assert torch.allclose(dp2["grads"][name], g, rtol=1e-4, atol=1e-7), name


def test_triton_path_tp1_equals_tp2_under_the_interpreter(tmp_path, interpreter):
    # the GPU code path (Triton leaf products with pinned tile configs, the fused log-prob kernel's leaf
    # statistics and backward, q/k norm + RoPE per head block, the attention backward) under Triton's
    # CPU interpreter: TP=2 equals TP=1 bit for bit and both equal the engine's rollout log-probs
    one = _run(tmp_path, "tp1", 1, 1, False, backend="interpreter")
    tp2 = _run(tmp_path, "tp2", 2, 1, False, backend="interpreter")
    _assert_same(one, tp2, "interpreter: TP=2 vs TP=1")
    assert one["metrics"]["train/train_rollout_logprob_abs_diff"] == 0.0
