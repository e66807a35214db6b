"""rlperf.kernels — batch-invariant kernels for train/rollout bit-identity, with torch references.

Every op has a Triton kernel and a torch reference (``rlperf.kernels.reference``). Which one runs
is explicit: one :class:`KernelPolicy` (``mode``: ``"invariant"`` or ``"fast"``; ``backend``:
triton on CUDA; reference, or the Triton interpreter when ``TRITON_INTERPRET=1``, on CPU), set for
a block with :func:`use_policy` / :func:`use_mode` / :func:`use_backend`, and one routing function
that every op calls. See ``rlperf.kernels.dispatch``.

Triton reads ``TRITON_INTERPRET`` when the kernel modules are imported, i.e. at
``import rlperf.kernels``: set it before that to run the kernels on the CPU.

No submodule shares a name with an op: the matmul kernel lives in ``gemm``, the fused lm-head
log-prob in ``fused_lm_head``, the expert ops in ``moe``, so ``rlperf.kernels.matmul`` is always the function. Those modules
also hold the launchers that tuning sweeps call with a config of their own
(``gemm.launch``, ``fused_lm_head.fused_logprob_forward`` / ``fused_logprob_backward``,
``attention.attention_forward``, ``attention_backward.attention_backward``).
"""
from .dispatch import (BACKENDS, MODES, KernelPolicy, backend, current_policy, default_policy, mode,
                       refresh_environment, set_mode, use_backend, use_mode, use_policy)

from .activation import silu_mul
from .attention import PAGE_SIZE, paged_attention, varlen_attention, write_kv_cache
from .fused_lm_head import (LogitsFold, fold_logits, fused_logprob, fused_logprob_of_logits, fused_sample_logprob,
                            logits_give_fused_logprob, logprob_of_fold)
from .gemm import linear, linear_silu_mul, matmul, matmul_config
from .logprob import log_softmax, token_logprobs
from .moe import grouped_matmul, moe_combine, moe_experts, moe_plan, moe_route, moe_route_weights, moe_slot_rows
from .norm import add_rmsnorm, rmsnorm, rmsnorm_blocks
from .pipeline import programmatic_launch, set_programmatic_launch, use_programmatic_launch
from .rope import rmsnorm_rope, rmsnorm_rope_blocks, rmsnorm_rope_store_kv
from .sampling import check_sampling_rows, sample


def _settle_cache_keys() -> None:
    """Every kernel module's ``@triton.jit`` keys computed once at import (:func:`.precompile.settle_cache_keys`:
    a kernel's on-disk cache key then does not depend on what this process compiled before, so the
    precompiled cache serves the run)."""
    import sys

    from . import precompile, tree_reduce  # noqa: F401 (tree_reduce: its kernels too)

    precompile.settle_cache_keys([m for name, m in sorted(sys.modules.items()) if name.startswith(__name__ + ".")])


_settle_cache_keys()

__all__ = [
    "BACKENDS", "MODES", "KernelPolicy", "backend", "current_policy", "default_policy", "mode", "refresh_environment",
    "set_mode", "use_backend", "use_mode", "use_policy",
    "matmul", "linear", "linear_silu_mul", "matmul_config", "rmsnorm", "rmsnorm_blocks", "add_rmsnorm", "PAGE_SIZE", "write_kv_cache",
    "paged_attention", "varlen_attention", "log_softmax", "token_logprobs", "fused_logprob", "fused_logprob_of_logits", "fold_logits", "logprob_of_fold", "LogitsFold", "logits_give_fused_logprob", "fused_sample_logprob", "sample", "check_sampling_rows", "silu_mul",
    "rmsnorm_rope", "rmsnorm_rope_blocks", "rmsnorm_rope_store_kv", "moe_route", "moe_route_weights", "moe_plan", "grouped_matmul", "moe_combine", "moe_experts",
    "moe_slot_rows", "programmatic_launch", "set_programmatic_launch", "use_programmatic_launch",
]
