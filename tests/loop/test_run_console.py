"""What ``rlperf train`` tells its user while it works and when it is stopped (issue #40, items 2 and 8),
as real processes:

* a large model on the CPU is warned about, with its estimated memory, before anything is allocated; a
  SIGTERM then ends the run with one line and leaves no empty ``--output-dir`` behind;
* a run stopped by SIGTERM mid-way says what it left; a new run into that directory is refused (exit 2,
  naming ``--overwrite-output-dir``) rather than replacing the metrics, and runs with the flag;
* a phase still running after a few seconds says what it is doing (``RLPERF_SLOW_PHASE_S=0``: every one).
"""
import os
import signal
import subprocess
import sys
import time

from rlperf.loop import METRICS_FILE
from rlperf.telemetry.notice import SLOW_PHASE_ENV

FLAGS = ("--no-progress", "--skip-gates", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--global-batch-size", "4")


def _train(*flags):
    return [sys.executable, "-m", "rlperf", "train", *map(str, flags)]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def test_a_large_model_on_the_cpu_is_warned_before_it_allocates_and_sigterm_leaves_no_empty_dir(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(_train("--model", "qwen3-0.6b", "--device", "cpu", "--output-dir", out),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        rss = _rss_bytes(proc.pid)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert first.startswith("rlperf train: --model qwen3-0.6b on the CPU: 596M parameters need about 13.3 GiB"), first
    assert rss < 1 << 30, f"{rss / 2**20:.0f} MiB resident when it warned: it allocated first"  # the model: 2.4 GB
    assert proc.returncode == 143, rest
    lines = rest.splitlines()
    assert "Traceback" not in rest and lines[-1].startswith("rlperf train: stopped by SIGTERM; it wrote nothing"), rest
    assert not out.exists()  # the run created it and wrote nothing: not left behind


def test_a_stopped_run_says_what_it_left_and_a_new_run_does_not_silently_replace_it(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(_train(*FLAGS, "--num-rollout", 100000, "--output-dir", out),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not ((out / METRICS_FILE).is_file() and (out / METRICS_FILE).read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    last = err.splitlines()[-1]
    rollouts = (out / METRICS_FILE).read_text().count("\n")
    assert last.startswith(f"rlperf train: stopped by SIGTERM; {out} keeps what it wrote: {METRICS_FILE} "
                           f"({rollouts} rollouts)"), last
    assert "--overwrite-output-dir" in last and "a rerun starts from rollout 0" in last, last
    assert sorted(p.name for p in out.iterdir()) == [METRICS_FILE, "timeline.pftrace"]  # no lock file left

    again = subprocess.run(_train(*FLAGS, "--num-rollout", 1, "--output-dir", out), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2 and again.stderr.splitlines() == [
        f"rlperf train: --output-dir {out} holds the metrics of an earlier run ({out / METRICS_FILE}, {rollouts} "
        f"rollout(s)) and this run would replace them: choose another --output-dir, resume that run with --load, "
        f"or add --overwrite-output-dir to replace them"], again.stderr
    assert (out / METRICS_FILE).read_text().count("\n") == rollouts  # untouched

    replace = subprocess.run(_train(*FLAGS, "--num-rollout", 1, "--output-dir", out, "--overwrite-output-dir"),
                             capture_output=True, text=True, timeout=300, env={**os.environ, SLOW_PHASE_ENV: "0"})
    assert replace.returncode == 0, replace.stderr[-3000:]
    assert (out / METRICS_FILE).read_text().count("\n") == 1
    for said in ("rlperf train: building the model ...", "rlperf train: building the model: done in ",
                 "rlperf train: generating rollout 1 ...", "rlperf train: training on rollout 1: done in "):
        assert said in replace.stderr, replace.stderr
