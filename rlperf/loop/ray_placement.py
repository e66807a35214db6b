"""``--placement ray``: actor ranks and rollout engines as Ray actors on the bundles of one placement group.

The same :class:`rlperf.loop.placement.Placement` interface as ``--placement local`` (the loop never
knows which it runs on), on Ray's own machinery, as slime places its Megatron actors and SGLang
engines (``slime/ray/placement_group.py``):

* **Cluster.** ``--ray-address`` (default: ``RAY_ADDRESS``, else the cluster ``ray start`` started on
  this host when it answers, else a new local Ray instance on this host). Several nodes join one
  cluster with ``ray start --head --num-gpus 8`` on the head and ``ray start --address HEAD:6379
  --num-gpus 8`` on every other node; ``rlperf train --placement ray`` then runs on any node of it
  (or under ``ray job submit``, which sets ``RAY_ADDRESS``).
* **One placement group**, strategy ``PACK``: ``W = --actor-num-nodes x --actor-num-gpus-per-node``
  bundles for the actor ranks plus, with disaggregated engines (``--rollout-num-gpus N`` without
  ``--colocate``), ``N`` bundles for the engines. A bundle is ``{"GPU": 1, "CPU": 1}`` when the
  cluster has GPUs, else ``{"CPU": 1}`` (a CPU cluster runs ``--device cpu``). With ``--colocate``
  the engines are the ranks' in-process engines: they share the actor bundles and the group has no
  bundle of their own. ``--actor-num-nodes`` only multiplies the count, as in slime: ``PACK`` puts the
  bundles on as few nodes as hold them. The bundles are ordered by node, the node of this process
  first and then by IP as slime sorts them, then by bundle index (so rank 0, which writes the metrics
  and checkpoints, runs here when the group has a bundle here, and the ranks of one node are
  consecutive): the first ``W`` go to the ranks in rank order, the rest to the engines.
* **Actor ranks**: one :class:`RankActor` per actor bundle (``PlacementGroupSchedulingStrategy`` with
  its bundle index; one GPU each, so Ray sets its ``CUDA_VISIBLE_DEVICES`` to that GPU alone). Each
  runs ``entry(ns)`` with torchrun's variables set (:data:`rlperf.loop.placement.RANK_ENV`):
  ``MASTER_ADDR`` is rank 0's node IP and ``MASTER_PORT`` a port that was free on that node, so
  ``torch.distributed``'s ``env://`` rendezvous joins the ranks across nodes. A rank sees only its own
  GPU, so its ``LOCAL_RANK`` is 0 and ``LOCAL_WORLD_SIZE`` 1 (the index into the devices it sees).
* **Engines** (disaggregated): one :class:`EngineActor` per engine bundle starts ``rlperf serve`` on
  its node (listening on the node's IP, a free port) as a child that inherits the actor's
  ``CUDA_VISIBLE_DEVICES`` and dies with it; the sglang-router runs in this process in front of them.
  The ranks find it as ``ns.engine_router_url`` (:data:`ENGINE_ROUTER_ATTR`); the loop talks to it as
  to the engines it starts itself (:func:`rlperf.loop.engines.start_engine_fleet`), weights by broadcast.

Bad layouts exit 2 before any actor starts (:class:`rlperf.loop.args.UsageError`): Ray not installed,
a ``--ray-address`` that does not answer within :data:`RAY_CONNECT_TIMEOUT_S`, a layout that needs
more GPUs (or CPUs) than the cluster has (``ray.cluster_resources()``, checked before the placement
group is made, so nothing waits for resources that will never come), ``--device cuda`` on a cluster
without GPUs, and a group that the cluster, busy with other work, does not place within
:data:`PLACEMENT_GROUP_TIMEOUT_S`. :attr:`RayPlacement.slots` keeps where every actor ran (bundle,
node, ``CUDA_VISIBLE_DEVICES``), as reported by the actor itself; it is printed when the actors start.

Ray stays an optional dependency: it is imported only here, and only for ``--placement ray``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import ipaddress
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable

from rlperf.rollout.router import free_port

from .args import UsageError
from .placement import ActorLayout, Placement

RAY_INSTALL_HINT = "install it with `pip install 'ray[default]'` (on every node of the cluster)"
RAY_CONNECT_TIMEOUT_S = 10.0
"""Seconds a ``--ray-address`` may take to accept a TCP connection before the run exits 2 (Ray's own
connect retries for minutes against an address where nothing listens)."""
PLACEMENT_GROUP_TIMEOUT_S = 120.0
"""Seconds the cluster may take to place the group when it has the resources but other work holds
them; then the run exits 2 (it never waits for ever)."""
ENGINE_START_TIMEOUT_S = 900.0
"""Seconds an engine may take to answer ``/health`` (its warm-up compiles kernels on a cold cache)."""
LOG_DRAIN_S = 1.5
"""Seconds the ranks' last output lines get to reach this process before the actors are stopped: Ray's
log monitor forwards the actors' output every 0.1 s, and stopping the actors (or leaving the cluster)
drops what it has not forwarded yet (the last step's summary line, a rank's traceback)."""
ENGINE_ROUTER_ATTR = "engine_router_url"
"""The attribute of the ranks' namespace that names the router in front of the engines this placement
started (``http://IP:PORT``); absent when the ranks start their own engines or have none."""
ENGINE_ACTOR_PREFIX = "rlperf-engine-"
"""Engine actors are named ``ENGINE_ACTOR_PREFIX + "<run token>-<index>"`` in the run's Ray namespace:
rank 0 finds them by name (:meth:`RayEngineFleet.attach`) to watch and replace them."""
ENGINE_CALL_TIMEOUT_S = 30.0
"""Seconds rank 0 waits for an engine actor to kill its server (a dead actor fails at once)."""
FORWARDED_ENV_PREFIXES = ("RLPERF_", "TRITON_")
"""This process's environment variables that reach every actor (a ``ray start`` cluster's workers
inherit the environment of ``ray start``, not of the driver): rlperf's and Triton's switches. The API
key variable is not forwarded (it would show in Ray's dashboard); the key travels in the run's flags."""


def import_ray():
    """The ``ray`` module; :class:`UsageError` naming ``--placement ray`` when it is not installed."""
    try:
        import ray
    except ImportError as exc:
        raise UsageError(f"--placement ray needs Ray, which is not installed ({exc}): {RAY_INSTALL_HINT}") from None
    return ray


# ---- the cluster ------------------------------------------------------------------------------------
def _host_port(address: str, flag: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"{flag} {address}: not HOST:PORT (the head's address, e.g. 10.0.0.1:6379), 'auto' or 'local'")
    return host.strip("[]"), int(port)


def _answers(host: str, port: int, timeout: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout`` s, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def _recorded_address() -> str | None:
    """The address of the last cluster ``ray start`` started or joined on this host (Ray's own record)."""
    try:
        from ray._private.utils import read_ray_address
    except ImportError:  # moved in another Ray version: no record, a local instance
        return None
    try:
        return read_ray_address()
    except OSError:
        return None


def resolve_ray_address(flag_value: str | None, environ=None, timeout: float = RAY_CONNECT_TIMEOUT_S) -> str:
    """What ``ray.init(address=...)`` gets for ``--ray-address flag_value``: ``HOST:PORT`` of a cluster that
    answers, ``"auto"`` for the cluster ``ray start`` recorded on this host once it answers (Ray then also
    picks up that cluster's authentication token, as it does only for a cluster it finds itself), or
    ``"local"`` for a new instance on this host. :class:`UsageError` naming the flag (or
    ``RAY_ADDRESS``) for an address where nothing answers within ``timeout`` s, and for Ray Client
    addresses (``ray://``: the router and the rendezvous need this process on a node of the cluster)."""
    env = os.environ if environ is None else environ
    flag, value = "--ray-address", flag_value
    if value is None and env.get("RAY_ADDRESS"):
        flag, value = "RAY_ADDRESS", env["RAY_ADDRESS"]
    if value == "local":
        return "local"
    if value is not None and value.startswith("ray://"):
        raise UsageError(f"{flag} {value}: Ray Client addresses are not supported: run rlperf on a node of the "
                         f"cluster (or submit it with `ray job submit`) and give the head's HOST:PORT")
    if value is None or value == "auto":
        recorded = _recorded_address()
        if recorded is None:
            if value == "auto":
                raise UsageError("--ray-address auto: no Ray cluster was started on this host (ray start --head); "
                                 "give the head's HOST:PORT, or omit --ray-address for a new local instance")
            return "local"
        why = _answers(*_host_port(recorded, "the address ray start recorded"), timeout)
        if why is None:
            return "auto"
        if value == "auto":
            raise UsageError(f"--ray-address auto: the Ray cluster ray start recorded on this host ({recorded}) does "
                             f"not answer ({why}); `ray start --head` again, or give the head's HOST:PORT")
        print(f"rlperf: --placement ray: the Ray cluster ray start recorded on this host ({recorded}) does not answer "
              f"({why}); starting a new local Ray instance (--ray-address picks another cluster)", file=sys.stderr)
        return "local"
    host, port = _host_port(value, flag)
    why = _answers(host, port, timeout)
    if why is not None:
        raise UsageError(f"{flag} {value}: no Ray cluster answers there ({why}, {timeout:g} s timeout); start one "
                         f"with `ray start --head --port {port}` on {host}, or fix {flag}")
    return value


@dataclasses.dataclass(frozen=True)
class ClusterResources:
    """What a Ray cluster has (``ray.cluster_resources()``, ``ray.nodes()``)."""

    gpus: float
    cpus: float
    nodes: int

    @classmethod
    def read(cls, ray) -> "ClusterResources":
        total = ray.cluster_resources()
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        return cls(float(total.get("GPU", 0)), float(total.get("CPU", 0)), alive)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one actor runs, as the actor itself reports it (:attr:`RayPlacement.slots`)."""

    role: str
    """``actor`` (a trainer rank) or ``engine``."""
    index: int
    """The rank, or the engine's index."""
    bundle: int
    """Its bundle in the placement group."""
    node_id: str
    node_ip: str
    cuda_visible_devices: str | None
    """What Ray set in the actor's environment (its GPU; empty on a CPU bundle)."""
    pid: int

    def describe(self) -> str:
        who = f"actor rank {self.index}" if self.role == "actor" else f"engine {self.index}"
        gpu = f"GPU {self.cuda_visible_devices}" if self.cuda_visible_devices else "no GPU"
        return f"{who:<13} bundle {self.bundle:<3} node {self.node_ip} ({self.node_id[:8]})  {gpu}  pid {self.pid}"


def _where(role: str, index: int, bundle: int) -> Slot:
    import ray

    return Slot(role, index, bundle, ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid())


def _ip_key(ip: str):
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def order_bundles(bundle_nodes: dict[int, str], node_ips: dict[str, str], first_node: str | None) -> list[int]:
    """The bundle indices in slot order: ``first_node``'s bundles first, then by node IP, node id and
    bundle index (ranks on one node take consecutive ranks; rank 0 runs on ``first_node`` when it can)."""
    def key(b):
        node = bundle_nodes[b]
        return node != first_node, _ip_key(node_ips.get(node, "")), node, b

    return sorted(bundle_nodes, key=key)


# ---- the actors ---------------------------------------------------------------------------------------
class RankActor:
    """One actor rank on its bundle (module docstring): runs ``entry(ns)`` with the rank's environment."""

    def __init__(self, rank: int, bundle: int):
        self.rank, self.bundle = rank, bundle

    def __repr__(self) -> str:  # Ray prefixes the actor's output lines with it: "(rank 0 pid=...)"
        return f"rank {self.rank}"

    def where(self) -> Slot:
        return _where("actor", self.rank, self.bundle)

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a port free on it now: rank 0's, where the ranks' process group meets
        (``MASTER_ADDR``, ``MASTER_PORT``)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def run(self, entry: tuple[str, str], ns, env: dict, sys_path: list[str], cwd: str) -> tuple[int, str | None]:
        """``entry(ns)`` (``entry``: module and function name, imported here after the driver's ``sys_path``
        entries this node has are added, as multiprocessing's spawn does) in the driver's ``cwd`` when this
        node has it; ``(exit code, None)``, or ``(1, traceback)`` when it raised."""
        os.environ.update(env)
        if os.path.isdir(cwd):
            os.chdir(cwd)
        sys.path.extend(p for p in sys_path if p not in sys.path and os.path.isdir(p))
        try:
            fn = getattr(importlib.import_module(entry[0]), entry[1])
            return int(fn(ns) or 0), None
        except SystemExit as exc:  # a rank that leaves with a code (its group without the closing barrier)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            return code, None
        except BaseException:  # noqa: BLE001 - RankFailure is one on purpose: report it; the driver stops the others
            return 1, traceback.format_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


class EngineActor:
    """One rollout engine on its bundle: an ``rlperf serve`` child on this node, with this actor's GPU.
    Rank 0 watches it through :class:`RayEngineFleet` (``poll``, ``kill_server``, ``spec``)."""

    def __init__(self, index: int, bundle: int):
        self.index, self.bundle, self.proc = index, bundle, None
        self._spec: dict | None = None
        self._reported = False  # its failure was named by rank 0's health check: not reported again at stop
        self._code: int | None = None  # the exit code of a server that kill_server ended

    def __repr__(self) -> str:
        return f"engine {self.index}"

    def where(self) -> Slot:
        return _where("engine", self.index, self.bundle)

    def start(self, server_args, log_dir: str | None, cwd: str, timeout: float = ENGINE_START_TIMEOUT_S,
              port: int | None = None, log_name: str | None = None) -> str:
        """Start ``rlperf serve`` with ``server_args`` on this node's IP and ``port`` (default a free one); its
        URL once it answers ``/health``. The child inherits ``CUDA_VISIBLE_DEVICES`` and dies with this
        actor. ``log_name``: its log under ``log_dir`` (default ``server-I.log``)."""
        import ray

        from rlperf.rollout.args import server_argv
        from rlperf.rollout.router import child_env, http_json, spawn, wait_until

        if os.path.isdir(cwd):
            os.chdir(cwd)
        ip = ray.util.get_node_ip_address()
        args = dataclasses.replace(server_args, host=ip, port=port or free_port(ip))
        self._spec = {"index": self.index, "bundle": self.bundle, "server_args": server_args, "log_dir": log_dir,
                      "cwd": cwd, "port": args.port, "url": f"http://{ip}:{args.port}",
                      "num_gpus": 1 if ray.get_gpu_ids() else 0}
        log = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            log = os.path.join(log_dir, log_name or f"server-{self.index}.log")
        self.proc = spawn([sys.executable, "-m", "rlperf", "serve", *server_argv(args)],
                          env=child_env(None, args.api_key), log_path=log, die_with_parent=True)
        url = f"http://{ip}:{args.port}"
        wait_until(lambda: http_json(url + "/health", timeout=2)[0] == 200, timeout, f"engine {self.index} {url}",
                   [self.proc])
        return url

    def server_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def spec(self) -> dict:
        """How this engine was started (what a replacement on the same bundle needs), its URL and pid."""
        return {**(self._spec or {}), "pid": self.server_pid()}

    def poll(self) -> int | None:
        """The server's exit code, None while it runs."""
        return self.proc.poll() if self.proc is not None else self._code

    def kill_server(self) -> int | None:
        """Kill the server (SIGKILL, which ends a stopped one too) if it still runs and remove its
        weight-receive files on this node; its exit code. It is not reported again at :meth:`stop` (rank
        0's health check named it)."""
        from rlperf.sync.receiver import remove_segments

        if self.proc is None:
            return self._code
        if self.proc.poll() is None:
            self.proc.kill()
        self._code = self.proc.wait()
        remove_segments(self.proc.pid)
        self._reported = True
        self.proc.output.close()
        self.proc = None  # let go here: a Popen collected while Ray stops this actor prints a traceback
        return self._code

    def stop(self) -> str | None:
        """Stop the server (a stopped one is continued to take its SIGTERM) and remove its weight-receive
        files; its last output when it had exited by itself before (else None)."""
        import signal

        from rlperf.rollout.router import output_tail
        from rlperf.sync.receiver import remove_segments

        if self.proc is None:
            return None
        exited = self.proc.poll()
        report = None
        if exited is not None:
            if not self._reported:
                report = f"exited with {exited}; its last output:" + "".join(
                    f"\n  | {line}" for line in output_tail(self.proc).splitlines())
        else:
            self.proc.terminate()
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it did not stop, kill it
                self.proc.kill()
                self.proc.wait()
        self.proc.output.close()
        remove_segments(self.proc.pid)  # a server killed by SIGKILL leaves its receive files
        self.proc = None
        return report


_REMOTE: dict[type, object] = {}


def _remote(cls):
    """``ray.remote(cls)``, made once per class."""
    if cls not in _REMOTE:
        import ray

        _REMOTE[cls] = ray.remote(cls)
    return _REMOTE[cls]


def _entry_name(entry: Callable) -> tuple[str, str]:
    module, name = getattr(entry, "__module__", None), getattr(entry, "__qualname__", "")
    if not module or module == "__main__" or "." in name or "<" in name:
        raise ValueError(f"--placement ray: the rank entry {entry!r} must be a module-level function of an "
                         f"importable module (it is imported by name in every actor)")
    return module, name


def _bundle_options(pg, bundle: int, num_gpus: int) -> dict:
    """An actor's options for bundle ``bundle`` of placement group ``pg``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return dict(num_cpus=1, num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                     placement_group_bundle_index=bundle),
                runtime_env={"env_vars": forwarded_env()})


def forwarded_env(environ=None) -> dict[str, str]:
    """The variables every actor gets (:data:`FORWARDED_ENV_PREFIXES`, less the API key's)."""
    from rlperf.rollout.args import API_KEY_ENV

    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(FORWARDED_ENV_PREFIXES) and k != API_KEY_ENV}


# ---- the engines, as rank 0 watches them --------------------------------------------------------------
class _RayServer:
    """An :class:`EngineActor`'s ``rlperf serve`` child as :class:`rlperf.loop.health.HealthMonitor` sees a
    process (``pid``, ``poll``, ``kill``, ``wait``, ``returncode``), through calls to the actor. A look
    never blocks: one ``poll`` call is in flight at a time and its answer is read at the next look
    (the monitor looks every 0.2 s). An actor that is gone (its node died, or it was killed) took its
    server with it: ``exit_reason`` says so."""

    def __init__(self, ray, actor, pid: int | None):
        import threading

        self._ray, self.actor, self.pid = ray, actor, pid
        self.returncode: int | None = None
        self.exit_reason: str | None = None
        self._pending = None
        self._lock = threading.Lock()

    def _gone(self, exc: BaseException) -> None:
        self.returncode = -9
        self.exit_reason = f"is gone with its Ray actor ({type(exc).__name__})"

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            if self._pending is None:
                self._pending = self.actor.poll.remote()
            ready, _ = self._ray.wait([self._pending], timeout=0)
            if not ready:
                return None
            ref, self._pending = self._pending, None
            try:
                self.returncode = self._ray.get(ref)
            except self._ray.exceptions.RayError as exc:
                self._gone(exc)
            return self.returncode

    def kill(self) -> None:
        """SIGKILL the server on its node (its receive files removed there)."""
        try:
            code = self._ray.get(self.actor.kill_server.remote(), timeout=ENGINE_CALL_TIMEOUT_S)
        except self._ray.exceptions.RayError as exc:  # the actor is gone, and its server with it
            with self._lock:
                if self.returncode is None:
                    self._gone(exc)
            return
        with self._lock:
            if self.returncode is None:
                self.returncode = code

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("rlperf serve", timeout)
            time.sleep(0.02)
        return self.returncode


@dataclasses.dataclass
class _RayCluster:
    """What :class:`rlperf.loop.health.HealthMonitor` reads of a fleet's processes. The router runs in
    the driver, not here: its liveness is its ``/health`` (the monitor asks it when a request fails)."""

    servers: list
    router: object = None


class RayEngineFleet:
    """The engines ``--placement ray`` started, as rank 0 watches and replaces them: the interface of
    :class:`rlperf.loop.engines.EngineFleet` that :class:`rlperf.loop.health.HealthMonitor` uses, so
    ``--use-fault-tolerance`` (and, without it, the one-line end) treats them as the engines a run starts
    itself. A failed engine's server is killed by its actor (its receive files removed on its node); a
    restart is a **new** :class:`EngineActor` on the same bundle of the placement group (rank 0 runs in a
    bundle of that group), serving on the same node and port, so its URL, which the router and the
    weight-update group know, stays the same. The replacements belong to rank 0 (Ray ends them with it);
    :meth:`close` stops them, and the driver stops the engines it started."""

    def __init__(self, ray, router_url: str, actors: list):
        self._ray, self.router_url = ray, router_url
        specs = ray.get([a.spec.remote() for a in actors])
        self._specs = specs
        self.cluster = _RayCluster([_RayServer(ray, a, sp["pid"]) for a, sp in zip(actors, specs)])
        self.worker_urls = [sp["url"] for sp in specs]
        self.handled: set = set()
        self.restarts = 0
        self._started: list = []  # the replacement actors (rank 0's)

    @classmethod
    def attach(cls, router_url: str, urls: list[str]) -> "RayEngineFleet":
        """The fleet of the engine actors of this Ray job that serve ``urls`` (the router's workers), in
        engine order. :class:`RuntimeError` when one is not found."""
        ray = import_ray()
        names = [n for n in ray.util.list_named_actors() if isinstance(n, str) and n.startswith(ENGINE_ACTOR_PREFIX)]
        actors = [ray.get_actor(n) for n in names]
        specs = ray.get([a.spec.remote() for a in actors])
        mine = sorted((sp["index"], a) for a, sp in zip(actors, specs) if sp.get("url") in set(urls))
        if len(mine) != len(urls):
            raise RuntimeError(f"--placement ray: found {len(mine)} engine actor(s) for the router's {len(urls)} "
                               f"worker(s) {urls}")
        return cls(ray, router_url, [a for _, a in mine])

    def remove_files(self, proc) -> None:
        """A failed engine's receive files go on its own node (:meth:`EngineActor.kill_server`)."""
        proc.kill()

    def restart_engine(self, i: int, timeout: float = ENGINE_START_TIMEOUT_S) -> None:
        """Start engine ``i`` again as a new :class:`EngineActor` on its bundle, node and port (its old
        actor, whose server has exited, is killed); return once it answers ``/health``.
        :class:`rlperf.loop.engines.EngineFleetError` when it does not come up."""
        from .engines import EngineFleetError

        ray, old, spec = self._ray, self.cluster.servers[i], self._specs[i]
        if old.poll() is None:
            raise RuntimeError(f"engine {i} still runs (pid {old.pid})")
        try:
            ray.kill(old.actor)
        except Exception:  # noqa: BLE001 - an actor that is gone already
            pass
        self.restarts += 1
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise EngineFleetError(f"rollout engine {i} cannot be restarted: this rank runs in no placement group")
        actor = _remote(EngineActor).options(**_bundle_options(pg, spec["bundle"], spec["num_gpus"])).remote(
            i, spec["bundle"])
        self._started.append(actor)
        try:
            url = ray.get(actor.start.remote(spec["server_args"], spec["log_dir"], spec["cwd"], timeout,
                                             port=spec["port"], log_name=f"server-{i}.restart-{self.restarts}.log"),
                          timeout=timeout + ENGINE_CALL_TIMEOUT_S)
            new = ray.get(actor.spec.remote(), timeout=ENGINE_CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, RuntimeError, TimeoutError) as exc:
            raise EngineFleetError(f"rollout engine {i} did not restart: {exc}".replace("\n", " ")) from None
        if url != self.worker_urls[i]:
            raise EngineFleetError(f"rollout engine {i} came back at {url}, not at {self.worker_urls[i]}")
        self._specs[i] = new
        self.cluster.servers[i] = _RayServer(ray, actor, new["pid"])

    def close(self) -> None:
        """Kill the engines found failed (the run ends because of one: nothing waits for its graceful
        stop, and the driver does not report it again) and stop the replacements this rank started."""
        ray = self._ray
        for p in self.cluster.servers:
            if p in self.handled and p.poll() is None:
                p.kill()
        failed = any(p in self.handled for p in self.cluster.servers)
        for a in self._started:
            try:
                ray.get(a.kill_server.remote() if failed else a.stop.remote(), timeout=ENGINE_CALL_TIMEOUT_S)
            except ray.exceptions.RayError:
                pass
            ray.kill(a)
        self._started = []


# ---- the placement ------------------------------------------------------------------------------------
def engine_count(ns: argparse.Namespace) -> int:
    """Engines of their own this run needs bundles for: ``--rollout-num-gpus`` without ``--colocate`` (and
    without an external ``--sglang-router-ip``), one GPU each; 0 otherwise."""
    n = ns.rollout_num_gpus
    if n <= 0 or ns.colocate or ns.sglang_router_ip is not None:
        return 0
    return n // max(1, ns.rollout_num_gpus_per_engine)


class RayPlacement(Placement):
    """Actor ranks and engines as Ray actors on one placement group's bundles (module docstring).

    ``address``: ``--ray-address``; ``engines``: bundles for disaggregated engines (:func:`engine_count`);
    ``device``: ``--device`` (``cuda...`` needs a cluster with GPUs)."""

    name = "ray"

    def __init__(self, address: str | None = None, engines: int = 0, device: str = "auto",
                 connect_timeout: float = RAY_CONNECT_TIMEOUT_S,
                 placement_timeout: float = PLACEMENT_GROUP_TIMEOUT_S):
        self.address, self.engines, self.device = address, engines, device
        self.connect_timeout, self.placement_timeout = connect_timeout, placement_timeout
        self.slots: list[Slot] = []
        self.cluster: ClusterResources | None = None
        self.gpu_bundles = False
        self._ray = None
        self._started_ray = False
        self._pg = None
        self._actors: list = []
        self._engines: list = []
        self._router = None
        self._ended_by_rank = False  # a rank ended the run on a failure it named: close kills, not stops

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "RayPlacement":
        return cls(ns.ray_address, engine_count(ns), str(ns.device or "auto"))

    # -- checks --------------------------------------------------------------------------------------
    def connect(self):
        """Join the cluster (once; a process already connected, a test's, keeps its connection)."""
        if self._ray is not None:
            return self._ray
        ray = import_ray()
        if not ray.is_initialized():
            address = resolve_ray_address(self.address, timeout=self.connect_timeout)
            if not _isatty(sys.stderr):
                os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # plain "(rank 0 pid=...)" prefixes in a log file
            kwargs = dict(include_dashboard=False) if address == "local" else {}
            try:
                ray.init(address=address, logging_level="WARNING", **kwargs)
            except (ConnectionError, RuntimeError) as exc:  # it answered TCP but is no Ray it can join
                if address == "local":
                    raise UsageError(f"--placement ray: Ray could not start a local instance ({exc})") from None
                flag = "--ray-address" if self.address else ("RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else
                                                             "the Ray cluster ray start recorded here,")
                chain = f"{exc} {exc.__cause__ or ''}"
                hint = (" It asks for an authentication token: set RAY_AUTH_MODE=token and give this host the "
                        "cluster's token (~/.ray/auth_token, or RAY_AUTH_TOKEN), as Ray's token-auth docs say."
                        if "uthentication" in chain else "")
                raise UsageError(f"{flag} {address}: Ray could not join the cluster ({exc}).{hint}") from None
            self._started_ray = True
        self._ray = ray
        self.cluster = ClusterResources.read(ray)
        return ray

    def bundle_count(self, layout: ActorLayout) -> int:
        return layout.world_size + self.engines

    def check(self, layout: ActorLayout) -> None:
        """Connect and refuse a layout the cluster cannot hold (:class:`UsageError`, nothing started)."""
        self.connect()
        c = self.cluster
        need = self.bundle_count(layout)
        self.gpu_bundles = c.gpus > 0
        ranks = (f"--actor-num-nodes {layout.num_nodes} x --actor-num-gpus-per-node {layout.gpus_per_node} = "
                 f"{layout.world_size} actor rank(s)")
        what = ranks + (f" + --rollout-num-gpus {self.engines} engine(s)" if self.engines else "")
        where = f"the Ray cluster ({c.nodes} node(s), {c.gpus:g} GPU(s), {c.cpus:g} CPU(s))"
        if self.device.startswith("cuda") and not self.gpu_bundles:
            raise UsageError(f"--device {self.device} --placement ray: {where} has no GPUs; start its nodes with "
                             f"`ray start ... --num-gpus N`, or use --device cpu")
        if self.gpu_bundles and need > c.gpus:
            raise UsageError(f"--placement ray: {what} need {need} GPUs, one each, but {where} has {c.gpus:g}; add "
                             f"nodes (ray start --address HEAD:6379 --num-gpus N) or ask for fewer")
        if need > c.cpus:
            raise UsageError(f"--placement ray: {what} need {need} CPUs, one each, but {where} has {c.cpus:g}")

    # -- the placement group -------------------------------------------------------------------------
    def _bundle(self) -> dict:
        return {"GPU": 1, "CPU": 1} if self.gpu_bundles else {"CPU": 1}

    def place_group(self, layout: ActorLayout) -> list[int]:
        """Make the group and wait until it is placed; the bundle indices in slot order."""
        ray = self._ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        n = self.bundle_count(layout)
        self._pg = placement_group([self._bundle() for _ in range(n)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.placement_timeout)
        if not ready:
            free = ray.available_resources()
            remove_placement_group(self._pg)
            self._pg = None
            raise UsageError(f"--placement ray: the Ray cluster did not place {n} bundles of {self._bundle()} within "
                             f"{self.placement_timeout:g} s: other work holds its resources (available now: "
                             f"{free.get('GPU', 0):g} GPU(s), {free.get('CPU', 0):g} CPU(s) of {self.cluster.gpus:g} "
                             f"and {self.cluster.cpus:g})")
        nodes = placement_group_table(self._pg)["bundles_to_node_id"]
        ips = {x["NodeID"]: x["NodeManagerAddress"] for x in ray.nodes()}
        return order_bundles(dict(nodes), ips, ray.get_runtime_context().get_node_id())

    def _options(self, bundle: int) -> dict:
        return _bundle_options(self._pg, bundle, 1 if self.gpu_bundles else 0)

    # -- engines -------------------------------------------------------------------------------------
    def launch_engines(self, server_args, bundles: list[int], log_dir: str | None = None,
                       timeout: float = ENGINE_START_TIMEOUT_S) -> str:
        """Start one engine per bundle of ``bundles`` (:class:`EngineActor`) with ``server_args`` (host and
        port are each engine's own), then the sglang-router here in front of them; the router's URL."""
        ray = self._ray
        from rlperf.rollout.router import start_router_on_free_port

        actor = _remote(EngineActor)
        token = f"{ENGINE_ACTOR_PREFIX}{os.getpid()}-{time.monotonic_ns()}-"
        self._engines = [actor.options(**self._options(b), name=f"{token}{i}").remote(i, b)
                         for i, b in enumerate(bundles)]
        self.slots += ray.get([e.where.remote() for e in self._engines])
        urls = ray.get([e.start.remote(server_args, log_dir, os.getcwd(), timeout) for e in self._engines])
        ip = ray.util.get_node_ip_address()
        self._router, port = start_router_on_free_port(urls, ip, log_dir=log_dir, api_key=server_args.api_key,
                                                       die_with_parent=True)
        return f"http://{ip}:{port}"

    def _engine_server_args(self, ns: argparse.Namespace):
        """The engines' ``rlperf serve`` options: the loop's (:func:`rlperf.loop.engines.engine_server_args`)
        on the device of the bundles."""
        from .args import is_resolved
        from .config import RunConfig
        from .device import kernel_policy, run_device
        from .engines import engine_server_args
        from .resolve import resolve_args

        if not is_resolved(ns):  # rlperf gate hands over its unresolved flags
            ns = resolve_args(copy.copy(ns))
        backend = kernel_policy(ns, run_device(ns)).backend
        args = engine_server_args(RunConfig.from_args(ns), backend)
        gpu = self.gpu_bundles and not self.device.startswith("cpu")
        return dataclasses.replace(args, device="cuda" if gpu else "cpu")

    # -- ranks ---------------------------------------------------------------------------------------
    def launch_actors(self, entry, ns, layout: ActorLayout) -> int:
        """Place the group, start the engines (if the run has its own) and the ``W`` rank actors, run
        ``entry(ns)`` on every rank; 0 when all returned 0, else the first failing rank's code (its error
        on stderr; the other ranks, the engines and the group are stopped either way)."""
        ray = self._ray or self.connect()
        entry_name = _entry_name(entry)
        try:
            self.check(layout)
            order = self.place_group(layout)
            w = layout.world_size
            self.slots = []
            rank_ns = ns
            if self.engines:
                from .engines import LOG_DIR

                out = ns.output_dir
                try:
                    router = self.launch_engines(self._engine_server_args(ns), order[w:],
                                                 os.path.join(os.path.abspath(out), LOG_DIR) if out else None)
                except (ray.exceptions.RayError, RuntimeError, TimeoutError) as exc:  # quoted with its output
                    print(f"rlperf: --placement ray: the rollout engines did not start: {exc}", file=sys.stderr)
                    return 1
                rank_ns = copy.copy(ns)
                setattr(rank_ns, ENGINE_ROUTER_ATTR, router)
            actor = _remote(RankActor)
            self._actors = [actor.options(**self._options(b)).remote(r, b) for r, b in enumerate(order[:w])]
            self.slots = list(ray.get([a.where.remote() for a in self._actors])) + self.slots
            print(self.describe(), file=sys.stderr, flush=True)
            master_addr, master_port = ray.get(self._actors[0].rendezvous_address.remote())
            env = {"WORLD_SIZE": str(w), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
            calls = {a.run.remote(entry_name, rank_ns, {**env, "RANK": str(r)}, list(sys.path), os.getcwd()): r
                     for r, a in enumerate(self._actors)}
            code = self._wait(calls, w)
            self._ended_by_rank = self.rank_said_why  # a rank ended the run on a failure it named
            time.sleep(LOG_DRAIN_S)
            return code
        except ray.exceptions.RayError as exc:  # an actor that could not start or died (its error quoted)
            print(f"rlperf: --placement ray: {exc}", file=sys.stderr)
            return 1
        finally:
            self.close()

    def _wait(self, calls: dict, world_size: int) -> int:
        """Wait for every rank; the first that fails (a code, an error, a dead actor) stops the others."""
        ray = self._ray
        pending = list(calls)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = calls[done[0]]
            try:
                code, error = ray.get(done[0])
            except ray.exceptions.RayError as exc:
                code, error = 1, str(exc)
            if code:
                if error is None:  # the rank returned its code, having said why (one line, with the resume)
                    self.rank_said_why = True
                else:
                    print(f"rlperf: actor rank {rank} of {world_size} failed:\n{error} (the other ranks were "
                          f"stopped)", file=sys.stderr)
                return code if code in (1, 2) else 1
        return 0

    def describe(self) -> str:
        """Where the actors run: one line per slot (the placement group's own record)."""
        nodes = len({s.node_id for s in self.slots})
        head = (f"rlperf: --placement ray: {len(self.slots)} bundle(s) of {self._bundle()} on {nodes} node(s) "
                f"of the Ray cluster")
        return "\n".join([head] + [f"  {s.describe()}" for s in sorted(self.slots, key=lambda s: (s.role, s.index))])

    def close(self) -> None:
        """Stop the router, the engines and the ranks, remove the group, and leave the cluster when this
        placement joined it (idempotent). After a rank ended the run on a failure it named (an engine's,
        say) the router and the engines are killed, not stopped gracefully: the abandoned rollout's
        requests would hold a server's stop 5 s and the router's a second or more (docs/scale-out.md's
        bound on ending the run)."""
        ray = self._ray
        if ray is None:
            return
        abrupt = self._ended_by_rank
        if self._router is not None:
            from rlperf.rollout.router import Cluster

            if abrupt and self._router.poll() is None:
                self._router.kill()
            Cluster([], self._router, [], "").close()
            self._router = None
        stops = []  # every engine asked at once: their stops overlap
        for e in self._engines:
            try:
                stops.append(e.kill_server.remote() if abrupt else e.stop.remote())
            except ray.exceptions.RayError:
                pass  # the actor is gone, and its server with it
        for ref in stops:
            try:
                report = ray.get(ref, timeout=30)
                report = report if isinstance(report, str) else None
                if report:
                    print(f"rlperf: --placement ray: a rollout engine {report}", file=sys.stderr)
            except ray.exceptions.RayError:
                pass  # the actor is gone, and its server with it (it dies with the actor)
        for a in self._actors + self._engines:
            ray.kill(a)
        self._actors, self._engines = [], []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        self._ray = None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
