"""References of the mixture-of-experts ops (``rlperf.kernels.moe``): float64 math, obvious code.

Shapes: T tokens, H hidden, E experts, k experts per token, I expert intermediate size.

* :func:`moe_route_ref`: ``p = softmax(logits)`` per row; the k largest ``p``, ties to the lower
  expert index; experts listed in increasing index; weights ``p[e]`` (divided by their sum when
  ``normalize``). logits [T, E] -> (weights [T, k] float64, experts [T, k] int64).
* :func:`moe_route_weights_ref`: the same weights for experts given (routing replay).
* :func:`grouped_matmul_ref`: ``out[s] = a[s] @ w[expert(s)].T`` for slots sorted by expert.
* :func:`moe_experts_ref`: the whole expert block,
  ``out[t] = sum_j weights[t, j] * down_e (silu(gate_e x_t) * up_e x_t)`` with ``e = experts[t, j]``.
"""
from __future__ import annotations

import torch


def moe_route_ref(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits`` [T, E] in float64 (module docstring); ties go to the lower index."""
    p = torch.softmax(logits.double(), dim=-1)
    # a stable sort of -p keeps equal probabilities in index order: the lower index wins a tie
    order = torch.sort(-p, dim=-1, stable=True).indices[:, :top_k]
    experts = torch.sort(order, dim=-1).values
    return moe_route_weights_ref(logits, experts, normalize), experts


def moe_route_weights_ref(logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Weights [T, k] float64 of the given ``experts`` [T, k] under ``logits`` [T, E]."""
    p = torch.softmax(logits.double(), dim=-1)
    w = p.gather(1, experts.long())
    return w / w.sum(-1, keepdim=True) if normalize else w


def grouped_matmul_ref(a: torch.Tensor, w: torch.Tensor, expert_of_slot: torch.Tensor) -> torch.Tensor:
    """``out[s] = a[s] @ w[expert_of_slot[s]].T`` in float64: a [S, K], w [E, N, K] -> [S, N]."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    for e in range(w.shape[0]):
        rows = (expert_of_slot == e).nonzero().flatten()
        if rows.numel():
            out[rows] = a[rows].double() @ w[e].double().T
    return out


def moe_experts_ref(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """The expert block in float64: x [T, H], experts [T, k], weights [T, k], w_gate_up [E, 2I, H],
    w_down [E, H, I] -> [T, H] float64 (module docstring). Differentiable (autograd, float64)."""
    t, k = experts.shape
    flat = experts.reshape(-1).long()
    xs = x.double().repeat_interleave(k, dim=0)                  # [T k, H]: pair (t, j) at row t k + j
    gu = grouped_matmul_ref(xs, w_gate_up, flat)
    inter = gu.shape[1] // 2
    g, u = gu[:, :inter], gu[:, inter:]
    y = grouped_matmul_ref(g * torch.sigmoid(g) * u, w_down, flat)  # [T k, H]
    return (weights.double().reshape(t, k, 1) * y.reshape(t, k, -1)).sum(1)
