"""The built-in task of ``rlperf train`` with no arguments: learn a key -> letter table by RL.

Prompts are ``"key k? "`` for 8 keys ``k`` in ``a..h``; the answer is one of ``A B C D`` by a fixed
table (:data:`EmbeddedTask.table`), then EOS. The reward (``exact``) is 1.0 when the response is
exactly the right letter.

Why a format warm-up: a randomly initialised tiny model spreads its first token over all 512 ids,
so a random answer is right 1 time in 512 and a GRPO group almost never sees a reward. Like an RL
run that starts from a model that already answers in the expected format, the embedded run first
teaches the *format only* — a few supervised steps towards "one of A-D, uniformly, then EOS",
whatever the key — so the rollout starts at chance (mean reward ~0.25) and only RL can learn which
letter goes with which key. The warm-up is seeded and deterministic.
"""
from __future__ import annotations

import dataclasses

import torch

from .embedded_defaults import EMBEDDED_DEFAULTS  # noqa: F401  (re-exported: the task's flag values)
from .jsonl import PromptRecord


@dataclasses.dataclass(frozen=True)
class EmbeddedTask:
    keys: str = "abcdefgh"
    letters: str = "ABCD"
    table: str = "CADBBDAC"
    """``table[i]`` answers ``keys[i]`` (each letter twice, so no letter is a free win)."""

    def prompt(self, key: str) -> str:
        return f"key {key}? "

    def records(self) -> list[PromptRecord]:
        return [PromptRecord(self.prompt(k), self.table[i], {"task": "embedded"}, i + 1) for i, k in enumerate(self.keys)]

    @property
    def chance(self) -> float:
        return 1.0 / len(self.letters)


EMBEDDED_TASK = EmbeddedTask()


def format_warmup(model, task: EmbeddedTask, tokenizer, steps: int = 60, lr: float = 1e-2,
                  compute_dtype: torch.dtype | None = None, graphed: bool | None = None) -> float:
    """Supervised format steps (module docstring): each prompt followed by each letter then EOS, so
    the cross-entropy is minimal for a uniform letter; updates ``model`` in place and returns the last
    loss. Deterministic.

    Every step is the same packed micro-batch (32 samples, 288 tokens with the embedded tokenizer):
    forward, ``cross_entropy`` of the response tokens' float32 logits, backward, Adam on ``model``'s
    parameters. ``compute_dtype`` (the run's, e.g. bfloat16 on CUDA; None: the model's own dtype) is
    the dtype of the forward and backward, as in a train step (:mod:`rlperf.train.trainer`): with a
    lower one, a copy of the model in that dtype computes, its gradients are copied into float32
    gradients of ``model`` (the master weights, which Adam updates) and the masters are rounded back
    into the copy after each step. Why: the float32 products of a 0.6b step took 72 of its 98 ms on an
    H100 (the batch-invariant matmul's tf32x3 at 288 rows), 6 s of every 0.6b gate's start.

    On CUDA a step is then a few milliseconds of kernels behind ~880 launches from Python, so the first
    step runs eagerly (it compiles the kernels and allocates Adam's state) and the other ``steps - 1``
    replay one CUDA graph of the step (:func:`_replay_steps`); there Adam is fused and ``capturable``,
    eager and graphed alike. ``graphed``: None replays on CUDA, False runs every step eagerly (the GPU
    test's reference). A replay runs the kernels of the eager step on the same buffers: the GPU test
    (``tests/loop/test_format_warmup.py``) checks the graphed warm-up against the eager one bit for bit."""
    import copy

    from rlperf.train import Sample, pack_micro_batches

    eos = tokenizer.eos_token_ids[0]
    samples = [Sample(tokenizer.encode(task.prompt(k)) + tokenizer.encode(a) + [eos], 2)
               for k in task.keys for a in task.letters]
    mb = pack_micro_batches(samples, micro_batch_size=len(samples), device=model.device)[0]
    on_cuda = model.device.type == "cuda"
    if graphed and not on_cuda:
        raise ValueError(f"format_warmup: graphed=True needs a model on CUDA, not on {model.device}")
    masters = [p for p in model.parameters() if p.requires_grad]
    mixed = compute_dtype is not None and compute_dtype != masters[0].dtype
    if mixed and masters[0].dtype != torch.float32:
        raise ValueError(f"format_warmup: a {compute_dtype} warm-up needs float32 master weights, not {masters[0].dtype}")
    compute = copy.deepcopy(model).to(compute_dtype) if mixed else model
    params = [p for p in compute.parameters() if p.requires_grad]  # the masters' order
    if mixed:  # static float32 gradients, overwritten by every step
        for m in masters:
            m.grad = torch.zeros_like(m)
    opt = torch.optim.Adam(masters, lr=lr, capturable=on_cuda, fused=on_cuda or None)

    def step() -> torch.Tensor:
        rows = compute.forward_packed(mb.input_ids, mb.positions, mb.cu_seqlens)[mb.logit_rows]
        loss = torch.nn.functional.cross_entropy(compute.logits(rows).float(), mb.targets)
        if mixed:
            with torch.no_grad():
                torch._foreach_copy_([m.grad for m in masters], torch.autograd.grad(loss, params, materialize_grads=True))
        else:
            opt.zero_grad(set_to_none=True)  # backward then writes fresh gradients (in a capture: its pool's)
            loss.backward()
        opt.step()
        if mixed:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        return loss

    loss = torch.tensor(float("nan"))
    if on_cuda and graphed is not False and steps > 1:
        loss = _replay_steps(step, steps)
    else:
        for _ in range(steps):
            loss = step()
    for m in masters:
        m.grad = None
    return float(loss.detach())


def _replay_steps(step, steps: int) -> torch.Tensor:
    """``steps`` warm-up steps on CUDA, on a side stream: one eager ``step()``, then one captured
    ``step()`` replayed ``steps - 1`` times. Returns the last step's loss; the graph is freed before
    returning.

    The capture calls ``capture_begin``/``capture_end`` itself: ``torch.cuda.graph``'s entry also runs
    ``gc.collect()`` and ``empty_cache()``, 0.66 s of a 0.6b gate's start for memory this step does
    not need back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        step()
        graph.capture_begin()
        try:
            loss = step()
        finally:
            graph.capture_end()
        for _ in range(steps - 1):
            graph.replay()
        loss = loss.detach().clone()
    torch.cuda.current_stream().wait_stream(side)
    del graph
    return loss
