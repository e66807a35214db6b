"""rlperf.loop.warm_start: the training run after the gates (and any later run of the process with
the same key) starts from the first run's warmed weights, bit for bit what its own warm-up gives."""
import pytest
import torch

from rlperf.loop import warm_start
from rlperf.loop.runner import Run, resolve

SMALL = ("--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16")


def _run(tmp, *flags) -> Run:
    return Run(resolve(["--output-dir", str(tmp), "--no-progress", "--device", "cpu", "--num-rollout", "1",
                         *SMALL, *flags]))


def _weights(run: Run) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in run.trainer.master_model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


@pytest.fixture(autouse=True)
def _nothing_kept():
    warm_start.clear()
    yield
    warm_start.clear()


def _built(tmp, *flags):
    run = _run(tmp, *flags)
    try:
        return run.warm_started is not None, run.warmup_loss, _weights(run)
    finally:
        run.close()


def test_a_second_run_takes_the_kept_weights_bit_for_bit(tmp_path):
    fresh, loss, weights = _built(tmp_path / "a")
    again, loss_again, weights_again = _built(tmp_path / "b")
    assert (fresh, again) == (False, True)
    assert loss_again == loss and _same(weights_again, weights)
    warm_start.clear()  # a third run warms up on its own: the same bits
    third, loss_third, weights_third = _built(tmp_path / "c")
    assert not third and loss_third == loss and _same(weights_third, weights)


def test_another_seed_or_kernel_mode_warms_up_afresh(tmp_path):
    _built(tmp_path / "a")
    seeded, _, other_weights = _built(tmp_path / "b", "--seed", "7")
    assert not seeded  # and it replaced what was kept
    assert _built(tmp_path / "c", "--seed", "7")[0]
    assert not _built(tmp_path / "d", "--seed", "7", "--mode", "fast")[0]
    assert not _same(other_weights, _built(tmp_path / "e")[2])


def test_a_model_over_the_size_limit_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "MAX_BYTES", 1024)
    _built(tmp_path / "a")
    assert not _built(tmp_path / "b")[0]


def test_rlperf_train_after_its_gates_equals_a_run_without_them(tmp_path, monkeypatch):
    """`rlperf train` runs the gates first: their run keeps the warmed weights and the training run
    takes them. Its metrics (weights checksum included) are those of a run that warmed up by itself."""
    import json

    from rlperf.cli import main

    def stable(out):
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in m.items() if not k.startswith(("perf/", "memory/"))} for m in lines]

    found = []
    lookup = warm_start.lookup
    monkeypatch.setattr(warm_start, "lookup", lambda key: found.append(lookup(key) is not None) or lookup(key))
    flags = ["--no-progress", "--device", "cpu", "--num-rollout", "2", *SMALL]
    assert main(["train", "--output-dir", str(tmp_path / "gated"), *flags]) == 0
    assert found == [False, True]  # the gates' run warmed up and kept; the training run took it
    warm_start.clear()
    assert main(["train", "--output-dir", str(tmp_path / "alone"), "--skip-gates", *flags]) == 0
    assert found == [False, True, False]
    assert stable(tmp_path / "gated") == stable(tmp_path / "alone")
