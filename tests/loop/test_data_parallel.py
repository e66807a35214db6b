"""Data parallel on the CPU: 2 actor ranks (real processes, gloo, FSDP2) against the 1-rank run.

The 2-rank runs start real rank processes (``--actor-num-gpus-per-node 2 --device cpu``), each a
few seconds of start-up; the 1-rank runs run in this process. Bit-for-bit claims hold for the first
rollout (same weights, batch-invariant kernels, seeds by sample index); after an update the ranks'
gradient sum differs from one process's in rounding only, so later rollouts are compared loosely.
"""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlperf.cli import main
from rlperf.loop import METRICS_FILE, first_step, parse_train_args, train
from rlperf.loop.placement import ActorLayout, LocalPlacement, actor_process_group
from rlperf.rollout.router import free_port
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import Sample, TrainArgs, Trainer
from rlperf.train.fsdp import equal_count_micro_batches, iter_hf_weights

FAST = ["--num-threads", "1", "--no-progress"]
PACKED = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "128"]
"""Packed micro-batches: fewer FSDP all-gathers than one sample per micro-batch, and different packings
on 1 and 2 ranks (a sample's log-probs must not depend on its micro-batch)."""


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]


def _train_cli(out: Path, *flags) -> int:
    return main(["train", "--device", "cpu", "--skip-gates", "--output-dir", str(out), *FAST, *flags])


# ---- what the ranks compute, without processes ---------------------------------------------------------
def test_equal_count_micro_batches_split_until_every_rank_has_as_many():
    lengths = [30, 5, 6, 7, 28, 4, 5, 6]  # rank 0 (strided) gets 30, 6, 28, 5: more bins than rank 1's 5, 7, 4, 6
    samples = [Sample(list(range(n)), 1) for n in lengths]
    shards = [[0, 2, 4, 6], [1, 3, 5, 7]]
    mbs = [equal_count_micro_batches(samples, shards, r, max_tokens_per_gpu=40) for r in (0, 1)]
    assert len(mbs[0]) == len(mbs[1]) == 2
    for r, shard in enumerate(shards):
        assert sorted(i for mb in mbs[r] for i in mb.indices) == shard  # every sample once, on its rank
        assert all(mb.num_tokens <= 40 for mb in mbs[r])


def test_iter_hf_weights_of_one_process_is_hf_state_dict_in_buckets():
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=3)
    expect = model.hf_state_dict()
    got = list(iter_hf_weights(model, bucket_bytes=1 << 12))  # many small buckets
    assert [n for n, _ in got] == list(expect)  # hf_state_dict's order: a broadcast of it flattens alike
    assert all(torch.equal(t, expect[n]) for n, t in got)
    half = dict(iter_hf_weights(model, torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, expect[n].to(torch.bfloat16)) for n, t in half.items())


def test_optimizer_state_is_keyed_by_name_and_old_index_keyed_state_loads():
    def trainer():
        return Trainer(Qwen3ForCausalLM.random(preset("tiny"), seed=0), TrainArgs(lr=1e-2))

    a = trainer()
    a.train([Sample([1, 2, 3, 4], 2, reward=r, rollout_log_probs=[-1.0, -1.0]) for r in (0.0, 1.0)])
    state = a.state_dict()
    assert "layers.0.qkv_proj" in state["optimizer"]["state"]  # names, the same for any number of ranks
    old = {"optimizer": a.optimizer.state_dict(), "step_count": 1}  # what checkpoints held before: indices
    for saved in (state, old):
        b = trainer()
        b.load_state_dict(saved)
        for x, y in zip(a.optimizer.state_dict()["state"].values(), b.optimizer.state_dict()["state"].values()):
            assert all(torch.equal(x[k], y[k]) for k in x)


# ---- bad layouts: exit 2 before any process starts -----------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--actor-num-gpus-per-node", "3"], "--global-batch-size 128 does not split over 3 actor ranks"),
    (["--actor-num-gpus-per-node", "0"], "--actor-num-gpus-per-node must be >= 1"),
    (["--actor-num-nodes", "2"], "for several nodes run torchrun on each node"),
    (["--actor-num-gpus-per-node", "2", "--async"], "--async with 2 actor ranks"),
    (["--actor-num-gpus-per-node", "2", "--engine-weights", "shared"], "--engine-weights shared with 2 actor ranks"),
])
def test_bad_layout_exits_2_before_any_rank_starts(tmp_path, capsys, flags, message):
    assert _train_cli(tmp_path / "out", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out" / METRICS_FILE).exists()


def test_more_ranks_than_gpus_exits_2(monkeypatch, capsys):
    from rlperf.loop import UsageError
    from rlperf.loop.placement import check_actor_layout

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ns = parse_train_args(["--device", "cpu"])
    ns.actor_num_gpus_per_node = 2
    with pytest.raises(UsageError, match="--actor-num-gpus-per-node 2: only 1 CUDA device"):
        check_actor_layout(ns, torch.device("cuda"))


# ---- 2 ranks against 1 ------------------------------------------------------------------------------------
def _first_step_on_rank(ns) -> int:
    """A rank's entry (spawned): the first step; rank 0 saves the record's samples."""
    with actor_process_group(ns) as place:
        rec = first_step(ns)
        if place.rank == 0:
            torch.save({"samples": [(s.tokens, s.rollout_log_probs_tensor(), s.log_probs, s.ref_log_probs)
                                    for s in rec.samples],
                        "step": rec.step_metrics, "phases": {p.phase: p.peak_bytes for p in rec.phases}}, ns.dump)
    return 0


def test_two_ranks_generate_and_score_the_one_rank_samples_bit_for_bit(tmp_path):
    flags = ["--device", "cpu", "--num-rollout", "1", *FAST, *PACKED]
    one = first_step(flags + ["--output-dir", str(tmp_path / "one")])
    ns = parse_train_args(flags + ["--output-dir", str(tmp_path / "two"), "--actor-num-gpus-per-node", "2"])
    ns.dump = str(tmp_path / "two.pt")
    assert LocalPlacement().launch_actors(_first_step_on_rank, ns, ActorLayout(1, 2)) == 0
    two = torch.load(ns.dump, weights_only=False)
    assert len(two["samples"]) == len(one.samples) == 128
    for (tokens, rollout_lp, lp, ref_lp), s in zip(two["samples"], one.samples):
        assert list(tokens) == list(s.tokens)  # the same generations, whichever rank's engine drew them
        assert torch.equal(rollout_lp, s.rollout_log_probs_tensor())
        assert torch.equal(lp, s.log_probs) and torch.equal(ref_lp, s.ref_log_probs)  # first-step train log-probs
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert two["step"][key] == pytest.approx(one.step_metrics[key], rel=1e-5, abs=1e-7)
    assert two["step"]["train/train_rollout_logprob_abs_diff"] == one.step_metrics["train/train_rollout_logprob_abs_diff"]
    assert set(two["phases"]) == {"rollout", "log_prob", "train", "weight_sync"}


def _with_reference(ns):
    """``ns``'s train args with a reference model (a KL loss of coefficient 0, as the first step asks)."""
    return dataclasses.replace(ns.train_args, use_kl_loss=True, kl_loss_coef=0.0)


def _start_on_rank(ns) -> int:
    """A rank's entry (spawned): the run built and its engine synced, no step; every rank's warm-up loss
    and the checksums of its engine's weights and of the full reference (gathered from the shards),
    all-gathered to rank 0, which saves them."""
    import torch.distributed as dist

    from rlperf.loop.runner import Run
    from rlperf.sync import weights_checksum

    with actor_process_group(ns) as place:
        run = Run(ns, train_args=_with_reference(ns))
        try:
            run.sync(-1)
            trainer = run.trainer
            mine = {"warmup_loss": run.warmup_loss,
                    "engine": weights_checksum(run.model.hf_state_dict().items()),
                    "ref": weights_checksum(iter_hf_weights(trainer.ref_model, root=trainer.ref_module))}
            every: list = [None] * place.world_size
            dist.all_gather_object(every, mine)
            if place.rank == 0:
                torch.save(every, ns.dump)
        finally:
            run.close()
    return 0


def test_rank_0_alone_warms_up_and_every_rank_starts_from_its_warmed_weights(tmp_path):
    """The embedded task's format warm-up runs on rank 0 alone (``warmup_loss`` None on rank 1), and
    every rank's engine and the sharded reference hold the one-rank run's warmed weights, bit for bit."""
    from rlperf.loop.runner import Run
    from rlperf.sync import weights_checksum

    flags = ["--device", "cpu", *FAST]
    ns_one = parse_train_args(flags + ["--output-dir", str(tmp_path / "one")])
    one = Run(ns_one, train_args=_with_reference(ns_one))
    try:
        one.sync(-1)
        expect = {"warmup_loss": one.warmup_loss, "engine": weights_checksum(one.model.hf_state_dict().items()),
                  "ref": weights_checksum(one.trainer.ref_model.hf_state_dict().items())}
        cold = weights_checksum(Qwen3ForCausalLM.random(one.model.cfg, seed=one.config.runtime.seed)
                                .hf_state_dict().items())
    finally:
        one.close()
    assert isinstance(expect["warmup_loss"], float) and expect["engine"] == expect["ref"] != cold  # warmed up
    ns = parse_train_args(flags + ["--output-dir", str(tmp_path / "two"), "--actor-num-gpus-per-node", "2"])
    ns.dump = str(tmp_path / "two.pt")
    assert LocalPlacement().launch_actors(_start_on_rank, ns, ActorLayout(1, 2)) == 0
    rank0, rank1 = torch.load(ns.dump, weights_only=False)
    assert rank0 == expect  # rank 0's warm-up is the one-rank run's, bit for bit
    assert rank1 == {**expect, "warmup_loss": None}  # rank 1 ran none, and holds rank 0's warmed weights


def test_two_ranks_learn_like_one_and_rank_0_alone_writes(tmp_path, capfd):
    flags = ["--num-rollout", "3", "--true-on-policy-mode", *PACKED]
    # with the first-step gates, which run on both ranks
    assert main(["train", "--device", "cpu", "--output-dir", str(tmp_path / "two"), "--actor-num-gpus-per-node", "2",
                 "--report-json", str(tmp_path / "gate.json"), *FAST, *flags]) == 0
    out, err = capfd.readouterr()  # the ranks' output (their own processes: file descriptors)
    assert out.count("all gates passed") == 1 and err.count("rollout 3/3 |") == 1  # rank 0 alone prints
    assert json.loads((tmp_path / "gate.json").read_text())["passed"] is True
    one = train(["--device", "cpu", "--output-dir", str(tmp_path / "one"), *FAST, *flags])
    two = _lines(tmp_path / "two")
    assert [m["rollout_id"] for m in two] == [0, 1, 2]  # one line per rollout: rank 0 alone writes
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    assert two[0]["rollout/rollout_log_probs"] == one[0]["rollout/rollout_log_probs"]
    assert two[0]["rollout/raw_reward"] == one[0]["rollout/raw_reward"]
    for a, b in zip(two, one):
        assert a["train/train_rollout_logprob_abs_diff"] == 0.0  # true on-policy on every rank's engine
        assert a["rollout/raw_reward"] == pytest.approx(b["rollout/raw_reward"], abs=0.1)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-2)
        assert all(a[k] > 0 for k in a if k.startswith("memory/") and k.endswith("_peak_bytes"))


def test_resume_across_rank_counts(tmp_path):
    """2 ranks save, 1 rank resumes, and the reverse: the resumed rollout is the straight run's (same
    weights: equal rollout log-probs bit for bit) and its training continues (same optimizer state)."""
    common = ["--num-rollout", "3", "--save-interval", "2", *PACKED]
    for saver, resumer in ((["--actor-num-gpus-per-node", "2"], []), ([], ["--actor-num-gpus-per-node", "2"])):
        tag = "two" if saver else "one"
        straight, ckpt = tmp_path / f"{tag}-straight", tmp_path / f"{tag}-ckpt"
        assert _train_cli(straight, *saver, *common, "--save", str(ckpt)) == 0
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000003",
                                                          "latest_checkpointed_iteration.txt"]
        (ckpt / "latest_checkpointed_iteration.txt").write_text("2")  # resume from iteration 2
        resumed = tmp_path / f"{tag}-resumed"
        assert _train_cli(resumed, *resumer, "--num-rollout", "3", "--load", str(ckpt), *PACKED) == 0
        (a,), b = _lines(resumed), _lines(straight)[2]
        assert a["rollout_id"] == 2
        assert a["rollout/rollout_log_probs"] == b["rollout/rollout_log_probs"]
        assert a["rollout/raw_reward"] == b["rollout/raw_reward"]
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
        assert a["train/entropy_loss"] == pytest.approx(b["train/entropy_loss"], rel=1e-4)


def test_ranks_that_torchrun_starts_train_and_exit_cleanly(tmp_path):
    """``torchrun -m rlperf train``: each process is already a rank (nothing more is started); both train
    the step, rank 0 alone writes, and every rank exits 0 (torchrun reports any other exit as a failure)."""
    import subprocess
    import sys

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "rlperf", "train", "--actor-num-gpus-per-node", "2",
                           "--device", "cpu", "--num-rollout", "1", "--skip-gates", "--output-dir", str(out), *FAST],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("rollout 1/1 |") == 1  # rank 0 alone prints
    assert [m["rollout_id"] for m in _lines(out)] == [0]


def test_a_rank_that_dies_takes_the_others_down(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLPERF_FAULT_AT", "checkpoint:write-tmp")  # rank 0 is killed while it saves
    code = _train_cli(tmp_path / "out", "--actor-num-gpus-per-node", "2", "--num-rollout", "1",
                      "--save", str(tmp_path / "ckpt"))
    assert code == 1
    assert "2 actor ranks: rank 0 was killed by SIGKILL" in capsys.readouterr().err
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


# ---- GPU: 2 ranks over NCCL on the qwen3-0.6b shape (bf16 compute, float32 masters) -----------------------
GPU_FLAGS = ["--device", "cuda", "--model", "qwen3-0.6b", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
             "--global-batch-size", "32", "--rollout-max-response-len", "16", "--lr", "1e-5", "--true-on-policy-mode",
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--no-progress"]
"""``bench/device_e2e.sh``'s short run (the embedded task on the 0.6b shape), packed micro-batches."""


def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.gpu
def test_two_gpu_ranks_true_on_policy_is_exact(tmp_path):
    _two_gpus()
    code = main(["train", *GPU_FLAGS, "--actor-num-gpus-per-node", "2", "--num-rollout", "2",
                 "--output-dir", str(tmp_path), "--report-json", str(tmp_path / "gate.json")])
    assert code == 0
    lines = _lines(tmp_path)
    assert [m["train/train_rollout_logprob_abs_diff"] for m in lines] == [0.0, 0.0]
    assert all(m["memory/kind"] == "cuda" for m in lines)
    assert json.loads((tmp_path / "gate.json").read_text())["passed"] is True


@pytest.mark.gpu
def test_two_gpu_ranks_first_step_matches_one_gpu_bit_for_bit(tmp_path):
    """bf16 on both sides: FSDP2 gathers the bf16 cast of the float32 shards, the bits of the one-GPU
    trainer's compute copy; the ranks' engines load the same bits."""
    _two_gpus()
    flags = [*GPU_FLAGS, "--num-rollout", "1"]
    ns = parse_train_args(flags + ["--output-dir", str(tmp_path / "two"), "--actor-num-gpus-per-node", "2"])
    ns.dump = str(tmp_path / "two.pt")
    assert LocalPlacement().launch_actors(_first_step_on_rank, ns, ActorLayout(1, 2, "cuda")) == 0
    two = torch.load(ns.dump, weights_only=False)
    one = first_step(flags + ["--output-dir", str(tmp_path / "one")])  # after the ranks: cuda:0 is free again
    for (tokens, rollout_lp, lp, ref_lp), s in zip(two["samples"], one.samples):
        assert list(tokens) == list(s.tokens)
        assert torch.equal(rollout_lp, s.rollout_log_probs_tensor())
        assert torch.equal(lp.cpu(), s.log_probs.cpu()) and torch.equal(ref_lp.cpu(), s.ref_log_probs.cpu())
    torch.cuda.empty_cache()
