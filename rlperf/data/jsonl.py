"""``--prompt-data`` files: one JSON object per line (slime's jsonl prompt format).

Each line is an object; ``record[input_key]`` is the prompt (a string, or with
``--apply-chat-template`` a list of chat messages ``{"role", "content"}``), ``record[label_key]``
the label the reward compares against (optional), ``record[metadata_key]`` an optional object
passed to the reward function. Blank lines are skipped. Anything else is a :class:`DataError`
naming the file and the 1-based line number, raised while loading — before any step runs.

Epochs: :class:`PromptDataset` hands out ``rollout_batch_size`` prompts per rollout in file order
and, when the file is used up, starts over in an order shuffled by ``(seed, epoch)`` only, so a
resumed run draws exactly the prompts an uninterrupted run would.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch


class DataError(ValueError):
    """A prompt-data problem; the message names the file and line."""


@dataclasses.dataclass
class PromptRecord:
    """One prompt: ``prompt`` text (chat template applied), ``label``, ``metadata`` dict, source line."""

    prompt: str
    label: str | None = None
    metadata: dict = dataclasses.field(default_factory=dict)
    line: int = 0


def apply_chat_template(messages, tokenizer=None) -> str:
    """Messages -> prompt text: the tokenizer's own template when it has one (HF), else a plain
    ``<|im_start|>role\\ncontent<|im_end|>`` rendering (Qwen's layout) ending with the assistant turn."""
    hf = getattr(tokenizer, "_tok", None)
    if hf is not None and getattr(hf, "chat_template", None):
        return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def _check_messages(value, where: str):
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        raise DataError(f"{where}: --apply-chat-template needs a non-empty list of {{role, content}} messages")


def iter_json_objects(path: Path, error: type[ValueError] = None):
    """``(line_number, object)`` for every non-blank line of a jsonl file; ``error(f"{path}:{n}: ...")``
    (default :class:`DataError`) for a line that is not JSON or not a JSON object."""
    error = error or DataError
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            yield n, obj


def load_prompt_data(path, input_key: str = "input", label_key: str | None = "label", metadata_key: str = "metadata",
                     apply_template: bool = False, tokenizer=None) -> list[PromptRecord]:
    """Read and check every line of ``path`` (see the module docstring); DataError on the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--prompt-data {path}: no such file")
    records = []
    for n, obj in iter_json_objects(path):
        where = f"{path}:{n}"
        if input_key not in obj:
            raise DataError(f"{where}: no --input-key {input_key!r} field (keys: {sorted(obj)})")
        prompt = obj[input_key]
        if apply_template:
            _check_messages(prompt, where)
            prompt = apply_chat_template(prompt, tokenizer)
        elif not isinstance(prompt, str) or not prompt:
            raise DataError(f"{where}: field {input_key!r} must be a non-empty string "
                            f"(a message list needs --apply-chat-template)")
        label = obj.get(label_key) if label_key else None
        if label is not None and not isinstance(label, (str, int, float)):
            raise DataError(f"{where}: field {label_key!r} must be a string or a number")
        meta = obj.get(metadata_key, {}) if metadata_key else {}
        if not isinstance(meta, dict):
            raise DataError(f"{where}: field {metadata_key!r} must be an object")
        records.append(PromptRecord(prompt, None if label is None else str(label), meta, n))
    if not records:
        raise DataError(f"--prompt-data {path}: no prompts (the file is empty)")
    return records


class PromptDataset:
    """Prompt batches for successive rollouts; batch ``k`` is a function of ``(records, seed, k)``."""

    def __init__(self, records: list[PromptRecord], seed: int = 0):
        self.records, self.seed = records, seed

    def _order(self, epoch: int) -> list[int]:
        if epoch == 0:
            return list(range(len(self.records)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=g).tolist()

    def batch(self, rollout_id: int, size: int) -> list[PromptRecord]:
        """The ``size`` prompts of rollout ``rollout_id`` (wrapping into the next epoch as needed)."""
        n = len(self.records)
        out, start = [], rollout_id * size
        for i in range(start, start + size):
            out.append(self.records[self._order(i // n)[i % n]])
        return out
