"""Tokenizers of the rollout engine: a checkpoint's Hugging Face tokenizer, or the built-in byte tokenizer.

Both expose the same small interface (:class:`Tokenizer`): ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``eos_token_ids`` and ``vocab_size``.

:class:`ByteTokenizer` is the embedded default (so ``rlperf serve`` runs with no files at all). It
is byte-level over UTF-8 and fits the tiny preset's 512-entry vocabulary::

    id 0..255    the byte with that value          (text -> UTF-8 bytes -> ids, one id per byte)
    id 256       <|endoftext|>                      (EOS)
    id 257       <|pad|>
    id 258..V-1  unused; decode to nothing          (a random model may still sample them)

``decode`` joins the bytes of ids < 256 and decodes them as UTF-8 with replacement characters for
invalid sequences; special and unused ids are skipped (SGLang's ``skip_special_tokens=True``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

BYTE_VOCAB = 256
BYTE_EOS_ID = 256
BYTE_PAD_ID = 257
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 byte tokenizer for vocabularies of at least 258 entries (module docstring)."""

    name = "rlperf-byte"

    def __init__(self, vocab_size: int = 512):
        if vocab_size < BYTE_PAD_ID + 1:
            raise ValueError(f"the byte tokenizer needs a vocabulary of >= {BYTE_PAD_ID + 1} ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = (BYTE_EOS_ID,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        # special and unused ids have no bytes: they decode to nothing either way
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer directory, loaded with ``transformers`` (no network)."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.name = str(path)
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        ids = set() if eos is None else {int(eos)}
        gen_cfg = Path(path) / "generation_config.json"
        if gen_cfg.exists():  # Qwen3 lists several EOS ids (<|im_end|>, <|endoftext|>) here
            import json

            extra = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update([extra] if isinstance(extra, int) else (extra or []))
        self.eos_token_ids = tuple(sorted(ids))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def has_hf_tokenizer(path: str | Path | None) -> bool:
    return path is not None and Path(path).is_dir() and any((Path(path) / f).exists() for f in HF_TOKENIZER_FILES)


def load_tokenizer(path: str | Path | None, vocab_size: int) -> Tokenizer:
    """The HF tokenizer at ``path`` when it holds tokenizer files, else the byte tokenizer for ``vocab_size``."""
    if has_hf_tokenizer(path):
        return HFTokenizer(path)
    return ByteTokenizer(vocab_size)
