"""CUDA graphs over the megatron trainer's micro-step (``cuda_graph_buckets`` at one rank,
``rlperf.train.megatron.trainer``).

* CPU, interpreter: what a replay computes, capture aside: the tree model's log-probs and every gradient
  (the tied head's, kept apart in ``head_grad``, included) of a micro-batch padded to a bucket the way the
  graphs pad it (one pad sequence, empty sequence slots, padded logit rows) equal the unpadded ones bit for
  bit; the tied head's side output accumulates as the eager backward does.
* GPU: two mixed-precision optimizer steps of the trainer with and without graphs: the same metrics and
  master weights bit for bit, and fewer launch calls.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

import rlperf.kernels as K  # noqa: E402
from rlperf.model.config import preset  # noqa: E402
from rlperf.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlperf.train import Sample, TrainArgs  # noqa: E402
from rlperf.train.batching import make_micro_batch, pad_micro_batch  # noqa: E402
from rlperf.train.cuda_graph import seq_slots  # noqa: E402
from rlperf.train.megatron.runtime import ParallelLayout  # noqa: E402

LENGTHS = [(9, 4), (23, 11), (5, 1)]  # (tokens, response tokens): 37 tokens, 16 log-prob rows


def _samples(vocab: int, seed: int = 3, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, vocab, (n,), generator=g), r, reward=float(i % 2))
            for i, (n, r) in enumerate(lengths)]


@pytest.fixture
def one_rank(tmp_path):
    from rlperf.train.megatron.runtime import destroy_model_parallel, initialize_model_parallel

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        initialize_model_parallel(ParallelLayout())
        yield
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _loss(lp, ent):
    w = torch.linspace(-1.0, 1.0, lp.numel(), device=lp.device)
    return (lp * w).sum() + 0.01 * ent.sum()


def test_a_padded_bucket_gives_the_tree_step_its_unpadded_bits(one_rank, interpreter):
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.trainer import graph_log_probs

    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=1)  # tied embeddings: the head_grad side output
    assert cfg.tie_word_embeddings
    model = build_gpt_model(cfg, torch.float32)
    model.load_hf_tensors(Qwen3ForCausalLM.random(cfg, seed=0, std=0.05).hf_state_dict())
    model.to(torch.float16)
    model.train()
    samples = _samples(cfg.vocab_size)
    mb = make_micro_batch(samples, range(len(samples)))
    n = sum(mb.response_lengths)
    params = [p for p in model.parameters() if p.requires_grad]
    runs = []
    with K.use_backend("interpreter"), K.use_mode("invariant"):
        for bucket in (None, 64):
            batch = mb if bucket is None else pad_micro_batch(mb, bucket, seq_slots(bucket, len(samples)))
            model.head_grad = None
            lp, ent = graph_log_probs(model, batch, 0.9, with_entropy=True)
            grads = torch.autograd.grad(_loss(lp[:n], ent[:n]), params)
            runs.append((lp[:n].detach(), ent[:n].detach(), grads, model.head_grad))
    (lp0, ent0, g0, h0), (lp1, ent1, g1, h1) = runs
    assert batch.num_tokens == 64 and batch.cu_seqlens.numel() > len(samples) + 2  # a pad sequence, empty slots
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    assert h0 is not None and torch.equal(h0, h1)
    differ = [i for i, (a, b) in enumerate(zip(g0, g1)) if not torch.equal(a, b)]
    assert not differ, f"gradients of parameters {differ} moved with the padding"


def test_the_tied_head_side_output_accumulates_as_the_eager_backward():
    from types import SimpleNamespace

    from rlperf.train.megatron.trainer import _TiedHeadGrad

    model = SimpleNamespace(head_grad=None)
    side = _TiedHeadGrad(model)
    static = torch.tensor([1.5, -2.0])
    side.deliver(static)
    assert torch.equal(model.head_grad, static) and model.head_grad is not static  # a copy: the next replay overwrites
    side.deliver(static)
    assert torch.equal(model.head_grad, torch.tensor([3.0, -4.0]))
    kept = side.stash()
    assert model.head_grad is None and torch.equal(kept, torch.tensor([3.0, -4.0]))
    side.restore(kept)
    assert model.head_grad is kept


def test_graphs_need_one_rank_the_tree_and_cuda(one_rank):
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.trainer import MegatronTrainer

    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=1)
    args = TrainArgs(n_samples_per_prompt=1, use_dynamic_batch_size=True, max_tokens_per_gpu=64,
                     cuda_graph_buckets=(64,))
    with pytest.raises(ValueError, match="the tree numerics only"):
        MegatronTrainer(build_gpt_model(cfg, torch.float32, plain=True), args)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--cuda-graph-buckets replays CUDA graphs: it needs a CUDA device"):
            MegatronTrainer(build_gpt_model(cfg, torch.float32), args)


@pytest.mark.gpu
def test_gpu_graphed_megatron_steps_equal_eager_steps_bit_for_bit(one_rank):
    """Two optimizer steps (bf16 compute, float32 masters, several micro-batches of two buckets, entropy in
    the loss, tied head) with and without ``cuda_graph_buckets``: the same metrics, log-probs and master
    weights bit for bit."""
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.trainer import MegatronTrainer

    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    weights = Qwen3ForCausalLM.random(cfg, seed=5, std=0.02).hf_state_dict()
    lengths = [(40, 20), (301, 150), (513, 400), (129, 1), (7, 6), (555, 300), (24, 23)]
    results = []
    for buckets in ((), (768, 1100)):
        model = build_gpt_model(cfg, torch.float32, device=torch.device("cuda"))
        model.load_hf_tensors(weights)
        args = TrainArgs(n_samples_per_prompt=len(lengths), use_dynamic_batch_size=True, max_tokens_per_gpu=1100,
                         entropy_coef=0.01, rollout_temperature=0.9, lr=1e-4, cuda_graph_buckets=buckets)
        trainer = MegatronTrainer(model, args, compute_dtype=torch.bfloat16)
        steps = []
        with K.use_mode("invariant"):
            for step in range(2):
                samples = _samples(cfg.vocab_size, seed=20 + step, lengths=lengths)
                trainer.prepare(samples)
                steps.append(([s.log_probs for s in samples], trainer.train_step(samples)))
        masters = [m.detach().clone() for m in trainer.master_params]
        results.append((steps, masters, trainer))
    (eager_steps, eager_w, _), (graph_steps, graph_w, graphed) = results
    assert graphed.graphs is not None and len(graphed.graphs.train_graphs) == 2  # both buckets captured
    for (lp_e, m_e), (lp_g, m_g) in zip(eager_steps, graph_steps):
        assert all(torch.equal(a, b) for a, b in zip(lp_e, lp_g))
        assert m_e == m_g
    assert all(torch.equal(a, b) for a, b in zip(eager_w, graph_w))
