"""Torch references of log-softmax and per-token log-probs / entropy (float64 math).

    z         = logits / temperature
    log_softmax(logits)[i, j]  = z[i, j] - logsumexp_j z[i, :]
    token_logprobs             = log_softmax[i, targets[i]]
    entropy[i]                 = -sum_j p[i, j] * log p[i, j],   p = softmax(z[i, :])

Results are float32 (the kernels' output dtype).
"""
from __future__ import annotations

import torch


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[..., V] -> [..., V] float32 log-softmax of ``logits / temperature``, computed in float64."""
    return torch.log_softmax(logits.double() / temperature, dim=-1).float()


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False
):
    """log p(targets) [...] float32 (and the entropy [...] float32), in float64 math."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    out = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1).float()
    if not return_entropy:
        return out
    entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)  # 0 * log 0 = 0 for -inf logits
    return out, entropy.float()
