"""rlperf.bench.persistent_products under Triton's interpreter: the persistent kernel's dataflow (tiles handed
out in order, each product waiting on the counter of the one before) computes the shipped chain's bits, and
its counters count every tile of every launch. The timing is GPU-only (a device run)."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.bench.persistent_products import BLOCK_N, SHAPES, ProductChain, main


def test_persistent_kernel_gives_the_chains_bits_and_counts_every_tile(interpreter):
    chain = ProductChain(layers=1, device="cpu", dtype=torch.float16, seed=3)
    with K.use_backend("interpreter"):
        chain.persistent()
        ref = chain.chain()
        assert chain.same_bits(ref)
        chain.outs[3].zero_()
        chain.persistent()  # a second launch waits for twice the tiles: its counters were not reset
        assert chain.same_bits(ref)
    assert chain.counters.tolist() == [2 * n // BLOCK_N for n, _ in SHAPES]


def test_cli_refuses_bad_flags_and_a_machine_that_cannot_run_it(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--layers", "0"])
    assert e.value.code == 2 and "--layers and --rounds must be >= 1" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--layers", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
