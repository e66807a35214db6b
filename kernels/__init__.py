"""rlperf.kernels — batch-invariant kernels for train/rollout bit-identity, with torch references.

Every op has a Triton kernel and a torch reference (``rlperf.kernels.reference``). Which one runs
is explicit: :func:`backend` (triton on CUDA; reference, or the Triton interpreter when
``TRITON_INTERPRET=1``, on CPU) and :func:`mode` (``"invariant"`` or ``"fast"``). See
``rlperf.kernels.dispatch``.

Triton reads ``TRITON_INTERPRET`` when the kernel modules are imported, i.e. at
``import rlperf.kernels``: set it before that to run the kernels on the CPU.

The ops are bound here by name after their submodules load, so ``rlperf.kernels.matmul`` is the
function even when the submodule of the same name was imported first.
"""
from .dispatch import BACKENDS, MODES, backend, mode, refresh_environment, set_mode, use_backend, use_mode

from .activation import silu_mul
from .attention import PAGE_SIZE, paged_attention, varlen_attention, write_kv_cache
from .fused_logprob import fused_logprob
from .logprob import log_softmax, token_logprobs
from .matmul import linear, matmul, matmul_config
from .norm import add_rmsnorm, rmsnorm
from .sampling import sample

__all__ = [
    "BACKENDS", "MODES", "backend", "mode", "refresh_environment", "set_mode", "use_backend", "use_mode",
    "matmul", "linear", "matmul_config", "rmsnorm", "add_rmsnorm", "PAGE_SIZE", "write_kv_cache",
    "paged_attention", "varlen_attention", "log_softmax", "token_logprobs", "fused_logprob", "sample", "silu_mul",
]
