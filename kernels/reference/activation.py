"""Reference for the SwiGLU activation: float64 math."""
import torch


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``gate_up = [g | u]`` along the last dim, in float64. [..., 2I] -> [..., I]."""
    g, u = gate_up.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u
