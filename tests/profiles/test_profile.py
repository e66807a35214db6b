"""`rlperf profile` against the real sglang-router and two rlperf servers on the tiny model (CPU).

The cluster is tests/rollout/test_server.py's fixture (two servers with an API key behind the
router), imported from that file rather than copied. Every trace is read back and parsed; the
summary's request numbers are checked against the load generator's own request log.
"""
import gzip
import importlib.util
import json
import logging
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from rlperf.cli import main
from rlperf.profiles import control, harness
from rlperf.profiles.traces import LOAD_PROCESS, REQUEST_CAT, WINDOW_NAME, read_json
from rlperf.rollout.router import free_port, http_json

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")

_spec = importlib.util.spec_from_file_location(
    "rollout_test_server", Path(__file__).resolve().parents[1] / "rollout" / "test_server.py")
_server_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_server_tests)
cluster = _server_tests.cluster  # the module-scoped fixture: 2 servers with an API key + sglang-router
KEY = _server_tests.KEY


def _profile(*argv):
    return main(["profile", *argv])


def _generate(url, n, seed):
    status, reply = http_json(url + "/generate", {"input_ids": [11, 12, 13, 14, 15],
                                                  "sampling_params": {"max_new_tokens": n, "sampling_seed": seed,
                                                                      "ignore_eos": True}},
                              headers={"Authorization": f"Bearer {KEY}"})  # the router asks for the key too
    assert status == 200, reply
    return reply


def test_start_stop_writes_one_trace_per_worker(cluster, tmp_path, capsys):
    out = tmp_path / "traces"
    assert _profile("--router-url", cluster.router_url, "--api-key", KEY, "--action", "start",
                    "--output-dir", str(out), "--activities", "CPU", "--record-shapes") == 0
    for i in range(4):  # round robin: both workers run steps
        _generate(cluster.router_url, 3, i)
    assert _profile("--router-url", cluster.router_url, "--api-key", KEY, "--action", "stop") == 0
    printed = capsys.readouterr().out
    files = sorted(out.glob("*-TP-0.trace.json.gz"))
    assert len(files) == 2, files
    for f in files:
        assert str(f) in printed
        doc = read_json(f)
        ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
        assert ops and any("Input Dims" in e.get("args", {}) for e in ops)  # --record-shapes reached the worker


def test_stop_without_start_fails_clearly(cluster, capsys):
    assert _profile("--router-url", cluster.router_url, "--api-key", KEY, "--action", "stop") == 1
    err = capsys.readouterr().err
    assert "no profile is running" in err and all(w in err for w in cluster.worker_urls)


def test_refusing_worker_fails_clearly(cluster, capsys, monkeypatch):
    monkeypatch.delenv("RLPERF_API_KEY", raising=False)  # --api-key's default
    # a wrong key: the router, which has the workers' key, refuses it first; each worker would too
    assert _profile("--router-url", cluster.router_url, "--api-key", "wrong", "--action", "start") == 1
    err = capsys.readouterr().err
    assert "/workers answered HTTP 401" in err and "refused the API key" in err
    assert _profile("--router-url", cluster.router_url, "--action", "start") == 1
    assert "needs the API key" in capsys.readouterr().err
    with pytest.raises(control.ProfileError) as info:
        control.start(cluster.worker_urls, control.StartOptions(activities=["CPU"]), "wrong")
    assert str(info.value).count("refused (HTTP 401)") == 2 and "API key" in str(info.value)
    assert _profile("--router-url", cluster.router_url, "--api-key", KEY, "--action", "start",
                    "--activities", "MEM") == 1  # rlperf servers have no memory snapshot: a 400 names it
    assert "unknown profiler activities" in capsys.readouterr().err
    # neither attempt left a profile running: stop still refuses on both workers
    assert _profile("--router-url", cluster.router_url, "--api-key", KEY, "--action", "stop") == 1


def test_unreachable_router_fails_clearly(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert _profile("--router-url", url, "--action", "start") == 1
    assert f"cannot reach {url}/workers" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "rlperf", "profile", "--router-url", url, "--action", "stop"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "cannot reach" in proc.stderr


def test_router_without_workers_fails_clearly(tmp_path, capsys):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--prometheus-port", str(free_port()), "--log-level", "warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                if http_json(url + "/workers", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline and proc.poll() is None, "sglang-router did not come up"
            time.sleep(0.2)
        assert _profile("--router-url", url, "--action", "start") == 1
        assert "lists no workers" in capsys.readouterr().err
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_usage_errors_exit_2(capsys):
    assert _profile("--action", "start") == 2
    assert _profile("--router-url", "http://127.0.0.1:1") == 2
    assert "--action start|stop" in capsys.readouterr().err


def test_help_shows_the_three_forms_with_the_mode_optional_and_the_routers_default_port(capsys):
    import argparse

    from rlperf.profiles.cli import ROUTER_URL_EXAMPLE
    from rlperf.rollout.args import add_serve_arguments

    with pytest.raises(SystemExit) as done:
        main(["profile", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    usage = out[: out.index("\n\n")].splitlines()
    assert usage == ["usage: rlperf profile --router-url URL --action {start,stop} [options]",
                     "       rlperf profile run --router-url URL [options] [load options]",
                     "       rlperf profile summarize TRACE [TRACE ...] [--top-n N] [--json FILE]"]
    assert "modes (optional: without one, --action start|stop)" in out
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    router_port = serve.parse_args([]).router_port  # where `rlperf serve --router N` puts the router
    assert ROUTER_URL_EXAMPLE == f"http://127.0.0.1:{router_port}" and ROUTER_URL_EXAMPLE in " ".join(out.split())
    for mode, form in (("run", "usage: rlperf profile run --router-url URL"), ("summarize", "usage: rlperf profile summarize TRACE")):
        with pytest.raises(SystemExit):
            main(["profile", mode, "--help"])
        assert capsys.readouterr().out.startswith(form)


def test_run_merges_one_process_per_worker_and_agrees_with_the_request_log(cluster, tmp_path, capsys):
    out = tmp_path / "run"
    n, output_len = 6, 5
    assert _profile("run", "--router-url", cluster.router_url, "--api-key", KEY, "--output-dir", str(out),
                    "--num-prompts", str(n), "--input-len", "9", "--output-len", str(output_len),
                    "--concurrency", "3", "--activities", "CPU", "--top-n", "5") == 0
    printed = capsys.readouterr().out
    merged_path, = out.glob("*.merged.json.gz")
    requests_path, = out.glob("*.requests.jsonl")
    summary_path, = out.glob("*.summary.json")
    log = [json.loads(line) for line in requests_path.read_text().splitlines()]
    assert len(log) == n and all(r["ok"] and r["completion_tokens"] == output_len and r["prompt_tokens"] == 9 for r in log)

    with gzip.open(merged_path, "rt") as f:  # plain gzip JSON: what Perfetto's JSON importer reads
        doc = json.load(f)
    ev = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == sorted(cluster.worker_urls + [LOAD_PROCESS])
    order = {e["pid"]: e["args"]["sort_index"] for e in ev if e.get("ph") == "M" and e["name"] == "process_sort_index"}
    assert [procs[p] for p in sorted(procs, key=order.get)] == sorted(cluster.worker_urls) + [LOAD_PROCESS]
    load_pid = next(p for p, name in procs.items() if name == LOAD_PROCESS)
    window, = [e for e in ev if e.get("name") == WINDOW_NAME and e.get("ph") == "X"]
    reqs = [e for e in ev if e.get("cat") == REQUEST_CAT]
    assert len(reqs) == n and {e["pid"] for e in reqs} == {load_pid}
    assert sum(e["args"]["completion_tokens"] for e in reqs) == sum(r["completion_tokens"] for r in log)
    for pid, name in procs.items():
        if pid == load_pid:
            continue
        ops = [e for e in ev if e.get("pid") == pid and e.get("cat") == "cpu_op"]
        assert ops, f"no CPU ops for {name}"
        # one clock: every worker's ops lie inside the profile window the load generator drew
        assert min(e["ts"] for e in ops) >= window["ts"] - 1e3
        assert max(e["ts"] + e["dur"] for e in ops) <= window["ts"] + window["dur"] + 1e3
    for e in reqs:
        assert window["ts"] <= e["ts"] and e["ts"] + e["dur"] <= window["ts"] + window["dur"]

    summary = json.loads(summary_path.read_text())
    load = summary["load"]
    assert load["requests"] == load["succeeded"] == n and load["failed"] == 0
    assert load["output_tokens"] == n * output_len and load["input_tokens"] == n * 9
    assert load["longest_sample"]["completion_tokens"] == output_len
    lat = sorted(r["end"] - r["start"] for r in log)
    assert abs(load["latency_ms"]["max"] - 1e3 * lat[-1]) < 1e-6
    assert summary["top_kind"] == "cpu" and 0 < len(summary["top"]) <= 5
    assert "output tok/s" in printed and str(merged_path) in printed
    # the engine names its prefill and decode steps, so the time splits between the two phases
    stages = summary["stages"]
    assert stages["prefill"]["count"] > 0 and stages["decode"]["count"] > 0
    assert stages["prefill"]["total_ms"] > 0 and stages["decode"]["total_ms"] > 0

    # summarize on the merged trace gives the same load numbers (request slices carry them)
    assert main(["profile", "summarize", str(merged_path), "--json", str(tmp_path / "s.json")]) == 0
    again = json.loads((tmp_path / "s.json").read_text())
    assert again["load"]["requests"] == n and again["load"]["output_tokens"] == n * output_len
    assert abs(again["load"]["latency_ms"]["p50"] - load["latency_ms"]["p50"]) < 1e-3
    assert [r["name"] for r in again["top"][:5]] == [r["name"] for r in summary["top"]]


def test_run_with_num_steps_collects_the_self_stopped_traces(cluster, tmp_path, capsys):
    out = tmp_path / "steps"
    assert _profile("run", "--router-url", cluster.router_url, "--api-key", KEY, "--output-dir", str(out),
                    "--num-steps", "2", "--num-prompts", "4", "--input-len", "4", "--output-len", "6",
                    "--concurrency", "2", "--activities", "CPU") == 0
    printed = capsys.readouterr().out
    assert printed.count("stopped by itself") == 2 and "no profile is running" in printed  # both ran out of steps
    merged_path, = out.glob("*.merged.json.gz")
    assert len(list(out.glob("*-TP-0.trace.json.gz"))) == 2
    doc = read_json(merged_path)
    assert len(doc["otherData"]["workers"]) == 2


def test_profile_trace_endpoint_serves_the_last_trace_over_http(cluster, tmp_path):
    worker = cluster.worker_urls[0]
    status, _, _ = control.http(worker + "/profile_trace")
    assert status == 401  # an admin endpoint: the key is needed
    replies = control.start([worker], control.StartOptions(output_dir=str(tmp_path), activities=["CPU"]), KEY)
    _generate(worker, 2, 0)
    stops = control.stop([worker], KEY)
    assert stops[0].trace_path == replies[0].trace_path
    doc, source = harness._fetch(worker, replies[0].trace_path, KEY, wait_s=10)
    assert source == worker + "/profile_trace" and doc == read_json(replies[0].trace_path)


def test_sleep_rollout_keeps_the_servers_answering(cluster, caplog, monkeypatch):
    import rlperf.rollout
    import rlperf.rollout.sleep as sleep_mod

    monkeypatch.setattr(sleep_mod, "LOG_INTERVAL_S", 0.3)
    fn = getattr(rlperf.rollout, "sleep")  # how a loader resolves --rollout-function-path rlperf.rollout.sleep
    result = {}
    args = types.SimpleNamespace(sleep_rollout_max_hours=4)
    with caplog.at_level(logging.INFO, logger=sleep_mod.__name__):
        t = threading.Thread(target=lambda: result.setdefault("out", fn(args, 7, None)))
        t.start()
        try:
            time.sleep(0.1)
            assert t.is_alive()
            for url in cluster.worker_urls:
                assert http_json(url + "/health")[0] == 200
            reply = _generate(cluster.router_url, 4, 1)
            assert reply["meta_info"]["completion_tokens"] == 4
        finally:
            t.join(timeout=10)
    assert result["out"] == []
    lines = [r.getMessage() for r in caplog.records if r.name == sleep_mod.__name__]
    assert len(lines) == 1 + 4 and "rollout 7" in lines[0] and lines[-1].endswith("asleep for 4 hours")


def test_a_refusing_worker_leaves_no_profiler_running_elsewhere(cluster, tmp_path, capsys):
    w0, w1 = cluster.worker_urls
    control.start([w0], control.StartOptions(output_dir=str(tmp_path), activities=["CPU"]), KEY)
    try:
        assert _profile("--router-url", cluster.router_url, "--api-key", KEY, "--action", "start",
                        "--output-dir", str(tmp_path), "--activities", "CPU") == 1
        err = capsys.readouterr().err
        assert f"{w0}/start_profile refused (HTTP 400)" in err and "already running" in err
        assert f"stopped again on {w1}" in err
    finally:
        control.stop([w0], KEY)
    with pytest.raises(control.ProfileError, match="no profile is running"):
        control.stop([w1], KEY)


@pytest.mark.gpu
def test_run_on_gpu_servers_ranks_gpu_kernels(tmp_path, capsys, launch_router_cluster):
    from rlperf.rollout.args import ServerArgs

    args = ServerArgs(model_path="tiny", device="cuda", api_key=KEY, max_total_tokens=4096)
    with launch_router_cluster(args) as c:
        assert _profile("run", "--router-url", c.router_url, "--api-key", KEY, "--output-dir", str(tmp_path / "run"),
                        "--num-prompts", "16", "--input-len", "100", "--output-len", "32", "--concurrency", "8") == 0
    summary = json.loads(next((tmp_path / "run").glob("*.summary.json")).read_text())
    assert summary["top_kind"] == "gpu" and summary["top"][0]["total_ms"] > 0
    assert summary["load"]["output_tokens"] == 16 * 32
    print(capsys.readouterr().out)


def test_run_without_output_dir_lets_the_workers_write_under_their_profile_root(cluster, tmp_path, monkeypatch, capsys):
    # the workers are never sent a path of this host: an rlperf server writes only under its --profile-root
    # (pytest's base temporary directory here) and reports where; the run reads those traces and merges them
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SGLANG_TORCH_PROFILER_DIR", raising=False)
    assert _profile("run", "--router-url", cluster.router_url, "--api-key", KEY, "--num-prompts", "2",
                    "--input-len", "4", "--output-len", "3", "--concurrency", "2", "--activities", "CPU") == 0
    capsys.readouterr()
    summary_path, = (tmp_path / "rlperf-profile").glob("*.summary.json")
    sources = json.loads(summary_path.read_text())["trace_sources"]
    assert sorted(sources) == sorted(cluster.worker_urls)
    root = http_json(cluster.worker_urls[0] + "/get_server_info")[1]["profile_root"]
    for path in sources.values():
        assert Path(path).parent == Path(root) and Path(path).exists()
        Path(path).unlink()
    assert not list((tmp_path / "rlperf-profile").glob("*-TP-0.trace.json.gz"))
