"""Qwen3-MoE's sparse expert block over rlperf.kernels ops, and the routing trace of one forward.

Block, per token (T tokens, hidden size H, E experts, top k)::

    logits  = linear(x, w.router)                     # [T, E], the batch-invariant matmul
    weights, experts = moe_route(logits, k, norm_topk_prob)       # or the replayed experts' weights
    out     = moe_experts(x, experts, weights, w.experts_gate_up, w.experts_down)

:class:`RoutingTrace` records which experts each MoE layer chose (the rollout engine returns them,
SGLang's ``meta_info["routed_experts"]``) or hands each layer the experts to use (rollout routing
replay, R3: the trainer routes every token as the rollout did, so a near-tie between two experts
cannot send the same token to different experts in the two forwards).
"""
from __future__ import annotations

import base64

import numpy as np
import torch

from rlperf import kernels as K

from .config import ModelConfig


class RoutingReplayError(ValueError):
    """Routing replay was asked for but the routed experts are missing or do not fit the forward."""


class RoutingTrace:
    """The routed experts of one forward, one [T, k] int32 tensor per MoE layer, in layer order.

    ``replay`` None: each MoE layer routes by its router and :meth:`record` keeps the result
    (:meth:`experts` stacks them to [T, L, k], L the number of MoE layers). ``replay`` [T, L, k]
    (integers): MoE layer l uses ``replay[:, l]`` instead of its own top-k, with the weights its
    router gives those experts; a layer count or token count that does not match is a
    :class:`RoutingReplayError`.
    """

    def __init__(self, replay: torch.Tensor | None = None):
        if replay is not None and replay.dim() != 3:
            raise RoutingReplayError(f"routed experts must be [tokens, moe_layers, top_k], got shape "
                                     f"{tuple(replay.shape)}")
        self.replay = replay
        self.recorded: list[torch.Tensor] = []

    def replayed(self, tokens: int) -> torch.Tensor | None:
        """The experts [T, k] the next MoE layer must use, or None when routing is not replayed."""
        if self.replay is None:
            return None
        layer = len(self.recorded)
        if layer >= self.replay.shape[1]:
            raise RoutingReplayError(f"routed experts cover {self.replay.shape[1]} MoE layers, the model has more")
        if self.replay.shape[0] != tokens:
            raise RoutingReplayError(f"routed experts cover {self.replay.shape[0]} tokens, the forward has {tokens}")
        return self.replay[:, layer]

    def record(self, experts: torch.Tensor) -> None:
        self.recorded.append(experts)

    def experts(self) -> torch.Tensor:
        """[T, L, k] int32: the experts every MoE layer used, in layer order."""
        if not self.recorded:
            raise RuntimeError("no MoE layer ran in this forward")
        return torch.stack(self.recorded, dim=1)


def sparse_moe_block(x: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor,
                     experts_down: torch.Tensor, cfg: ModelConfig, routing: RoutingTrace | None,
                     expert_parallel=None) -> torch.Tensor:
    """x [T, H] -> [T, H]: the block of the module docstring. ``router`` [E, H], ``experts_gate_up``
    [E, 2I, H] (rows: gate, then up), ``experts_down`` [E, H, I]. ``expert_parallel``: an
    :class:`rlperf.model.expert_parallel.ExpertParallel` (the expert weights are then this rank's
    [E/W, ...] share and the tokens travel to their experts' ranks) or None."""
    logits = K.linear(x, router)
    replay = routing.replayed(x.shape[0]) if routing is not None else None
    if replay is None:
        weights, experts = K.moe_route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    else:
        if replay.shape[1] != cfg.num_experts_per_tok:
            raise RoutingReplayError(f"routed experts list {replay.shape[1]} experts per token, the model routes "
                                     f"to num_experts_per_tok={cfg.num_experts_per_tok}")
        weights, experts = K.moe_route_weights(logits, replay, cfg.norm_topk_prob)
    if routing is not None:
        routing.record(experts)
    if expert_parallel is not None:
        return expert_parallel(x, experts, weights, experts_gate_up, experts_down)
    return K.moe_experts(x, experts, weights, experts_gate_up, experts_down)


# ---- routed experts on the wire (SGLang's meta_info["routed_experts"]) ----------------------------

def encode_routed_experts(experts: torch.Tensor, cfg: ModelConfig) -> str:
    """``experts`` [T, L, k] (L = ``cfg.moe_layers``, in order) -> base64 of little-endian int32
    [T, num_hidden_layers, k], token-major, then layer, then slot; a dense layer's rows are -1
    (SGLang's ``meta_info["routed_experts"]`` layout)."""
    if experts is None:
        raise RoutingReplayError("no routed experts were recorded for this request (it ran no forward step)")
    t, k = experts.shape[0], cfg.num_experts_per_tok
    full = torch.full((t, cfg.num_hidden_layers, k), -1, dtype=torch.int32)
    full[:, cfg.moe_layers] = experts.to(device="cpu", dtype=torch.int32)
    return base64.b64encode(full.numpy().astype("<i4").tobytes()).decode("ascii")


def decode_routed_experts(data: str | None, cfg: ModelConfig, num_tokens: int) -> torch.Tensor:
    """The inverse of :func:`encode_routed_experts`: [num_tokens, L, k] int32 of the MoE layers.

    :class:`RoutingReplayError` naming what is wrong when ``data`` is missing, is not base64, or
    does not hold ``num_tokens`` x ``num_hidden_layers`` x ``num_experts_per_tok`` experts."""
    if data is None:
        raise RoutingReplayError("routing replay needs the rollout's routed experts, and this sample has none: "
                                 "generate with return_routed_experts (meta_info['routed_experts'])")
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as exc:
        raise RoutingReplayError(f"routed experts are not valid base64 ({exc})") from None
    k, layers = cfg.num_experts_per_tok, cfg.num_hidden_layers
    want = num_tokens * layers * k * 4
    if len(raw) != want:
        raise RoutingReplayError(f"routed experts hold {len(raw)} bytes; {num_tokens} tokens x {layers} layers x "
                                 f"{k} experts of int32 need {want}")
    full = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32).reshape(num_tokens, layers, k))
    return full[:, cfg.moe_layers].contiguous()


def routing_agreement(rollout: torch.Tensor, train: torch.Tensor) -> float:
    """The fraction of (token, MoE layer) pairs routed to the same set of experts by the two sides:
    ``rollout`` and ``train`` [T, L, k] (any order within a row). 1.0 when routing is invariant."""
    if rollout.shape != train.shape:
        raise ValueError(f"routing_agreement: shapes {tuple(rollout.shape)} and {tuple(train.shape)} differ")
    if rollout.numel() == 0:
        return 1.0
    same = (torch.sort(rollout.long(), -1).values == torch.sort(train.long(), -1).values).all(-1)
    return float(same.double().mean())
