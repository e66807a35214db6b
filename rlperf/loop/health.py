"""Health checks of the run's own rollout engines (``--rollout-num-gpus``) and what a failure does.

A :class:`HealthMonitor` watches an :class:`rlperf.loop.engines.EngineFleet` (or the engines of
``--placement ray``, :class:`rlperf.loop.ray_placement.RayEngineFleet`) from a daemon thread:

* every 0.2 s it asks each engine process and the router process whether they have exited (a
  ``kill -9`` is seen at once);
* after ``--rollout-health-check-first-wait`` seconds, then every ``--rollout-health-check-interval``
  seconds after the last round of probes ended, it sends ``GET /health`` to every engine in service;
  one that does not answer 200 within ``--rollout-health-check-timeout`` seconds (stopped with
  SIGSTOP, hung, or gone) has failed. The probes run on threads of their own: a probe waiting out its
  timeout never delays the look at the processes, and nothing is added to the timeout (an engine
  whose connection was refused or reset gets :data:`ENGINE_EXIT_SETTLE_S` to show an exit; one that
  timed out is named at once). So an engine stopped at time t is found failed by
  t + max(first wait, interval) + timeout + 0.2 s. A probe under way is never repeated: a client that
  asks at the same moment (:meth:`HealthMonitor.check_now`) waits for its answer, so the bound holds for
  the rollout and the weight sync as well.

The :class:`rlperf.loop.clients.RouterClient` of the fleet asks the monitor (:meth:`HealthMonitor.handle`)
while it waits for a rollout's requests, whenever a request fails, and before each weight sync:

* without ``--use-fault-tolerance`` a failed engine raises :class:`EngineFailure`, a dead router
  :class:`RouterFailure` (both :class:`RolloutProcessFailure`): one line naming the process, which the
  CLI prints with the command that resumes the run. A rollout never waits for a stopped engine longer
  than the first wait plus one interval plus the timeout (and the 0.25 s the rollout takes to look);
  a weight sync neither (:meth:`watch`: the broadcast gives up on an engine found failed while it
  runs); the fleet then kills the failed engine instead of waiting for its graceful stop.
* with it, a failed engine is killed (a stopped one too: its open requests then fail at once), removed
  from the router (``DELETE /workers/{id}``, sglang-router 0.3.2's API; it has no ``/remove_worker``),
  and every request that failed is sent again through the router to the engines left. At the next
  weight sync (:meth:`restart`) the engine is started again on its port, the weight-update group is
  formed anew with every engine, the current weights are broadcast and every engine's checksum is
  checked; then it is added back (``POST /workers``) and the event is reported
  (:meth:`take_events`: engine, reason, seconds out of service). A dead router still ends the run.
  When every engine is out in the middle of a rollout, the client restarts them all at once instead
  (:meth:`rlperf.loop.clients.RouterClient._recover_all`); a restart that fails raises
  :class:`EngineFailure` (one line and the resume command).

An engine whose weight-receiver child died answers ``/health`` with 503 (it could not take the next
sync): it has failed like a dead one, and the client probes every engine before each weight sync. An
engine taken out or restarted has its weight-receive files removed (:func:`rlperf.sync.receiver.remove_segments`).

When the client closes, the engines found failed (:meth:`failed_urls`) are not asked to leave the
weight-update group: a stopped engine would not answer, and the run would wait out the close timeout.
"""
from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time

from rlperf.rollout.router import http_json, wait_until

from .config import HealthCheckConfig

PROCESS_POLL_S = 0.2
"""Seconds between two looks at whether an engine or the router process has exited."""
ENGINE_EXIT_SETTLE_S = 1.0
"""Seconds the engines whose ``/health`` probe was refused or reset get, all together, to show an exit:
as for the router (below), a killed engine's connection resets a moment before ``waitpid`` reports it,
and "was killed by SIGKILL" names the cause better than the reset. A probe that timed out gets none (a
killed engine never leaves a probe waiting): it would only add to the bound on finding a stopped one."""
ROUTER_EXIT_SETTLE_S = 2.0
"""Seconds a router that stopped answering gets to show an exit: a killed process closes its sockets
a moment before ``waitpid`` reports it, and the exit names the cause better than the refused request."""
ROUTER_UPDATE_TIMEOUT_S = 30.0
"""Seconds the router may take to drop or list a worker (it applies both in the background)."""
RESTART_TIMEOUT_S = 900.0
"""Seconds a restarted engine may take to answer ``/health`` (as at the fleet's start)."""


class RolloutProcessFailure(RuntimeError):
    """A process of the rollout (an engine or the router) died or stopped answering; the run ends."""


class EngineFailure(RolloutProcessFailure):
    """A rollout engine died or stopped answering its health check (without ``--use-fault-tolerance``)."""


class RouterFailure(RolloutProcessFailure):
    """The sglang-router process died or stopped answering."""


def exit_reason(returncode: int) -> str:
    """``was killed by SIGKILL`` / ``exited with code 3``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _why(reply) -> str:
    """`` (its message)`` of an error reply (``{"error": {"message": ...}}``), else empty."""
    err = reply.get("error") if isinstance(reply, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
    return f" ({str(msg)[:300]})" if msg else ""


@dataclasses.dataclass
class EngineOutage:
    """An engine taken out of service (``--use-fault-tolerance``)."""

    engine: int
    url: str
    reason: str
    since: float
    """``time.monotonic()`` when it was found failed."""
    out_s: float | None = None
    """Seconds from then until it was back in the router (set by :meth:`HealthMonitor.put_back`)."""


class HealthMonitor:
    """Probes a fleet's engines and router (module docstring); ``headers``: the API key's."""

    def __init__(self, fleet, config: HealthCheckConfig, headers: dict | None = None):
        self.fleet, self.config, self.headers = fleet, config, headers or {}
        self._lock = threading.Lock()
        self._failed: dict[int, str] = {}  # engine -> why, found and not handled yet
        self.out: dict[int, EngineOutage] = {}  # engines taken out of service (fault tolerance)
        self.events: list[EngineOutage] = []  # outages ended since take_events()
        self._router_failure: str | None = None
        self._stop = threading.Event()
        self._next_probe = time.monotonic() + config.first_wait
        self._probing: threading.Thread | None = None  # the round of probes under way (its own thread)
        self._in_flight: set[int] = set()  # engines whose /health probe is under way (anyone's round)
        self._probes_ended = threading.Condition(self._lock)  # notified when a round's probes are recorded
        self._thread = threading.Thread(target=self._watch, name="rlperf-engine-health", daemon=True)
        self._thread.start()

    @property
    def fault_tolerance(self) -> bool:
        return self.config.fault_tolerance

    def engine_name(self, i: int) -> str:
        p = self.fleet.cluster.servers[i]
        return f"rollout engine {i} ({self.fleet.worker_urls[i]}, pid {p.pid})"

    def router_name(self) -> str:
        p = self.fleet.cluster.router
        pid = getattr(p, "pid", None)  # a router in another process's care (--placement ray) has none here
        return f"the sglang-router ({self.fleet.router_url}" + (f", pid {pid})" if pid is not None else ")")

    # ---- finding failures ------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(PROCESS_POLL_S):
            try:
                self._check_processes()
                if (self._probing is None or not self._probing.is_alive()) and time.monotonic() >= self._next_probe:
                    self._probing = threading.Thread(target=self._probe_round, name="rlperf-engine-probes", daemon=True)
                    self._probing.start()
            except Exception as exc:  # noqa: BLE001  (the watch must go on; a failure shows in the next look)
                self._report(exc)

    def _probe_round(self) -> None:
        try:
            self._probe_engines()
        except Exception as exc:  # noqa: BLE001
            self._report(exc)
        finally:
            self._next_probe = time.monotonic() + self.config.interval

    @staticmethod
    def _report(exc: BaseException) -> None:
        print(f"rlperf train: engine health check: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def _check_processes(self) -> None:
        with self._lock:
            for i, p in enumerate(self.fleet.cluster.servers):
                if i not in self.out and i not in self._failed and p.poll() is not None:
                    self._failed[i] = getattr(p, "exit_reason", None) or exit_reason(p.returncode)
            router = self.fleet.cluster.router
            if self._router_failure is None and router is not None and router.poll() is not None:
                self._router_failure = exit_reason(router.returncode)

    def _probe_engines(self) -> None:
        """``GET /health`` of every engine in service at once; one that fails or says nothing within the
        timeout is recorded as failed. An engine whose probe is already under way (the monitor's round,
        when a request's failure or a weight sync asks at the same moment) is not probed again: this
        round waits for that probe's answer instead, so asking never takes longer than the round under
        way, and the bound on finding a stopped engine holds for whoever asks."""
        with self._lock:
            engines = [i for i in range(len(self.fleet.worker_urls)) if i not in self.out and i not in self._failed]
            theirs = [i for i in engines if i in self._in_flight]
            mine = [i for i in engines if i not in self._in_flight]
            self._in_flight.update(mine)
        answers: dict[int, str | None] = {}
        refused: set[int] = set()  # refused or reset, not timed out: the engine may be exiting

        def probe(i):
            try:
                status, reply = http_json(self.fleet.worker_urls[i] + "/health", timeout=self.config.timeout,
                                      headers=self.headers)
                answers[i] = None if status == 200 else f"answered /health with {status}{_why(reply)}"
            except OSError as exc:
                if not (isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError)):
                    refused.add(i)
                answers[i] = f"did not answer /health within {self.config.timeout:g} s ({exc})"
        try:
            threads = [threading.Thread(target=probe, args=(i,), daemon=True) for i in mine]
            deadline = time.monotonic() + self.config.timeout
            for t in threads:
                t.start()
            for t in threads:  # urllib's timeout bounds each socket operation: the round as a whole is bounded here
                t.join(max(0.0, deadline - time.monotonic()) + 0.05)
            # an exit explains a refused or reset probe better; a killed engine's socket can reset before its
            # exit is visible to poll(), so such an engine gets a moment to show it
            settle = time.monotonic() + ENGINE_EXIT_SETTLE_S
            for i in sorted(refused):
                try:
                    self.fleet.cluster.servers[i].wait(timeout=max(0.0, settle - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self._check_processes()
            with self._lock:
                for i in mine:
                    why = answers.get(i, f"did not answer /health within {self.config.timeout:g} s")
                    if why is not None and i not in self._failed and i not in self.out:
                        self._failed[i] = why
        finally:
            with self._lock:
                self._in_flight.difference_update(mine)
                self._probes_ended.notify_all()
        if theirs:  # the other round records its answers before it ends (bounded like this round)
            with self._lock:
                self._probes_ended.wait_for(lambda: not self._in_flight.intersection(theirs),
                                            timeout=self.config.timeout + ENGINE_EXIT_SETTLE_S + 0.1)

    def router_down(self) -> bool:
        """Whether the router does not answer its ``/health`` within the timeout (its process may still run)."""
        try:
            return http_json(self.fleet.router_url + "/health", timeout=self.config.timeout)[0] != 200
        except OSError:
            return True

    def raise_router_down(self, during: str, error: BaseException) -> None:
        """:class:`RouterFailure` for a router that does not answer: its exit (``was killed by
        SIGKILL ...``) if the process ends within :data:`ROUTER_EXIT_SETTLE_S`, else the request's error."""
        router = self.fleet.cluster.router
        deadline = time.monotonic() + ROUTER_EXIT_SETTLE_S
        while router is not None and router.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if router is not None and router.poll() is not None:
            with self._lock:
                if self._router_failure is None:
                    self._router_failure = exit_reason(router.returncode)
            self.handle(during)  # raises, naming the exit
        raise RouterFailure(f"{self.router_name()} does not answer {during} ({error})")

    def found_failed(self) -> dict[str, str]:
        """The engines found failed and not acted on yet, URL -> why: what a weight broadcast under way
        looks at (:class:`rlperf.sync.distributed.WeightBroadcaster`'s ``watch``), so that it gives up on
        an engine that died or stopped in the middle of it instead of waiting out the group's timeout."""
        with self._lock:
            return {self.fleet.worker_urls[i]: why for i, why in sorted(self._failed.items())}

    def check_now(self) -> None:
        """Look at the processes and probe every engine now (a request failed: find out whose fault). An
        engine whose probe is under way in the monitor's round gets that probe's answer, when it comes."""
        self._probe_engines()

    # ---- acting on them --------------------------------------------------------------------------
    def handle(self, during: str) -> list[int]:
        """Act on what was found (module docstring): :class:`RouterFailure` for a dead router;
        :class:`EngineFailure` for a failed engine without fault tolerance; with it, each failed engine
        is taken out (:meth:`take_out`). Returns the engines taken out now."""
        with self._lock:
            router, failed = self._router_failure, dict(self._failed)
        if router is not None:
            self.fleet.handled.add(self.fleet.cluster.router)  # named here: the fleet does not report it again
            raise RouterFailure(f"{self.router_name()} {router} {during}")
        if not failed:
            return []
        if not self.fault_tolerance:
            i, why = sorted(failed.items())[0]
            self.fleet.handled.add(self.fleet.cluster.servers[i])
            raise EngineFailure(f"{self.engine_name(i)} {why} {during}")
        for i, why in sorted(failed.items()):
            self.take_out(i, why, during)
        return sorted(failed)

    def take_out(self, i: int, why: str, during: str) -> None:
        """Kill engine ``i`` (if it still runs), remove it from the router and wait until the router no
        longer lists it."""
        name, url = self.engine_name(i), self.fleet.worker_urls[i]
        since = time.monotonic()
        p = self.fleet.cluster.servers[i]
        if p.poll() is None:
            p.kill()  # SIGKILL also ends a stopped process; its connections close and its requests fail now
        p.wait()
        self.fleet.remove_files(p)  # a killed engine leaves its weight-receive files behind
        self.fleet.handled.add(p)
        self._remove_from_router(url)
        with self._lock:
            self._failed.pop(i, None)
            self.out[i] = EngineOutage(i, url, why, since)
        print(f"rlperf train: {name} {why} {during}: taken out of the router; its samples go to the other engines; "
              f"it is restarted at the next weight sync (--use-fault-tolerance)", file=sys.stderr, flush=True)

    def _router_workers(self) -> list[dict]:
        status, reply = http_json(self.fleet.router_url + "/workers", timeout=self.config.timeout, headers=self.headers)
        if status != 200 or not isinstance(reply, dict):
            raise RouterFailure(f"{self.router_name()} answered GET /workers with {status}: {reply!r}")
        return reply.get("workers") or []

    def _remove_from_router(self, url: str) -> None:
        for w in self._router_workers():
            if w.get("url") == url:
                status, reply = http_json(f"{self.fleet.router_url}/workers/{w['id']}", timeout=self.config.timeout,
                                          headers=self.headers, method="DELETE")
                if status not in (200, 202, 404):
                    raise RouterFailure(f"{self.router_name()} refused to remove {url} ({status}: {reply!r})")
        wait_until(lambda: all(w.get("url") != url for w in self._router_workers()), ROUTER_UPDATE_TIMEOUT_S,
                   f"{self.router_name()} dropping {url}", [p for p in [self.fleet.cluster.router] if p is not None])

    def restart(self, engines: list[int] | None = None) -> list[EngineOutage]:
        """Start every engine taken out (or those of ``engines``) again on its port (this thread must live
        as long as the engines: they die with it) and wait for its ``/health``; the outages, to
        :meth:`put_back` once the engines hold the current weights. A restart that fails raises
        :class:`EngineFailure` (the run ends with one line)."""
        from .engines import EngineFleetError

        outages = [self.out[i] for i in sorted(self.out) if engines is None or i in engines]
        for o in outages:
            try:
                self.fleet.restart_engine(o.engine, RESTART_TIMEOUT_S)
            except EngineFleetError as exc:  # the restart itself failed: the run ends with one line
                p = self.fleet.cluster.servers[o.engine]
                self.fleet.handled.add(p)
                raise EngineFailure(f"{self.engine_name(o.engine)} {o.reason} and could not be restarted "
                                    f"({exc})".replace("\n", " ")) from None
        return outages

    def all_out(self) -> bool:
        """Whether every engine is out of service (taken out, not yet back): nothing can generate."""
        with self._lock:
            return bool(self.fleet.worker_urls) and len(self.out) == len(self.fleet.worker_urls)

    def put_back(self, outages: list[EngineOutage]) -> None:
        """Add the restarted engines back to the router, wait until it lists them, record the events."""
        for o in outages:
            status, reply = http_json(self.fleet.router_url + "/workers", {"url": o.url}, timeout=self.config.timeout,
                                      headers=self.headers)
            if status not in (200, 201, 202):
                raise RouterFailure(f"{self.router_name()} refused to add {o.url} back ({status}: {reply!r})")
        for o in outages:
            wait_until(lambda: any(w.get("url") == o.url for w in self._router_workers()), ROUTER_UPDATE_TIMEOUT_S,
                       f"{self.router_name()} listing {o.url}", [p for p in [self.fleet.cluster.router] if p is not None])
            o.out_s = time.monotonic() - o.since
            with self._lock:
                self.out.pop(o.engine, None)
                self.events.append(o)
            print(f"rlperf train: {self.engine_name(o.engine)} restarted, given the current weights (checksum checked) "
                  f"and back in the router after {o.out_s:.1f} s out", file=sys.stderr, flush=True)

    def take_events(self) -> list[EngineOutage]:
        """The outages that ended since the last call."""
        with self._lock:
            events, self.events = self.events, []
        return events

    def failed_urls(self) -> list[str]:
        """The URLs of the engines found failed or taken out of service (not yet back)."""
        with self._lock:
            return [self.fleet.worker_urls[i] for i in sorted({*self._failed, *self.out})]

    def close(self) -> None:
        self._stop.set()
