"""``--fsdp-gather``: when the data-parallel trainer gathers its FSDP2 shards (rlperf.train.fsdp).

Two real rank processes (gloo) train the tiny model on the same global batch of 6 samples, one sample
per micro-batch (3 micro-batches per rank), once gathering per micro-batch and once per step. Each
rank counts the FSDP collectives it issues. Both modes must give the one-process step's gradient of
the global batch (to float32 rounding: only the order of the additions differs), and ``step`` must issue one
reduce-scatter per FSDP group per optimizer step instead of one per micro-batch.
"""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rlperf.kernels as K
from rlperf.loop.placement import leave_process
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.train import Sample, TrainArgs, Trainer
from rlperf.train.fsdp import (GATHERED_STEP_MEMORY_FRACTION, FSDPTrainer, gather_once_per_step,
                               gathered_step_bytes)

CFG = preset("tiny")
LENGTHS = [(6, 3), (9, 5), (4, 1), (13, 7), (8, 2), (11, 6)]  # (total, response): 2 prompts x 3 samples
WORLD = 2
GATHERS = ("all_gather_into_tensor", "all_gather_single")
SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")


def _samples():
    g = torch.Generator().manual_seed(0)
    return [Sample(torch.randint(0, CFG.vocab_size, (n,), generator=g), r, reward=float(i % 2))
            for i, (n, r) in enumerate(LENGTHS)]


def _args(mode: str) -> TrainArgs:
    return TrainArgs(n_samples_per_prompt=3, micro_batch_size=1, lr=1e-2, fsdp_gather=mode)


def _count_collectives(counts: dict) -> None:
    """Wrap torch.distributed's tensor all-gather and reduce-scatter (whichever names this torch has)
    to count the outermost calls: ``counts["gather"]``, ``counts["scatter"]``."""
    depth = [0]
    for kind, names in (("gather", GATHERS), ("scatter", SCATTERS)):
        for name in names:
            if not hasattr(dist, name):
                continue

            def wrapped(*a, _orig=getattr(dist, name), _kind=kind, **k):
                if depth[0] == 0:
                    counts[_kind] += 1
                depth[0] += 1
                try:
                    return _orig(*a, **k)
                finally:
                    depth[0] -= 1
            setattr(dist, name, wrapped)


def _rank(rank: int, tmp: str, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init-{mode}", rank=rank, world_size=WORLD)
    try:
        with K.use_backend("reference"):
            trainer = FSDPTrainer(Qwen3ForCausalLM.random(CFG, seed=0, std=0.05), _args(mode))
            samples = _samples()
            counts = {"gather": 0, "scatter": 0}
            _count_collectives(counts)
            trainer.prepare(samples)
            prepare = dict(counts)
            trainer.train_step(samples)
            step = {k: counts[k] - prepare[k] for k in counts}
            full = {n: p.grad.full_tensor() for n, p in trainer.master_model.named_parameters()}
        torch.save((rank, trainer.gather_once_per_step, prepare, step, full if rank == 0 else None),
                   f"{tmp}/{mode}-{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_process(0)


def _run(mode: str, tmp: str):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, tmp, mode)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"--fsdp-gather {mode}: a rank exited with {p.exitcode}"
    return [torch.load(f"{tmp}/{mode}-{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-gather")
    return {mode: _run(mode, str(tmp)) for mode in ("step", "micro-batch")}


def _one_process_gradient():
    with K.use_backend("reference"):
        trainer = Trainer(Qwen3ForCausalLM.random(CFG, seed=0, std=0.05), _args("auto"))
        samples = _samples()
        trainer.prepare(samples)
        trainer.train_step(samples)
        return {n: p.grad.clone() for n, p in trainer.master_model.named_parameters()}


def test_both_modes_give_the_one_process_gradient(runs):
    one = _one_process_gradient()
    for mode, results in runs.items():
        full = results[0][4]
        assert set(full) == set(one)
        for name, t in one.items():
            torch.testing.assert_close(full[name], t, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")


def test_step_gathers_and_reduce_scatters_once_per_step(runs):
    groups = CFG.num_hidden_layers + 1  # one FSDP group per decoder layer, one for the root
    micro_batches = len(LENGTHS) // WORLD  # one sample per micro-batch, 3 per rank
    for rank, gathered, prepare, step, _ in runs["step"]:
        assert gathered is True
        assert step["scatter"] == groups, rank
        assert step["gather"] == groups, rank  # every group gathered once, kept across the micro-batches
        assert prepare["gather"] == groups, rank  # the log-prob pass too
    for rank, gathered, prepare, step, _ in runs["micro-batch"]:
        assert gathered is False
        assert step["scatter"] == groups * micro_batches, rank
        assert step["gather"] > groups * micro_batches, rank  # before each forward and again before each backward


def test_auto_keeps_a_step_gathered_only_when_it_fits(monkeypatch):
    import types

    model = Qwen3ForCausalLM.random(CFG, seed=0)
    params = sum(p.numel() for p in model.parameters())
    assert gathered_step_bytes(model) == params * 8  # float32 parameters + float32 gradients
    need = gathered_step_bytes(model, torch.bfloat16)
    assert need == params * 6
    assert gather_once_per_step("auto", model, torch.device("cpu")) is True
    assert gather_once_per_step("micro-batch", model, torch.device("cpu")) is False
    assert gather_once_per_step("step", model, torch.device("cpu")) is True
    # on CUDA, auto compares the cost with the GPU's memory: a GPU just large enough, and one too small
    fits = int(need / GATHERED_STEP_MEMORY_FRACTION) + 1
    for total, expected in ((fits, True), (int((need - 1) / GATHERED_STEP_MEMORY_FRACTION), False)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, t=total: types.SimpleNamespace(total_memory=t))
        assert gather_once_per_step("auto", model, torch.device("cuda"), torch.bfloat16) is expected, total
        assert gather_once_per_step("micro-batch", model, torch.device("cuda"), torch.bfloat16) is False


def test_a_bad_mode_names_the_flag():
    with pytest.raises(ValueError, match="--fsdp-gather 'layer'"):
        TrainArgs(fsdp_gather="layer")
