"""Issue #39, items 6 and 7: one ``rlperf train`` per directory, and a save stopped by a full disk or by
SIGINT ends in one line with the resume command while the last complete checkpoint stays loadable.

* Two real ``rlperf train`` processes on one ``--output-dir`` (or one ``--save``): the second exits 2
  naming the first's pid; once the first is SIGKILLed, its lock file left behind blocks nothing.
* A save whose write raises ``OSError(ENOSPC)``: exit 1, the line (directory and ``--load`` command), no
  traceback, the pointer on the previous checkpoint, and the resume equals an uninterrupted run bit for bit.
* SIGINT delivered to a real run in the middle of a save (``RLPERF_FAULT_AT=checkpoint:write-tmp:2:INT``):
  exit 130 with the line, no traceback, the previous checkpoint intact.
"""
import errno
import os
import signal
import subprocess
import sys
import time

import torch

from checkpoint_state import bit_equal, saved_state
from rlperf.cli import main
from rlperf.loop import checkpoint as ckpt
from rlperf.loop import train
from rlperf.loop.run_lock import LOCK_FILE

FLAGS = ("--no-progress", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--global-batch-size", "4")


def _env(fault=None):
    env = {k: v for k, v in os.environ.items() if k != ckpt.FAULT_ENV}
    if fault:
        env[ckpt.FAULT_ENV] = fault
    return env


def _cmd(*flags):
    return [sys.executable, "-m", "rlperf", "train", "--skip-gates", *FLAGS, *map(str, flags)]


def _wait_for_lock(path, pid, proc, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the first run ended early: rc {proc.returncode}"
        if path.is_file() and path.read_text().strip() == str(pid):
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} never named pid {pid}")


def test_a_second_run_on_the_same_directory_is_refused_until_the_first_dies(tmp_path):
    out, save = tmp_path / "out", tmp_path / "save"
    first = subprocess.Popen(_cmd("--num-rollout", 100000, "--output-dir", out, "--save", save,
                                  "--save-interval", 1000000),
                             env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_lock(out / LOCK_FILE, first.pid, first)
        _wait_for_lock(save / LOCK_FILE, first.pid, first)
        for flags in (("--output-dir", out), ("--output-dir", tmp_path / "out2", "--save", save)):
            second = subprocess.run(_cmd("--num-rollout", 1, *flags), env=_env(), capture_output=True, text=True,
                                    timeout=300)
            assert second.returncode == 2, second.stderr[-2000:]
            assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr, second.stderr
            flag = "--save" if "--save" in map(str, flags) else "--output-dir"
            assert f"{flag} " in second.stderr.strip().splitlines()[-1], second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
        first.stderr.close()
    assert (out / LOCK_FILE).read_text().strip() == str(first.pid)  # left behind by the dead run
    again = subprocess.run(_cmd("--num-rollout", 1, "--output-dir", out, "--save", save, "--overwrite-save",
                                "--overwrite-output-dir"),
                           env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    # a run that ends removes its lock files: the directories hold only what it wrote
    assert not (out / LOCK_FILE).exists() and not (save / LOCK_FILE).exists()


def _one_line(stderr: str, *needles: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    for n in needles:
        assert n in last, f"{n!r} not in the last line: {last}"
    return last


def test_disk_full_during_a_save_ends_in_one_line_and_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    run = ["--num-rollout", "3", "--save-interval", "1"]
    train([*FLAGS, *run, "--output-dir", str(tmp_path / "ref_out"), "--save", str(tmp_path / "ref")])
    save, out = tmp_path / "save", tmp_path / "out"
    real_save, calls = torch.save, []

    def full_disk(obj, f, *a, **k):  # the checkpoint's trainer.pt write: the second save finds the disk full
        calls.append(f)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    capsys.readouterr()
    code = main(["train", "--skip-gates", *FLAGS, *run, "--output-dir", str(out), "--save", str(save)])
    err = capsys.readouterr().err
    monkeypatch.setattr(torch, "save", real_save)
    assert code == 1, err[-3000:]
    _one_line(err, "disk is full", str(save), "iter_0000001", f"--load {save}")
    assert ckpt.latest_iteration(save) == 1 and not (save / "iter_0000002.tmp").exists()
    ckpt.check_trainer_state(save)
    assert main(["train", "--skip-gates", *FLAGS, *run, "--output-dir", str(out), "--save", str(save), "--load", str(save)]) == 0
    assert ckpt.latest_iteration(save) == 3
    assert bit_equal(saved_state(save), saved_state(tmp_path / "ref"))


def test_sigint_during_a_save_exits_130_with_one_line(tmp_path):
    save, out = tmp_path / "save", tmp_path / "out"
    proc = subprocess.run(_cmd("--num-rollout", 3, "--save-interval", 1, "--output-dir", out, "--save", save),
                          env=_env("checkpoint:write-tmp:2:INT"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr[-3000:]
    _one_line(proc.stderr, "interrupted (SIGINT)", str(save), "iter_0000001", f"--load {save}")
    assert ckpt.latest_iteration(save) == 1 and not (save / "iter_0000002.tmp").exists()
    ckpt.check_trainer_state(save)
    ckpt.check_weights(ckpt.checkpoint_dir(save) / "model")


def test_release_removes_only_its_own_lock_file(tmp_path):
    from rlperf.loop.run_lock import lock_dir, release_run_dirs

    held = lock_dir(tmp_path, "--output-dir")
    release_run_dirs([held])
    assert not (tmp_path / LOCK_FILE).exists()
    # a lock file replaced under the name (another run's) is not removed by the one that held the old file
    held = lock_dir(tmp_path, "--output-dir")
    (tmp_path / LOCK_FILE).unlink()
    other = lock_dir(tmp_path, "--output-dir")
    release_run_dirs([held])
    assert (tmp_path / LOCK_FILE).exists()
    release_run_dirs([other])
    assert not (tmp_path / LOCK_FILE).exists()


class _Stopped(BaseException):
    pass


def test_a_signal_while_the_locks_are_taken_leaves_every_lock_file_with_the_caller(tmp_path, monkeypatch):
    """SIGTERM (here from inside ``flock``, right after the lock file was created) is handled only once
    both locks are in the caller's list: the handler's exception comes out of ``lock_run_dirs``, and the
    release leaves both directories empty. Before the fix a stop there left ``.rlperf.lock`` behind."""
    import fcntl
    import threading

    import pytest

    from rlperf.loop import run_lock

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set from the main thread only")
    real_flock, handled = fcntl.flock, []

    def flock_then_signal(fd, op):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_flock(fd, op)

    def stop(signum, frame):
        handled.append(signum)
        raise _Stopped()

    monkeypatch.setattr(run_lock.fcntl, "flock", flock_then_signal)
    previous = signal.signal(signal.SIGTERM, stop)
    held = []
    try:
        with pytest.raises(_Stopped):
            run_lock.lock_run_dirs(tmp_path / "out", tmp_path / "save", held)
    finally:
        signal.signal(signal.SIGTERM, previous)
        run_lock.release_run_dirs(held)
    assert handled == [signal.SIGTERM]  # two signals sent, one recorded and raised again
    assert len(held) == 2
    assert list((tmp_path / "out").iterdir()) == [] and list((tmp_path / "save").iterdir()) == []
