"""`rlperf profile run` that loses a worker in the middle of its load (issue #24): real processes (two
``rlperf serve`` workers behind the real sglang-router, ``rlperf profile run`` as a command), one
worker killed with SIGKILL once the load is under way.

The run exits 1 and names the lost worker; the merged trace and the summary are still written, with
the surviving worker's trace in them and the lost one listed under ``lost_workers``.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rlperf.profiles.traces import read_json
from rlperf.rollout.args import ServerArgs

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")


def test_a_run_that_loses_a_worker_merges_and_summarizes_the_others(launch_router_cluster, tmp_path):
    args = ServerArgs(model_path="tiny", kernel_backend="reference", num_threads=1, device="cpu",
                      max_total_tokens=4096, skip_warmup=True)
    out = tmp_path / "run"
    with launch_router_cluster(args) as cluster:
        victim, survivor = cluster.worker_urls
        victim_proc = next(p for p in cluster.servers if victim.rsplit(":", 1)[1] in map(str, p.args))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen([sys.executable, "-m", "rlperf", "profile", "run", "--router-url", cluster.router_url,
                                 "--output-dir", str(out), "--activities", "CPU", "--num-prompts", "48",
                                 "--input-len", "8", "--output-len", "16", "--concurrency", "4"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        deadline = time.time() + 120
        while not any("profiling on 2 workers" in ln for ln in lines):
            assert proc.poll() is None and time.time() < deadline, "".join(lines)
            time.sleep(0.1)
        time.sleep(1.0)  # the load is under way on both workers
        assert proc.poll() is None, "the load finished before the kill: " + "".join(lines)
        victim_proc.send_signal(signal.SIGKILL)
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            reader.join(10)
            pytest.fail("the profile run did not end: " + "".join(lines))
        reader.join(10)
        text = "".join(lines)
    assert proc.returncode == 1, text
    assert f"lost worker {victim}" in text and "Traceback" not in text, text
    (summary_path,) = out.glob("*.summary.json")
    summary = json.loads(summary_path.read_text())
    assert list(summary["lost_workers"]) == [victim]
    assert list(summary["trace_sources"]) == [survivor]
    assert summary["load"]["succeeded"] >= 1, summary["load"]  # the router may retry the lost one's requests
    (merged,) = out.glob("*.merged.json.gz")
    names = {e["args"]["name"] for e in read_json(merged)["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert any(survivor in n for n in names) and not any(victim in n for n in names), names
