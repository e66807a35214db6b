"""Backward passes for the forward kernels, so the trainer can differentiate through the model.

The forward of every op is the batch-invariant kernel (that is what makes training and rollout
log-probs equal bit for bit); the backward only has to be a correct gradient of the same math, and
need not be batch-invariant, except where a contract below says so. Two kinds:

* :func:`matmul_with_grad` — ``y = x @ w.T + b`` with the analytic backward
  (``dx = g @ w``, ``dw = g.T @ x``, ``db = sum_rows(g)``): in invariant mode through the Triton
  kernels of :func:`rlperf.kernels.gemm.invariant_linear_grads` (a row of dx depends on that row
  of g only; dw sums the rows in a fixed order that rows appended with g = 0 do not change, so a
  micro-batch padded to a CUDA-graph bucket has the gradients of the unpadded one, bit for bit);
  in fast mode torch's matmuls (cuBLAS on the GPU, whose kernel choice follows the row count);
* :func:`with_recompute_backward` — the rest (token log-probs, log-softmax, and varlen attention
  in fast mode): the forward runs the kernel and saves only its inputs; the
  backward re-runs a stock torch formula of the same op under autograd and differentiates it
  (``torch.autograd.grad``), like activation checkpointing for one op. The formula runs in float32
  for the row ops (``upcast=True``); fast-mode attention recomputes in its input dtype through SDPA
  / flash varlen, whose backward never materializes the [L, L] scores. (Invariant-mode varlen
  attention has its own Triton backward: ``kernels/attention_backward.py``.)

RMSNorm, add+RMSNorm, SwiGLU and the fused q/k RMSNorm + RoPE carry their own Triton backward
next to their forward (``kernels/norm.py``, ``kernels/activation.py``, ``kernels/rope.py``: one
``torch.autograd.Function`` each, float32 math, fixed-order partial sums for the weight gradients);
fast mode's stock torch path of those ops is differentiated by torch itself.

An op wraps itself only when :func:`rlperf.kernels.dispatch.route` answers ``"autograd"``: grad
mode is on and an input requires grad, so the rollout engine, the CUDA-graph captures and every
``torch.no_grad`` log-prob pass run the bare kernels; and never on the reference backend, whose
float64 torch code autograd differentiates as it is.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


class _MatmulWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward: Callable, grads: Callable | None, x: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor | None):
        ctx.save_for_backward(x, w)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.grads = grads
        return forward(x, w, bias)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        gx = gw = gb = None
        if ctx.grads is not None:
            gx, gw = ctx.grads(x, w, g, need_x, need_w)
        else:
            if need_x:
                gx = (g.to(w.dtype) @ w).to(x.dtype)                           # [M, N] @ [N, K]
            if need_w:
                gw = (g.to(x.dtype).transpose(0, 1) @ x).to(w.dtype)           # [N, M] @ [M, K]
        if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
            gb = g.float().sum(0).to(ctx.bias_dtype)
        return None, None, gx, gw, gb


def matmul_with_grad(forward: Callable, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                     grads: Callable | None = None):
    """``forward(x [M, K], w [N, K], bias [N] | None) -> [M, N]`` (the kernel), made differentiable.

    ``grads(x, w, g, need_x, need_w) -> (dx | None, dw | None)`` computes the backward's two
    products (invariant mode passes :func:`rlperf.kernels.gemm.invariant_linear_grads`); None: torch's
    ``g @ w`` and ``g.T @ x``. The choice is made here, at forward time: the backward runs on
    autograd's own thread, outside the caller's kernel policy."""
    return _MatmulWithGrad.apply(forward, grads, x, w, bias)


class _RecomputeBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward: Callable, formula: Callable, upcast: bool, *inputs: torch.Tensor):
        ctx.formula, ctx.upcast = formula, upcast
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        return forward(*inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        inputs = ctx.saved_tensors
        wanted = [i for i, t in enumerate(inputs) if ctx.needs_input_grad[3 + i]]
        leaves = [t.detach().requires_grad_(i in wanted) for i, t in enumerate(inputs)]
        with torch.enable_grad():
            args = [t.float() if ctx.upcast and t.is_floating_point() else t for t in leaves]
            outs = ctx.formula(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        result: list[torch.Tensor | None] = [None] * len(inputs)
        if pairs and wanted:
            got = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wanted],
                                      [g for _, g in pairs], allow_unused=True)
            for i, gi in zip(wanted, got):
                result[i] = gi
        return (None, None, None, *result)


def with_recompute_backward(forward: Callable, formula: Callable, *inputs: torch.Tensor, upcast: bool = True):
    """``forward(*inputs)`` (a kernel; a tensor or a tuple of tensors), with the gradient of
    ``formula(*inputs)`` (stock torch, same math; inputs cast to float32 first when ``upcast``).

    ``inputs`` are the tensors gradients may flow to; other arguments (eps, cu_seqlens, targets,
    temperature) are closed over by ``forward`` and ``formula``.
    """
    return _RecomputeBackward.apply(forward, formula, upcast, *inputs)
