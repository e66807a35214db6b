"""The trainers' AdamW, one construction for every backend and layout.

On CUDA the optimizer is torch's fused AdamW (``fused=True``): one multi-tensor kernel reads each
parameter, gradient and moment once per step, where the default multi-tensor ("foreach") form runs a
chain of element-wise passes over the 0.6b model's 2.4 GB of float32 masters and 4.8 GB of moments. On
the CPU it is torch's default. The update is element-wise, so a parameter's bits depend only on the
implementation, never on how it is sharded: one GPU, FSDP2's DTensor shards (DTensor runs the fused
op shard by shard), the megatron backend's tensor-parallel pieces and its distributed optimizer's
chunks all step with the same arithmetic, and the layouts stay bit-equal. The implementation differs
from the foreach form in the last bits (both are AdamW); every trainer of a device type uses the same.

The implementation is the device's, not a checkpoint's: ``torch.optim`` restores the saved param
groups' ``fused``/``foreach`` entries with the hyperparameters, so :func:`keep_implementation` sets them
back after a load (a checkpoint written on the CPU resumes fused on CUDA). Under the fused kernel an
AdamW state's ``step`` lives on the parameter's device (:func:`step_state`).
"""
from __future__ import annotations

import torch


def fused_for(groups: list[dict]) -> bool:
    """Whether AdamW over ``groups`` (param groups, their ``params`` tensors or DTensors) runs fused:
    every parameter on a CUDA device."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.device.type == "cuda" for p in params)


def adamw(groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
          fused: bool | None = None) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``groups`` (each with its own ``weight_decay``), fused where
    :func:`fused_for` holds (``fused`` overrides: tests run the fused form on the CPU)."""
    fused = fused_for(groups) if fused is None else fused
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {}))


def keep_implementation(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: each param group's ``fused`` and ``foreach`` back to the optimizer's
    own (the loaded groups carry the saving run's)."""
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            if key in optimizer.defaults:
                group[key] = optimizer.defaults[key]


def step_state(optimizer: torch.optim.Optimizer, step: float, param: torch.Tensor) -> torch.Tensor:
    """An AdamW state's ``step`` (float32, 0-dim) as ``optimizer`` keeps it for ``param``: on the
    parameter's device under the fused kernel, on the CPU otherwise."""
    fused = bool(optimizer.defaults.get("fused"))
    return torch.tensor(step, dtype=torch.float32, device=param.device if fused else "cpu")
