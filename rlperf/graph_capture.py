"""CUDA-graph captures that may fail without failing the process: the engine's decode and prefill graphs
(``rlperf.rollout.cuda_graph``) and the trainer's graphed micro-steps (``rlperf.train.cuda_graph``) both
capture through this module.

A capture can raise for reasons outside the captured code's control: an op that may not run under capture
(a host sync, a pageable copy), memory the graph's private pool cannot get, a Python error in a rarely
taken branch. Every graph rlperf captures replays the kernels of an eager step that runs over the same
static buffers with the same bits, so the answer to a failed capture is to run that key's steps eagerly:

* :func:`capturing` is ``torch.cuda.graph`` (thread-local error mode) that, when the capture raises,
  leaves the stream and the caching allocator as they were before it (:func:`after_failed_capture`);
* :func:`capture_or_fall_back` runs one capture, and on failure records the error under its key, logs a
  warning once and returns False: the caller's eager path takes that key from then on.

What stays behind: the failed graph's private pool keeps the memory it had reserved until its owner goes.
Imports nothing of rlperf (layer 0).
"""
from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None):
    """``with capturing(graph, pool):`` captures the block into ``graph`` (memory from ``pool``; None: a
    new private pool) with ``capture_error_mode="thread_local"`` (other threads may touch CUDA meanwhile,
    e.g. a server copying a weight bucket). If the block or the capture's end raises, the caller's stream
    and the allocator's routing are restored (:func:`after_failed_capture`) before the error propagates."""
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield graph
    except BaseException:
        after_failed_capture(graph, stream)
        raise


def after_failed_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """Undo what a capture that raised left behind, so the process goes on eagerly. When CUDA invalidated the
    capture itself (an op that may not be captured: a host sync, an allocation the pool cannot make),
    ``torch.cuda.graph``'s exit raises from ``capture_end`` and skips restoring the caller's stream, and the
    caching allocator may still route the capture stream's allocations to the graph's pool: the stream is set
    back here and the routing ended (a no-op if ``capture_end`` got that far; the pool's memory stays
    reserved). The GPU tests of failed captures (tests/rollout/test_engine.py, tests/train/
    test_cuda_graph_train.py) check that later captures and eager steps work."""
    if torch.cuda.current_stream() == stream:
        return  # capture_end ran: the stream and the allocator are as they were
    torch.cuda.set_stream(stream)
    try:
        torch._C._cuda_endAllocateToPool(stream.device_index, graph.pool())
    except RuntimeError:  # the allocator had already ended it
        pass


def capture_or_fall_back(failed: dict, key, what: str, capture_once, hint: str = "") -> bool:
    """``capture_once()`` (a capture that stores its graph); True when it did. When it raises, the error's
    text goes to ``failed[key]``, a warning to the log (``what`` names the step, e.g. ``"decode step"``;
    ``hint`` is appended, e.g. the flag that turns graphs off) and False comes back: the caller runs that key's steps eagerly, with the
    replay's bits (the same kernels over the same padded buffers) and without the launch savings. The caller
    does not capture a key that is in ``failed`` again."""
    try:
        capture_once()
        return True
    except Exception as exc:  # noqa: BLE001 - any capture failure: that graph's steps run eagerly
        failed[key] = f"{type(exc).__name__}: {exc}".strip()
        log.warning("CUDA graph capture of the %s %s failed; those steps run eagerly%s: %s", what, key,
                    f" ({hint})" if hint else "", failed[key].splitlines()[0])
        return False
