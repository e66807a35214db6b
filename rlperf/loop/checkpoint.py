"""Checkpoints (``--save --load --ref-load --save-interval``), slime's directory layout::

    SAVE/iter_0000007/model/            HF safetensors + config.json (Qwen3ForCausalLM.save_pretrained)
    SAVE/iter_0000007/trainer.pt        optimizer state, step count, next rollout id
    SAVE/latest_checkpointed_iteration.txt   "7" — written last, atomically

A checkpoint is first written to ``iter_XXXXXXX.tmp`` and renamed into place, and only then does
``latest_checkpointed_iteration.txt`` change (temporary file + ``os.replace``), so a crash at any
moment leaves the previous latest checkpoint loadable. ``iter`` counts rollouts done.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

LATEST = "latest_checkpointed_iteration.txt"


def iter_dir(save: str | os.PathLike, iteration: int) -> Path:
    return Path(save) / f"iter_{iteration:07d}"


def save_checkpoint(save, iteration: int, model, trainer) -> Path:
    final = iter_dir(save, iteration)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model")
    torch.save({"trainer": trainer.state_dict(), "iteration": iteration}, tmp / "trainer.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = Path(save) / (LATEST + ".tmp")
    latest_tmp.write_text(str(iteration))
    os.replace(latest_tmp, Path(save) / LATEST)
    return final


def latest_iteration(load) -> int:
    f = Path(load) / LATEST
    if not f.is_file():
        raise FileNotFoundError(f"--load {load}: no {LATEST} (not a checkpoint directory written by --save)")
    text = f.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{f}: expected an iteration number, got {text!r}")
    return int(text)


def model_dir(path) -> Path:
    """The HF directory of ``path``: itself when it holds config.json, else its latest checkpoint's model."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    return iter_dir(p, latest_iteration(p)) / "model"


def load_trainer_state(load, trainer) -> int:
    """Restore optimizer state; returns the iteration (rollouts done) of the latest checkpoint."""
    it = latest_iteration(load)
    state = torch.load(iter_dir(load, it) / "trainer.pt", map_location="cpu", weights_only=True)
    trainer.load_state_dict(state["trainer"])
    return int(state["iteration"])
