"""Start one spawned process per rank of a test's process group and require that each exits 0."""
from __future__ import annotations

import torch.multiprocessing as mp


def run_ranks(target, world: int, *args, timeout: float = 300.0, what: str = "a rank") -> None:
    """``target(rank, *args)`` in ``world`` spawned processes; AssertionError naming ``what`` and the exit
    code of the first that does not exit 0 within ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
        assert p.exitcode == 0, f"{what} exited with {p.exitcode}"
