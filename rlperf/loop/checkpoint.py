"""Checkpoints (``--save --load --ref-load --save-interval``), slime's directory layout::

    SAVE/iter_0000007/model/            HF safetensors + config.json (Qwen3ForCausalLM.save_pretrained)
    SAVE/iter_0000007/trainer.pt        optimizer state, step count, next rollout id
    SAVE/latest_checkpointed_iteration.txt   "7" — written last, atomically

The format is consolidated, the same for any number of actor ranks, so a run resumes on another
layout: ``model/`` holds the full float32 master weights under HF names, and ``trainer.pt`` the full
optimizer state keyed by parameter name (:meth:`rlperf.train.Trainer.state_dict`). With data-parallel
ranks both are gathered from the FSDP2 shards to rank 0, which alone writes; on resume every rank
reads them and keeps its shard (:mod:`rlperf.loop.data_parallel`).

``iter`` counts rollouts done. The pointer (``latest_checkpointed_iteration.txt``) names a loadable
checkpoint at every moment: a kill at any point of :func:`save_checkpoint` leaves it on a complete
checkpoint (the previous one, or the new one once the pointer has moved). Its steps, in order
(:data:`STEPS`; each is a :func:`fault_point`, see below):

1. ``write-tmp`` — write ``iter_N.tmp/`` (its fault point sits halfway: the model written, not
   ``trainer.pt``);
2. ``fsync`` — fsync every file and directory of ``iter_N.tmp/``;
3. ``move-old-aside`` — an existing ``iter_N/`` (a re-save of iteration N) is renamed to
   ``iter_N.old/``, never deleted first;
4. ``rename-into-place`` — ``iter_N.tmp/`` becomes ``iter_N/``;
5. ``update-pointer`` — the pointer is rewritten (temporary file, fsync, ``os.replace``);
6. ``remove-old`` — ``iter_N.old/`` and leftovers of interrupted saves (``iter_*.tmp``) are removed;
   the old copy ``iter_M.old/`` of an interrupted re-save of another iteration M gets its name back.

When the pointer names N and a kill falls between steps 3 and 4, ``iter_N/`` is momentarily absent:
:func:`checkpoint_dir` then resolves N to ``iter_N.old/``, the complete previous copy (renamed, not
rewritten). Every loader goes through :func:`checkpoint_dir`.

Fault injection (tests): ``RLPERF_FAULT_AT=checkpoint:<step>:<n>`` makes the process SIGKILL itself
at the ``n``-th time (default 1) it reaches ``<step>``; ``checkpoint:<step>:<n>:INT`` sends it SIGINT
instead (an operator's Ctrl-C in the middle of a save). :func:`fault_point` is the one place that
reads it.

A save that fails because the disk is full (``OSError`` ENOSPC) or is interrupted by SIGINT
(``KeyboardInterrupt``) removes its temporary ``iter_N.tmp/`` and raises :class:`CheckpointInterrupted`:
the pointer still names the last complete checkpoint (steps above), so nothing is lost, and the CLI
ends with one line naming the directory and the resume command (exit 1; 130 for SIGINT).

A fresh run (no ``--load``) into a ``--save`` that already holds checkpoints would overwrite them and
move the pointer back: :func:`check_save_dir` refuses it unless ``--overwrite-save`` is given (or
``--save`` is the ``--load`` directory: a resume).
"""
from __future__ import annotations

import collections
import errno
import os
import shutil
import signal
import zipfile
from pathlib import Path

import torch

LATEST = "latest_checkpointed_iteration.txt"
STEPS = ("write-tmp", "fsync", "move-old-aside", "rename-into-place", "update-pointer", "remove-old")
"""The steps of :func:`save_checkpoint`, in order (each is a :func:`fault_point`)."""
FAULT_ENV = "RLPERF_FAULT_AT"

_fault_hits: collections.Counter = collections.Counter()


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the path, not a flag (callers add it)."""


class CheckpointInterrupted(RuntimeError):
    """A save that the disk being full (ENOSPC) or SIGINT stopped; the pointer is untouched or already on
    the new checkpoint, never on a partial one. ``exit_code``: 1 (disk full) or 130 (SIGINT)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def fault_point(step: str, site: str = "checkpoint") -> None:
    """Die by SIGKILL here when ``$RLPERF_FAULT_AT`` is ``<site>:<step>[:<n>]`` and this is the
    ``n``-th time (default 1) this process reaches ``step`` (crash-consistency tests)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) not in (2, 3, 4) or (len(parts) >= 3 and not parts[2].isdigit()) or (
            len(parts) == 4 and parts[3] not in ("KILL", "INT")):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <site>:<step>[:<n>[:KILL|INT]], e.g. "
                         f"checkpoint:update-pointer:2")
    if parts[0] == "checkpoint" and parts[1] not in STEPS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown checkpoint step {parts[1]!r}; choose from {', '.join(STEPS)}")
    if (parts[0], parts[1]) != (site, step):
        return
    _fault_hits[(site, step)] += 1
    if _fault_hits[(site, step)] == int(parts[2] if len(parts) >= 3 else 1):
        if len(parts) == 4 and parts[3] == "INT":
            os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt right here
            return
        _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # where SIGKILL does not exist


def iter_dir(save: str | os.PathLike, iteration: int) -> Path:
    return Path(save) / f"iter_{iteration:07d}"


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a directory cannot be opened on some systems (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            _fsync_path(Path(d) / f)
        _fsync_path(Path(d))


def save_checkpoint(save, iteration: int, model, trainer_state: dict) -> Path:
    """Write checkpoint ``iteration`` under ``save`` and point the pointer at it (steps: module docstring):
    ``model``'s ``save_pretrained`` files and ``trainer_state`` (:meth:`rlperf.train.Trainer.state_dict`).
    :class:`CheckpointInterrupted` when the disk is full (ENOSPC) or SIGINT arrives meanwhile."""
    save = Path(save)
    try:
        return _save_checkpoint(save, iteration, model, trainer_state)
    except (OSError, KeyboardInterrupt) as exc:
        if isinstance(exc, OSError) and exc.errno != errno.ENOSPC:
            raise
        shutil.rmtree(_sibling(iter_dir(save, iteration), ".tmp"), ignore_errors=True)  # frees what it wrote
        (save / (LATEST + ".tmp")).unlink(missing_ok=True)
        try:
            kept = f"the pointer stays on {checkpoint_dir(save).name}, the last complete checkpoint"
        except (CheckpointError, OSError):
            kept = "no earlier checkpoint was complete"
        what = ("the disk is full (No space left on device)" if isinstance(exc, OSError)
                else "interrupted (SIGINT)")
        raise CheckpointInterrupted(f"{what} while saving checkpoint {iter_dir(save, iteration).name} in {save}: "
                                    f"nothing is lost, {kept}", 1 if isinstance(exc, OSError) else 130) from None


def _save_checkpoint(save: Path, iteration: int, model, trainer_state: dict) -> Path:
    final = iter_dir(save, iteration)
    tmp, old = _sibling(final, ".tmp"), _sibling(final, ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    # 1. write-tmp
    model.save_pretrained(tmp / "model")
    fault_point("write-tmp")  # halfway: a temporary without trainer.pt
    torch.save({"trainer": trainer_state, "iteration": iteration}, tmp / "trainer.pt")
    # 2. fsync: the data is on disk before any name points at it
    _fsync_tree(tmp)
    fault_point("fsync")
    # 3. move-old-aside: the copy the pointer may name is renamed, never deleted, until the new one is in place
    if final.exists():
        if old.exists():  # a leftover of an interrupted re-save; the complete iter_N is the live copy
            shutil.rmtree(old)
        os.rename(final, old)
        _fsync_path(save)
    fault_point("move-old-aside")
    # 4. rename-into-place
    os.replace(tmp, final)
    _fsync_path(save)
    fault_point("rename-into-place")
    # 5. update-pointer
    latest_tmp = save / (LATEST + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, save / LATEST)
    _fsync_path(save)
    fault_point("update-pointer")
    # 6. remove-old: the pointer names the complete iter_N; temporaries and old copies are leftovers, except
    # the old copy of an interrupted re-save of another iteration M (no iter_M): it goes back to its name
    for p in sorted(save.glob("iter_*")):
        if p.is_dir() and p.suffix == ".tmp":
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_dir() and p.suffix == ".old":
            if p.with_suffix("").exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.rename(p, p.with_suffix(""))
    _fsync_path(save)
    fault_point("remove-old")
    return final


def latest_iteration(load) -> int:
    """The iteration the pointer of the directory ``load`` names (:class:`CheckpointError` if unreadable)."""
    f = Path(load) / LATEST
    if not f.is_file():
        raise CheckpointError(f"no {LATEST} (not a checkpoint directory written by --save)")
    text = f.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{f}: expected an iteration number, got {text!r}")
    return int(text)


def checkpoint_dir(load) -> Path:
    """The directory of the checkpoint the pointer of ``load`` names: ``iter_N``, or ``iter_N.old``
    while a re-save of N is between moving the old copy aside and renaming the new one in."""
    it = latest_iteration(load)
    d = iter_dir(load, it)
    if d.is_dir():
        return d
    if _sibling(d, ".old").is_dir():
        return _sibling(d, ".old")
    raise CheckpointError(f"{LATEST} names iteration {it}, but {d} does not exist")


def model_dir(path) -> Path:
    """The HF directory of ``path``: itself when it holds config.json, else its latest checkpoint's model."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    return checkpoint_dir(p) / "model"


def check_weights(directory) -> None:
    """Every safetensors file of an HF directory is complete (header readable, data fully present);
    reads headers only. :class:`CheckpointError` naming the file otherwise."""
    import json

    from safetensors import safe_open

    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{d}: no model.safetensors or {index.name}")
    for name in files:
        try:
            with safe_open(str(d / name), "pt"):
                pass
        except Exception as exc:  # SafetensorError (truncated, bad header) or OSError (missing)
            raise CheckpointError(f"{d / name}: unreadable ({exc})") from None


def check_trainer_state(load) -> None:
    """``trainer.pt`` of the latest checkpoint of ``load`` is present and a complete torch archive
    (its zip directory is read, not the tensors)."""
    f = checkpoint_dir(load) / "trainer.pt"
    try:
        with zipfile.ZipFile(f) as z:
            if not any(n.endswith("data.pkl") for n in z.namelist()):
                raise CheckpointError(f"{f}: not a torch.save archive")
    except (OSError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{f}: unreadable ({exc})") from None


def load_trainer_state(load, trainer) -> int:
    """Restore optimizer state; returns the iteration (rollouts done) of the latest checkpoint."""
    f = checkpoint_dir(load) / "trainer.pt"
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
        trainer.load_state_dict(state["trainer"])
        return int(state["iteration"])
    except (OSError, RuntimeError, EOFError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{f}: cannot restore the trainer state ({type(exc).__name__}: {exc})") from None


def existing_checkpoints(save) -> list[str]:
    """What in ``save`` a run would overwrite: the pointer and ``iter_N`` directories (sorted names)."""
    p = Path(save)
    if not p.is_dir():
        return []
    return sorted(c.name for c in p.iterdir()
                  if c.name == LATEST or (c.name.startswith("iter_") and c.is_dir() and c.suffix == ""))


def check_save_dir(save, load=None, overwrite: bool = False) -> None:
    """Refuse (:class:`CheckpointError`) a ``--save`` that already holds checkpoints, unless the run
    resumes from it (``load`` is the same directory) or ``overwrite``."""
    if overwrite or not save:
        return
    found = existing_checkpoints(save)
    if not found:
        return
    if load is not None and Path(load).is_dir() and Path(save).is_dir() and os.path.samefile(load, save):
        return
    try:
        latest = f"its pointer names iteration {latest_iteration(save)}"
    except CheckpointError:
        latest = f"{len(found)} checkpoint entries"
    raise CheckpointError(
        f"already holds checkpoints ({latest}); this run would overwrite them and move the pointer back. "
        f"Resume with --load {save}, choose another --save, or pass --overwrite-save")
