"""The embedded task's format warm-up: deterministic, lowers the loss, and on CUDA its graphed
steps equal eager steps bit for bit (``rlperf.data.embedded.format_warmup``)."""
from __future__ import annotations

import time

import pytest
import torch

import rlperf.kernels as K
from rlperf.data.embedded import EMBEDDED_TASK, format_warmup
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.tokenizer import load_tokenizer


def _warmed(name: str, device: str, steps: int, graphed=None):
    """A fresh seeded model after ``steps`` warm-up steps (0: one eager step), its last loss and the
    warm-up's seconds. CPU runs the torch reference kernels, as ``rlperf train`` does there."""
    with K.use_policy(K.KernelPolicy(backend=None if device == "cuda" else "reference")):
        return _warm(name, device, steps, graphed)


def _warm(name: str, device: str, steps: int, graphed):
    model = Qwen3ForCausalLM.random(preset(name), seed=3, device=device)
    tokenizer = load_tokenizer(None, model.cfg.vocab_size)
    first = format_warmup(model, EMBEDDED_TASK, tokenizer, steps=1, graphed=False) if steps == 0 else None
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = format_warmup(model, EMBEDDED_TASK, tokenizer, steps=steps, graphed=graphed) if steps else first
    if device == "cuda":
        torch.cuda.synchronize()
    return model, loss, time.perf_counter() - t0


def _same_bits(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the parameters whose bits differ."""
    return [name for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters())
            if not torch.equal(x.detach().view(torch.int32), y.detach().view(torch.int32))]


def test_warmup_is_deterministic_and_lowers_the_loss():
    _, loss_one, _ = _warmed("tiny", "cpu", 1)
    a, loss_a, _ = _warmed("tiny", "cpu", 6)
    b, loss_b, _ = _warmed("tiny", "cpu", 6)
    assert loss_a == loss_b and not _same_bits(a, b)
    assert loss_a < loss_one


def test_graphed_warmup_needs_cuda():
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=3)
    with pytest.raises(ValueError, match="graphed=True needs a model on CUDA"):
        format_warmup(model, EMBEDDED_TASK, load_tokenizer(None, model.cfg.vocab_size), steps=2, graphed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name,steps", [("tiny", 7), ("qwen3-0.6b", 60)])
def test_gpu_graphed_warmup_equals_eager_bit_for_bit(name, steps):
    eager, loss_eager, t_eager = _warmed(name, "cuda", steps, graphed=False)
    graphed, loss_graphed, t_graphed = _warmed(name, "cuda", steps, graphed=None)
    print(f"\nformat warm-up {name}, {steps} steps: eager {t_eager:.2f} s, graphed {t_graphed:.2f} s "
          f"({t_eager / t_graphed:.1f}x); loss {loss_graphed:.6f}")
    assert loss_graphed == loss_eager
    assert _same_bits(eager, graphed) == []
