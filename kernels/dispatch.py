"""The kernel policy: which implementation every rlperf op runs, and the one function that decides.

A :class:`KernelPolicy` is two choices.

Mode:

* ``"invariant"`` (default) — batch-invariant kernels: a row's bits never depend on the batch.
* ``"fast"``               — the fastest path, invariance not required, so the price of
  invariance can be measured: stock torch where it beats rlperf's kernel (:data:`FAST_MODE_STOCK`;
  for the matmul only above :data:`FAST_MODE_KERNEL_ROWS` rows).

Backend, chosen per call from the input's device unless the policy names one:

* ``"triton"``       — CUDA tensors: the Triton kernels, compiled for the GPU.
* ``"interpreter"``  — CPU tensors with ``TRITON_INTERPRET=1`` in the environment: the same Triton
  kernels, run by Triton's interpreter on the CPU (how CI tests every kernel).
* ``"reference"``    — CPU tensors otherwise: the torch references of ``rlperf.kernels.reference``
  (float64 math, result cast to the input dtype).

Naming a backend that cannot run on the input's device (``"triton"`` for CPU tensors,
``"interpreter"`` for CUDA tensors or without ``TRITON_INTERPRET=1``) is an error, never a silent
fallback. Triton reads ``TRITON_INTERPRET`` when a kernel module is imported, so it has to be set
before ``import rlperf.kernels``.

Where the policy lives. :func:`use_policy` (and its shorthands :func:`use_mode`,
:func:`use_backend`) sets it for a block, in a :class:`contextvars.ContextVar`: it holds for the
current thread or asyncio task and for what is started from a copy of its context (asyncio tasks,
``asyncio.to_thread``, ``contextvars.copy_context().run``). A ``threading.Thread`` starts from an
empty context, so a thread that must run under a policy enters :func:`use_policy` itself. Outside
every block the process default applies: ``RLPERF_MODE`` (read at import) and :func:`set_mode`
for the mode; ``RLPERF_BACKEND`` for the backend (read with ``TRITON_INTERPRET`` when the first op
runs, or by :func:`refresh_environment`).

Routing. Every public op calls :func:`route` once and follows its answer:

* ``"autograd"``  — grad is on, an input requires grad, and the op will run a kernel: the op wraps
  itself in its backward (:mod:`rlperf.kernels.autograd`; varlen attention's own Triton backward is
  :mod:`rlperf.kernels.attention_backward`). The reference backend's float64 torch code needs no
  wrapper: autograd differentiates it as it is.
* ``"stock"``     — fast mode, and the stock torch op is the faster path here (:data:`FAST_MODE_STOCK`,
  for a ``"large"`` op with the call's ``rows``).
* ``"triton"`` / ``"interpreter"`` — launch the Triton kernel (compiled, or under the interpreter).
* ``"reference"`` — the torch reference.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os

import torch

BACKENDS = ("triton", "interpreter", "reference")
MODES = ("invariant", "fast")
ROUTES = ("autograd", "stock", *BACKENDS)

FAST_MODE_KERNEL_ROWS = 64
"""Fast mode's matmul on CUDA is rlperf's kernel for calls of at most this many rows (decode steps of up to 64
sequences), cuBLAS above. At these sizes the products are memory-bound, and the kernel's small-batch tiles ran
faster than cuBLAS in 11 of 12 cases and 0.2 us slower in one (o_proj at 64 rows). The figures are us per
product at M = 1 / 16 / 64, kernel against cuBLAS, from bench/NOTES-matmul.md run 8 (one H200, weights streamed
from HBM):

* 0.6B qkv: 5.2 / 5.3 / 5.5 against 5.8 / 5.8 / 5.8;
* o_proj: 6.2 / 6.2 / 6.5 against 10.7 / 6.4 / 6.3;
* gate_up: 6.2 / 6.2 / 6.5 against 6.7 / 6.8 / 7.1;
* down: 7.8 / 7.8 / 8.1 against 8.0 / 8.3 / 8.5.

The kernel's launches also keep the engine's programmatic dependent launches chained, which cuBLAS's launches
break. From 256 rows cuBLAS wins some shapes (gate_up 8.2 against 9.9 us)."""

FAST_MODE_STOCK = {
    # op: where fast mode runs the stock torch op instead of rlperf's ("everywhere", "large", "cpu" or None).
    # "everywhere": stock beats the kernel on CUDA too (bench/BENCHMARKS.md): cuBLAS, SDPA / flash.
    # "large": on the CPU, and on CUDA for calls of more than FAST_MODE_KERNEL_ROWS rows (or that name none).
    "matmul": "large",
    "varlen_attention": "everywhere",
    "paged_attention": "everywhere",  # decode-only batches keep the kernel: torch has no paged decode
    "fused_logprob": "everywhere",    # not with a tp_group: the vocabulary split needs the kernels
    # "cpu": on CUDA rlperf's kernel is at least as fast, so there invariance costs nothing
    "rmsnorm": "cpu",
    "add_rmsnorm": "cpu",
    "silu_mul": "cpu",
    "rmsnorm_rope": "cpu",
    "log_softmax": "cpu",
    "token_logprobs": "cpu",
    "write_kv_cache": "cpu",          # a copy: the torch path syncs the host (negative-slot filter)
    "moe_experts": "everywhere",      # torch._grouped_mm / a per-expert loop (on CUDA bf16 only: kernels/moe.py)
    # None: the kernel in both modes (a sampler that changed with the batch would break seeded runs)
    "sample": None,
    "moe_route": None,                # routing decides which weights a token meets: same in both modes
}


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Which implementation the ops run (module docstring)."""

    mode: str = "invariant"
    """``"invariant"`` (batch-invariant kernels) or ``"fast"`` (stock torch where it is faster)."""
    backend: str | None = None
    """``"triton"``, ``"interpreter"``, ``"reference"``, or None: chosen from each input's device."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: expected one of {MODES}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: expected one of {BACKENDS}")

    def backend_for(self, device: torch.device | str | None) -> str:
        """The backend an op on ``device`` runs under this policy; RuntimeError if the named one cannot."""
        interpret = _environment()["interpret"]
        is_cuda = _is_cuda(device)
        if self.backend is None:
            if is_cuda:
                return "triton"
            return "interpreter" if interpret else "reference"
        if self.backend == "triton" and not is_cuda:
            raise RuntimeError(f"backend 'triton' needs CUDA tensors, got a tensor on {device or 'cpu'}")
        if self.backend == "interpreter":
            if is_cuda:
                raise RuntimeError("backend 'interpreter' runs on CPU tensors only")
            if not interpret:
                raise RuntimeError("backend 'interpreter' needs TRITON_INTERPRET=1 set before rlperf.kernels runs an op")
        return self.backend


def _is_cuda(device: torch.device | str | None) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return device is not None and str(device).startswith("cuda")


# ---- the process default ----------------------------------------------------------------------

_env: dict | None = None
_default_mode = os.environ.get("RLPERF_MODE", "invariant")
if _default_mode not in MODES:
    raise ValueError(f"RLPERF_MODE={_default_mode!r}: expected one of {MODES}")
_default: KernelPolicy | None = None  # built with the environment, on the first op


def refresh_environment() -> None:
    """Re-read ``TRITON_INTERPRET`` and ``RLPERF_BACKEND`` (they are read once, on the first op).

    Reading them once keeps the per-op routing cost to a few lookups (it sits on the decode hot
    path), and matches Triton, which reads ``TRITON_INTERPRET`` when a kernel module is imported:
    changing it later does not change how already-imported kernels run.
    """
    global _env, _default
    forced = os.environ.get("RLPERF_BACKEND") or None
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"RLPERF_BACKEND={forced!r}: expected one of {BACKENDS}")
    _env = {"interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), "forced": forced}
    _default = KernelPolicy(_default_mode, forced)


def _environment() -> dict:
    if _env is None:
        refresh_environment()
    return _env


def default_policy() -> KernelPolicy:
    """The process default: :func:`set_mode` / ``RLPERF_MODE``, and ``RLPERF_BACKEND`` (or automatic)."""
    if _default is None:
        refresh_environment()
    return _default


def set_mode(name: str) -> None:
    """Set the process default mode (``"invariant"`` or ``"fast"``): every thread and task outside a
    :func:`use_policy` / :func:`use_mode` / :func:`use_backend` block follows it; a block keeps its own."""
    global _default_mode, _default
    KernelPolicy(name)  # validates
    _default_mode = name
    if _default is not None:
        _default = dataclasses.replace(_default, mode=name)


# ---- the current policy -----------------------------------------------------------------------

_policy: contextvars.ContextVar[KernelPolicy | None] = contextvars.ContextVar("rlperf_kernel_policy", default=None)


def current_policy() -> KernelPolicy:
    """The policy ops run under here: the innermost :func:`use_policy` block's, else the process default."""
    policy = _policy.get()
    return policy if policy is not None else default_policy()


@contextlib.contextmanager
def use_policy(policy: KernelPolicy | None):
    """Run the block (in this context: thread or task) under ``policy``; None: the process default."""
    if policy is not None and not isinstance(policy, KernelPolicy):
        raise TypeError(f"use_policy: expected a KernelPolicy or None, got {type(policy).__name__}")
    token = _policy.set(policy)
    try:
        yield policy
    finally:
        _policy.reset(token)


def use_mode(name: str):
    """Run the block in mode ``name``, the backend as it is (a context manager)."""
    return use_policy(dataclasses.replace(current_policy(), mode=name))


def use_backend(name: str | None):
    """Run the block on backend ``name``, the mode as it is (a context manager); None: the process
    default's backend (``RLPERF_BACKEND``, else automatic)."""
    if name is None:
        name = default_policy().backend
    return use_policy(dataclasses.replace(current_policy(), backend=name))


def mode() -> str:
    """``"invariant"`` (batch-invariant kernels) or ``"fast"`` (cuBLAS/SDPA/torch), as ops run here now."""
    return current_policy().mode


def backend(device: torch.device | str | None = None) -> str:
    """The backend an op on ``device`` runs here now: ``"triton"``, ``"interpreter"`` or ``"reference"``."""
    return current_policy().backend_for(device)


# ---- routing ----------------------------------------------------------------------------------


def route(op: str, device: torch.device, grad_inputs: tuple = (), stock_ok: bool = True,
          rows: int | None = None) -> str:
    """How op ``op`` runs on ``device`` under the current policy: one of :data:`ROUTES` (module docstring).

    ``grad_inputs``: the tensors (None allowed) a gradient may flow to; ``"autograd"`` needs one of
    them to require grad while grad mode is on. ``stock_ok=False``: this call cannot take the stock
    op (``fused_logprob`` with a ``tp_group``; a ``paged_attention`` batch the stock path declined).
    ``rows``: the call's row count, which decides a ``"large"`` op in fast mode on CUDA (None: taken as
    large). The backend is resolved only when the answer depends on it, so a fast-mode stock op never fails
    on a backend that could not have run it.
    """
    stock = FAST_MODE_STOCK[op]
    policy = current_policy()
    where = None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grad_inputs):
        where = policy.backend_for(device)
        if where != "reference":
            return "autograd"
    if policy.mode == "fast" and stock_ok and _stock_here(stock, device, rows):
        return "stock"
    return where if where is not None else policy.backend_for(device)


def _stock_here(stock: str | None, device, rows: int | None) -> bool:
    """Whether fast mode takes the stock op of :data:`FAST_MODE_STOCK` entry ``stock`` for this call."""
    if stock == "everywhere":
        return True
    if stock == "large":
        return not _is_cuda(device) or rows is None or rows > FAST_MODE_KERNEL_ROWS
    return stock == "cpu" and not _is_cuda(device)
