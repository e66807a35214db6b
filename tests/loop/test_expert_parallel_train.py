"""``--expert-model-parallel-size`` on the CPU: 2 gloo ranks, the experts of qwen3-moe-tiny split between
them, give the first step of one process bit for bit: the rollout, old and reference log-probs, the
loss and every metric, every gradient (the expert shares gathered whole) and the updated weights.

A prompt file (no embedded format warm-up) and 3 micro-batches on 2 ranks: the second round has one
micro-batch, so rank 1 also runs the round a rank without work runs. Bad layouts exit 2 before any rank.
"""
import hashlib
import json

import pytest
import torch

from rlperf.cli import main
from rlperf.loop import parse_train_args
from rlperf.loop.placement import ActorLayout, LocalPlacement, actor_process_group
from rlperf.loop.runner import Run


def _flags(tmp_path, out: str) -> list[str]:
    data = tmp_path / "prompts.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"input": f"q{i}?", "label": "A"}) + "\n" for i in range(3)))
    return ["--model", "qwen3-moe-tiny", "--device", "cpu", "--num-threads", "1", "--no-progress",
            "--prompt-data", str(data), "--rollout-batch-size", "3", "--n-samples-per-prompt", "2",
            "--global-batch-size", "6", "--micro-batch-size", "2", "--rollout-max-response-len", "2",
            "--num-rollout", "1", "--use-kl-loss", "--kl-loss-coef", "0.1", "--lr", "1e-2",
            "--output-dir", str(tmp_path / out)]


def _whole_grads(trainer) -> dict[str, torch.Tensor]:
    from rlperf.train.expert_parallel import _gather_share, _is_expert

    groups = getattr(trainer, "groups", None)
    return {n: (_gather_share(p.grad, groups.expert) if groups is not None and _is_expert(n) else p.grad).clone()
            for n, p in trainer.master_model.named_parameters()}


def _first_step(ns) -> dict:
    """One rollout, prepare and one optimizer step of a run; what the test compares. With
    ``ns.time_second_step`` a second optimizer step on the same samples is timed (CUDA synchronized):
    ``train_seconds`` and ``train_tokens``, the train phase's throughput on this layout."""
    run = Run(ns)
    try:
        run.sync(-1)
        samples, _ = run.rollout(0)
        hook = {}
        with run.kernels():
            metrics = run.trainer.train(samples, on_first_micro_step=hook.update)[0]
            grads = _whole_grads(run.trainer)
            # copies: one process's compute weights and AdamW moments are views of the live tensors,
            # which a timed second step would update in place (the gathered expert shares are not)
            weights = {n: w.clone() for n, w in run.trainer.compute_weights()}
            moments = {}
            if getattr(ns, "check_state", True):  # the whole-state round trip of a checkpoint (qwen3-moe-tiny)
                state = run.trainer.state_dict()  # whole AdamW moments (rank 0; a collective)
                optim = state["optimizer"]
                moments = {n: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
                           for n, st in optim.get("state", {}).items()}
                if run.world_size > 1:  # a resume on this layout slices the whole state back to the same shares
                    from rlperf.loop.data_parallel import broadcast_from_rank0

                    live = [{k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
                            for st in run.trainer.optimizer.state.values()]
                    run.trainer.load_state_dict(broadcast_from_rank0(state))
                    again = [{k: v for k, v in st.items() if torch.is_tensor(v)}
                             for st in run.trainer.optimizer.state.values()]
                    assert len(live) == len(again) and all(
                        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(live, again))
        timing = {}
        if getattr(ns, "time_second_step", False):
            import time

            with run.kernels():
                if run.world_size > 1:  # every rank done with the state round trip above before the clock starts
                    torch.distributed.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run.trainer.train(samples)
                torch.cuda.synchronize()
            timing = {"train_seconds": time.perf_counter() - t0, "train_tokens": sum(len(s.tokens) for s in samples)}
        shares = [tuple(layer.experts_gate_up.shape) for layer in run.trainer.master_model.layers if layer.is_moe]
        return {"shares": shares, "tokens": [list(s.tokens) for s in samples], "rollout": [s.rollout_log_probs_tensor() for s in samples],
                "old": [s.log_probs for s in samples], "ref": [s.ref_log_probs for s in samples],
                "metrics": metrics, "first": hook, "grads": grads, "weights": weights,
                "moments": moments,
                **timing}
    finally:
        run.close()


def _digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype and shape in front): equal digests, equal bits."""
    t = t.detach().contiguous().cpu()
    head = f"{t.dtype} {tuple(t.shape)}".encode()
    return hashlib.sha256(head + t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _digested(out: dict) -> dict:
    """``out`` of :func:`_first_step` with its gradients and updated weights as :func:`_digest` strings:
    what a layout of a model with billions of parameters writes for the comparison (gigabytes less to
    save, load and compare)."""
    return {**out, "grads": {n: _digest(g) for n, g in out["grads"].items()},
            "weights": {n: _digest(w) for n, w in out["weights"].items()}}


def _step_on_rank(ns) -> int:
    with actor_process_group(ns) as place:
        out = _first_step(ns)
        if place.rank == 0:
            torch.save(_digested(out) if getattr(ns, "digests", False) else out, ns.dump)
    return 0


def test_two_expert_parallel_ranks_give_the_one_process_step_bit_for_bit(tmp_path):
    one = _first_step(parse_train_args(_flags(tmp_path, "one")))
    ns = parse_train_args(_flags(tmp_path, "two") + ["--actor-num-gpus-per-node", "2",
                                                     "--expert-model-parallel-size", "2"])
    ns.dump = str(tmp_path / "two.pt")
    assert LocalPlacement().launch_actors(_step_on_rank, ns, ActorLayout(1, 2)) == 0
    two = torch.load(ns.dump, weights_only=False)
    assert one["shares"] and [s[0] for s in two["shares"]] == [s[0] // 2 for s in one["shares"]]  # half the experts each
    assert two["tokens"] == one["tokens"]
    for key in ("rollout", "old", "ref"):
        assert all(torch.equal(a, b) for a, b in zip(two[key], one[key])), key
    assert two["metrics"] == one["metrics"]  # loss, pg/kl/entropy terms, grad norm, abs diff: the same floats
    assert two["first"] == one["first"] and two["first"]["train/ppo_kl"] == 0.0
    assert two["grads"].keys() == one["grads"].keys()
    for name, g in one["grads"].items():
        assert torch.equal(two["grads"][name], g), f"gradient of {name}"
    assert _digested(two)["grads"] == _digested(one)["grads"]  # the 4-GPU test's comparison, on these bits
    assert any(n.endswith("experts_gate_up") and bool(g.abs().sum() > 0) for n, g in one["grads"].items())
    assert two["weights"].keys() == one["weights"].keys()
    for name, w in one["weights"].items():  # the AdamW update, the engines' weights
        assert torch.equal(two["weights"][name], w), f"updated {name}"
    assert two["moments"].keys() == one["moments"].keys()  # a checkpoint's optimizer state: whole tensors
    for name, st in one["moments"].items():
        assert all(torch.equal(two["moments"][name][k], v) for k, v in st.items()), f"AdamW state of {name}"


@pytest.mark.parametrize("flags, message", [
    (["--actor-num-gpus-per-node", "3", "--expert-model-parallel-size", "3"],
     "--expert-model-parallel-size 3 does not divide the model's num_experts=8"),
    (["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "4"],
     "--expert-model-parallel-size 4 does not divide the 2 actor rank(s)"),
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be >= 1"),
    (["--model", "tiny", "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size 2: the model is dense"),
    (["--model", "tiny", "--use-rollout-routing-replay"], "--use-rollout-routing-replay: the model is dense"),
])
def test_bad_expert_parallel_layouts_exit_2_before_any_rank_starts(tmp_path, capsys, flags, message):
    argv = ["train", "--device", "cpu", "--model", "qwen3-moe-tiny", "--rollout-batch-size", "3",
            "--n-samples-per-prompt", "2", "--global-batch-size", "6", "--output-dir", str(tmp_path / "out"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ---- GPU: 2 ranks over NCCL, bf16 compute (float32 masters), the Triton expert kernels ----------------------
def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.gpu
def test_two_gpu_expert_parallel_ranks_give_the_one_gpu_step_bit_for_bit(tmp_path):
    """The kernels' path (grouped GEMMs per source rank through gradient taps) in bf16 over NCCL."""
    _two_gpus()
    flags = [f.replace("cpu", "cuda") for f in _flags(tmp_path, "two")] + ["--actor-num-gpus-per-node", "2",
                                                                          "--expert-model-parallel-size", "2"]
    ns = parse_train_args(flags)
    ns.dump = str(tmp_path / "two.pt")
    assert LocalPlacement().launch_actors(_step_on_rank, ns, ActorLayout(1, 2, "cuda")) == 0
    two = torch.load(ns.dump, weights_only=False, map_location="cpu")
    one = _first_step(parse_train_args([f.replace("cpu", "cuda") for f in _flags(tmp_path, "one")]))
    assert two["tokens"] == one["tokens"]
    for key in ("rollout", "old", "ref"):
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(two[key], one[key])), key
    assert two["metrics"] == one["metrics"]
    for name, g in one["grads"].items():
        assert torch.equal(two["grads"][name].cpu(), g.cpu()), f"gradient of {name}"
    for name, w in one["weights"].items():
        assert torch.equal(two["weights"][name].cpu(), w.cpu()), f"updated {name}"


@pytest.mark.gpu
def test_routing_replay_on_the_reduced_30b_a3b_shape_is_exactly_on_policy(tmp_path):
    """R3 on one GPU at the 30B-A3B expert shape (2 layers): gates (routing_agreement 1.0) and two steps
    with abs diff exactly 0."""
    from rlperf.cli import main

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"question {i}?", "label": "A"}) + "\n" for i in range(4)))
    code = main(["train", "--model", "qwen3-30b-a3b-2l", "--device", "cuda", "--prompt-data", str(data),
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
                 "--rollout-max-response-len", "16", "--num-rollout", "2", "--lr", "1e-6", "--true-on-policy-mode",
                 "--use-rollout-routing-replay", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
                 "--no-progress", "--output-dir", str(tmp_path / "out"), "--report-json", str(tmp_path / "gate.json")])
    assert code == 0
    gates = {g["name"]: g for g in json.loads((tmp_path / "gate.json").read_text())["gates"]}
    assert gates["routing_agreement"]["measured"]["agreement"] == 1.0
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/train_rollout_logprob_abs_diff"] for m in lines] == [0.0, 0.0]


def _to_host(obj):
    """``obj`` (dicts, lists, tuples of tensors and plain values) with every tensor copied to the CPU."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def _reduced_30b_flags(tmp_path, out: str) -> list[str]:
    data = tmp_path / "prompts.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"input": f"question {i}?", "label": "A"}) + "\n" for i in range(8)))
    return ["--model", "qwen3-30b-a3b-2l", "--device", "cuda", "--no-progress", "--prompt-data", str(data),
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
            "--rollout-max-response-len", "32", "--num-rollout", "1", "--use-kl-loss", "--kl-loss-coef", "0.1",
            "--lr", "1e-6", "--true-on-policy-mode", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
            "--output-dir", str(tmp_path / out)]


@pytest.mark.gpu
def test_four_gpu_expert_parallel_on_the_reduced_30b_a3b_shape_gives_the_one_gpu_step(tmp_path):
    """EP=4 and EP=2 over NCCL on qwen3-30b-a3b-2l (128 experts of the 30B-A3B shape, 2 layers): the
    first step equals one GPU's bit for bit (rollout, log-probs, metrics, every gradient and updated
    weight by SHA-256 digest); a second, timed step gives each layout's train tokens/s (printed: the
    EP=4 / EP=2 ratio)."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    import time

    results = {}
    for ep in (1, 2, 4):
        started = time.perf_counter()
        ns = parse_train_args(_reduced_30b_flags(tmp_path, f"ep{ep}") + (
            ["--actor-num-gpus-per-node", str(ep), "--expert-model-parallel-size", str(ep)] if ep > 1 else []))
        # the checkpoint round trip is the CPU test's (its pickled whole state of ~1.8e9 parameters took
        # minutes); gradients and weights compared by digest
        ns.time_second_step, ns.check_state, ns.digests = True, False, True
        if ep == 1:  # in this process: its tensors go to the host and its cache is freed for the ranks' GPU 0
            results[ep] = _to_host(_digested(_first_step(ns)))
            torch.cuda.empty_cache()
        else:
            ns.dump = str(tmp_path / f"ep{ep}.pt")
            assert LocalPlacement().launch_actors(_step_on_rank, ns, ActorLayout(1, ep, "cuda")) == 0
            results[ep] = torch.load(ns.dump, weights_only=False, map_location="cpu")
        print(f"\nEP={ep}: layout done in {time.perf_counter() - started:.1f} s (build, rollout, two steps, digests)",
              flush=True)
    one = results[1]
    rate = {ep: r["train_tokens"] / r["train_seconds"] for ep, r in results.items()}
    print(f"\nqwen3-30b-a3b-2l train step, {one['train_tokens']} tokens: "
          + ", ".join(f"EP={ep} {r['train_seconds']:.3f} s ({rate[ep]:.0f} tokens/s)" for ep, r in results.items())
          + f"; EP=4 / EP=2 {rate[4] / rate[2]:.2f}x")
    for ep in (2, 4):
        got = results[ep]
        assert [s[0] for s in got["shares"]] == [s[0] // ep for s in one["shares"]], ep
        assert got["tokens"] == one["tokens"], ep
        for key in ("rollout", "old", "ref"):
            assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got[key], one[key])), (ep, key)
        assert got["metrics"] == one["metrics"], ep
        assert got["grads"].keys() == one["grads"].keys() and got["weights"].keys() == one["weights"].keys()
        for name, g in one["grads"].items():
            assert got["grads"][name] == g, f"EP={ep}: gradient of {name}"
        for name, w in one["weights"].items():
            assert got["weights"][name] == w, f"EP={ep}: updated {name}"
