"""Torch reference of the fused lm-head log-prob (float64 math, differentiable).

    logits = hidden @ weight.T            (float64)
    logp, entropy = token_logprobs(logits, targets, temperature)   (rlperf.kernels.reference.logprob)

Autograd flows to ``hidden`` and ``weight`` (gradients come back in their dtypes).
"""
from __future__ import annotations

import torch

from .logprob import token_logprobs


def fused_logprob(hidden, weight, targets, temperature: float = 1.0, return_entropy: bool = False):
    """logp [N] float32 (and entropy [N] float32) of ``softmax(hidden @ weight.T / temperature)``."""
    logits = hidden.double() @ weight.double().t()
    return token_logprobs(logits, targets, temperature, return_entropy)
