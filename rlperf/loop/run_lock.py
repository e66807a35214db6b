"""One ``rlperf train`` per directory: an exclusive lock on ``--output-dir`` and ``--save``.

Two runs writing the same directory interleave ``metrics.jsonl`` and overwrite each other's
checkpoints. :func:`lock_run_dirs` takes an exclusive ``fcntl.flock`` on ``DIR/.rlperf.lock`` of
each directory and writes the holder's pid into it. The kernel drops the lock when its holder's
process ends, however it ends (SIGKILL included), so a lock file left by a dead run blocks nothing: no
stale-lock heuristics. A second run finds the lock held and stops with :class:`RunDirLocked` (exit 2)
naming the pid read from the file. A run that ends (normally, or by an error it reports) removes its
lock files (:func:`release_run_dirs`), so a directory holds only what the run wrote; a run that takes a
lock checks that the file it locked is still the one under that name (one removed in between is
taken again), so removal never lets two runs in. SIGTERM and SIGINT wait while the locks are taken
(:func:`lock_run_dirs`): a signal that raised between creating a lock file and handing it to the
caller would leave that file behind, and the run's directory not empty.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import threading
from pathlib import Path

LOCK_FILE = ".rlperf.lock"


class RunDirLocked(RuntimeError):
    """Another live ``rlperf train`` holds the directory; the message names it and its pid."""


def lock_dir(directory, flag: str):
    """Lock ``directory`` (created if missing) for this process: the open lock file, to keep open for
    the run's lifetime (closing it, or the process ending, releases it). :class:`RunDirLocked` when
    another process holds it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_FILE
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        f = os.fdopen(fd, "r+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                f.close()
                raise
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise RunDirLocked(f"{flag} {directory} is in use by another rlperf train (pid {holder}, lock {path}): "
                               f"two runs would interleave its metrics and checkpoints; wait for it to end, stop "
                               f"it, or choose another {flag}") from None
        if _same_file(f, path):
            break
        f.close()  # the holder removed it between our open and our lock: take the file now under the name
    else:
        raise RunDirLocked(f"{flag} {directory}: its lock file {path} keeps being replaced; is another run starting?")
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _same_file(f, path: Path) -> bool:
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(f.fileno())
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def release_run_dirs(held: list) -> None:
    """End of a run: remove each lock file this run holds (still the one under its name), then release it."""
    for f in held:
        try:
            path = Path(os.readlink(f"/proc/self/fd/{f.fileno()}"))
        except OSError:
            path = None
        try:
            if path is not None and path.name == LOCK_FILE and _same_file(f, path):
                path.unlink()
        except OSError:
            pass
        finally:
            f.close()


@contextlib.contextmanager
def signals_deferred(signums=(signal.SIGTERM, signal.SIGINT)):
    """While the block runs, the signals ``signums`` are recorded instead of handled; on leaving it, each
    one recorded is raised again, into the handler it would have met (a handler that raises then raises
    after the block, not inside it). Outside the main thread, where handlers cannot be set, the block
    runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    try:
        for s in signums:
            previous[s] = signal.signal(s, lambda signum, frame: caught.append(signum))
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


def lock_run_dirs(output_dir, save, held: list) -> None:
    """Lock ``--output-dir`` and ``--save`` (when given and a different directory), appending each open
    lock file to ``held`` as it is taken, for :func:`release_run_dirs`. SIGTERM and SIGINT wait until
    both are in ``held`` (:func:`signals_deferred`), so a stopped run never leaves a lock file it made."""
    with signals_deferred():
        held.append(lock_dir(output_dir, "--output-dir"))
        if save and Path(save).resolve() != Path(output_dir).resolve():
            held.append(lock_dir(save, "--save"))
