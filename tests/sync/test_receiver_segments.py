"""Issue #39 item 3: the weight-receive files (``rlperf_receive_<pid>_*``) of an engine that is gone are
removed, by pid or by a sweep at an engine's start; a live process's are kept."""
import os
import subprocess
import sys

from rlperf.sync import receiver as R


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not R.process_exists(p.pid)
    return p.pid


def _plant(tmp_path, pid: int, tag: str = "abc") -> str:
    path = tmp_path / f"{R.SEGMENT_PREFIX}{pid}_{tag}"
    path.write_bytes(b"w" * 64)
    return str(path)


def test_segment_owner_parses_only_receive_files():
    assert R.segment_owner("rlperf_receive_1234_ab_cd") == 1234
    for name in ("rlperf_receive_x_ab", "rlperf_receive_1234", "rlperf_receive__ab", "rlperf_bucket_1234_ab",
                 "rlperf_receive_0_ab", "rlperf_receive_99999999999_ab"):
        assert R.segment_owner(name) is None, name


def test_sweep_removes_a_dead_pids_files_and_keeps_a_live_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "SHM_DIR", str(tmp_path))
    dead = _plant(tmp_path, _dead_pid())
    live_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _plant(tmp_path, live_proc.pid)
        mine = _plant(tmp_path, os.getpid())
        other = tmp_path / "rlperf_bucket_1_x"
        other.write_bytes(b"x")
        link = tmp_path / f"{R.SEGMENT_PREFIX}{_dead_pid()}_link"
        os.symlink(other, link)
        removed = R.sweep_dead_segments()
        assert dead in removed and not os.path.exists(dead)
        assert os.path.exists(live) and os.path.exists(mine) and other.exists() and os.path.islink(link)
    finally:
        live_proc.kill()
        live_proc.wait()
    # its process gone, the live one's file goes by pid too
    assert R.remove_segments(live_proc.pid) == [live] and not os.path.exists(live)


def test_a_server_start_sweeps_dead_segments(tmp_path, monkeypatch):
    """``rlperf serve`` sweeps before it loads the model (the real /dev/shm when there is one)."""
    shm = R.SHM_DIR if os.path.isdir(R.SHM_DIR) else str(tmp_path)
    monkeypatch.setattr(R, "SHM_DIR", shm)
    planted = os.path.join(shm, f"{R.SEGMENT_PREFIX}{_dead_pid()}_planted")
    with open(planted, "wb") as f:
        f.write(b"w" * 64)
    from rlperf.rollout import server as S

    def stop(*a, **k):
        raise SystemExit(0)
    monkeypatch.setattr(S, "load_model", stop)
    from rlperf.rollout.args import ServerArgs
    try:
        S.serve(ServerArgs(model_path="tiny", device="cpu"))
    except SystemExit:
        pass
    assert not os.path.exists(planted)


def test_a_dead_receiver_child_is_reported():
    r = R.GlooReceiver("g")
    assert r.dead() is None
    r._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    assert r.dead() is None
    r._proc.kill()
    r._proc.wait()
    assert r.dead() == f"the weight receiver of group 'g' (pid {r._proc.pid}) was killed by SIGKILL"
    r.close()
    assert r.dead() is None  # closed on purpose: not a failure
