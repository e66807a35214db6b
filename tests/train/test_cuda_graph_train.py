"""Graphed micro-batches (``--cuda-graph-buckets``, :mod:`rlperf.train.cuda_graph`): the refusals on
CPU, and on the GPU the replayed log-prob pass and train micro-step against the eager ones, bit for
bit (log-probs, every gradient, a whole mixed-precision optimizer step), and the launches they save."""
import argparse
import dataclasses

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import Sample, TrainArgs, Trainer, frozen_copy, micro_batch_log_probs, pack_micro_batches
from rlperf.flags import check_token_buckets
from rlperf.train.cuda_graph import MicroBatchGraphs, seq_slots

# odd sizes; packed under 1100 tokens (first-fit decreasing): micro-batches of 1099 and 470 tokens
LENGTHS = [(40, 20), (301, 150), (513, 400), (129, 1), (7, 6), (555, 300), (24, 23)]


def _samples(vocab: int, seed: int = 8):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, r) in enumerate(LENGTHS):
        mask = torch.ones(r)
        mask[r // 2] = 0 if r > 3 else 1
        out.append(Sample(torch.randint(0, vocab, (n,), generator=g), r, reward=float(i % 2), loss_mask=mask))
    return out


def _gpu_model(dtype=torch.bfloat16, seed=7):
    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    return Qwen3ForCausalLM.random(cfg, seed=seed, dtype=dtype, device="cuda")


def test_buckets_and_refusals_name_the_flag():
    assert check_token_buckets([4096, 1024, 1024]) == (1024, 4096)
    assert seq_slots(1024) == 513 and seq_slots(1024, 3) == 8 and seq_slots(1024, 8) == 16
    assert seq_slots(1024, 600) == 513 and seq_slots(10, 1) == 6  # never more than a bucket can hold
    with pytest.raises(ValueError, match="--cuda-graph-buckets"):
        check_token_buckets([1, 64])
    with pytest.raises(ValueError, match="--cuda-graph-buckets replays CUDA graphs: it needs a CUDA device"):
        MicroBatchGraphs(Qwen3ForCausalLM.random(preset("tiny"), seed=0), [64], 1.0)
    with pytest.raises(ValueError, match="--cuda-graph-buckets needs --use-dynamic-batch-size"):
        TrainArgs(cuda_graph_buckets=(64,))
    with pytest.raises(ValueError, match="--max-tokens-per-gpu 128 exceeds the largest --cuda-graph-buckets bucket"):
        TrainArgs(use_dynamic_batch_size=True, max_tokens_per_gpu=128, cuda_graph_buckets=(32, 64))


def test_rlperf_train_refuses_the_flag_on_cpu_with_exit_2(capsys):
    from rlperf.cli import main

    code = main(["train", "--device", "cpu", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64",
                 "--cuda-graph-buckets", "64", "--num-rollout", "1"])
    assert code == 2 and "--cuda-graph-buckets replays CUDA graphs: it needs a CUDA device" in capsys.readouterr().err


def _loss_of(logp, ent):
    """A loss on the real rows only (the policy loss's shape: weighted log-probs plus entropy)."""
    w = torch.linspace(-1.0, 1.0, logp.numel(), device=logp.device)
    return (logp * w).sum() + 0.01 * ent.sum()


def _eager(model, mb, params, temperature=0.8):
    """Eager (log-probs, entropy, gradients of :func:`_loss_of`) of ``mb``'s real rows."""
    lp, ent = micro_batch_log_probs(model, mb, temperature, with_entropy=True)
    n = sum(mb.response_lengths)
    lp, ent = lp[:n], ent[:n]
    return lp.detach(), ent.detach(), torch.autograd.grad(_loss_of(lp, ent), params)


def _differ(got, want) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]


def _check_graphs_against_eager(graphs, mb, eager, params, where: str):
    """``graphs``' no-grad log-prob pass (with and without entropy) and train micro-step on ``mb`` against
    ``eager`` = :func:`_eager` of the padded ``mb``, bit for bit; returns the micro-step's gradients."""
    want_lp, want_ent, want = eager
    with torch.no_grad():
        got_lp, got_ent = graphs.log_probs(mb, with_entropy=True)
        assert torch.equal(got_lp, want_lp) and torch.equal(got_ent, want_ent), where
        assert torch.equal(graphs.log_probs(mb), want_lp), where
    lp, ent = graphs.log_probs_with_grad(mb)
    assert torch.equal(lp.detach(), want_lp) and torch.equal(ent.detach(), want_ent), where
    got = torch.autograd.grad(_loss_of(lp, ent), params)
    assert not _differ(got, want), f"{where}: parameters {_differ(got, want)} differ"
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_gpu_replayed_graphs_equal_the_eager_calls_on_the_padded_micro_batch(pdl):
    """What capture changes, alone: the no-grad log-prob replay and the forward + backward replays
    against the eager calls on the same padded micro-batch (bf16, invariant mode), bit for bit;
    micro-batches of two buckets, each bucket replayed twice with different contents. ``pdl``: the
    graphs captured with programmatic dependent launch (``K.use_programmatic_launch``), the eager
    calls launched plainly."""
    from rlperf.train.batching import pad_micro_batch

    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs SM 90 or later")

    model = _gpu_model()
    mbs = pack_micro_batches(_samples(model.cfg.vocab_size), max_tokens_per_gpu=1100, device="cuda")
    assert len(mbs) == 2 and sorted(mb.num_tokens for mb in mbs) == [470, 1099]
    graphs = MicroBatchGraphs(model, [768, 1100], temperature=0.8)
    params = [p for p in model.parameters() if p.requires_grad]
    with K.use_mode("invariant"):
        for rep in range(2):
            for mb in mbs:
                bucket, slots = graphs.shape_of(mb)
                padded = pad_micro_batch(mb, bucket, slots)
                with K.use_programmatic_launch(False):
                    eager = _eager(model, padded, params)
                with K.use_programmatic_launch(pdl):  # the captures (on first use) and the replays
                    got = _check_graphs_against_eager(graphs, mb, eager, params, f"rep {rep}, bucket {bucket}")
                assert all(torch.isfinite(g).all() for g in got)
    assert len(graphs.train_graphs) == 2 and len(graphs.log_prob_graphs) == 4  # captured once per key
    too_big = pack_micro_batches(_samples(model.cfg.vocab_size), max_tokens_per_gpu=2048, device="cuda")[0]
    with pytest.raises(ValueError, match="exceeds the largest --cuda-graph-buckets bucket"):
        graphs.log_probs(too_big)


@pytest.mark.gpu
def test_gpu_failed_captures_run_those_micro_steps_eagerly_with_the_replay_bits(caplog):
    """Captures that fail for real. The log-prob passes of the 768-token bucket: a host sync inside the capture
    (CUDA invalidates it and ``capture_end`` raises before ``torch.cuda.graph`` restores the stream and the
    allocator: :func:`rlperf.graph_capture.capturing` must). Every train micro-step: a Python error inside the
    forward's capture. Those passes and micro-steps run eagerly on the padded micro-batch: log-probs, entropy
    and every gradient equal the eager calls' bit for bit (what a replay gives), the 1100 bucket's log-prob
    passes still capture and replay, the current stream is the default one again, ``failed`` lists each key
    once (a failed key is not captured again: one warning per key over two rounds, naming the flag)."""
    import logging

    from rlperf.train.batching import pad_micro_batch

    def log_probs_fn(m, mb, temperature, with_entropy=False):
        if torch.cuda.is_current_stream_capturing():
            if torch.is_grad_enabled():
                raise RuntimeError("an op this capture cannot take")
            if mb.num_tokens == 768:
                torch.cuda.synchronize()  # not permitted while the stream captures
        return micro_batch_log_probs(m, mb, temperature, with_entropy=with_entropy)

    model = _gpu_model()
    mbs = pack_micro_batches(_samples(model.cfg.vocab_size), max_tokens_per_gpu=1100, device="cuda")
    graphs = MicroBatchGraphs(model, [768, 1100], temperature=0.8, log_probs_fn=log_probs_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    with K.use_mode("invariant"), caplog.at_level(logging.WARNING, logger="rlperf.graph_capture"):
        for rep in range(2):
            for mb in mbs:
                bucket, slots = graphs.shape_of(mb)
                eager = _eager(model, pad_micro_batch(mb, bucket, slots), params)
                _check_graphs_against_eager(graphs, mb, eager, params, f"rep {rep}, bucket {bucket}")
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert not graphs.train_graphs and sorted((k[1], k[3]) for k in graphs.log_prob_graphs) == [(1100, False),
                                                                                                (1100, True)]
    failed = sorted(graphs.failed)
    assert [k[1] for k in failed] == [768, 768, 768, 1100], failed
    assert all("an op this capture cannot take" in graphs.failed[k] for k in failed if len(k) == 3), graphs.failed
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == len(failed) and all("--cuda-graph-buckets none keeps every step eager" in w
                                              for w in warned), warned


@pytest.mark.gpu
def test_gpu_padding_changes_no_real_log_prob_nor_any_gradient():
    """Eager, bf16: the micro-batch padded to a bucket (odd and round sizes, extra sequence slots)
    against the unpadded one. The log-prob rows are batch invariant; a gradient that differs names
    the op whose reduction over the tokens depends on their count (the weight gradients' cuBLAS
    ``g.T @ x`` reduces over T: its kernel choice may change with T)."""
    from rlperf.train.batching import pad_micro_batch

    model = _gpu_model()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    mbs = pack_micro_batches(_samples(model.cfg.vocab_size), max_tokens_per_gpu=1100, device="cuda")
    with K.use_mode("invariant"):
        for mb in mbs:
            want_lp, want_ent, want = _eager(model, mb, params)
            for bucket in (mb.num_tokens + 1, 1100, 2048):
                lp, ent, got = _eager(model, pad_micro_batch(mb, bucket, seq_slots(bucket)), params)
                assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent), (mb.num_tokens, bucket)
                differ = [names[i] for i in _differ(got, want)]
                assert not differ, f"{mb.num_tokens} tokens padded to {bucket}: gradients of {differ} differ"


@pytest.mark.gpu
def test_gpu_graphed_trainer_steps_equal_eager_steps_bit_for_bit():
    """Two optimizer steps of the mixed-precision trainer (bf16 compute, float32 masters and AdamW;
    several micro-batches, the KL loss against a reference, entropy in the loss) with and without
    ``cuda_graph_buckets``: the same metrics and the same master weights, bit for bit."""
    base = _gpu_model(dtype=torch.float32, seed=11)
    samples = _samples(base.cfg.vocab_size, seed=12)
    args = dict(advantage_estimator="grpo", n_samples_per_prompt=len(LENGTHS), use_kl_loss=True, kl_loss_coef=0.05,
                kl_loss_type="low_var_kl", entropy_coef=0.01, use_dynamic_batch_size=True, max_tokens_per_gpu=1100,
                rollout_temperature=0.9, lr=1e-4)
    results = []
    for buckets in ((), (512, 1100)):
        model = _gpu_model(dtype=torch.float32, seed=11)
        trainer = Trainer(model, TrainArgs(cuda_graph_buckets=buckets, **args), ref_model=frozen_copy(model),
                          compute_dtype=torch.bfloat16)
        steps = []
        with K.use_mode("invariant"):
            for _ in range(2):
                batch = [dataclasses.replace(s) for s in samples]
                steps.append(trainer.train(batch)[0])
        results.append((steps, {n: p.detach().clone() for n, p in trainer.master_model.named_parameters()}))
    (eager_steps, eager_w), (graph_steps, graph_w) = results
    assert graph_steps == eager_steps
    assert eager_steps[1]["train/kl_loss"] != 0.0  # the second step trained an actor the first step moved
    differ = [n for n in eager_w if not torch.equal(eager_w[n], graph_w[n])]
    assert not differ, f"master weights differ after two steps: {differ[:4]}"


@pytest.mark.gpu
def test_gpu_graph_replays_cut_the_launch_calls():
    """The launch counter (``rlperf bench loop``'s) on the eager and the replayed log-prob pass: the
    same kernels run, but the replay is one launch call where eager makes one per kernel."""
    from rlperf.bench.harness import measure_launches

    model = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=8)
    model = Qwen3ForCausalLM.random(model, seed=3, dtype=torch.bfloat16, device="cuda")
    (mb,) = pack_micro_batches(_samples(model.cfg.vocab_size)[:2], max_tokens_per_gpu=1100, device="cuda")
    graphs = MicroBatchGraphs(model, [512], temperature=1.0)
    with K.use_mode("invariant"), torch.no_grad():
        eager = measure_launches(lambda: micro_batch_log_probs(model, mb, 1.0))
        graphed = measure_launches(lambda: graphs.log_probs(mb))
    print(f"log-prob pass, 8 layers: eager {eager}; graphed {graphed}")
    assert eager.kernels >= 8 * 8, eager  # several kernels per layer
    assert eager.launch_calls >= 0.9 * eager.kernels, f"launch calls missed (Triton's driver-API launches?): {eager}"
    assert graphed.launch_calls < eager.launch_calls / 3, (eager, graphed)


def test_the_autograd_bridge_loads_real_rows_zeroes_padding_and_hands_out_copies():
    """:class:`_ReplayedLogProbs` with stand-in graphs (CPU): the forward gives the first ``n`` rows; the
    backward loads the upstream gradient into the static buffer with zeros on the padding rows (stale
    values there would leak into the gradients), and the parameter gradients autograd receives are
    copies: two backward passes accumulate ``a + b`` in ``.grad``, not twice the last static buffer."""
    from types import SimpleNamespace

    from rlperf.train.cuda_graph import _ReplayedLogProbs, _TrainGraph

    bucket, n = 9, 5
    w = torch.linspace(0.5, 1.5, bucket, dtype=torch.float64, requires_grad=True)
    static = {k: torch.full((bucket,), 7.0, dtype=torch.float64) for k in ("lp", "ent", "glp", "gent", "gw")}

    def forward():  # log-probs 2 w, entropy w^2 (what a captured forward writes into its outputs)
        static["lp"].copy_(2 * w.detach())
        static["ent"].copy_(w.detach() ** 2)

    def backward():  # d/dw of sum(glp * 2w + gent * w^2)
        static["gw"].copy_(2 * static["glp"] + 2 * w.detach() * static["gent"])

    entry = _TrainGraph(SimpleNamespace(replay=forward), SimpleNamespace(replay=backward), static["lp"],
                        static["ent"], static["glp"], static["gent"], (static["gw"],))
    c = torch.arange(1.0, n + 1, dtype=torch.float64)
    lp, ent = _ReplayedLogProbs.apply(entry, n, w)
    assert lp.shape == ent.shape == (n,) and torch.equal(lp, 2 * w.detach()[:n])
    ((lp * c).sum() + ent.sum()).backward()
    want = torch.zeros(bucket, dtype=torch.float64)
    want[:n] = 2 * c + 2 * w.detach()[:n]
    assert torch.equal(w.grad, want)  # the padding rows' stale 7.0 never reached the gradient
    first = w.grad.clone()
    lp, ent = _ReplayedLogProbs.apply(entry, n, w)
    (lp * 3).sum().backward()  # entropy unused: its upstream gradient is zeros
    second = torch.zeros(bucket, dtype=torch.float64)
    second[:n] = 6.0
    assert torch.equal(w.grad, first + second)


def test_the_loop_refuses_layouts_the_graphs_do_not_cover():
    """``check_cuda_graph_buckets`` (``rlperf train``/``gate`` flag checks, exit 2): CPU, several actor
    ranks (either backend), routing replay and an MoE preset are refused, each naming the flag; one
    process of either backend is accepted."""
    from types import SimpleNamespace

    from rlperf.loop import UsageError
    from rlperf.loop.resolve import check_cuda_graph_buckets

    cuda = torch.device("cuda")

    def ns(**kw):
        base = dict(train_backend="fsdp", use_rollout_routing_replay=False, load=None, hf_checkpoint=None,
                    model="qwen3-0.6b")
        return SimpleNamespace(**{**base, **kw})

    check_cuda_graph_buckets(ns(), cuda, 1)  # one process, dense preset: accepted
    check_cuda_graph_buckets(ns(train_backend="megatron"), cuda, 1)  # the megatron backend at one rank too
    for args, device, ranks, why in [
        (ns(), torch.device("cpu"), 1, "needs a CUDA device"),
        (ns(), cuda, 2, "one actor process"),
        (ns(train_backend="megatron"), cuda, 2, "one actor process (got --train-backend megatron with 2"),
        (ns(use_rollout_routing_replay=True), cuda, 1, "--use-rollout-routing-replay"),
        (ns(model="qwen3-moe-tiny"), cuda, 1, "MoE layers"),
    ]:
        with pytest.raises(UsageError, match="--cuda-graph-buckets") as info:
            check_cuda_graph_buckets(args, device, ranks)
        assert why in str(info.value)


def test_the_auto_ladder_steps_down_from_max_tokens_and_fits_the_memory_bound():
    """``auto_cuda_graph_buckets``: M, 3M/4, M/2, 3M/8, M/4, 3M/16 rounded up to 64 tokens, none below 512;
    only the largest buckets whose gradient sets fit 10% of the device's memory (none: eager)."""
    from rlperf.train.args import auto_cuda_graph_buckets as auto

    assert auto(4096) == (768, 1024, 1536, 2048, 3072, 4096)
    assert auto(16384) == (3072, 4096, 6144, 8192, 12288, 16384)  # 6 buckets at most: 3M/16 is the smallest
    assert auto(3000) == (576, 768, 1152, 1536, 2304, 3000)  # the top bucket is M itself: full micro-batches pad nothing
    assert auto(1100) == (576, 832, 1100) and auto(600) == (512, 600) and auto(100) == (100,) and auto(2) == (2,)
    for m in (4096, 3000, 1100, 16384, 4097, 700):
        ladder = auto(m)
        assert ladder == tuple(sorted(set(ladder))) and ladder[-1] == m and ladder[0] >= min(m, 512)
        assert all(b % 64 == 0 for b in ladder[:-1])
        assert all(b <= 1.5 * a for a, b in zip(ladder, ladder[1:]))  # above the smallest a micro-batch pads <= 1.5x
    # the 0.6b synthetic loop's last micro-batch (2,616 tokens) pads to 3072, not 4096
    assert min(b for b in auto(4096) if b >= 2616) == 3072
    gib = 1 << 30
    assert auto(4096, 2 * gib, 80 * gib) == (1536, 2048, 3072, 4096)  # 4 x 2 GiB <= 8 GiB: the largest 4
    assert auto(4096, 1 * gib, 80 * gib) == auto(4096)
    assert auto(4096, 3 * gib, 80 * gib) == (3072, 4096)  # the largest kept
    assert auto(4096, 9 * gib, 80 * gib) == ()  # not one gradient set fits: eager


def _resolve_ns(**kw):
    from types import SimpleNamespace

    base = dict(cuda_graph_buckets="auto", train_backend="fsdp", use_rollout_routing_replay=False, load=None,
                hf_checkpoint=None, model="qwen3-0.6b", use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
                precision="bf16")
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture
def h100_memory(monkeypatch):
    """A CUDA device of 80 GiB, as :func:`rlperf.telemetry.memory.capacity_bytes` reads it."""
    from rlperf.telemetry import memory

    monkeypatch.setattr(memory, "capacity_bytes", lambda device: 80 << 30)


def test_auto_resolves_to_the_ladder_on_cuda_where_graphs_apply_and_to_eager_elsewhere(h100_memory):
    """``resolve_cuda_graph_buckets`` (``rlperf train``/``gate``'s stage 2) on a CUDA device (faked:
    the function reads only ``device.type`` and the capacity): ``auto`` becomes the ladder for one fsdp
    or megatron process on a dense model with packed micro-batches, and ``()`` without an error where graphs do not
    apply; ``none`` is ``()`` everywhere."""
    from rlperf.loop.resolve import resolve_cuda_graph_buckets

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ns = _resolve_ns()
    resolve_cuda_graph_buckets(ns, cuda, 1)
    assert ns.cuda_graph_buckets == (768, 1024, 1536, 2048, 3072, 4096)
    ns = _resolve_ns(max_tokens_per_gpu=3000, precision="fp32")  # three float32 gradient sets (2.4 GB) fit 8 GiB
    resolve_cuda_graph_buckets(ns, cuda, 1)
    assert ns.cuda_graph_buckets == (1536, 2304, 3000)
    ns = _resolve_ns(model="qwen3-4b")  # one bf16 gradient set (8 GB) fits 10% of 80 GiB, two do not
    resolve_cuda_graph_buckets(ns, cuda, 1)
    assert ns.cuda_graph_buckets == (4096,)
    ns = _resolve_ns(train_backend="megatron")  # one rank: the tree step graphed like the fsdp one
    resolve_cuda_graph_buckets(ns, cuda, 1)
    assert ns.cuda_graph_buckets == (768, 1024, 1536, 2048, 3072, 4096)
    for ns, device, ranks in [
        (_resolve_ns(), cpu, 1),
        (_resolve_ns(), cuda, 2),
        (_resolve_ns(train_backend="megatron"), cuda, 2),
        (_resolve_ns(model="qwen3-moe-tiny"), cuda, 1),
        (_resolve_ns(model="qwen3-moe-tiny", use_rollout_routing_replay=True), cuda, 1),
        (_resolve_ns(use_dynamic_batch_size=False, max_tokens_per_gpu=None), cuda, 1),
        (_resolve_ns(model="qwen3-8b"), cuda, 1),  # its gradient set alone is over the memory bound
        (_resolve_ns(hf_checkpoint="/nonexistent"), cuda, 1),  # stage 3 names the flag; eager until then
        (_resolve_ns(cuda_graph_buckets=()), cuda, 1),  # --cuda-graph-buckets none
        (_resolve_ns(cuda_graph_buckets=(), train_backend="megatron"), cuda, 2),
    ]:
        resolve_cuda_graph_buckets(ns, device, ranks)
        assert ns.cuda_graph_buckets == (), (vars(ns), device, ranks)


def test_an_explicit_list_keeps_its_refusals(h100_memory):
    """An explicit list goes through :func:`check_cuda_graph_buckets` (exit 2 naming the flag) where
    ``auto`` would silently stay eager; accepted where graphs apply, unchanged."""
    from rlperf.loop import UsageError
    from rlperf.loop.resolve import resolve_cuda_graph_buckets

    cuda = torch.device("cuda")
    ns = _resolve_ns(cuda_graph_buckets=(1024, 4096))
    resolve_cuda_graph_buckets(ns, cuda, 1)
    assert ns.cuda_graph_buckets == (1024, 4096)
    ns = _resolve_ns(cuda_graph_buckets=(1024, 4096), train_backend="megatron")
    resolve_cuda_graph_buckets(ns, cuda, 1)
    assert ns.cuda_graph_buckets == (1024, 4096)
    for ns, device, ranks, why in [
        (_resolve_ns(cuda_graph_buckets=(64,)), torch.device("cpu"), 1, "needs a CUDA device"),
        (_resolve_ns(cuda_graph_buckets=(64,)), cuda, 2, "one actor process"),
        (_resolve_ns(cuda_graph_buckets=(64,), train_backend="megatron"), cuda, 2, "one actor process"),
        (_resolve_ns(cuda_graph_buckets=(64,), model="qwen3-moe-tiny"), cuda, 1, "MoE layers"),
    ]:
        with pytest.raises(UsageError, match="--cuda-graph-buckets") as info:
            resolve_cuda_graph_buckets(ns, device, ranks)
        assert why in str(info.value)


def test_a_checkpoint_model_with_moe_layers_is_read_from_its_config(tmp_path, h100_memory):
    """``--hf-checkpoint``: the model's MoE layers come from its config.json: ``auto`` stays eager and
    an explicit list is refused naming both flags."""
    import json

    from rlperf.loop import UsageError
    from rlperf.loop.resolve import resolve_cuda_graph_buckets
    from rlperf.model.config import preset

    cfg = preset("qwen3-moe-tiny")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32"}))
    cuda = torch.device("cuda")
    ns = _resolve_ns(hf_checkpoint=str(tmp_path))
    resolve_cuda_graph_buckets(ns, cuda, 1)
    assert ns.cuda_graph_buckets == ()
    with pytest.raises(UsageError, match=f"--cuda-graph-buckets: --hf-checkpoint {tmp_path} has MoE layers"):
        resolve_cuda_graph_buckets(_resolve_ns(hf_checkpoint=str(tmp_path), cuda_graph_buckets=(64,)), cuda, 1)


def test_the_default_on_the_cpu_is_eager_without_an_error(tmp_path):
    """``rlperf train``'s default (``auto``) on the CPU resolves to eager; ``none`` too; TrainArgs never
    holds ``auto`` (:func:`train_args_from` of unresolved flags reads it as eager)."""
    from rlperf.loop.resolve import parse_train_args
    from rlperf.train.args import add_train_arguments, train_args_from

    for flags in ([], ["--cuda-graph-buckets", "none"], ["--cuda-graph-buckets", "auto"]):
        ns = parse_train_args(["--device", "cpu", "--output-dir", str(tmp_path), *flags])
        assert ns.use_dynamic_batch_size  # the embedded task packs micro-batches: only the CPU keeps it eager
        assert ns.cuda_graph_buckets == () and ns.train_args.cuda_graph_buckets == ()
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    assert p.parse_args([]).cuda_graph_buckets == "auto"
    assert train_args_from(p.parse_args([])).cuda_graph_buckets == ()  # a hand-made first step: eager
    with pytest.raises(ValueError, match="auto is resolved by rlperf train / rlperf gate"):
        TrainArgs(cuda_graph_buckets="auto")


@pytest.mark.gpu
def test_gpu_default_flags_replay_graphed_micro_steps(tmp_path):
    """``rlperf train --device cuda`` with no other flag (the embedded task, tiny model, packed
    micro-batches): ``auto`` resolves to the ladder, and one rollout's log-prob passes and train
    micro-steps replay CUDA graphs, true on-policy (abs diff 0)."""
    from rlperf.loop.resolve import parse_train_args
    from rlperf.loop.runner import Run
    from rlperf.train.args import auto_cuda_graph_buckets

    ns = parse_train_args(["--device", "cuda", "--output-dir", str(tmp_path), "--no-progress",
                           "--true-on-policy-mode", "--num-rollout", "1"])
    assert ns.train_args.cuda_graph_buckets == auto_cuda_graph_buckets(ns.max_tokens_per_gpu) != ()
    run = Run(ns)
    try:
        (metrics,) = run.run()
        graphs = list(run.trainer._graphs.values())
        assert graphs and any(g.train_graphs for g in graphs) and any(g.log_prob_graphs for g in graphs)
        assert metrics["train/train_rollout_logprob_abs_diff"] == 0.0
    finally:
        run.close()


def test_the_captured_pass_runs_on_fresh_leaves_that_alias_the_parameters():
    """:class:`_LogProbsThrough` (what the train capture differentiates): through fresh leaves it gives
    the log-probs and the gradients of the pass through the parameters, bit for bit, leaves the
    parameters' ``.grad`` alone, and reads the parameters' storage (an in-place update reaches it)."""
    from rlperf.train.batching import micro_batch_log_probs
    from rlperf.train.cuda_graph import _LogProbsThrough

    model = Qwen3ForCausalLM.random(preset("tiny"), seed=2, dtype=torch.float32)
    samples = _samples(model.cfg.vocab_size)
    (mb,) = pack_micro_batches([samples[i] for i in (0, 4, 6)], max_tokens_per_gpu=128)  # 71 tokens
    through = _LogProbsThrough(model, mb, 0.7)
    params = [p for p in model.parameters() if p.requires_grad]
    leaves = through.fresh_leaves()
    assert len(leaves) == len(params) and all(a.data_ptr() == p.data_ptr() for a, p in zip(leaves, params))
    with K.use_backend("reference"):  # what is checked is autograd's wiring, not a kernel
        lp, ent = through(leaves)
        want_lp, want_ent = micro_batch_log_probs(model, mb, 0.7, with_entropy=True)
        assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
        got = torch.autograd.grad(_loss_of(lp, ent), leaves)
        want = torch.autograd.grad(_loss_of(want_lp, want_ent), params)
        assert not _differ(got, want) and all(p.grad is None for p in params)
        with torch.no_grad():
            params[0].mul_(2.0)  # the optimizer's in-place step
        assert not torch.equal(through(through.fresh_leaves())[0], lp)
