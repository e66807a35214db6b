"""torch.profiler plumbing of the rollout server (``/start_profile``, ``/stop_profile``).

Traces are written as SGLang names them, ``{output_dir}/{profile_id}-TP-{rank}.trace.json.gz``
(``profile_id`` = the start time in seconds, as SGLang uses), so slime's and rlperf's profile tools
find them. The profiler runs on the engine thread: it is started and stopped between engine steps,
and with ``num_steps`` it stops itself after that many steps.

Where traces may go: under the **profile root** (``rlperf serve --profile-root``, default the system
temporary directory), never elsewhere, whatever a client sends:

* ``output_dir`` (default ``$SGLANG_TORCH_PROFILER_DIR``, else the root itself) is an absolute path
  inside the root, or a path relative to it; no ``..`` component;
* the directories below the root are created (or entered) one at a time relative to an open
  descriptor of their parent, never following a symbolic link (``O_NOFOLLOW``), so no link, however
  placed or swapped in, leads out of the root;
* ``profile_id`` is a plain name (letters, digits, ``.``, ``_``, ``-``), so the file name cannot
  escape its directory either;
* the trace file is created at start, exclusively (``O_EXCL``: an existing file or link there is
  refused, never overwritten), and written at stop through that same descriptor.

Anything else is a ``ValueError`` naming the root, which the server answers with 400.
"""
from __future__ import annotations

import gzip
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path, PurePath

import torch

TRACE_NAME = "{profile_id}-TP-{rank}.trace.json.gz"
DEFAULT_OUTPUT_DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"
ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA,
              "CUDA": torch.profiler.ProfilerActivity.CUDA}
PROFILE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""A ``profile_id``: a plain file-name part (SGLang's default, the start time, is one)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def default_profile_root() -> str:
    """The profile root when ``--profile-root`` is not given: the system temporary directory."""
    return tempfile.gettempdir()


class TraceProfiler:
    """At most one torch.profiler session at a time; ``rank`` is the tensor-parallel rank (0 here);
    traces only under ``root`` (module docstring; default :func:`default_profile_root`)."""

    def __init__(self, rank: int = 0, root: str | os.PathLike | None = None):
        self.rank = rank
        given = os.path.abspath(os.fspath(root) if root is not None else default_profile_root())
        self.root = Path(given)
        """The profile root as configured (absolute; symbolic links in it are the operator's and are followed)."""
        self._root_real = Path(os.path.realpath(given))
        self._prof = None
        self._path: Path | None = None
        self._file_fd: int | None = None
        self._dir_fd: int | None = None
        self._steps_left: int | None = None
        self._last: tuple[Path, int, str] | None = None  # (path, fd of its directory, file name)

    @property
    def last_trace(self) -> Path | None:
        """The path of the last trace written (None before the first)."""
        return self._last[0] if self._last else None

    def open_last_trace(self):
        """(path, binary file) of the last trace written, opened through its directory's descriptor
        without following a link (what ``GET /profile_trace`` serves; the caller closes the file);
        None when there is none (any more)."""
        if self._last is None:
            return None
        path, dir_fd, name = self._last
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
        except OSError:
            return None
        return path, os.fdopen(fd, "rb")

    def _outside(self, output_dir: str, why: str) -> ValueError:
        return ValueError(f"output_dir {output_dir!r} {why}: traces are written only inside the profile root "
                          f"{self.root} (rlperf serve --profile-root)")

    def _relative_parts(self, output_dir: str) -> tuple[Path, tuple[str, ...]]:
        """(the directory as reported, its components below the root) of an ``output_dir``."""
        if "\x00" in output_dir:
            raise self._outside(output_dir, "holds a NUL character")
        p = PurePath(output_dir)
        if ".." in p.parts:
            raise self._outside(output_dir, "has a '..' component")
        if not p.is_absolute():
            return self.root.joinpath(*p.parts), p.parts
        for base in (self.root, self._root_real):
            try:
                rel = p.relative_to(base)
            except ValueError:
                continue
            return base.joinpath(*rel.parts), rel.parts
        raise self._outside(output_dir, "is outside the profile root")

    def _open_dir(self, output_dir: str, parts: tuple[str, ...]) -> int:
        """A descriptor of ``root/parts``, creating what is missing, following no link below the root."""
        try:
            os.makedirs(self._root_real, exist_ok=True)
            fd = os.open(self._root_real, _DIR_FLAGS)
        except OSError as exc:
            raise ValueError(f"the profile root {self.root} cannot be opened: {exc.strerror}") from None
        try:
            for name in parts:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:  # a symbolic link (ELOOP or ENOTDIR), or not a directory
                    try:
                        link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                    except OSError:
                        link = False
                    what = "a symbolic link (links are not followed)" if link else exc.strerror
                    raise self._outside(output_dir, f"cannot be entered at {name!r}: {what}") from None
                os.close(fd)
                fd = sub
        except OSError as exc:  # mkdir refused (permissions, read-only file system, ...)
            os.close(fd)
            raise self._outside(output_dir, f"cannot be created: {exc.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def start(self, output_dir: str | None = None, num_steps: int | None = None, activities=None,
              with_stack: bool = False, record_shapes: bool = False, profile_id: str | None = None) -> Path:
        """Start profiling; returns the trace path that :meth:`stop` will write. ValueError on bad input."""
        if self._prof is not None:
            raise ValueError("a profile is already running; POST /stop_profile first")
        cuda = torch.cuda.is_available()
        names = activities or (["CPU", "GPU"] if cuda else ["CPU"])
        unknown = [a for a in names if a not in ACTIVITIES]
        if unknown:
            raise ValueError(f"unknown profiler activities {unknown}; choose from {sorted(ACTIVITIES)}")
        if not cuda and any(ACTIVITIES[a] == torch.profiler.ProfilerActivity.CUDA for a in names):
            raise ValueError(f"profiler activities {names}: GPU needs CUDA, and this server has no CUDA device; "
                             "ask for CPU")
        acts = sorted({ACTIVITIES[a] for a in names}, key=str)
        if num_steps is not None and num_steps <= 0:
            raise ValueError(f"num_steps must be positive, got {num_steps}")
        pid = profile_id if profile_id is not None else str(time.time())
        if not PROFILE_ID.fullmatch(pid):
            raise ValueError(f"profile_id {pid[:80]!r} must be a plain name: 1 to 128 letters, digits, '.', '_' "
                             "or '-', not starting with '.' or '-'")
        if output_dir is None:  # SGLang's default directory, when set, must be under the root too
            output_dir = os.environ.get(DEFAULT_OUTPUT_DIR_ENV) or str(self.root)
        try:
            output_dir.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("output_dir is not valid Unicode text (a lone surrogate)") from None
        shown, parts = self._relative_parts(output_dir)
        name = TRACE_NAME.format(profile_id=pid, rank=self.rank)
        dir_fd = self._open_dir(output_dir, parts)
        try:
            try:
                file_fd = os.open(name, _NEW_FILE_FLAGS, 0o644, dir_fd=dir_fd)
            except FileExistsError:
                if profile_id is not None:
                    raise
                # Our own default id collided: workers of one router all write TP-0 traces, and started
                # together they can read the same clock tick. Keep the start time, add this process.
                pid = f"{pid}-{os.getpid()}"
                name = TRACE_NAME.format(profile_id=pid, rank=self.rank)
                file_fd = os.open(name, _NEW_FILE_FLAGS, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            os.close(dir_fd)
            if isinstance(exc, FileExistsError):
                raise ValueError(f"{shown / name} already exists (traces are never overwritten): choose another "
                                 "profile_id or output_dir") from None
            raise ValueError(f"{shown / name} cannot be created: {exc.strerror}") from None
        try:
            prof = torch.profiler.profile(activities=acts, with_stack=with_stack, record_shapes=record_shapes)
            prof.__enter__()
        except BaseException:
            os.close(file_fd)
            os.unlink(name, dir_fd=dir_fd)
            os.close(dir_fd)
            raise
        self._prof, self._path, self._file_fd, self._dir_fd = prof, shown / name, file_fd, dir_fd
        self._steps_left = num_steps
        return self._path

    def on_step(self) -> Path | None:
        """Called after every engine step; stops and writes the trace once ``num_steps`` steps ran."""
        if self._prof is None or self._steps_left is None:
            return None
        self._steps_left -= 1
        return self.stop() if self._steps_left <= 0 else None

    def stop(self) -> Path:
        """Stop and write the gzip-compressed Chrome trace into the file created at start; ValueError
        when nothing is running."""
        if self._prof is None:
            raise ValueError("no profile is running; POST /start_profile first")
        prof, path, file_fd, dir_fd = self._prof, self._path, self._file_fd, self._dir_fd
        self._prof = self._path = self._file_fd = self._dir_fd = self._steps_left = None
        try:
            prof.__exit__(None, None, None)
            with tempfile.TemporaryDirectory() as tmp, os.fdopen(file_fd, "wb") as out:
                file_fd = None  # the file object owns it now
                raw = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as src, gzip.GzipFile(filename="", mode="wb", fileobj=out) as dst:
                    shutil.copyfileobj(src, dst)
        except BaseException:
            if file_fd is not None:
                os.close(file_fd)
            os.close(dir_fd)
            raise
        if self._last is not None:
            os.close(self._last[1])
        self._last = (path, dir_fd, path.name)
        return path
