"""The megatron trainer backend on the GPU: train tokens/s, TP bit-equality, true on-policy with an engine.

Launched once per configuration (``torchrun --nproc-per-node N -m rlperf.bench.megatron ...``; one
process per GPU, NCCL; ``--device cpu`` runs the same on gloo for a smoke test):

* ``--backend megatron`` (tree numerics, the TP-invariant mode), ``megatron-plain`` (Megatron's own
  all-reduce order: the anchor of the tree's cost), ``fsdp`` (rlperf's one-GPU trainer: the anchor
  of the backend's speed) or ``megatron-te`` (:func:`run_te`: plain Megatron-core with Transformer
  Engine layers and its fusions, the layers a plain-Megatron user trains with: the anchor of what
  exactness costs; CUDA with Transformer Engine, ``bench/device_te.sh``) at ``--tp`` x ``--pp`` ranks per
  model replica; the N launched processes
  split into N / (tp x pp) data-parallel replicas, each of which trains on its share of the samples;
* synthetic samples (``--samples`` of ``--tokens`` tokens, the last ``--response`` of them the
  response), or with ``--engine`` the responses of rlperf's engine on rank 0's GPU (tree mode, bf16),
  whose rollout log-probs the trainer's old log-probs must equal (``abs_diff``, expected exactly 0);
* ``--steps`` timed optimizer steps after one warm-up step; reported: train-phase tokens/s (tokens of
  the global batch per step / step time), the kernels and host launch calls of one more step (CUDA),
  the old log-probs' and the first step's gradients' SHA-256 digests (per sample / per HF tensor), so
  runs at different TP compare bit for bit (:func:`compare`: ``python -m rlperf.bench.megatron --compare
  a.json b.json``).

Writes one JSON object to ``--out``. CPU timings are not performance claims.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from rlperf.kernels.tree_reduce import TREE_NODE_TILES

from .harness import launch_fields, measure_launches

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936)


def _config(shape: str):
    from rlperf.model.config import ModelConfig, preset

    if shape == "qwen3-1.7b":
        return ModelConfig(**QWEN3_1_7B)
    return preset(shape)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _samples(cfg, n: int, tokens: int, response: int, device, engine: bool):
    from rlperf.train import Sample

    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, cfg.vocab_size, (tokens - response,), generator=g).tolist() for _ in range(n)]
    if not engine:
        return [Sample(torch.tensor(p + torch.randint(0, cfg.vocab_size, (response,), generator=g).tolist()),
                       response, reward=float(i % 2)) for i, p in enumerate(prompts)], None
    box = [None]
    if dist.get_rank() == 0:
        from rlperf.kernels.tree_reduce import TREE_LEAVES
        from rlperf.model.qwen3 import Qwen3ForCausalLM
        from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
        from rlperf.rollout.tokenizer import ByteTokenizer

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = Qwen3ForCausalLM.random(cfg, seed=0, std=0.02, reduction_leaves=TREE_LEAVES).to(dtype).to(device)
        eng = Engine(model, ByteTokenizer(cfg.vocab_size), EngineConfig(max_total_tokens=n * tokens + 256))
        params = [SamplingParams(max_new_tokens=response, temperature=1.0, ignore_eos=True, seed=i) for i in range(n)]
        results = eng.generate(prompts, params)
        box[0] = [(p + r.output_ids, list(r.output_logprobs)) for p, r in zip(prompts, results)]
        del eng, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.broadcast_object_list(box, src=0)
    samples = []
    for i, (ids, lps) in enumerate(box[0]):
        s = Sample(torch.tensor(ids), len(lps), reward=float(i % 2))
        s.rollout_log_probs = lps
        samples.append(s)
    return samples, [torch.tensor(lps, dtype=torch.float32) for _, lps in box[0]]


def run(ns) -> dict:
    from rlperf import kernels as K
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.train import TrainArgs, Trainer
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.runtime import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from rlperf.train.megatron.trainer import MegatronTrainer

    from rlperf.kernels import tree_reduce

    tree_reduce.FUSED_LEAF_PRODUCTS = not ns.per_leaf_tree
    if ns.tree_node_tile:
        tree_reduce.TREE_NODE_TILE = ns.tree_node_tile
    cuda = ns.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    compute = torch.bfloat16 if cuda else None
    cfg = _config(ns.shape)
    rank, world = dist.get_rank(), dist.get_world_size()
    samples, rollout = _samples(cfg, ns.samples, ns.tokens, ns.response, device, ns.engine)
    buckets = tuple(int(b) for b in ns.cuda_graph_buckets.split(",") if b.strip())
    args = TrainArgs(n_samples_per_prompt=1, use_dynamic_batch_size=True, max_tokens_per_gpu=ns.max_tokens_per_gpu,
                     lr=1e-6, clip_grad=1.0, cuda_graph_buckets=buckets)
    weights = Qwen3ForCausalLM.random(cfg, seed=0, std=0.02)  # float32 on the CPU, the same on every rank
    if world % (ns.tp * ns.pp):
        raise SystemExit(f"{world} processes do not split into --tp {ns.tp} x --pp {ns.pp} replicas")
    out = {"backend": ns.backend, "shape": ns.shape, "tp": ns.tp, "pp": ns.pp, "dp": world // (ns.tp * ns.pp),
           "cuda_graph_buckets": list(buckets),
           "sequence_parallel": ns.sequence_parallel, "fused_tree_node": not ns.per_leaf_tree,
           "tree_node_tile": tree_reduce.TREE_NODE_TILE, "world": world,
           "device": ns.device,
           "gpu": torch.cuda.get_device_name() if cuda else None, "tokens_per_step": sum(s.total_length for s in samples)}
    if ns.backend == "megatron-te":
        return run_te(ns, cfg, samples, device, out)
    if ns.backend == "fsdp":
        if world != 1:
            raise SystemExit("--backend fsdp here is the one-GPU trainer: launch 1 process")
        weights.reduction_leaves = None
        trainer = Trainer(weights.to(device), args, compute_dtype=compute)
        grads_of = lambda: [(n, p.grad) for n, p in trainer.master_model.named_parameters()]  # noqa: E731
    else:
        initialize_model_parallel(ParallelLayout(tensor_model_parallel_size=ns.tp, pipeline_model_parallel_size=ns.pp,
                                                 sequence_parallel=ns.sequence_parallel))
        model = build_gpt_model(cfg, torch.float32, device=device, plain=ns.backend == "megatron-plain",
                                sequence_parallel=ns.sequence_parallel)
        model.load_hf_tensors(weights.hf_state_dict())
        del weights
        trainer = MegatronTrainer(model, args, compute_dtype=compute)
        grads_of = lambda: list(trainer.iter_hf_grads())  # noqa: E731  (a collective)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with K.use_mode("invariant"):
        trainer.prepare(samples)
        out["log_prob_digests"] = [_digest(s.log_probs) for s in samples]
        if rollout is not None:
            diff = max(float((s.log_probs - r).abs().max()) for s, r in zip(samples, rollout))
            out["train_rollout_logprob_abs_diff"] = diff
        metrics = trainer.train_step(samples)  # warm-up, and the step whose gradients are compared
        out["first_step"] = {k: v for k, v in metrics.items()}
        grads = grads_of()
        out["grad_digests"] = {n: _digest(g) for n, g in grads} if rank == 0 else {}
        del grads
        times = []
        for _ in range(ns.steps):
            sync()
            t0 = time.perf_counter()
            trainer.train_step(samples)
            sync()
            times.append(time.perf_counter() - t0)
        # kernels and host launch calls of one optimizer step (forward, backward, grad norm, AdamW), after
        # the timed steps: what the tree mode's host cost is made of (n/a without CUDA)
        out.update(launch_fields("train_step", measure_launches(lambda: trainer.train_step(samples), warmup=0)))
        if ns.kernel_table and cuda:
            out.update(kernel_table(lambda: trainer.train_step(samples), ns.kernel_table))
    times.sort()
    out["step_s_median"] = times[len(times) // 2] if times else None
    out["train_tokens_per_s"] = out["tokens_per_step"] / out["step_s_median"] if times else None
    if cuda:
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    if ns.backend != "fsdp":
        destroy_model_parallel()
    return out


def kernel_table(step, top: int) -> dict:
    """Where one optimizer step's GPU time goes: ``kernel_table`` (the ``top`` kernels by GPU time,
    ``[{"name", "ms", "calls"}]``), ``profiled_step_ms`` (the wall time of an unprofiled step) and
    ``gpu_busy_ms`` (the GPU time of every kernel, copy and set in the profiled step; wall - busy is
    time the GPU waited on the host). Printed on rank 0."""
    from .kernel_profile import profile_kernels, top_kernels

    kernels, wall_ms = profile_kernels(step, 1)
    busy_ms = sum(us for us, _ in kernels.values()) / 1e3
    rows = top_kernels(kernels, 1, top)
    if dist.get_rank() == 0:
        print(f"one step: wall {wall_ms:.1f} ms, GPU busy {busy_ms:.1f} ms")
        for r in rows:
            print(f"{r['ms']:9.3f} ms {r['ms'] / busy_ms:6.1%} {r['calls']:6.0f}  {r['name'][:110]}")
    return {"kernel_table": rows, "profiled_step_ms": wall_ms, "gpu_busy_ms": busy_ms}


def te_model(cfg, tp: int):
    """Megatron-core's ``GPTModel`` for ``cfg`` with Transformer Engine's layer spec (TE linear layers,
    TE's fused attention and RMSNorm, fused bias-dropout-add and RoPE), bf16 parameters, random init: the model a
    plain-Megatron user trains, for timing only (no rlperf numerics, not batch- or TP-invariant)."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from rlperf.train.megatron.model import transformer_config

    config = dataclasses.replace(
        transformer_config(cfg, torch.bfloat16, tp, 1), bias_dropout_fusion=True, apply_rope_fusion=True,
        use_cpu_initialization=False, perform_initialization=True)
    return GPTModel(config, get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True), vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=int(cfg.rope_theta), share_embeddings_and_output_weights=cfg.tie_word_embeddings)


def te_refusal(ns) -> str | None:
    """Why ``--backend megatron-te`` cannot run with these flags here (one line), or None."""
    if ns.device != "cuda":
        return "--backend megatron-te runs Transformer Engine's CUDA layers: --device cuda"
    if ns.pp != 1 or ns.sequence_parallel or ns.engine:
        return ("--backend megatron-te times --tp N replicas on the synthetic samples only (no --pp, "
                "--sequence-parallel or --engine)")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        return (f"--backend megatron-te needs Transformer Engine ({exc}): bash bench/pack_te.sh on the CPU machine, "
                f"then bash bench/device_te.sh on the GPU machine puts it on the path")
    return None


def run_te(ns, cfg, samples, device, out: dict) -> dict:
    """``--backend megatron-te``: ``--steps`` timed steps (after one warm-up) of forward, backward and a
    fused AdamW update of :func:`te_model` on the same samples as the other backends, as a [samples,
    tokens] batch (they are equally long) with the loss the mean cross-entropy of the response tokens.
    bf16 parameters and optimizer state (no float32 master copy: a lower bound on the plain step's
    cost). No log-prob or gradient digests: its numerics are not rlperf's."""
    from rlperf.train.megatron.runtime import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(tensor_model_parallel_size=ns.tp, pipeline_model_parallel_size=1))
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    model = te_model(cfg, ns.tp).to(device)
    dp = dist.get_world_size() // ns.tp
    mine = samples[(dist.get_rank() // ns.tp) % dp::dp]  # this replica's share
    ids = torch.stack([torch.as_tensor(s.tokens) for s in mine]).to(device)  # [B, S]
    labels = torch.roll(ids, -1, dims=1)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    response = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(mine):
        response[i, s.total_length - s.response_length - 1:s.total_length - 1] = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    from megatron.core import parallel_state as ps

    replicas = ps.get_data_parallel_group()  # the ranks holding the same tensor-parallel shard

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(ids, positions, attention_mask=None, labels=labels)  # [B, S] per-token cross-entropy
        (loss[response].float().mean()).backward()
        if dp > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=replicas)
        opt.step()

    step()  # warm-up
    times = []
    for _ in range(ns.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out.update(launch_fields("train_step", measure_launches(step, warmup=0)))
    times.sort()
    out["step_s_median"] = times[len(times) // 2] if times else None
    out["train_tokens_per_s"] = out["tokens_per_step"] / out["step_s_median"] if times else None
    out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    import transformer_engine

    out["transformer_engine"] = transformer_engine.__version__
    destroy_model_parallel()
    return out


def compare(a_path: str, b_path: str) -> dict:
    """Bit-equality of two runs' digests (log-probs, first-step gradients) and their throughput ratio."""
    a, b = json.load(open(a_path)), json.load(open(b_path))
    same_lp = a["log_prob_digests"] == b["log_prob_digests"]
    same_grads = bool(a.get("grad_digests")) and a.get("grad_digests") == b.get("grad_digests")
    ratio = (b["train_tokens_per_s"] / a["train_tokens_per_s"]) if a.get("train_tokens_per_s") else None
    return {"a": a_path, "b": b_path, "log_probs_bit_identical": same_lp, "grads_bit_identical": same_grads,
            "tokens_per_s_ratio_b_over_a": ratio}


RUNS = ("fsdp-0.6b-tp1", "te-0.6b-tp1", "tree-0.6b-tp1", "tree-0.6b-tp1-perleaf", "tree-0.6b-tp2", "tree-0.6b-tp2-sp", "tree-0.6b-pp2", "plain-0.6b-tp2",
        "tree-1.7b-tp1", "tree-1.7b-tp2", "tree-0.6b-tp2-dp2")
"""The runs of ``bench/device_megatron.sh`` (``<backend>-<shape>-tp<N>.json`` in its output folder)."""


def summary(folder: str) -> dict:
    """The issue's targets from the runs' JSON files in ``folder`` (those present): bit-equality at TP=1
    vs TP=2 (``None`` where a run of the pair is missing), the engine abs diffs, and the ratios, each
    against its anchor from the same machine."""
    r = {}
    for n in RUNS:
        path = os.path.join(folder, n + ".json")
        r[n] = json.load(open(path)) if os.path.exists(path) else None

    def tps(n):
        return r[n]["train_tokens_per_s"] if r[n] else None

    def ratio(a, b):
        return tps(a) / tps(b) if tps(a) and tps(b) else None

    def busy_ratio(a, b):  # GPU busy time of a step, a over b (None unless both ran with --kernel-table)
        ga, gb = (r[n].get("gpu_busy_ms") if r[n] else None for n in (a, b))
        return ga / gb if ga and gb else None

    def same(a, b, key):  # None where either run (or its digest) is missing: not measured, not "differs"
        if not (r[a] and r[b] and r[a].get(key) and r[b].get(key)):
            return None
        return r[a][key] == r[b][key]

    return {
        "tokens_per_s": {n: tps(n) for n in RUNS},
        "train_step_launch_calls": {n: r[n].get("train_step_launch_calls") for n in RUNS if r[n]},
        "gpus": sorted({x["gpu"] for x in r.values() if x and x.get("gpu")}),
        "bits_0.6b_tp1_vs_tp2": {"log_probs": same("tree-0.6b-tp1", "tree-0.6b-tp2", "log_prob_digests"),
                                 "grads": same("tree-0.6b-tp1", "tree-0.6b-tp2", "grad_digests")},
        "bits_0.6b_tp1_vs_tp2_sp": {"log_probs": same("tree-0.6b-tp1", "tree-0.6b-tp2-sp", "log_prob_digests"),
                                    "grads": same("tree-0.6b-tp1", "tree-0.6b-tp2-sp", "grad_digests")},
        "sp_step_over_tp2_step_0.6b": ratio("tree-0.6b-tp2", "tree-0.6b-tp2-sp"),
        "bits_0.6b_tp1_vs_pp2": {"log_probs": same("tree-0.6b-tp1", "tree-0.6b-pp2", "log_prob_digests"),
                                 "grads": same("tree-0.6b-tp1", "tree-0.6b-pp2", "grad_digests")},
        "bits_0.6b_tp1_vs_tp2_dp2": {"log_probs": same("tree-0.6b-tp1", "tree-0.6b-tp2-dp2", "log_prob_digests"),
                                     "grads": same("tree-0.6b-tp1", "tree-0.6b-tp2-dp2", "grad_digests")},
        "bits_1.7b_tp1_vs_tp2": {"log_probs": same("tree-1.7b-tp1", "tree-1.7b-tp2", "log_prob_digests"),
                                 "grads": same("tree-1.7b-tp1", "tree-1.7b-tp2", "grad_digests")},
        "engine_abs_diff": {n: r[n]["train_rollout_logprob_abs_diff"] for n in RUNS
                            if r[n] and "train_rollout_logprob_abs_diff" in r[n]},
        "target1_tp1_megatron_over_fsdp_0.6b (>= 1.0)": ratio("tree-0.6b-tp1", "fsdp-0.6b-tp1"),
        # the GPU work of one step (--kernel-table runs): steadier than the wall time of a host-bound step
        "gpu_busy_ms": {n: r[n]["gpu_busy_ms"] for n in RUNS if r[n] and r[n].get("gpu_busy_ms")},
        "gpu_work_tree_tp1_over_fsdp_0.6b": busy_ratio("tree-0.6b-tp1", "fsdp-0.6b-tp1"),
        "target2_tree_step_over_plain_step_tp2_0.6b (<= 1.15)": ratio("plain-0.6b-tp2", "tree-0.6b-tp2"),
        "target3_tp2_over_tp1_1.7b (>= 1.6)": ratio("tree-1.7b-tp2", "tree-1.7b-tp1"),
        "tp2_dp2_on_4_over_tp2_on_2_0.6b (>= 1.7)": ratio("tree-0.6b-tp2-dp2", "tree-0.6b-tp2"),
        "tree_tp1_over_transformer_engine_tp1_0.6b": ratio("tree-0.6b-tp1", "te-0.6b-tp1"),
        "fused_tree_node_over_per_leaf_tp1_0.6b": ratio("tree-0.6b-tp1", "tree-0.6b-tp1-perleaf"),
        "bits_0.6b_fused_vs_per_leaf": {"log_probs": same("tree-0.6b-tp1", "tree-0.6b-tp1-perleaf", "log_prob_digests"),
                                        "grads": same("tree-0.6b-tp1", "tree-0.6b-tp1-perleaf", "grad_digests")},
        "fsdp_over_transformer_engine_tp1_0.6b": ratio("fsdp-0.6b-tp1", "te-0.6b-tp1"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlperf.bench.megatron", description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"), help="compare two runs' results and exit")
    p.add_argument("--summary", metavar="DIR", help="the targets from bench/device_megatron.sh's run files in DIR")
    p.add_argument("--backend", choices=("megatron", "megatron-plain", "fsdp", "megatron-te"), default="megatron")
    p.add_argument("--shape", default="qwen3-0.6b", help="a preset name or qwen3-1.7b")
    p.add_argument("--tp", type=int, default=1, help="--tensor-model-parallel-size")
    p.add_argument("--pp", type=int, default=1, help="--pipeline-model-parallel-size (processes / (tp x pp): data parallel)")
    p.add_argument("--sequence-parallel", action="store_true", help="megatron: --sequence-parallel (tree mode)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per sample (prompt + response)")
    p.add_argument("--response", type=int, default=256, help="response tokens per sample")
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    p.add_argument("--cuda-graph-buckets", default="", metavar="T1,T2,...",
                   help="fsdp, or megatron at one rank (tree numerics): replay each micro-batch from CUDA graphs "
                        "padded to these token counts (the largest >= --max-tokens-per-gpu); default eager")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps after the warm-up step")
    p.add_argument("--engine", action="store_true", help="responses from rlperf's engine on rank 0 (abs diff check)")
    p.add_argument("--per-leaf-tree", action="store_true",
                   help="megatron: a launch per tree leaf and the tree's adds instead of one launch per tree node "
                        "(rlperf.kernels.tree_reduce.FUSED_LEAF_PRODUCTS = False; the same bits), for the A/B")
    p.add_argument("--tree-node-tile", choices=sorted(TREE_NODE_TILES), default=None,
                   help="megatron: the tree node's launch choice (rlperf.kernels.tree_reduce.TREE_NODE_TILE; the "
                        "same bits; default: the module's), for the A/B with python -m rlperf.bench.tree_node_sweep")
    p.add_argument("--kernel-table", type=int, default=0, metavar="N",
                   help="CUDA: profile one more optimizer step and record its N kernels of most GPU time "
                        "(kernel_table in the JSON, printed on rank 0) and its GPU busy time (default 0: off)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the JSON result here (rank 0)")
    ns = p.parse_args(argv)
    if ns.compare:
        print(json.dumps(compare(*ns.compare), indent=2))
        return 0
    if ns.summary:
        print(json.dumps(summary(ns.summary), indent=2))
        return 0
    if ns.response >= ns.tokens:
        p.error("--response must be smaller than --tokens")
    if ns.backend == "megatron-te" and (why := te_refusal(ns)):
        p.error(why)
    result = run(ns)
    if dist.get_rank() == 0:
        text = json.dumps(result, indent=2)
        print(text)
        if ns.out:
            with open(ns.out, "w") as f:
                f.write(text)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown after a gloo/NCCL group (rank processes, as the loop's)


if __name__ == "__main__":
    sys.exit(main())
