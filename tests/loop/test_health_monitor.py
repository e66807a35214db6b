"""``HealthMonitor``'s verdict on an engine that fails its ``/health`` probe: a killed engine's socket
resets a moment before its exit can be read, so the probe's failure waits briefly for the exit, which
names the cause ("was killed by SIGKILL"); a frozen engine, which never exits, stays "did not answer"."""
import signal
import socket
import subprocess
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
