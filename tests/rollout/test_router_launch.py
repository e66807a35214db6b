"""A router (or server) that exits while ``rlperf serve --router`` waits for it: the error quotes the
tail of the child's own output, and a router that cannot import a module says what to install."""
import os
import signal
import sys
import textwrap
import urllib.request

import pytest

from rlperf.rollout import router as R
from rlperf.rollout.args import ServerArgs


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_a_router_module_that_is_not_installed_says_what_to_install(monkeypatch, free_ports):
    monkeypatch.setattr(R, "ROUTER_MODULE", "rlperf_no_such_router.launch_router")
    (port,) = free_ports(1)
    with pytest.raises(R.ProcessExited) as info:
        R.start_router(["http://127.0.0.1:1"], "127.0.0.1", port, env=_env(), timeout=30)
    msg = str(info.value)
    assert "exited with 1; its last output:" in msg
    assert "No module named 'rlperf_no_such_router'" in msg  # python's own words, quoted from the child
    assert "pip install sglang-router" in msg and "[serve]" in msg


def test_the_error_quotes_the_last_lines_of_the_router_output(monkeypatch, free_ports, tmp_path):
    # a stand-in router that talks a lot, then fails on a missing dependency
    (tmp_path / "chatty_router.py").write_text(textwrap.dedent("""
        import sys
        for i in range(40):
            print(f"router line {i:02d}", file=sys.stderr if i % 2 else sys.stdout, flush=True)
        import rlperf_missing_dependency
    """))
    monkeypatch.setattr(R, "ROUTER_MODULE", "chatty_router")
    (port,) = free_ports(1)
    with pytest.raises(R.ProcessExited) as info:
        R.start_router(["http://127.0.0.1:1"], "127.0.0.1", port, env=_env(PYTHONPATH=str(tmp_path)), timeout=30)
    msg, tail = str(info.value), info.value.output
    assert len(tail.splitlines()) == R.TAIL_LINES and tail.splitlines()[-1].startswith("ModuleNotFoundError")
    assert "router line 39" in msg and "router line 38" in msg and "router line 10" not in msg
    assert "pip install sglang-router" in msg


def test_a_real_router_that_refuses_its_arguments_shows_why_without_an_install_hint(free_ports, tmp_path):
    pytest.importorskip("sglang_router")
    (port,) = free_ports(1)
    with pytest.raises(R.ProcessExited) as info:
        R.start_router(["http://127.0.0.1:1"], "127.0.0.1", port, policy="no-such-policy", env=_env(),
                       log_dir=str(tmp_path), timeout=30)
    msg = str(info.value)
    assert "exited with 2" in msg and "invalid choice: 'no-such-policy'" in msg
    assert "pip install" not in msg
    assert "invalid choice" in (tmp_path / "router.log").read_text()  # with log_dir the log file is the source


def test_cli_serve_router_reports_the_router_failure_and_stops_its_servers(monkeypatch, free_ports, capsys):
    monkeypatch.setattr(R, "ROUTER_MODULE", "rlperf_no_such_router.launch_router")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port, router_port = free_ports(2)
    args = ServerArgs(kernel_backend="reference", device="cpu", num_threads=1, port=port, max_total_tokens=1024)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert R.serve_cluster(args, 1, router_port, "round_robin") == 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert err.startswith("rlperf serve: sglang-router on port") and "exited with 1" in err, err
    assert "No module named 'rlperf_no_such_router'" in err and "pip install sglang-router" in err
    assert "Traceback (most recent call last)" not in err.split("its last output:")[0]
    with pytest.raises(OSError):  # the server it had started is gone
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_server_that_exits_at_start_is_quoted_too(free_ports, tmp_path):
    (port,) = free_ports(1)
    args = ServerArgs(model_path=str(tmp_path / "missing"), device="cpu", port=port)
    with pytest.raises(R.ProcessExited) as info:
        R.start_servers(args, 1, env=_env(), timeout=60)
    assert "exited with" in str(info.value) and "neither a preset" in str(info.value), str(info.value)
    assert sys.executable in str(info.value)


def _taken_port():
    """A listening socket on a port the OS picked (the caller closes it)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_real_router_on_a_taken_port_says_its_address_is_in_use(tmp_path):
    """The words :func:`start_router_on_free_port` retries on are the router's own."""
    pytest.importorskip("sglang_router")
    sock, port = _taken_port()
    try:
        with pytest.raises(R.ProcessExited) as info:
            R.start_router(["http://127.0.0.1:1"], "127.0.0.1", port, env=_env(), log_dir=str(tmp_path), timeout=30)
    finally:
        sock.close()
    assert R.ADDRESS_IN_USE in info.value.output


def test_a_port_taken_after_its_pick_is_picked_again(monkeypatch, tmp_path):
    """free_port's race (another process binds the port before the router does): the router is started
    again on a new port. A stand-in router answers /workers with the workers it was given and, like
    sglang-router, exits with the OS's words when its port is taken."""
    (tmp_path / "standin_router.py").write_text(textwrap.dedent("""
        import json, sys
        from http.server import BaseHTTPRequestHandler, HTTPServer
        argv = sys.argv[1:]
        host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
        urls = argv[argv.index("--worker-urls") + 1:argv.index("--policy")]
        class Workers(BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"workers": [{"url": u} for u in urls]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *a):
                pass
        try:
            server = HTTPServer((host, port), Workers)
        except OSError as exc:
            print(f"Error starting router: {exc}", flush=True)
            sys.exit(1)
        server.serve_forever()
    """))
    monkeypatch.setattr(R, "ROUTER_MODULE", "standin_router")
    sock, taken = _taken_port()
    picks = iter([taken])
    real = R.free_port
    monkeypatch.setattr(R, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    try:
        router, port = R.start_router_on_free_port(["http://127.0.0.1:1"], "127.0.0.1",
                                                   env=_env(PYTHONPATH=str(tmp_path)), timeout=30)
    finally:
        sock.close()
    try:
        assert port != taken
        status, body = R.http_json(f"http://127.0.0.1:{port}/workers", timeout=5)
        assert status == 200 and body == {"workers": [{"url": "http://127.0.0.1:1"}]}
    finally:
        R._kill([router])


def test_a_router_that_fails_otherwise_is_not_started_again(monkeypatch):
    monkeypatch.setattr(R, "ROUTER_MODULE", "rlperf_no_such_router.launch_router")
    calls = []
    real = R.free_port
    monkeypatch.setattr(R, "free_port", lambda host="127.0.0.1": calls.append(1) or real(host))
    with pytest.raises(R.ProcessExited, match="No module named"):
        R.start_router_on_free_port(["http://127.0.0.1:1"], "127.0.0.1", env=_env(), timeout=30)
    assert len(calls) == 2  # one router port and its metrics port: one attempt


def test_picked_ports_stay_out_of_the_ephemeral_range_and_never_repeat():
    # the rank-0 rendezvous (MASTER_PORT), engines and routers listen on these: a port the OS can hand
    # to an outgoing connection could be taken between the pick and the bind (a Ray cluster opens many)
    low, high = R.listen_port_span()
    assert high <= R.ephemeral_port_low() or (low, high) == R.LISTEN_PORTS  # the whole span only on a host
    # whose ephemeral range starts below 21024 (fewer than 1,024 ports would be left)
    ports = [R.free_port() for _ in range(50)] + R.free_ports(7) + R.free_ports(5, consecutive=True)
    assert len(set(ports)) == len(ports)  # one process never gets one port twice
    assert all(low <= p < high for p in ports)
    assert ports[-5:] == list(range(ports[-5], ports[-5] + 5))


def test_a_port_with_a_listener_is_never_picked():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))  # the OS picks it: outside any span the product draws from
        busy.listen()
        port = busy.getsockname()[1]
        assert not R.port_is_free("127.0.0.1", port)
        with pytest.raises(RuntimeError, match=f"no 1 free TCP ports on 127.0.0.1 in {port}-{port}"):
            R.free_ports(1, span=(port, port + 1))  # a span of the busy port alone: 1,000 draws all fail
