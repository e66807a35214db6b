"""``HealthMonitor``'s verdict on an engine that fails its ``/health`` probe: a killed engine's socket
resets a moment before its exit can be read, so the probe's failure waits briefly for the exit, which
names the cause ("was killed by SIGKILL"); a frozen engine, which never exits, stays "did not answer".
A probe under way is waited for, never repeated: whoever asks learns no later than the round under way."""
import http.server
import signal
import socket
import subprocess
import threading
import time
import types

import pytest

from rlperf.loop.config import HealthCheckConfig
from rlperf.loop.health import ENGINE_EXIT_SETTLE_S, HealthMonitor


class _LateExit:
    """A process whose exit shows only once someone waits for it (the kernel's lag after SIGKILL), or
    never (a stopped process)."""

    def __init__(self, exits: bool):
        self.exits, self.returncode, self.waited = exits, None, []

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self.waited.append(timeout)
        if not self.exits:
            raise subprocess.TimeoutExpired("engine", timeout)
        self.returncode = -signal.SIGKILL
        return self.returncode


def _closed_port_url() -> str:
    with socket.socket() as s:  # bound, never listening: a connection is refused at once
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("exits, why", [(True, "was killed by SIGKILL"), (False, "did not answer /health within 2 s")])
def test_a_failed_probe_waits_a_moment_for_the_exit_that_explains_it(exits, why):
    proc = _LateExit(exits)
    fleet = types.SimpleNamespace(worker_urls=[_closed_port_url()],
                                  cluster=types.SimpleNamespace(servers=[proc], router=None))
    monitor = HealthMonitor(fleet, HealthCheckConfig(first_wait=3600.0, timeout=2.0))
    try:
        monitor._probe_engines()
        assert monitor._failed[0].startswith(why), monitor._failed
        assert proc.waited and all(0 <= t <= ENGINE_EXIT_SETTLE_S for t in proc.waited)
    finally:
        monitor.close()


class _Running:
    """A process that runs."""

    returncode = None

    def poll(self):
        return None

    def wait(self, timeout=None):
        raise subprocess.TimeoutExpired("engine", timeout)


def test_asking_while_the_monitor_probes_waits_for_its_answer_not_a_second_timeout():
    """A frozen engine (it takes the connection and never answers) and a healthy one. The monitor's
    round starts at once and times out on the frozen one at ~2 s; a request's failure asks
    (``check_now``) 1 s in: it gets the round's verdict when the round ends, not 1 s + 2 s later, and
    the healthy engine is probed by the asker itself (its probe had ended)."""
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # the kernel completes the connection; nothing ever reads the request

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    healthy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    fleet = types.SimpleNamespace(
        worker_urls=[f"http://127.0.0.1:{frozen.getsockname()[1]}", f"http://127.0.0.1:{healthy.server_address[1]}"],
        cluster=types.SimpleNamespace(servers=[_Running(), _Running()], router=None))
    start = time.monotonic()
    monitor = HealthMonitor(fleet, HealthCheckConfig(first_wait=0.0, interval=3600.0, timeout=2.0))
    try:
        time.sleep(1.0)
        assert 0 in monitor._in_flight  # the monitor's round is waiting on the frozen engine
        monitor.check_now()
        took = time.monotonic() - start
        assert monitor._failed == {0: monitor._failed[0]}, monitor._failed
        assert monitor._failed[0].startswith("did not answer /health within 2 s")
        assert took < 2.0 + 0.2 + 0.8, took  # the round's end (first look 0.2 s + timeout), not 1 s + 2 s
        assert not monitor._in_flight
    finally:
        monitor.close()
        healthy.shutdown()
        frozen.close()
