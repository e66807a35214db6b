"""An engine's gloo membership of a weight-update group, held by a child process of its own.

Why a process: gloo's TCP transport checks the size of every message it receives against the buffer
posted for it on its own event-loop thread, and a message longer than that buffer throws there, where
nothing can catch it: the process aborts (``terminate called ... op.preamble.length <= op.nbytes``).
A peer of the group decides how many bytes it broadcasts, so a peer that sends more than it announced
over HTTP would end the engine. The child (``python -m rlperf.sync.receiver``) joins the group and
takes part in the broadcasts; the engine only reads what it received. A child that aborts, stalls or
exits is a failed receive: the engine kills it, leaves the group and keeps serving.

The child receives each broadcast into its own byte range of one file that both processes map
(under ``/dev/shm`` when it has room, else the temporary directory); nothing of the engine's
weights changes until the whole request has arrived and been checked (:meth:`GlooReceiver.receive`).

Protocol (one JSON object per line; the engine writes to the child's stdin, the child answers on its
stdout)::

    engine -> {"master_address", "master_port", "rank", "world_size", "group_name", "timeout",
               "collective_timeout"}
    child  -> {"ok": true} | {"error": "..."}          (joined, or why not; then it exits)
    engine -> {"path": FILE, "size": BYTES, "ranges": [[offset, nbytes], ...]}
    child  -> {"ok": true} | {"error": "..."}          (one broadcast per range, in order)
    engine closes stdin                               (the child leaves the group and exits)

A short broadcast (fewer bytes than announced) completes in gloo as if it were whole. The child
receives each range through :func:`rlperf.sync.exact_receive.receive_exact`, which knows from the
kernel's page tables whether the range's last byte was written, and answers an error naming the
announced bytes otherwise: a broadcast short by even one byte is refused and nothing is loaded.
The engine's sentinel check (fresh random bytes, :data:`SENTINEL_BYTES`, at the end of every range of
at least that size, which must be overwritten) stays as a second line.

The receive file is named ``rlperf_receive_<engine pid>_<random>`` (:data:`SEGMENT_PREFIX`). An engine
removes it when the group closes; one killed (SIGKILL) cannot, so whoever started the engine removes
the files of its pid once it is gone (:func:`remove_segments`), and every engine start removes those
whose process no longer exists (:func:`sweep_dead_segments`). A child that dies leaves its engine
unable to receive: :meth:`GlooReceiver.dead` says so, and the engine's ``/health`` answers 503.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

SENTINEL_BYTES = 16
"""Random bytes written at the end of each receive range to see whether the broadcast filled it."""
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "rlperf_receive_"
"""Receive files are ``SEGMENT_PREFIX + "<engine pid>_<random>"``, under :data:`SHM_DIR` or the temporary directory."""
_EXIT_WAIT_S = 5.0


def _segment_dirs() -> list[str]:
    return list(dict.fromkeys(d for d in (SHM_DIR, tempfile.gettempdir()) if os.path.isdir(d)))


def segment_owner(name: str) -> int | None:
    """The engine pid in a receive file's name (``rlperf_receive_<pid>_<random>``), else None."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    pid, sep, rest = name[len(SEGMENT_PREFIX):].partition("_")
    return int(pid) if sep and rest and pid.isdigit() and 0 < int(pid) < 1 << 22 else None


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (any user's; a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> bool:
    """Unlink ``path`` if it is a regular file (never follows a link); whether it was removed."""
    try:
        if not os.path.isfile(path) or os.path.islink(path):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def _remove_segments_of(owners) -> list[str]:
    """Remove every receive file whose owner pid ``owners(pid)`` accepts; the paths removed."""
    out = []
    for d in _segment_dirs():
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            pid = segment_owner(name)
            if pid is not None and owners(pid) and _remove(os.path.join(d, name)):
                out.append(os.path.join(d, name))
    return out


def remove_segments(pid: int) -> list[str]:
    """Remove the receive files of engine ``pid`` (call it once that process is gone); the paths removed."""
    return _remove_segments_of(lambda owner: owner == pid)


def sweep_dead_segments() -> list[str]:
    """Remove every receive file whose engine process no longer exists (an engine killed by SIGKILL, or
    with its trainer); a live process's files are kept. The paths removed."""
    return _remove_segments_of(lambda owner: owner != os.getpid() and not process_exists(owner))


class ReceiverError(RuntimeError):
    """The child failed, stalled, exited or refused; the group it held is gone (the child is killed)."""


class ReceiverGone(ReceiverError):
    """The child had died before the request came (not a sender's overlong broadcast): this engine cannot
    take weight updates of that group any more, a failure of the engine (its ``/health`` says so)."""


def _receive_dir(nbytes: int) -> str:
    """``/dev/shm`` when it exists and has room for ``nbytes``, else the temporary directory."""
    try:
        if os.path.isdir(SHM_DIR) and shutil.disk_usage(SHM_DIR).free > 2 * nbytes + (64 << 20):
            return SHM_DIR
    except OSError:
        pass
    return tempfile.gettempdir()


class GlooReceiver:
    """One gloo weight-update group membership in a child process (module docstring).

    :meth:`join` starts the child and waits for its rendezvous; :meth:`receive` takes part in one
    request's broadcasts and returns the received bytes; :meth:`close` kills the child and removes the
    receive file. Blocking calls take a timeout after which the child is killed (:class:`ReceiverError`).
    Thread-safe: one call at a time (a lock), :meth:`close` from any thread at any time.
    """

    def __init__(self, name: str):
        self.name = name
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._path: str | None = None
        self._size = 0
        self._pending = b""
        self._map: torch.Tensor | None = None
        self._reading: subprocess.Popen | None = None  # the child whose output _reply is reading now
        self.closed = False

    # ---- the child -----------------------------------------------------------------------------
    def join(self, master_address: str, master_port: int, rank: int, world_size: int, timeout: float,
             collective_timeout: float) -> None:
        """Start the child and wait up to ``timeout`` seconds for it to join; ReceiverError if it does not.
        ``collective_timeout``: how long the child's gloo group waits for one broadcast."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        deadline = time.monotonic() + timeout
        self._proc = subprocess.Popen([sys.executable, "-m", "rlperf.sync.receiver"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        if self.closed:  # closed while it started (the server is stopping)
            self.close()
            raise ReceiverError(f"the group {self.name!r} was closed while joining")
        self._send({"master_address": master_address, "master_port": master_port, "rank": rank,
                    "world_size": world_size, "group_name": self.name, "timeout": timeout,
                    "collective_timeout": collective_timeout})
        reply = self._reply(deadline, f"joining the group at {master_address}:{master_port}", timeout)
        if "error" in reply:
            self.close()
            raise ReceiverError(reply["error"])

    def receive(self, ranges: list[tuple[int, int]], timeout: float) -> torch.Tensor:
        """Take part in one broadcast per ``(offset, nbytes)`` of ``ranges`` (in order) and return the
        received bytes (uint8, as long as the ranges' end; a copy the caller owns). ReceiverError when
        the child fails, a range was not filled in full, or ``timeout`` seconds pass; the group is then
        left (the child killed)."""
        with self._lock:
            if self.closed:
                raise ReceiverError(f"the group {self.name!r} is closed")
            gone = self.dead()
            if gone is not None:
                self.close()
                raise ReceiverGone(f"{gone} before this update; the group {self.name!r} is left")
            size = max((o + n for o, n in ranges), default=0)
            view = self._file(max(size, 1))[:size]
            sentinels = []
            for offset, nbytes in ranges:
                if nbytes >= SENTINEL_BYTES:
                    s = torch.frombuffer(bytearray(secrets.token_bytes(SENTINEL_BYTES)), dtype=torch.uint8)
                    view[offset + nbytes - SENTINEL_BYTES:offset + nbytes] = s
                    sentinels.append((offset, nbytes, s))
            deadline = time.monotonic() + timeout
            self._send({"path": self._path, "size": self._size, "ranges": [list(r) for r in ranges]})
            reply = self._reply(deadline, f"receiving {size} bytes in {len(ranges)} broadcast(s)", timeout)
            if "error" in reply:
                self.close()
                raise ReceiverError(f"the broadcast failed: {reply['error']}")
            for offset, nbytes, s in sentinels:
                if torch.equal(view[offset + nbytes - SENTINEL_BYTES:offset + nbytes], s):
                    self.close()  # the sender sent less than it announced: its group is out of step
                    raise ReceiverError(f"a broadcast of {nbytes} announced bytes (at byte {offset} of the request) "
                                        "arrived short: fewer bytes were sent than announced")
            return view.clone()

    def close(self) -> None:
        """Kill the child (it leaves the group with it) and remove the receive file; idempotent."""
        self.closed = True
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.kill()
                proc.wait(_EXIT_WAIT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
            # a reader in another thread sees the dead child's end of file and closes its output itself
            # (closing it here could hand its descriptor number to another file under that reader)
            for f in (proc.stdin,) if self._reading is proc else (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self._map = None  # unmapped: the removed file's memory goes back
        path, self._path = self._path, None
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    def dead(self) -> str | None:
        """Why the child can no longer receive (it exited or was killed outside :meth:`close`), else None."""
        proc = self._proc
        if self.closed or proc is None:
            return None
        code = proc.poll()
        if code is None:
            return None
        how = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
        try:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else how
        except ValueError:
            pass
        return f"the weight receiver of group {self.name!r} (pid {proc.pid}) {how}"

    # ---- plumbing ------------------------------------------------------------------------------
    def _file(self, size: int) -> torch.Tensor:
        """The receive file mapped here, at least ``size`` bytes (a new, larger one replaces a smaller)."""
        if self._path is None or self._size < size:
            if self._path is not None:
                os.unlink(self._path)
            fd, self._path = tempfile.mkstemp(prefix=f"{SEGMENT_PREFIX}{os.getpid()}_", dir=_receive_dir(size))
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            self._size = size
            self._map = torch.from_file(self._path, shared=True, size=size, dtype=torch.uint8)
        return self._map

    def _send(self, msg: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self._proc.stdin.flush()
        except (OSError, ValueError, AttributeError) as exc:
            self.close()
            raise ReceiverGone(f"the receiver process of group {self.name!r} is gone ({exc})") from None

    def _reply(self, deadline: float, what: str, timeout: float) -> dict:
        """The child's next line, read until ``deadline``; ReceiverError (child killed) on timeout or EOF."""
        proc = self._proc
        self._reading = proc
        try:
            return self._read_line(proc, deadline, what, timeout)
        finally:
            self._reading = None
            if self.closed and proc is not None:
                proc.stdout.close()

    def _read_line(self, proc, deadline: float, what: str, timeout: float) -> dict:
        fd = proc.stdout.fileno() if proc is not None else -1
        buf = self._pending
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if proc is None or left <= 0:
                self.close()
                raise ReceiverError(f"{what}: no answer within {timeout:g} s; the group {self.name!r} is left")
            try:
                ready, _, _ = select.select([fd], [], [], left)
            except (OSError, ValueError):
                ready = [fd]
            if not ready:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                code = proc.poll()
                self.close()
                how = f"exited with {code}" if code is not None and code >= 0 else \
                    f"was killed by signal {-code}" if code is not None else "closed its output"
                raise ReceiverError(f"{what}: the receiver process {how} (a broadcast longer than announced "
                                    f"aborts it); the group {self.name!r} is left")
            buf += chunk
        line, self._pending = buf.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            self.close()
            raise ReceiverError(f"{what}: the receiver process answered {line[:200]!r}")
        return reply


# ---- the child's side ----------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Exit when the engine that started this process is gone (a child blocked in a broadcast would
    otherwise hold the group until its timeout)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _child_main() -> int:
    from .distributed import init_weight_update_group
    from .exact_receive import receive_exact

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    out = sys.stdout.buffer

    def answer(msg: dict) -> None:
        out.write(json.dumps(msg).encode() + b"\n")
        out.flush()

    line = sys.stdin.buffer.readline()
    try:
        spec = json.loads(line)
        group = init_weight_update_group(spec["master_address"], int(spec["master_port"]), int(spec["rank"]),
                                         int(spec["world_size"]), group_name=spec["group_name"], backend="gloo",
                                         timeout=float(spec["collective_timeout"]),
                                         connect_timeout=float(spec["timeout"]))
    except Exception as exc:  # noqa: BLE001  (the engine reports it)
        answer({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    answer({"ok": True})
    maps: dict[tuple[str, int], torch.Tensor] = {}
    for line in sys.stdin.buffer:
        try:
            cmd = json.loads(line)
            key = (cmd["path"], int(cmd["size"]))
            if key not in maps:
                maps.clear()
                maps[key] = torch.from_file(key[0], shared=True, size=key[1], dtype=torch.uint8)
            buf = maps[key]
            for offset, nbytes in cmd["ranges"]:
                receive_exact(group, buf[offset:offset + nbytes])  # ShortBroadcast unless all of it came
        except Exception as exc:  # noqa: BLE001  (a failed or timed-out broadcast: the engine leaves the group)
            answer({"error": f"{type(exc).__name__}: {exc}"})
            break
        answer({"ok": True})
    group.close()
    os._exit(0)  # no interpreter teardown after a gloo group (it can abort in static destructors)


if __name__ == "__main__":
    sys.exit(_child_main())
