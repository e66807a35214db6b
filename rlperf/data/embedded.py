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

EMBEDDED_DEFAULTS = dict(
    rollout_batch_size=8, n_samples_per_prompt=16, global_batch_size=128, num_steps_per_rollout=1, num_rollout=80,
    rollout_max_response_len=2, rollout_temperature=1.0, lr=3e-3, rm_type="exact", model="tiny",
    use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
)
"""Flag values the embedded run uses where the command line gives none.

Why 16 samples per prompt and lr 3e-3: with 8 samples and lr 5e-3 the run's end reward depended on
the seed and on last-bit differences of the numerics (0.5-0.98 over seeds, CPU fp32 and GPU bf16):
GRPO's std-normalised advantages of a group with one right answer in 8 are large, and big steps made
some keys collapse onto a wrong letter, a group of identical answers that no longer has a gradient.
16 samples and a smaller step reached 0.92-0.99 over the seeds tried, in about 45 s on 2 CPU cores.

Why dynamic batching: the 128 samples of a step are short (a prompt and 2 response tokens), so one
packed micro-batch of up to 4096 tokens holds them all; one sample per micro-batch (slime's default,
what ``--prompt-data`` runs keep) made 128 forward/backward passes of a few dozen tokens each, which
on a GPU cost ~1.7 s of host-bound launches per step."""


def format_warmup(model, task: EmbeddedTask, tokenizer, steps: int = 60, lr: float = 1e-2,
                  graphed: bool | None = None) -> float:
    """Supervised format steps (module docstring): each prompt followed by each letter then EOS, so
    the cross-entropy is minimal for a uniform letter; returns the last loss. Deterministic.

    Every step is the same packed micro-batch (32 samples, 288 tokens with the embedded tokenizer):
    forward, cross-entropy of the response tokens, backward, Adam. On CPU the loss is
    ``cross_entropy`` of the model's float32 logits. On CUDA it is ``-mean`` of the fused log-prob
    path's log-probs (:meth:`Qwen3ForCausalLM.token_logprobs`, what the trainer runs; the same loss
    in exact arithmetic): the plain logits' backward there is a ``[rows, vocab] x [vocab, hidden]``
    product whose reduction runs over the whole vocabulary in a few output tiles (the batch-invariant
    matmul never splits K), 70 of the 106 ms of a 0.6b step on an H100. Adam is fused there.

    A CUDA step is then a few milliseconds of kernels behind ~880 launches from Python, so the first
    step runs eagerly (it compiles the kernels and allocates Adam's state) and the other ``steps - 1``
    replay one CUDA graph of the step (:func:`_replay_steps`); Adam is ``capturable``, eager and
    graphed alike. ``graphed``: None replays on CUDA, False runs every step eagerly (the GPU test's
    reference). A replay runs the kernels of the eager step on the same buffers: the GPU test
    (``tests/loop/test_format_warmup.py``) checks the graphed warm-up against the eager one bit for bit."""
    from rlperf.train import Sample, pack_micro_batches

    eos = tokenizer.eos_token_ids[0]
    samples = [Sample(tokenizer.encode(task.prompt(k)) + tokenizer.encode(a) + [eos], 2)
               for k in task.keys for a in task.letters]
    mb = pack_micro_batches(samples, micro_batch_size=len(samples), device=model.device)[0]
    on_cuda = model.device.type == "cuda"
    if graphed and not on_cuda:
        raise ValueError(f"format_warmup: graphed=True needs a model on CUDA, not on {model.device}")
    opt = torch.optim.Adam(model.parameters(), lr=lr, capturable=on_cuda, fused=on_cuda or None)

    def loss_and_grads() -> torch.Tensor:
        rows = model.forward_packed(mb.input_ids, mb.positions, mb.cu_seqlens)[mb.logit_rows]
        if on_cuda:
            loss = -model.token_logprobs(rows, mb.targets).mean()
        else:
            loss = torch.nn.functional.cross_entropy(model.logits(rows).float(), mb.targets)
        loss.backward()
        return loss

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_and_grads()
        opt.step()
        return loss

    loss = torch.tensor(float("nan"))
    if on_cuda and graphed is not False and steps > 1:
        loss = _replay_steps(step, loss_and_grads, opt, steps)
    else:
        for _ in range(steps):
            loss = step()
    return float(loss.detach())


def _replay_steps(step, loss_and_grads, opt, steps: int) -> torch.Tensor:
    """``steps`` warm-up steps on CUDA, on a side stream: one eager ``step()``, then one captured step
    (gradients set to None before the capture, so the captured backward writes fresh gradients in the
    graph's pool rather than adding to old ones) replayed ``steps - 1`` times. Returns the last
    step's loss; the graph and its gradients are freed before returning.

    The capture calls ``capture_begin``/``capture_end`` itself: ``torch.cuda.graph``'s entry also runs
    ``gc.collect()`` and ``empty_cache()``, 0.66 s of a 0.6b gate's start for memory this step does
    not need back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        step()
        opt.zero_grad(set_to_none=True)
        graph.capture_begin()
        try:
            loss = loss_and_grads()
            opt.step()
        finally:
            graph.capture_end()
        for _ in range(steps - 1):
            graph.replay()
        loss = loss.detach().clone()
        opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    del graph
    return loss
