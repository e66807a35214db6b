"""``rlperf serve --router N``: N rollout servers behind the real ``sglang-router``.

Each server is a subprocess ``python -m rlperf serve --port PORT+i ...``; once every one answers
``GET /health``, the router starts with ``sglang_router.launch_router``'s arguments (``--worker-urls
...``: the workers are registered at start) and the cluster is ready when the router's ``GET /workers``
lists all N. Closing the cluster terminates the router, then the servers.

With an API key, every child gets it in its environment (:data:`API_KEY_ENV`), never on its command
line, which ``ps`` shows to every user of the host: the servers read the variable, and the router runs
through :data:`ROUTER_BOOTSTRAP`, which parses the router's own arguments, sets the key as its
``api_key`` and starts it, as ``--api-key`` would. The router then asks for the key on everything but
its health and info routes (``/generate``, ``GET /workers``, ``DELETE /workers/{id}``,
``/flush_cache``, ...) and sends it to the workers, so its ``/flush_cache`` reaches their admin routes.

Each child writes its stdout and stderr to a file (``log_dir``'s ``server-i.log`` / ``router.log``,
else an anonymous temporary file), never to a pipe nobody reads; when a child exits while we wait
for it, the error quotes the last lines of its own output (:class:`ProcessExited`), and a router
that cannot import a module says what to install.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from .args import API_KEY_ENV, ServerArgs, server_argv

ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_BOOTSTRAP = f"""\
import importlib, os, sys
module = importlib.import_module(sys.argv[1])  # sglang_router.launch_router
sys.argv = sys.argv[1:]
args = module.parse_router_args(sys.argv[1:])
args.api_key = os.environ.pop({API_KEY_ENV!r}, None) or args.api_key
module.launch_router(args)
"""
"""``python -c ROUTER_BOOTSTRAP MODULE ARGS...``: ``python -m MODULE ARGS...`` (the module's own
``main``), but with the API key from the environment rather than from ``--api-key`` on argv."""
ROUTER_INSTALL_HINT = ("sglang-router is missing or incomplete: install it with `pip install sglang-router` "
                       "(or install rlperf with its serve extra, `pip install -e \".[serve]\"` in a checkout)")
_IMPORT_FAILED = re.compile(r"\b(ModuleNotFoundError|ImportError)\b|No module named")
TAIL_LINES = 20


def http_json(url: str, body=None, timeout: float = 30.0, headers: dict | None = None, method: str | None = None):
    """(status, decoded JSON or text) of a GET (``body`` None) or a JSON POST (``method``: another verb,
    e.g. DELETE); never raises on 4xx/5xx."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


LISTEN_PORTS = (20000, 32768)
"""Where :func:`free_ports` picks (low inclusive, high exclusive): above Ray's worker ports (10002-19999
by default) and below the ephemeral range the OS hands to ``bind(port 0)`` and to every outgoing
connection (32768-60999 on Linux). A port picked there cannot be taken between the pick and the
server's bind by a client socket or an OS-picked port (a Ray cluster opens many); only another explicit
listener could, and the pick is random over 12,768 ports."""


def ephemeral_port_low() -> int:
    """The first port of this host's ephemeral range (Linux ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return LISTEN_PORTS[1]


def listen_port_span() -> tuple[int, int]:
    """``(low, high)``: :data:`LISTEN_PORTS` cut at this host's ephemeral range; the whole of it when the
    ephemeral range starts so low that fewer than 1,024 ports would be left."""
    low, high = LISTEN_PORTS[0], min(LISTEN_PORTS[1], ephemeral_port_low())
    return (low, high) if high - low >= 1024 else LISTEN_PORTS


def port_is_free(host: str, port: int) -> bool:
    """True when a TCP socket can bind ``(host, port)`` and the wildcard address at ``port`` now (no
    listener on any of the host's IPv4 addresses, no connection in TIME_WAIT): a server that listens on
    every address (``torch.distributed``'s TCPStore does) can take it too."""
    for address in dict.fromkeys((host, "")):
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


_PORT_DRAW = random.Random()  # its own generator: callers (tests, seeded runs) seed the global one
_PORTS_GIVEN: set[int] = set()  # never the same port twice from one process


def free_ports(n: int, host: str = "127.0.0.1", consecutive: bool = False,
               span: tuple[int, int] | None = None) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` a moment ago, drawn at random from ``span`` (default
    :func:`listen_port_span`) and never one this process was given before; ``consecutive``: n ports in
    a row (``rlperf serve --router N --port P`` gives its servers P .. P+N-1). Raises ``RuntimeError``
    when 1,000 draws find none."""
    low, high = span or listen_port_span()
    ports: list[int] = []
    for _ in range(1000):
        if consecutive:
            start = _PORT_DRAW.randrange(low, high - n)
            ports = list(range(start, start + n))
            if _PORTS_GIVEN.isdisjoint(ports) and all(port_is_free(host, p) for p in ports):
                break
        else:
            port = _PORT_DRAW.randrange(low, high)
            if port not in ports and port not in _PORTS_GIVEN and port_is_free(host, port):
                ports.append(port)
                if len(ports) == n:
                    break
    else:
        raise RuntimeError(f"no {n} free TCP ports on {host} in {low}-{high - 1}")
    _PORTS_GIVEN.update(ports)
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` a moment ago, outside the ephemeral range (:func:`free_ports`)."""
    return free_ports(1, host)[0]


class ProcessExited(RuntimeError):
    """A child exited while we waited for it; ``output`` is the tail of its stdout and stderr."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


def _die_with_parent():
    """A ``preexec_fn`` (Linux): the child gets SIGKILL when the thread that started it dies, whatever
    way it dies (``kill -9`` included), so no child outlives it. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    parent = os.getpid()

    def set_pdeathsig():
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent was already gone before the call
            os._exit(1)
    return set_pdeathsig


def spawn(cmd: list[str], env=None, log_path: str | None = None, die_with_parent: bool = False) -> subprocess.Popen:
    """Start ``cmd`` with stdout and stderr into ``log_path`` (else an anonymous temporary file),
    kept open as ``proc.output`` so :func:`output_tail` can quote it later. ``die_with_parent``
    (Linux): the child is killed when the thread that started it dies (start it from a thread that
    lives as long as the child should, e.g. the main thread)."""
    out = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent() if die_with_parent else None)
    except BaseException:
        out.close()
        raise
    proc.output = out
    return proc


def output_tail(proc: subprocess.Popen, lines: int = TAIL_LINES, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines a :func:`spawn` child wrote (read without moving its file offset)."""
    out = getattr(proc, "output", None)
    if out is None or out.closed:
        return ""
    fd = out.fileno()
    size = os.fstat(fd).st_size
    data = os.pread(fd, min(size, max_bytes), max(0, size - max_bytes))
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _quote(output: str) -> str:
    return "".join(f"\n  | {line}" for line in output.splitlines()) if output.strip() else " (no output)"


def describe(proc: subprocess.Popen) -> list[str]:
    """The first words of a child's command line (the router's bootstrap shown as ``-m MODULE``)."""
    args = [str(a) for a in proc.args]
    if args[1:3] == ["-c", ROUTER_BOOTSTRAP]:
        args[1:3] = ["-m"]
    return args[:4]


def wait_until(check, timeout: float, what: str, procs=()) -> None:
    """Poll ``check()`` until true; :class:`ProcessExited` (with its output's tail) if one of ``procs`` exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            if p.poll() is not None:
                tail = output_tail(p)
                raise ProcessExited(f"{what}: process {describe(p)} exited with {p.returncode}; its last output:"
                                    + _quote(tail), tail)
        try:
            if check():
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    tails = "".join(f"\nlast output of {describe(p)}:" + _quote(output_tail(p)) for p in procs if getattr(p, "output", None))
    raise TimeoutError(f"{what}: not ready after {timeout:.0f} s" + tails)


@dataclasses.dataclass
class Cluster:
    servers: list[subprocess.Popen]
    router: subprocess.Popen | None
    worker_urls: list[str]
    router_url: str

    def close(self) -> None:
        for p in ([self.router] if self.router else []) + self.servers:
            if p.poll() is None:
                p.terminate()
                p.send_signal(signal.SIGCONT)  # a stopped process (SIGSTOP) handles its SIGTERM only once continued
        for p in ([self.router] if self.router else []) + self.servers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            _close_output(p)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_output(proc: subprocess.Popen) -> None:
    out = getattr(proc, "output", None)
    if out is not None:
        out.close()


def _kill(procs) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
        _close_output(p)


def child_env(env, api_key: str | None) -> dict:
    """``env`` (default: this process's) with :data:`API_KEY_ENV` set to ``api_key``, or removed without one."""
    env = dict(os.environ if env is None else env)
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    return env


def start_servers(args: ServerArgs, n: int, env=None, log_dir: str | None = None, ports: list[int] | None = None,
                  timeout: float = 120.0, envs: list[dict] | None = None,
                  die_with_parent: bool = False) -> tuple[list[subprocess.Popen], list[str]]:
    """Start ``n`` servers on ``ports`` (default ``args.port + i``); return them once all answer /health.
    ``args.api_key`` reaches them in their environment, not their argv. ``envs``: per-server additions
    to the environment (``CUDA_VISIBLE_DEVICES`` of each); ``die_with_parent``: :func:`spawn`'s."""
    procs, urls = [], []
    ports = ports or [args.port + i for i in range(n)]
    env = child_env(env, args.api_key)
    try:
        for i in range(n):
            a = dataclasses.replace(args, port=ports[i])
            log = os.path.join(log_dir, f"server-{i}.log") if log_dir else None
            procs.append(spawn([sys.executable, "-m", "rlperf", "serve", *server_argv(a)],
                               env={**env, **envs[i]} if envs else env, log_path=log, die_with_parent=die_with_parent))
            urls.append(f"http://{args.host}:{a.port}")
        for url in urls:
            wait_until(lambda: http_json(url + "/health", timeout=2)[0] == 200, timeout, f"server {url}", procs)
    except BaseException:
        _kill(procs)
        raise
    return procs, urls


def start_router(worker_urls: list[str], host: str, port: int, policy: str = "round_robin", env=None,
                 log_dir: str | None = None, timeout: float = 60.0, api_key: str | None = None,
                 die_with_parent: bool = False) -> subprocess.Popen:
    """Start sglang-router with ``worker_urls``; return it once ``GET /workers`` lists them all.
    ``api_key``: the router's ``api_key`` (module docstring), passed in its environment;
    ``die_with_parent``: :func:`spawn`'s."""
    # the router also serves Prometheus metrics, on a fixed default port unless told: give it a free one
    # so two clusters (or another program) on one host do not collide
    cmd = [sys.executable, "-c", ROUTER_BOOTSTRAP, ROUTER_MODULE, "--host", host, "--port", str(port),
           "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn",
           "--prometheus-host", host, "--prometheus-port", str(free_port(host))]
    proc = spawn(cmd, env=child_env(env, api_key), log_path=os.path.join(log_dir, "router.log") if log_dir else None,
                 die_with_parent=die_with_parent)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None

    def registered():
        status, body = http_json(f"http://{host}:{port}/workers", timeout=2, headers=auth)
        urls = {w.get("url") for w in body.get("workers", [])} if status == 200 and isinstance(body, dict) else set()
        return set(worker_urls) <= urls

    try:
        wait_until(registered, timeout, f"sglang-router on port {port}", [proc])
    except ProcessExited as exc:
        _kill([proc])
        if _IMPORT_FAILED.search(exc.output):
            raise ProcessExited(f"{exc}\n{ROUTER_INSTALL_HINT}", exc.output) from None
        raise
    except BaseException:
        _kill([proc])
        raise
    return proc


ADDRESS_IN_USE = "Address already in use"
"""What the router prints (the OS's words) when a port it was given is taken."""
PORT_ATTEMPTS = 3


def start_router_on_free_port(worker_urls: list[str], host: str, **kwargs) -> tuple[subprocess.Popen, int]:
    """:func:`start_router` on a port :func:`free_port` picks; ``(router, port)``. A free port can be
    taken by another process between the pick and the router's bind (many clusters starting at once on
    one host): a router that exits saying its address is in use is started again on new ports, at most
    :data:`PORT_ATTEMPTS` times in all; any other failure is raised at once."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port(host)
        try:
            return start_router(worker_urls, host, port, **kwargs), port
        except ProcessExited as exc:
            if ADDRESS_IN_USE not in exc.output or attempt == PORT_ATTEMPTS:
                raise


def launch_cluster(args: ServerArgs, n: int, router_port: int, policy: str = "round_robin", env=None,
                   log_dir: str | None = None, ports: list[int] | None = None) -> Cluster:
    servers, urls = start_servers(args, n, env=env, log_dir=log_dir, ports=ports)
    try:
        router = start_router(urls, args.host, router_port, policy, env=env, log_dir=log_dir, api_key=args.api_key)
    except BaseException:
        _kill(servers)
        raise
    return Cluster(servers, router, urls, f"http://{args.host}:{router_port}")


def serve_cluster(args: ServerArgs, n: int, router_port: int, policy: str) -> int:
    """Run N servers and the router until interrupted (``rlperf serve --router N``)."""
    def interrupt(signum, frame):  # SIGTERM ends the cluster like Ctrl-C: children are terminated, not orphaned
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        cluster = launch_cluster(args, n, router_port, policy)  # cleans up after itself when interrupted
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError) as exc:  # a child exited or never came up: its output says why
        print(f"rlperf serve: {exc}", file=sys.stderr)
        return 1
    print(f"rlperf serve: sglang-router at {cluster.router_url} in front of {', '.join(cluster.worker_urls)}", flush=True)
    try:
        while all(p.poll() is None for p in cluster.servers + [cluster.router]):
            time.sleep(1.0)
        for p in cluster.servers + [cluster.router]:
            if p.poll() is not None:
                print(f"rlperf serve: process {describe(p)} exited with {p.returncode}; its last output:"
                      + _quote(output_tail(p)), file=sys.stderr)
        print("rlperf serve: a server or the router exited; shutting the rest down", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.close()
