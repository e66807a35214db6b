"""Test setup shared by the whole suite.

* Without CUDA, ``TRITON_INTERPRET=1`` is set before any kernel module is imported, so the Triton
  kernels run under Triton's interpreter on the CPU (Triton reads the variable at import time), and
  rlperf's dispatch reads it at once (it keeps the first value it reads).
* Tests marked ``gpu`` need CUDA: skipped without it, run on the device before an issue is resolved.
* Under pytest-xdist (the README's test command runs 2 workers) each worker uses one CPU thread.
"""
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# rlperf.kernels reads TRITON_INTERPRET once, on its first op: read it now, so a test that removes it
# for the processes it starts (``no_interpreter``) cannot leave this process's later tests without it
import rlperf.kernels  # noqa: E402

rlperf.kernels.refresh_environment()


def _interpreter_patches_once_per_launch():
    """Triton's interpreter re-patches ``triton.language`` (``_patch_lang``: ``inspect.getmembers`` over
    tl, tl.tensor, tl.math, ...) on *every* call of a ``@triton.jit`` helper inside a kernel, not just once
    per launch: a fifth of the interpreter's time in helper-heavy kernels (norms, rope). The launch's own
    patch (``GridExecutor``) stays, and so does each helper's first patch in a launch; a repeat call of the
    same helper in the same launch would set the same attributes to equivalent wrappers again, and its
    scope is never restored, so skipping it changes nothing the kernels compute. Applied only where
    Triton's interpreter has the functions this relies on."""
    import threading

    try:
        from triton.runtime import interpreter as interp
    except Exception:
        return
    grid_call = getattr(getattr(interp, "GridExecutor", None), "__call__", None)
    patch_lang = getattr(interp, "_patch_lang", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    if grid_call is None or patch_lang is None or scope_cls is None:
        return
    local = threading.local()

    def launch(self, *args, **kwargs):
        outer = getattr(local, "patched", None)
        local.patched = set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            local.patched = outer

    def patch_once(fn):
        patched = getattr(local, "patched", None)
        if patched is None:
            return patch_lang(fn)
        if fn in patched:
            return scope_cls()
        patched.add(fn)
        return patch_lang(fn)

    interp.GridExecutor.__call__ = launch
    interp._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _interpreter_patches_once_per_launch()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one CPU thread per xdist worker (and for the processes it starts): the workers already keep the
    # cores busy, and more threads than cores make every torch op wait on the others
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marker gpu): run on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def interpreter():
    """Skip unless kernels run under the Triton interpreter (CPU tensors, TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("TRITON_INTERPRET is not set: the CPU kernel tests need Triton's interpreter")


@pytest.fixture
def poison(monkeypatch):
    """Every float tensor an op allocates with torch.empty starts as NaN, so unwritten outputs fail."""
    original = torch.empty

    def empty(*args, **kwargs):
        t = original(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(scope="session")
def free_ports():
    """``free_ports(n, consecutive=False)``: n distinct TCP ports on 127.0.0.1, free a moment ago, from
    this pytest-xdist worker's slice of the span the product's own picks use
    (:func:`rlperf.rollout.router.listen_port_span`), so two workers never draw the same port."""
    from rlperf.rollout.router import free_ports as pick, listen_port_span

    low, high = listen_port_span()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    width = (high - low) // max(workers, 1)
    span = (low + index * width, low + (index + 1) * width)
    return lambda n, consecutive=False: pick(n, "127.0.0.1", consecutive=consecutive, span=span)


@pytest.fixture(scope="session")
def launch_router_cluster(tmp_path_factory, free_ports):
    """``launch_router_cluster(args, n=2)``: n ``rlperf serve`` workers (``ServerArgs`` args) on free ports
    behind the real sglang-router, one CPU thread each, not under the Triton interpreter; returns the
    started ``rlperf.rollout.router.Cluster`` (a context manager). A start failure prints the logs."""

    def launch(args, n: int = 2):
        from rlperf.rollout.router import launch_cluster

        log_dir = tmp_path_factory.mktemp("cluster-logs")
        *ports, router_port = free_ports(n + 1)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["OMP_NUM_THREADS"] = "1"
        try:
            return launch_cluster(args, n, router_port, env=env, log_dir=str(log_dir), ports=ports)
        except Exception:
            for f in sorted(log_dir.iterdir()):
                sys.stderr.write(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}\n")
            raise

    return launch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Many tiny engine ops: one intra-op thread is far faster than threads fighting over shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def png_ink():
    """``png_ink(path) -> dict``: pixel statistics of a PNG that show whether curves or bars were drawn:
    ``pixels``, ``colored`` (pixels whose channels differ by more than 0.25: the matplotlib palette's
    lines, areas and bars; axes, text and grid are grey) and ``colors`` (distinct colours). Needs
    matplotlib (its PNG reader)."""
    import numpy as np

    def ink(path) -> dict:
        from matplotlib.image import imread

        rgb = imread(str(path))[..., :3]
        spread = rgb.max(axis=-1) - rgb.min(axis=-1)
        return {"pixels": rgb.shape[0] * rgb.shape[1], "colored": int((spread > 0.25).sum()),
                "colors": len(np.unique((rgb * 255).astype(np.uint8).reshape(-1, 3), axis=0)), "rgb": rgb}

    return ink
