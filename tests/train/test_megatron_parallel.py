"""The megatron backend's tensor-parallel-invariant numerics (rlperf/train/megatron/, kernels/tree_reduce.py).

Real rank processes (gloo, float32) run RL steps of the tiny model in many layouts: TP=1 (one
process), TP=2, TP=2 with sequence parallelism, PP=2 and DP=2 with and without the distributed
optimizer (two processes). The old log-probs, the step's loss and metrics, every gradient (under its
Hugging Face name, gathered from the shards) and the weights after the AdamW step must be the same bits
in the TP / SP / PP layouts, and the log-probs must equal rlperf's own model in its tree mode
(``reduction_leaves``), which is what the rollout engine computes: a TP=2 trainer stays exactly
on-policy with a one-GPU engine.

To keep CI short every layout runs once, in one spawn for the whole module: one process for the TP=1
runs and a pair of processes that re-lays out its megatron groups run after run (``SCENARIOS``); the
tests below compare the saved results.
"""
import dataclasses
import datetime
import os
import traceback

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
# the Triton interpreter runs every kernel program in Python: one layer and short responses keep the
# interpreter's runs (engine and trainer) within seconds
ONE_LAYER = dataclasses.replace(UNTIED, num_hidden_layers=1)

# (tag, TP, PP, options). ``steps``: optimizer steps (each step's results are kept); ``save``: write a
# checkpoint (HF-named float32 weights and AdamW state) after that many steps; ``resume``: start from
# another run's checkpoint.
ONE_RANK = [
    ("tp1-tied", 1, 1, dict(tied=True)),
    ("tp1-untied", 1, 1, dict(steps=2)),
    ("tp1-interp", 1, 1, dict(backend="interpreter")),
]
TWO_RANKS = [
    ("tp2-tied", 2, 1, dict(tied=True)),
    ("pp2-tied", 1, 2, dict(tied=True)),
    ("sp-tied", 2, 1, dict(tied=True, sp=True)),
    ("tp2-untied", 2, 1, dict(save=1)),
    ("pp2-untied", 1, 2, {}),
    ("sp-untied", 2, 1, dict(sp=True)),
    ("pp2-resumed", 1, 2, dict(resume="tp2-untied")),  # a layout change: TP=2 -> PP=2
    ("dp2", 1, 1, dict(steps=2, save=1)),
    ("dp2-distopt", 1, 1, dict(steps=2, save=1, distopt=True, grad_bucket_bytes=4096)),  # many gradient buckets
    ("dp2-resumed", 1, 1, dict(resume="tp2-untied")),  # TP=2 -> DP=2
    ("dp2-distopt-resumed", 1, 1, dict(resume="tp2-untied", distopt=True)),
    ("sp-interp", 2, 1, dict(backend="interpreter", sp=True)),
]


def _config(tied: bool, backend: str) -> ModelConfig:
    return TIED if tied else (ONE_LAYER if backend == "interpreter" else UNTIED)


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
        lengths = (2, 3, 2, 1) if backend == "interpreter" else (3, 6, 4, 2)
        params = [SamplingParams(max_new_tokens=m, temperature=1.0, ignore_eos=True, seed=i)
                  for i, m in enumerate(lengths)]
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


def _samples_file(tmp, tied, backend):
    return f"{tmp}/samples-{'tied' if tied else 'untied'}-{backend}.pt"


def _scenario(tmp: str, tag: str, tp: int, pp: int, tied: bool = False, sp: bool = False, distopt: bool = False,
              backend: str = "reference", steps: int = 1, save: int | None = None, resume: str | None = None,
              grad_bucket_bytes: int | None = None) -> None:
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.runtime import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from rlperf.train.megatron.trainer import MegatronTrainer

    cfg = _config(tied, backend)
    initialize_model_parallel(ParallelLayout(tp, pp, sequence_parallel=sp))
    with K.use_backend(backend):
        weights = Qwen3ForCausalLM.random(cfg, seed=0, std=0.05).hf_state_dict()
        model = build_gpt_model(cfg, sequence_parallel=sp)
        model.load_hf_tensors(weights)
        exported = dict(model.iter_hf_weights(bucket_bytes=4096))
        assert list(exported) == list(weights), "HF names out in hf_state_dict() order"
        assert all(torch.equal(exported[n], weights[n]) for n in weights), "HF weights round trip"
        trainer = MegatronTrainer(model, _args(), distributed_optimizer=distopt)
        if grad_bucket_bytes is not None:
            trainer.grad_bucket_bytes = grad_bucket_bytes
        samples = torch.load(_samples_file(tmp, tied, backend), weights_only=False)
        if resume is not None:  # a checkpoint written at another layout: weights and AdamW state
            saved = torch.load(f"{tmp}/{resume}-checkpoint.pt", weights_only=False)
            model.load_hf_tensors(saved["weights"])
            trainer.load_state_dict(saved["trainer"])
        results = []
        for step in range(steps):
            trainer.prepare(samples)
            metrics = trainer.train_step(samples)
            # (cloned: at one rank a replicated tensor comes out as the live parameter itself)
            results.append({"log_probs": [s.log_probs for s in samples], "metrics": metrics,
                            "grads": {n: t.clone() for n, t in trainer.iter_hf_grads(bucket_bytes=4096)},
                            "after": {n: t.clone() for n, t in trainer.iter_hf_weights(bucket_bytes=4096)}})
            if save == step + 1:
                checkpoint = {"weights": trainer.gather_model(bucket_bytes=4096), "trainer": trainer.state_dict(4096)}
                if dist.get_rank() == 0:
                    checkpoint["weights"] = checkpoint["weights"].hf_state_dict()
                    torch.save(checkpoint, f"{tmp}/{tag}-checkpoint.pt")
    if dist.get_rank() == 0:
        torch.save(results, f"{tmp}/{tag}.pt")
    dist.barrier()
    destroy_model_parallel()


def _worker(rank: int, world: int, tmp: str, scenarios: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init-{world}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    code = 0
    try:
        for tag, tp, pp, opts in scenarios:
            _scenario(tmp, tag, tp, pp, **opts)
    except BaseException:
        with open(f"{tmp}/error-{world}-{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        if code == 0:
            dist.destroy_process_group()
    leave_process(code)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario's results by tag (a list of steps), and the engine samples by (tied, backend)."""
    tmp = tmp_path_factory.mktemp("megatron")
    samples = {}
    for tied, backend in ((True, "reference"), (False, "reference"), (False, "interpreter")):
        if backend == "interpreter" and os.environ.get("TRITON_INTERPRET") != "1":
            continue
        samples[tied, backend] = _engine_samples(_config(tied, backend), backend)
        torch.save(samples[tied, backend], _samples_file(tmp, tied, backend))
    have = {b for _, b in samples}
    pick = [[s for s in group if s[3].get("backend", "reference") in have] for group in (ONE_RANK, TWO_RANKS)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(0, 1, str(tmp), pick[0]))]
    procs += [ctx.Process(target=_worker, args=(r, 2, str(tmp), pick[1])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    errors = [f.read_text() for f in sorted(tmp.glob("error-*.txt"))]
    assert not errors and all(p.exitcode == 0 for p in procs), "\n".join(errors) or [p.exitcode for p in procs]
    out = {tag: torch.load(f"{tmp}/{tag}.pt") for tag, *_ in pick[0] + pick[1]}
    out["checkpoints"] = {tag: torch.load(f"{tmp}/{tag}-checkpoint.pt", weights_only=False)
                          for tag, *_, opts in pick[0] + pick[1] if opts.get("save")}
    out["samples"] = samples
    return out


def _assert_same(a, b, what):
    assert a["metrics"] == b["metrics"], what
    for x, y in zip(a["log_probs"], b["log_probs"]):
        assert torch.equal(x, y), what
    assert list(a["grads"]) == list(b["grads"]), what
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), f"{what}: gradient {name}"
        assert torch.equal(a["after"][name], b["after"][name]), f"{what}: weight {name} after the step"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tp1_tp2_sp_pp2_bit_identical(runs, tied):
    kind = "tied" if tied else "untied"
    (one, *_), (tp2,), (sp,), (pp2,) = (runs[f"{t}-{kind}"] for t in ("tp1", "tp2", "sp", "pp2"))
    _assert_same(one, tp2, "TP=2 vs TP=1")
    _assert_same(one, sp, "TP=2 with sequence parallelism vs TP=1")
    _assert_same(one, pp2, "PP=2 vs TP=1")
    # the step did something, and the gradient norm was clipped
    assert one["metrics"]["train/grad_norm"] > 0.5
    assert any(not torch.equal(one["after"][n], w) for n, w in
               Qwen3ForCausalLM.random(TIED if tied else UNTIED, seed=0, std=0.05).hf_state_dict().items())
    # true on-policy: the trainer's old log-probs at every layout are the engine's rollout log-probs
    samples = runs["samples"][tied, "reference"]
    for got in (one, tp2, sp, pp2):
        assert got["metrics"]["train/train_rollout_logprob_abs_diff"] == 0.0
        for x, s in zip(got["log_probs"], samples):
            assert torch.equal(x, s.rollout_log_probs_tensor())
    # the tree is another order than the plain kernels: the plain model's log-probs differ (the test
    # can tell the two apart)
    with K.use_backend("reference"):
        plain = compute_log_probs(Qwen3ForCausalLM.random(TIED if tied else UNTIED, seed=0, std=0.05), samples,
                                  micro_batch_size=1)
    assert any(not torch.equal(x, y) for x, y in zip(one["log_probs"], plain))


def test_checkpoint_resumes_across_a_layout_change(runs):
    # step 1 at TP=2, checkpoint (HF-named weights and AdamW moments), step 2 at PP=2 from it: the
    # second step of the TP=1 run that never stopped, bit for bit
    _assert_same(runs["tp1-untied"][1], runs["pp2-resumed"][0], "resumed at PP=2 from TP=2 vs TP=1 throughout")
    saved = runs["checkpoints"]["tp2-untied"]["trainer"]["optimizer"]
    assert saved["step"] == 1.0 and set(saved["moments"]) == {"exp_avg", "exp_avg_sq"}
    assert any(t.abs().sum() > 0 for t in saved["moments"]["exp_avg_sq"].values())


def test_data_parallel_replicas_train_the_global_batch(runs):
    # 2 data-parallel replicas (TP=1): each computes half of the samples; log-probs are the same bits
    # (batch invariance), the summed gradient is the one-process gradient up to float32 rounding (the
    # replicas' sums are added in replica order, not micro-batch by micro-batch)
    one, dp2 = runs["tp1-untied"][0], runs["dp2"][0]
    for x, y in zip(one["log_probs"], dp2["log_probs"]):
        assert torch.equal(x, y)
    for k, v in one["metrics"].items():
        assert dp2["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for name, g in one["grads"].items():
        assert torch.allclose(dp2["grads"][name], g, rtol=1e-4, atol=1e-7), name


def test_distributed_optimizer_is_the_same_bits_and_checkpoints_whole_moments(runs):
    # AdamW's moments sharded over the 2 replicas (and the replicas' gradients summed in 4 KiB buckets,
    # not in one): both steps (the second reads the first's moments) are the unsharded run's bits, and the checkpoint holds the whole moments under HF names
    for step, (plain, sharded) in enumerate(zip(runs["dp2"], runs["dp2-distopt"])):
        _assert_same(plain, sharded, f"DP=2 distributed optimizer vs not, step {step + 1}")
    a, b = (runs["checkpoints"][t]["trainer"]["optimizer"] for t in ("dp2", "dp2-distopt"))
    assert a["step"] == b["step"] == 1.0
    for key in ("exp_avg", "exp_avg_sq"):
        assert list(a["moments"][key]) == list(b["moments"][key])
        for name, t in a["moments"][key].items():
            assert torch.equal(t, b["moments"][key][name]), f"{key} {name}"
    # a checkpoint from another layout (TP=2) loads into the shards: the same step as without them
    _assert_same(runs["dp2-resumed"][0], runs["dp2-distopt-resumed"][0], "resumed at DP=2, sharded vs not")
    assert not torch.equal(runs["dp2-resumed"][0]["grads"]["lm_head.weight"], runs["dp2"][0]["grads"]["lm_head.weight"])


def test_triton_path_tp1_equals_tp2_sp_under_the_interpreter(runs, interpreter):
    # the GPU code path (Triton leaf products with pinned tile configs, the fused log-prob kernel's leaf
    # statistics and backward, q/k norm + RoPE per head block, the norms' kernel per token block, the
    # attention backward) under Triton's CPU interpreter: TP=2 with sequence parallelism equals TP=1 bit
    # for bit and both equal the engine's rollout log-probs
    _assert_same(runs["tp1-interp"][0], runs["sp-interp"][0], "interpreter: TP=2 + SP vs TP=1")
    assert runs["tp1-interp"][0]["metrics"]["train/train_rollout_logprob_abs_diff"] == 0.0


@pytest.mark.parametrize("dim, shape", [(None, (7,)), (0, (16, 3)), (1, (5, 24)), (0, (8, 33))])
def test_leaf_square_sums_is_the_tree_of_the_leaves_squared_norms(dim, shape):
    """One call for every parameter: per parameter the squared norm of its gradient, its leaves' squared
    norms added in the tree's order; close to the float64 sum of squares; a parameter's value does not
    depend on the others in the call, nor on where its leaves start in memory."""
    from rlperf.train.megatron.trainer import leaf_square_sums

    g = torch.Generator().manual_seed(3)
    t = torch.randn(shape, generator=g)
    other = torch.randn(8, 9, generator=g)
    leaves = 8
    got = leaf_square_sums([t], [dim], leaves, None)
    assert got.shape == (1,) and got.dtype == torch.float32
    torch.testing.assert_close(got[0].double(), t.double().square().sum(), rtol=1e-5, atol=0)
    if dim is not None:  # the tree's order, leaf by leaf
        parts = [x.contiguous() for x in t.chunk(leaves, dim=dim)]
        sq = [torch.linalg.vector_norm(x.reshape(-1)) ** 2 for x in parts]
        while len(sq) > 1:
            sq = [sq[i] + sq[i + 1] for i in range(0, len(sq), 2)]
        assert torch.equal(got[0], sq[0])
    together = leaf_square_sums([other, t], [0, dim], leaves, None)
    assert torch.equal(together[1], got[0])
    unaligned = torch.empty(t.numel() + 1)[1:].view(shape).copy_(t)  # starts 4 bytes past an allocation
    assert torch.equal(leaf_square_sums([unaligned], [dim], leaves, None)[0], got[0])


def test_master_gradients_accumulate_in_multi_tensor_calls_with_the_per_parameter_bits():
    """Mixed precision: two micro-batches' bf16 gradients (a -0.0 and a parameter without a gradient
    among them) go into the float32 master gradients with the bits of the base trainer's per-parameter
    ``.to(float32)`` then ``add_``, and the compute gradients are freed."""
    from rlperf.train import Trainer
    from rlperf.train.megatron.trainer import MegatronTrainer

    g = torch.Generator().manual_seed(5)
    shapes = [(4, 3), (7,), (2, 2, 5)]

    def fresh():
        t = object.__new__(MegatronTrainer)
        t.mixed = True
        t.params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
        t.master_params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        return t

    grads = [[torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes] for _ in range(2)]
    grads[0][1][0] = -0.0
    ours, base = fresh(), fresh()
    for step in grads:
        for t in (ours, base):
            for i, (p, x) in enumerate(zip(t.params, step)):
                p.grad = None if (i == 2 and step is grads[0]) else x.clone()
        ours._accumulate_master_grads()
        Trainer._accumulate_master_grads(base)
        assert all(p.grad is None for p in ours.params)
    for a, b in zip(ours.master_params, base.master_params):
        assert a.grad.dtype == torch.float32 and torch.equal(a.grad.view(torch.int32), b.grad.view(torch.int32))
