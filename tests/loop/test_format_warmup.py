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


def _warmed(name: str, device: str, steps: int, graphed=None, compute_dtype=None):
    """A fresh seeded model after ``steps`` warm-up steps, its last loss and the warm-up's seconds.
    CPU runs the torch reference kernels, as ``rlperf train`` does there."""
    with K.use_policy(K.KernelPolicy(backend=None if device == "cuda" else "reference")):
        model = Qwen3ForCausalLM.random(preset(name), seed=3, device=device)
        tokenizer = load_tokenizer(None, model.cfg.vocab_size)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = format_warmup(model, EMBEDDED_TASK, tokenizer, steps=steps, compute_dtype=compute_dtype, graphed=graphed)
        if device == "cuda":
            torch.cuda.synchronize()
        return model, loss, time.perf_counter() - t0


def _differing(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the parameters whose bits differ."""
    return [name for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters())
            if not torch.equal(x.detach().view(torch.int32), y.detach().view(torch.int32))]


def test_warmup_is_deterministic_and_lowers_the_loss():
    _, loss_one, _ = _warmed("tiny", "cpu", 1)
    a, loss_a, _ = _warmed("tiny", "cpu", 6)
    b, loss_b, _ = _warmed("tiny", "cpu", 6)
    assert loss_a == loss_b and not _differing(a, b)
    assert loss_a < loss_one


def test_graphed_warmup_needs_cuda():
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=3)
    with pytest.raises(ValueError, match="graphed=True needs a model on CUDA"):
        format_warmup(model, EMBEDDED_TASK, load_tokenizer(None, model.cfg.vocab_size), steps=2, graphed=True)


def test_mixed_precision_warmup_keeps_float32_masters():
    """A lower compute dtype computes in a copy and updates the float32 masters; the model's own
    dtype is the plain float32 warm-up (what CPU runs do)."""
    plain, loss_plain, _ = _warmed("tiny", "cpu", 3)
    same, loss_same, _ = _warmed("tiny", "cpu", 3, compute_dtype=torch.float32)
    assert loss_same == loss_plain and not _differing(plain, same)
    mixed, loss_mixed, _ = _warmed("tiny", "cpu", 3, compute_dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 and p.grad is None for p in mixed.parameters())
    assert _differing(plain, mixed)  # bf16 products moved the masters elsewhere
    assert abs(loss_mixed - loss_plain) < 0.05 * loss_plain


def test_mixed_precision_warmup_needs_float32_masters():
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=3, dtype=torch.float16)
    with pytest.raises(ValueError, match="needs float32 master weights"):
        format_warmup(model, EMBEDDED_TASK, load_tokenizer(None, model.cfg.vocab_size), steps=1,
                      compute_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name,steps,dtype", [("tiny", 7, torch.float32), ("tiny", 7, torch.bfloat16),
                                              ("qwen3-0.6b", 60, torch.bfloat16)])
def test_gpu_graphed_warmup_equals_eager_bit_for_bit(name, steps, dtype):
    """bfloat16: what ``rlperf train --device cuda`` runs (float32 masters); float32: ``--precision fp32``."""
    eager, loss_eager, t_eager = _warmed(name, "cuda", steps, graphed=False, compute_dtype=dtype)
    graphed, loss_graphed, t_graphed = _warmed(name, "cuda", steps, graphed=None, compute_dtype=dtype)
    print(f"\nformat warm-up {name} {dtype}, {steps} steps: eager {t_eager:.2f} s, graphed {t_graphed:.2f} s "
          f"({t_eager / t_graphed:.1f}x); loss {loss_graphed:.6f}")
    assert loss_graphed == loss_eager
    assert _differing(eager, graphed) == []
