"""Disaggregated rollout engines: ``rlperf serve`` processes on their own GPUs behind the real sglang-router.

With ``--rollout-num-gpus N`` and without ``--colocate``, the loop (trainer rank 0 with several actor
ranks) starts N engines, one GPU each (engine i sees only the i-th GPU after the actor ranks' through
``CUDA_VISIBLE_DEVICES``; the layout is checked before anything starts,
:func:`rlperf.loop.device.resolve_engine_layout`) or, with ``--device cpu``, N plain processes; then the
sglang-router in front of them (:mod:`rlperf.rollout.router`). The loop talks to them as to any router
(:class:`rlperf.loop.clients.RouterClient`: ``/generate`` through the router), and the weights reach
them by broadcast from trainer rank 0 (:mod:`rlperf.sync.distributed`), every engine's checksum
checked at each sync.

The engines serve the trainer's model (``--load``'s, ``--hf-checkpoint``'s or the ``--model`` preset;
the first weight sync replaces whatever they loaded) in the trainer's compute dtype, with its kernel
mode and backend, so a sample's rollout log-probs are the trainer's bits (true on-policy).

Lifetime: :meth:`EngineFleet.close` stops the router, then the engines (the runner calls it when the
run ends or fails; an ``atexit`` hook calls it at the latest). Every child also dies with the thread
that started it (``PR_SET_PDEATHSIG``, Linux), so none outlives a killed trainer. Each child writes
its output to ``OUTPUT_DIR/engines/server-i.log`` and ``router.log``; one that exits while the fleet
starts fails the start with its last lines (:class:`EngineFleetError`), and one that exited during
the run is quoted when the fleet closes.

Shared memory: an engine's weight-receive files (``/dev/shm/rlperf_receive_<pid>_*``, the model's bytes
each, :mod:`rlperf.sync.receiver`) outlive an engine killed by SIGKILL. The fleet removes those of each
engine once it is gone: one taken out or restarted (fault tolerance) and every engine at
:meth:`EngineFleet.close`; an engine's start removes those of any engine whose process no longer exists
(a trainer killed with its engines).
"""
from __future__ import annotations

import atexit
import dataclasses
import sys
from pathlib import Path

from rlperf.rollout.args import ServerArgs, server_argv
from rlperf.rollout.router import (Cluster, child_env, free_port, http_json, output_tail, spawn,
                                   start_router_on_free_port, start_servers, wait_until)
from rlperf.sync.receiver import remove_segments

from . import checkpoint as ckpt
from .config import RunConfig

FLEET_START_TIMEOUT_S = 900.0
"""Seconds an engine may take to answer ``/health``: on a GPU its warm-up compiles the kernels and
captures every CUDA-graph decode size (minutes for a large model on a cold Triton cache)."""
HOST = "127.0.0.1"
LOG_DIR = "engines"
"""The engines' and the router's logs, under ``--output-dir``."""


ENGINE_MEM_FRACTION_STATIC = 0.8
"""A run's engine on a GPU of its own sizes weights + KV cache to this fraction unless
``--sglang-mem-fraction-static`` says otherwise: serve's 0.85 plus decode activations and CUDA-graph
pools would sit at the first-step gate's default 10% headroom, which now checks every engine."""


class EngineFleetError(RuntimeError):
    """An engine or the router did not come up; the message quotes its last output."""


def engine_server_args(config: RunConfig, kernel_backend: str | None) -> ServerArgs:
    """The ``rlperf serve`` options of every engine of a run (``kernel_backend``: the run's resolved
    backend, None for auto); the engines compute in the trainer's precision."""
    m, r = config.model, config.rollout
    model = str(ckpt.model_dir(m.load)) if m.load else (m.hf_checkpoint or m.preset)
    return ServerArgs(
        model_path=model, tokenizer_path=m.hf_checkpoint, host=HOST,
        dtype="bfloat16" if config.train.precision == "bf16" else "float32",
        device="cpu" if r.engine_gpus is None else "cuda",
        kernel_backend=kernel_backend or "auto", mode=config.runtime.mode,
        mem_fraction_static=r.mem_fraction_static if r.mem_fraction_static is not None else ENGINE_MEM_FRACTION_STATIC,
        cuda_graph_max_bs=r.cuda_graph_max_bs, random_seed=config.runtime.seed, api_key=r.api_key,
        num_threads=config.runtime.num_threads or None)


class EngineFleet:
    """N ``rlperf serve`` engines and the sglang-router in front of them (module docstring)."""

    def __init__(self, cluster: Cluster, gpus: list[str] | None, log_dir: Path | None):
        self.cluster, self.gpus, self.log_dir = cluster, gpus, log_dir
        self.args: ServerArgs | None = None  # the engines' options (set by start; restart_engine needs them)
        self.restarts = 0
        self.handled: set = set()  # processes whose failure was already reported (rlperf.loop.health)
        self._closed = False
        atexit.register(self.close)

    @property
    def router_url(self) -> str:
        return self.cluster.router_url

    @property
    def worker_urls(self) -> list[str]:
        return self.cluster.worker_urls

    @property
    def router_port(self) -> int:
        return int(self.router_url.rsplit(":", 1)[1])

    @classmethod
    def start(cls, args: ServerArgs, n: int, gpus: list[str] | None = None, log_dir: str | Path | None = None,
              timeout: float = FLEET_START_TIMEOUT_S, env=None) -> "EngineFleet":
        """Start ``n`` engines with ``args`` (ports picked free; on ``gpus[i]`` when given) and the router;
        return once the router lists them all. :class:`EngineFleetError` (what was started is stopped)
        when one exits or never answers."""
        if gpus is not None and len(gpus) != n:
            raise ValueError(f"{n} engines need {n} GPUs, got {gpus}")
        if log_dir is not None:
            log_dir = Path(log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        envs = [{"CUDA_VISIBLE_DEVICES": g} for g in gpus] if gpus is not None else None
        where = f"GPUs {','.join(gpus)}" if gpus is not None else "CPU"
        try:
            servers, urls = start_servers(args, n, env=env, log_dir=str(log_dir) if log_dir else None,
                                          ports=[free_port(args.host) for _ in range(n)], timeout=timeout,
                                          envs=envs, die_with_parent=True)
        except (RuntimeError, TimeoutError) as exc:
            raise EngineFleetError(f"the {n} rollout engine(s) on {where} did not start: {exc}") from None
        try:
            router, port = start_router_on_free_port(urls, args.host, env=env, api_key=args.api_key,
                                                     log_dir=str(log_dir) if log_dir else None, die_with_parent=True)
        except BaseException as exc:
            Cluster(servers, None, urls, "").close()
            if isinstance(exc, (RuntimeError, TimeoutError)):
                raise EngineFleetError(f"the sglang-router in front of the rollout engines did not start: {exc}") from None
            raise
        fleet = cls(Cluster(servers, router, urls, f"http://{args.host}:{port}"), gpus, log_dir)
        fleet.args = args
        return fleet

    def restart_engine(self, i: int, timeout: float = FLEET_START_TIMEOUT_S) -> None:
        """Start engine ``i`` again (its process has exited) on its port and GPU, its output appended to
        its log; return once it answers ``/health``. Call it from the thread the fleet started in (the
        child dies with that thread). :class:`EngineFleetError` when it does not come up."""
        old = self.cluster.servers[i]
        if old.poll() is None:
            raise RuntimeError(f"engine {i} still runs (pid {old.pid})")
        if getattr(old, "output", None) is not None:
            old.output.close()
        remove_segments(old.pid)
        url = self.worker_urls[i]
        port = int(url.rsplit(":", 1)[1])
        self.restarts += 1
        log = str(self.log_dir / f"server-{i}.restart-{self.restarts}.log") if self.log_dir else None
        env = child_env(None, self.args.api_key)
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[i]
        proc = spawn([sys.executable, "-m", "rlperf", "serve", *server_argv(dataclasses.replace(self.args, port=port))],
                     env=env, log_path=log, die_with_parent=True)
        self.cluster.servers[i] = proc
        try:
            wait_until(lambda: http_json(url + "/health", timeout=2)[0] == 200, timeout, f"engine {i} at {url}", [proc])
        except (RuntimeError, TimeoutError) as exc:
            raise EngineFleetError(f"rollout engine {i} did not restart: {exc}") from None

    def remove_files(self, proc) -> None:
        """Remove what engine process ``proc`` left behind once it is gone (its weight-receive files)."""
        remove_segments(proc.pid)

    def exited(self) -> list[str]:
        """Each process of the fleet that has exited, with its exit code and last output."""
        named = [(f"rollout engine {i} ({url}, pid {p.pid})", p)
                 for i, (url, p) in enumerate(zip(self.worker_urls, self.cluster.servers))]
        if self.cluster.router:
            named.append((f"the sglang-router ({self.router_url}, pid {self.cluster.router.pid})", self.cluster.router))
        out = []
        for name, p in named:
            if p.poll() is not None and p not in self.handled:
                tail = output_tail(p)
                out.append(f"{name} exited with {p.returncode}; its last output:"
                           + "".join(f"\n  | {line}" for line in tail.splitlines()))
        return out

    def close(self) -> None:
        """Stop the router and the engines (idempotent). An engine that had exited by itself is reported
        on stderr with its last output. When an engine was found failed (:mod:`rlperf.loop.health`: the
        run ends because of it) every process of the fleet is killed instead of stopped gracefully: a
        server's stop gives the requests in flight (the abandoned rollout's) 5 s, a stopped server's
        too, and the router's takes a second, several on a loaded 2-core machine; the run would add them
        to the bound on naming the engine (docs/scale-out.md). The fleet removes the engines' files
        either way, and their weight receivers exit within a second of their engine."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for report in self.exited():
            print(f"rlperf train: {report}", file=sys.stderr)
        if any(p in self.handled for p in self.cluster.servers):
            procs = [p for p in [*self.cluster.servers, self.cluster.router] if p is not None and p.poll() is None]
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
        self.cluster.close()
        for p in self.cluster.servers:  # all have ended: a killed one's receive files are still there
            remove_segments(p.pid)

    def __enter__(self) -> "EngineFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_engine_fleet(config: RunConfig, kernel_backend: str | None) -> EngineFleet:
    """The disaggregated engines of a run (``--rollout-num-gpus``): its :class:`EngineFleet` of
    ``config.rollout.num_engines`` engines on ``config.rollout.engine_gpus`` (or CPU processes), logs
    under ``--output-dir``. The client on its router is :func:`rlperf.loop.clients.client_for`'s."""
    r = config.rollout
    args = engine_server_args(config, kernel_backend)
    gpus = list(r.engine_gpus) if r.engine_gpus is not None else None
    where = f"GPUs {','.join(gpus)}" if gpus is not None else "CPU"
    log_dir = Path(config.telemetry.output_dir) / LOG_DIR
    print(f"rlperf train: starting {r.num_engines} rollout engine(s) ({args.model_path}, {args.dtype}) on {where} "
          f"behind the sglang-router; logs in {log_dir}", file=sys.stderr, flush=True)
    return EngineFleet.start(args, r.num_engines, gpus, log_dir)
