"""API keys and shared-memory buckets over real HTTP and real processes (issue #12, "Server" 5 and 6).

* Every admin route of ``rlperf serve`` refuses every wrong form of the key with 401 and takes the
  right one; the list of admin routes is checked against the server's own route table.
* ``--router N`` with a key: the router asks for it too (its control plane: ``GET /workers``,
  ``DELETE /workers/{id}``), forwards it to the workers (``/flush_cache`` reaches both), and no
  child process has the key on its command line (``/proc/<pid>/cmdline``).
* ``rlperf train`` talks to key-protected servers with ``--sglang-api-key[-file]`` or
  ``RLPERF_API_KEY`` and stops with exit 2 and one line naming the flag without it.
* Shared memory: only rlperf's own per-transfer segments are opened, the checksum is required, a
  mismatch reply holds no hash, a segment the server opened outlives the server, and a directory,
  FIFO, link or socket under a bucket's name is a 400 naming ``transport.name`` (issue #39, 4).
* Stop conditions: over their limits a 400 naming the field and the limit, at the limits served,
  and another client's requests unaffected meanwhile (issue #39, 8).
"""
import base64
import concurrent.futures
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from rlperf.cli import main
from rlperf.rollout.args import API_KEY_ENV, ServerArgs
from rlperf.rollout.router import http_json
from rlperf.sync import bucket_payload, flatten_buckets, release

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")

KEY = "rlperf-test-key-5f1c0a"
AUTH = {"Authorization": f"Bearer {KEY}"}

ADMIN_ROUTES = [("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/flush_cache"),
                ("GET", "/flush_cache"), ("POST", "/abort_request"), ("POST", "/start_profile"), ("GET", "/start_profile"),
                ("POST", "/stop_profile"), ("GET", "/stop_profile"), ("GET", "/profile_trace"),
                ("POST", "/update_weights_from_tensor"), ("POST", "/init_weights_update_group"),
                ("POST", "/update_weights_from_distributed"), ("POST", "/destroy_weights_update_group"),
                ("GET", "/weights_checksum")]
PUBLIC_PATHS = {"/health", "/health_generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info",
                "/get_weight_version", "/v1/models", "/generate"}
# a body each admin handler refuses (400) or answers harmlessly, so the right key is shown to reach it
HARMLESS_BODY = {"/pause_generation": {"mode": "no-such-mode"}, "/abort_request": {}, "/start_profile": {"num_steps": "x"},
                 "/update_weights_from_tensor": {"load_format": "pickle"}}

WRONG_FORMS = {
    "missing": [],
    "wrong key": [("Authorization", b"Bearer wrong")],
    "no scheme": [("Authorization", KEY.encode())],
    "lowercase bearer": [("Authorization", b"bearer " + KEY.encode())],
    "other scheme": [("Authorization", b"Basic " + base64.b64encode(f"user:{KEY}".encode()))],
    "two spaces": [("Authorization", b"Bearer  " + KEY.encode())],
    "scheme only": [("Authorization", b"Bearer")],
    "key prefix": [("Authorization", b"Bearer " + KEY[:-1].encode())],
    "key plus a byte": [("Authorization", b"Bearer " + KEY.encode() + b"x")],
    "key twice": [("Authorization", f"Bearer {KEY} {KEY}".encode())],
    "two headers, right first": [("Authorization", b"Bearer " + KEY.encode()), ("Authorization", b"Bearer wrong")],
    "two headers, right last": [("Authorization", b"Bearer wrong"), ("Authorization", b"Bearer " + KEY.encode())],
    "other header": [("X-API-Key", KEY.encode()), ("Api-Key", KEY.encode())],
    "query parameter": "?api_key=" + KEY,
    "non-UTF-8 bytes": [("Authorization", b"Bearer " + KEY.encode() + b"\xff\xfe")],
    "non-ASCII": [("Authorization", ("Bearer " + KEY + "\u00e9").encode())],
    "latin-1 key": [("Authorization", b"Bearer \xe9" + KEY.encode())],
}


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", API_KEY_ENV)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _raw(url: str, method: str, path: str, headers=(), body: bytes | None = None):
    """(status, decoded JSON or None): a request with exactly these raw header bytes."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest(method, path)
        for name, value in headers:
            conn.putheader(name, value)
        body = body or b""
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return resp.status, raw.decode(errors="replace")


@pytest.fixture(scope="module")
def cluster(launch_router_cluster):
    args = ServerArgs(model_path="tiny", kernel_backend="reference", num_threads=1, device="cpu", api_key=KEY,
                      max_total_tokens=1024)
    with launch_router_cluster(args) as c:
        yield c


# ---- the key on every admin route -----------------------------------------------------------------


def test_the_admin_route_list_is_the_server_s_own():
    """Every route of the server is public or in ADMIN_ROUTES, so a new admin route joins the test below."""
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.rollout.server import RolloutServer
    from rlperf.rollout.tokenizer import ByteTokenizer

    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    server = RolloutServer(ServerArgs(device="cpu", api_key=KEY, max_total_tokens=1024), model, ByteTokenizer(512))
    routes = {(r.method, r.resource.canonical) for r in server.app.router.routes() if r.method != "HEAD"}
    admin = {rt for rt in routes if rt[1] not in PUBLIC_PATHS}
    assert admin == set(ADMIN_ROUTES), f"classify these routes as public or admin: {admin ^ set(ADMIN_ROUTES)}"


@pytest.mark.parametrize("form", list(WRONG_FORMS))
@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
def test_every_admin_route_refuses_every_wrong_form_of_the_key(cluster, method, path, form):
    url = cluster.worker_urls[0]
    wrong = WRONG_FORMS[form]
    query, headers = (wrong, []) if isinstance(wrong, str) else ("", wrong)
    body = json.dumps(HARMLESS_BODY.get(path, {})).encode()
    status, reply = _raw(url, method, path + query, headers, body)
    assert status == 401, (status, reply)
    assert reply == {"error": {"message": "this endpoint needs the server's API key (Authorization: Bearer <key>)",
                               "code": 401}}


@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
def test_every_admin_route_takes_the_right_key(cluster, method, path):
    url = cluster.worker_urls[0]
    body = json.dumps(HARMLESS_BODY.get(path, {})).encode()
    status, reply = _raw(url, method, path, [("Authorization", f"Bearer {KEY}".encode())], body)
    expected = {"/continue_generation": 200, "/flush_cache": 200, "/profile_trace": 404, "/stop_profile": 400,
                "/weights_checksum": 200}
    assert status == expected.get(path, 400), (status, reply)  # 400: the handler read the body and refused it
    assert http_json(url + "/get_server_info")[1]["internal_states"][0]["paused"] is False


# ---- the router with --api-key ----------------------------------------------------------------------


def test_the_router_control_plane_needs_the_key(cluster):
    router = cluster.router_url
    assert http_json(router + "/workers")[0] == 401
    assert http_json(router + "/workers", headers={"Authorization": "Bearer wrong"})[0] == 401
    status, body = http_json(router + "/workers", headers=AUTH)
    assert status == 200 and {w["url"] for w in body["workers"]} == set(cluster.worker_urls)
    for w in body["workers"]:  # no worker can be removed without the key ...
        for headers in ([], [("Authorization", b"Bearer wrong")]):
            assert _raw(router, "DELETE", f"/workers/{w['id']}", headers)[0] == 401
    assert _raw(router, "POST", "/workers", [], json.dumps({"url": "http://127.0.0.1:9"}).encode())[0] == 401
    status, after = http_json(router + "/workers", headers=AUTH)  # ... nor added
    assert status == 200 and [w["id"] for w in after["workers"]] == [w["id"] for w in body["workers"]]
    assert http_json(router + "/health")[0] == 200  # liveness stays open


def test_the_router_reaches_the_workers_admin_routes_with_the_key(cluster):
    router = cluster.router_url
    assert http_json(router + "/flush_cache", {})[0] == 401
    status, reply = http_json(router + "/flush_cache", {}, headers=AUTH)
    assert status == 200 and reply["workers_flushed"] == len(cluster.worker_urls) == 2, reply
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    assert http_json(router + "/generate", body)[0] == 401  # the router asks for the key on everything
    status, reply = http_json(router + "/generate", body, headers=AUTH)
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 2


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_no_child_has_the_key_on_its_command_line(cluster):
    for proc in cluster.servers + [cluster.router]:
        assert KEY not in " ".join(map(str, proc.args)) and KEY not in _cmdline(proc.pid)
    for proc in cluster.servers:  # it came in the environment, which only the user and root can read
        assert f"{API_KEY_ENV}={KEY}".encode() in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_cli_serve_router_with_a_key_file_shows_the_key_on_no_command_line(tmp_path, free_ports):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    port, router_port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "rlperf", "serve", "--router", "1", "--port", str(port),
                             "--router-port", str(router_port), "--kernel-backend", "reference", "--device", "cpu",
                             "--num-threads", "1", "--max-total-tokens", "1024", "--api-key-file", str(key_file)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    router = f"http://127.0.0.1:{router_port}"
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the CLI says when the cluster is up
            line = pool.submit(proc.stdout.readline).result(timeout=180).decode()
        if "sglang-router at" not in line:  # its first line names what failed; the rest quotes its output
            proc.terminate()
            pytest.fail(line + proc.communicate(timeout=30)[0].decode(errors="replace"))
        kids = _children(proc.pid)
        assert len(kids) == 2  # one server, one router
        for pid in [proc.pid, *kids]:
            assert KEY not in _cmdline(pid), _cmdline(pid)
        assert http_json(router + "/workers")[0] == 401
        assert http_json(router + "/flush_cache", {}, headers=AUTH)[1]["workers_flushed"] == 1
        assert http_json(f"http://127.0.0.1:{port}/flush_cache", {})[0] == 401
        assert http_json(f"http://127.0.0.1:{port}/flush_cache", {}, headers=AUTH)[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert proc.returncode == 0, out


def test_cli_serve_refuses_an_unreadable_key_file(tmp_path, capsys):
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "--api-key-file" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    assert main(["serve", "--api-key-file", str(tmp_path / "empty")]) == 2
    assert "empty" in capsys.readouterr().err


def test_resolve_api_key_takes_the_flag_then_the_file_then_the_environment(tmp_path, monkeypatch):
    from rlperf.rollout.args import resolve_api_key

    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key("from-flag", None) == "from-flag"
    assert resolve_api_key(None, str(key_file)) == KEY
    assert resolve_api_key(None, None) == "from-env"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert resolve_api_key(None, None) is None
    with pytest.raises(ValueError, match="--sglang-api-key and --sglang-api-key-file exclude each other"):
        resolve_api_key("k", str(key_file), "--sglang-api-key")
    with pytest.raises(ValueError, match="--api-key-file .*missing: cannot read the key"):
        resolve_api_key(None, str(tmp_path / "missing"))


# ---- rlperf train against key-protected servers ------------------------------------------------------


def _train_flags(cluster, out):
    port = cluster.router_url.rsplit(":", 1)[1]
    return ["train", "--skip-gates", "--no-progress", "--num-rollout", "1", "--output-dir", str(out),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
            "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", port]


def test_train_refuses_an_unreadable_key_file_before_anything_starts(tmp_path, capsys):
    assert main(["train", "--skip-gates", "--sglang-api-key-file", str(tmp_path / "missing"),
                 "--output-dir", str(tmp_path / "out")]) == 2
    assert "--sglang-api-key-file" in capsys.readouterr().err


def test_train_without_the_key_stops_with_one_line_naming_the_flag(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(_train_flags(cluster, tmp_path / "none")) == 2
    err = capsys.readouterr().err
    assert "401" in err and "--sglang-api-key" in err and API_KEY_ENV in err and "Traceback" not in err, err
    assert main(_train_flags(cluster, tmp_path / "wrong") + ["--sglang-api-key", "wrong"]) == 2
    err = capsys.readouterr().err
    assert "401" in err and "refused" in err and "Traceback" not in err, err


def test_the_gates_run_with_the_key_and_their_reports_do_not_show_it(cluster, tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    port = cluster.router_url.rsplit(":", 1)[1]
    report, junit = tmp_path / "gate.json", tmp_path / "gate.xml"
    code = main(["gate", "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", port, "--sglang-api-key", KEY,
                 "--output-dir", str(tmp_path / "out"), "--report-json", str(report), "--junit-xml", str(junit)])
    assert code in (0, 1) and report.exists() and junit.exists()  # the step ran; verdicts are not this test's
    assert "sglang_router_port" in report.read_text()  # the run's flags are there ...
    for f in (report, junit):
        assert KEY not in f.read_text()  # ... but not the key


def test_train_with_the_key_in_a_file_or_the_environment(cluster, tmp_path, monkeypatch):
    from rlperf.loop import METRICS_FILE

    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(_train_flags(cluster, tmp_path / "file") + ["--sglang-api-key-file", str(key_file)]) == 0
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert main(_train_flags(cluster, tmp_path / "env")) == 0
    for run in ("file", "env"):
        lines = (tmp_path / run / METRICS_FILE).read_text().splitlines()
        assert len(lines) == 1 and json.loads(lines[0])["rollout_id"] == 0
    for url in cluster.worker_urls:  # the runs' weight syncs reached both workers
        assert http_json(url + "/get_weight_version")[1]["weight_version"] == "1"


# ---- shared-memory buckets ----------------------------------------------------------------------------


def _bucket():
    named = {"model.norm.weight": torch.full((64,), 1.0)}
    (bucket,) = flatten_buckets(named)
    return bucket


def _update(url, payload):
    return http_json(url + "/update_weights_from_tensor",
                     {"load_format": "flattened_bucket", "serialized_named_tensors": [payload]}, headers=AUTH)


def test_shm_refuses_a_segment_rlperf_did_not_create_for_the_transfer(cluster):
    url = cluster.worker_urls[1]
    foreign = shared_memory.SharedMemory(create=True, size=256)  # another program's segment, Python's default name
    try:
        foreign.buf[:256] = bytes(range(256))
        payload, handle = bucket_payload(_bucket(), "shm")
        release(handle)
        for name in (foreign.name, "/" + foreign.name, "rlperf_bucket_1_zz", f"../{foreign.name}"):
            payload["transport"]["name"] = name
            status, reply = _update(url, payload)
            assert status == 400 and "must name a segment rlperf created for this transfer" in reply["error"]["message"]
        assert bytes(foreign.buf[:256]) == bytes(range(256))
    finally:
        foreign.close()
        foreign.unlink()


def test_shm_requires_the_checksum_and_a_mismatch_reply_holds_no_hash(cluster):
    url = cluster.worker_urls[1]
    payload, handle = bucket_payload(_bucket(), "shm")
    try:
        no_sum = {**payload, "description": {**payload["description"], "checksum": None}}
        status, reply = _update(url, no_sum)
        assert status == 400 and "no checksum" in reply["error"]["message"], reply
        guess = {**payload, "description": {**payload["description"], "checksum": "0" * 16}}
        status, reply = _update(url, guess)
        assert status == 400 and reply["error"]["message"] == "bucket rejected: checksum mismatch", reply
        assert not re.search(r"[0-9a-fA-F]{8}", json.dumps(reply))
    finally:
        release(handle)
    assert http_json(url + "/get_weight_version")[1]["weight_version"] != "bad"


def test_a_segment_the_server_opened_outlives_the_server(free_ports):
    (port,) = free_ports(1)
    server = subprocess.Popen([sys.executable, "-m", "rlperf", "serve", "--port", str(port), "--kernel-backend",
                               "reference", "--device", "cpu", "--num-threads", "1", "--max-total-tokens", "1024"],
                              env=_env(**{API_KEY_ENV: KEY}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    payload, handle = bucket_payload(_bucket(), "shm")  # this process's segment
    name = payload["transport"]["name"]
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if http_json(url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
            assert server.poll() is None, server.stdout.read().decode(errors="replace")
        status, reply = _update(url, payload)
        assert status == 200 and reply["success"], reply  # the server opened the segment and loaded it
        helpers = _children(server.pid)  # e.g. a resource tracker, which would clean up after the server
        server.send_signal(signal.SIGTERM)
        out = server.communicate(timeout=60)[0].decode(errors="replace")
        for pid in helpers:  # the server's helpers end with it: whatever they clean up is cleaned up now
            while Path(f"/proc/{pid}").exists() and time.time() < deadline:
                time.sleep(0.05)
        assert "leaked shared_memory" not in out, out
        try:
            again = shared_memory.SharedMemory(name=name)  # still there, the bytes unchanged
        except FileNotFoundError:
            pytest.fail(f"the server's exit unlinked {name}, a segment of this process")
        try:
            assert bytes(again.buf[:256]) == _bucket().buffer.numpy().tobytes()
        finally:
            again.close()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        try:
            release(handle)
        except FileNotFoundError:  # unlinked by someone else: the failure above says who
            pass


def _checksum(url):
    status, reply = http_json(url + "/weights_checksum", headers=AUTH)
    assert status == 200, reply
    return reply


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux /dev/shm")
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink to a segment", "dangling symlink", "socket"])
def test_shm_refuses_anything_but_a_regular_file_under_a_bucket_name(cluster, kind, tmp_path):
    """A directory (a 500 before), a FIFO, a link (even to a real segment of the right size) or a socket
    under a bucket's name: 400 naming transport.name and what is there; the weights stay as they were."""
    import socket as socketlib

    url = cluster.worker_urls[0]
    before = _checksum(url)
    payload, handle = bucket_payload(_bucket(), "shm")  # a real segment of this bucket, the link's target
    name = f"rlperf_bucket_{os.getpid()}_{os.urandom(8).hex()}"
    path = os.path.join("/dev/shm", name)
    sock = None
    try:
        if kind == "directory":
            os.mkdir(path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink to a segment":
            os.symlink(os.path.join("/dev/shm", payload["transport"]["name"]), path)
        elif kind == "dangling symlink":
            os.symlink(str(tmp_path / "nothing"), path)
        else:
            sock = socketlib.socket(socketlib.AF_UNIX)
            sock.bind(path)
        status, reply = _update(url, {**payload, "transport": {"kind": "shm", "name": name}})
        what = {"directory": "a directory", "fifo": "a FIFO", "socket": "a socket"}.get(kind, "a symbolic link")
        assert status == 400, reply
        assert reply["error"]["message"].endswith(
            f"transport.name: shared-memory segment {name!r} is not a regular file ({what})"), reply
    finally:
        release(handle)
        if sock is not None:
            sock.close()
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)
    assert _checksum(url) == before
    assert http_json(url + "/health", timeout=10)[0] == 200


# ---- stop conditions: bounded per request (issue #39, 8) ----------------------------------------------


def _generate(url, sampling_params, timeout=120):
    t0 = time.perf_counter()
    status, reply = http_json(url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True, **sampling_params}}, timeout=timeout)
    return status, reply, time.perf_counter() - t0


def test_stop_strings_and_stop_token_ids_are_bounded_and_another_client_is_unaffected(cluster):
    from rlperf.rollout.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    url = cluster.worker_urls[0]
    _generate(url, {})  # warm
    alone = min(_generate(url, {})[2] for _ in range(3))
    over = {
        "75,000 stop strings": ({"stop": [f"s{i:05d}x" for i in range(75_000)]},
                                f"sampling_params.stop holds 75000 strings, more than the limit of {MAX_STOP_STRINGS}"),
        "one string too many": ({"stop": ["z"] * (MAX_STOP_STRINGS + 1)},
                                f"more than the limit of {MAX_STOP_STRINGS}"),
        "one character too many": ({"stop": ["q" * (MAX_STOP_CHARS // 2), "r" * (MAX_STOP_CHARS // 2 + 1)]},
                                   f"sampling_params.stop holds {MAX_STOP_CHARS + 1} characters in all, "
                                   f"more than the limit of {MAX_STOP_CHARS}"),
        "one stop token id too many": ({"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)},
                                       f"sampling_params.stop_token_ids holds {MAX_STOP_TOKEN_IDS + 1} ids, "
                                       f"more than the limit of {MAX_STOP_TOKEN_IDS}"),
    }
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # another client's requests, sent while the over-limit ones arrive, take about their time alone
        others = [pool.submit(_generate, url, {}) for _ in range(3)]
        hostile = {k: [pool.submit(_generate, url, params) for _ in range(2)] for k, (params, _) in over.items()}
        for k, futures in hostile.items():
            for f in futures:
                status, reply, seconds = f.result()
                assert status == 400 and over[k][1] in reply["error"]["message"], (k, reply)
                assert seconds < 10, (k, seconds)
        for f in others:
            status, reply, seconds = f.result()
            assert status == 200 and reply["meta_info"]["completion_tokens"] == 64, reply
            assert seconds < max(10 * alone, alone + 5.0), (seconds, alone)
    # exactly at every limit: served (never-matching stop strings, ids above the vocabulary)
    at_limit = {"stop": ["\x01" * (MAX_STOP_CHARS // MAX_STOP_STRINGS - 1) + chr(0x4e00 + i)
                         for i in range(MAX_STOP_STRINGS)],
                "stop_token_ids": list(range(10**6, 10**6 + MAX_STOP_TOKEN_IDS))}
    assert sum(map(len, at_limit["stop"])) == MAX_STOP_CHARS
    status, reply, seconds = _generate(url, at_limit)
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 64, reply
    assert seconds < max(20 * alone, alone + 10.0), (seconds, alone)
