"""The seam between the loop and its rollout engines: one protocol, :class:`RolloutClient`, and the
factory that picks its implementation from the configuration (:func:`client_for`).

Every client has ``generate(prompts, params) -> list[GenerationResult]`` (one typed result per prompt,
:class:`rlperf.rollout.engine.GenerationResult`), ``load_weights(named_tensors, version) -> SyncStats``
(``named_tensors``: ``(HF name, tensor)`` pairs, possibly an iterator that gathers them as it goes;
the engines hold version ``version`` afterwards), ``weights_checksum()`` (of the weights the engines
hold, :func:`rlperf.sync.weights_checksum` at ``SYNC_BUCKET_BYTES``; None on a data-parallel rank
other than 0) and ``close()``. Implementations:

* :class:`EngineClient` — an in-process :class:`rlperf.rollout.engine.Engine` (the default when no
  ``--sglang-router-ip`` is given, e.g. the embedded CPU run): the engine ``rlperf serve`` runs, in the
  trainer's compute dtype (bf16 on CUDA), with CUDA-graph decode up to serve's default batch size
  (:func:`rlperf.rollout.cuda_graph.default_max_bs`) and CUDA-graph prefill steps up to serve's default
  token count (:func:`rlperf.rollout.cuda_graph.default_max_prefill_tokens`); ``--sglang-cuda-graph-max-bs 0``
  keeps both eager (the debuggable path); on CPU it is eager. Its weights (:data:`ENGINE_WEIGHTS`):

  - ``buckets`` (``--engine-weights buckets``) — the engine runs its **own copy** of the model; weight
    sync is :func:`rlperf.sync.sync_weights`: on CPU through the path a server takes
    (``flatten_buckets`` -> a shared-memory bucket payload -> ``receive_bucket``, which checks sizes and
    checksum -> ``load_bucket`` into the engine's model); on one GPU the buckets are loaded directly
    (one copy launch per bucket).
  - ``shared`` (``--engine-weights shared``) — the engine runs on the trainer's compute weights
    themselves (no copy, no second set of weights in memory): the trainer updates them in place after
    each optimizer step (CUDA graphs captured on them stay valid), and weight sync only checks that the
    engine still holds those very tensors. Sync mode only: in ``--async`` the rollout would read
    weights mid-update.
  - ``copy`` — the engine runs on the model it is given (a data-parallel rank's full copy), and each
    tensor is copied into it as the iterator yields it (the FSDP shards gathered bucket by bucket).

  Then the KV cache is flushed.
* :class:`RouterClient` — ``POST /generate`` through a running sglang-router, one request per
  sample; weight sync pauses every worker the router lists (``/pause_generation``), pushes the
  buckets to each (:func:`push_weights`, ``/update_weights_from_tensor``), flushes their caches and
  continues them. The router answers 404 for those admin endpoints (docs/ARCHITECTURE.md, "Measured
  facts"), so the client finds the workers with ``GET /workers`` and calls them directly. With
  an API key (``--sglang-api-key``, ``--sglang-api-key-file`` or ``RLPERF_API_KEY``) every request,
  to the router and to the workers, carries ``Authorization: Bearer <key>``; a 401 is a
  :class:`ServerAuthError` that says how to pass the key. With ``distributed=True`` (disaggregated
  engines on their own GPUs, :mod:`rlperf.loop.engines`) the weights go by broadcast instead:
  :class:`rlperf.sync.distributed.WeightBroadcaster` forms one process group with the workers at the
  first sync (SGLang's ``/init_weights_update_group``), pauses them, broadcasts bucket by bucket as the
  iterator yields the tensors (``/update_weights_from_distributed``), checks every worker's
  ``weights_checksum`` against the trainer's and continues them; :meth:`RouterClient.close` leaves the
  group.
* On several data-parallel ranks the wrappers of :mod:`rlperf.loop.data_parallel` (each rank's engine,
  or rank 0's engines) implement the same protocol: the loop calls the same methods on every layout.

Bucket sizes and transports are :class:`rlperf.sync.SyncConfig`'s.
"""
from __future__ import annotations

import copy
import itertools
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

from rlperf.model.moe import decode_routed_experts
from rlperf.rollout.args import API_KEY_ENV
from rlperf.rollout.cuda_graph import default_max_bs, default_max_prefill_tokens
from rlperf.rollout.engine import Engine, EngineConfig, GenerationResult, SamplingParams
from rlperf.rollout.router import http_json
from rlperf.sync import (SYNC_BUCKET_BYTES, SyncConfig, SyncStats, bucket_payload, flatten_buckets, release,
                         sync_weights, weights_checksum)
from rlperf.sync.distributed import WeightBroadcaster, WeightSyncError

from .config import RunConfig
from .data_parallel import DataParallelEngineClient, Rank0EnginesClient
from .engines import HOST, start_engine_fleet
from .health import EngineFailure, HealthMonitor
from .record import EngineMemory
from .sglang_engines import SGLangBroadcaster, push_tensors_to_sglang, start_sglang_fleet

TRAIN_MEM_FRACTION_STATIC = 0.3
"""The in-process engine shares the device with the trainer (weights, grads, AdamW state,
activations): its KV cache may fill device memory up to this fraction (a server's default, 0.85,
left the trainer too little at qwen3-0.6b: the oom_headroom gate failed at 96% of the card)."""
ENGINE_WEIGHTS = ("buckets", "shared", "copy")
"""How an :class:`EngineClient` holds and loads its weights (module docstring)."""


def client_for(config: RunConfig, model, tokenizer, *, kv_tokens: int | None = None, kernel_backend: str | None = None,
               rank: int = 0, world_size: int = 1):
    """The run's :class:`RolloutClient`, chosen by ``config.rollout.engine``, and the
    :class:`rlperf.loop.engines.EngineFleet` it started (None when it started none).

    * ``--rollout-backend sglang`` — a :class:`SGLangClient` on real SGLang engines the run starts
      (:func:`sglang_client_for`, :mod:`rlperf.loop.sglang_engines`); on several ranks rank 0 starts
      them and holds that client, and every rank gets a :class:`rlperf.loop.data_parallel.Rank0EnginesClient`
      around it (None on the others), as for ``disaggregated`` below;

    * ``router`` — a :class:`RouterClient` on ``--sglang-router-ip:--sglang-router-port``;
    * ``disaggregated`` — rank 0 starts the engines and their router (``--placement local``; under
      ``--placement ray`` the placement started them and names their router, and rank 0 watches them
      through :class:`rlperf.loop.ray_placement.RayEngineFleet`) and holds a
      :class:`RouterClient` with broadcast weight sync and their health monitor; on several ranks every rank gets a
      :class:`rlperf.loop.data_parallel.Rank0EnginesClient` around it (None on the others);
    * ``in-process`` — an :class:`EngineClient` on ``model`` (``--engine-weights``; the KV cache holds
      ``kv_tokens``); on several ranks each rank's engine runs on its own full copy (``model``),
      loaded from the gathered shards, inside a :class:`rlperf.loop.data_parallel.DataParallelEngineClient`.

    ``kernel_backend``: the run's resolved backend, which the engines it starts use too.
    """
    r = config.rollout
    if r.backend == "sglang":  # real SGLang engines; on several ranks rank 0 starts and drives them
        if world_size == 1:
            return sglang_client_for(config, model, tokenizer)
        inner, fleet = sglang_client_for(config, model, tokenizer, push_weights=False) if rank == 0 else (None, None)
        return Rank0EnginesClient(inner, rank, world_size), fleet
    if r.engine == "router":
        return RouterClient(r.router_ip, r.router_port, tokenizer, r.colocate, api_key=r.api_key,
                            model_cfg=model.cfg), None
    if r.engine == "disaggregated":
        fleet = inner = None
        if rank == 0:
            if r.engine_router_url:  # --placement ray started the engines; this rank watches them all the same
                from .ray_placement import RayEngineFleet

                host, port = r.engine_router_url.rsplit("/", 1)[-1].rsplit(":", 1)
                inner = RouterClient(host, int(port), tokenizer, api_key=r.api_key, distributed=True,
                                     model_cfg=model.cfg)
                fleet = RayEngineFleet.attach(r.engine_router_url, inner.workers())
                inner.health = HealthMonitor(fleet, r.health_check, _auth_headers(r.api_key))
            else:
                fleet = start_engine_fleet(config, kernel_backend)
                try:
                    health = HealthMonitor(fleet, r.health_check, _auth_headers(r.api_key))
                    inner = RouterClient(HOST, fleet.router_port, tokenizer, api_key=r.api_key, distributed=True,
                                         health=health, model_cfg=model.cfg)
                except BaseException:
                    fleet.close()
                    raise
        return (inner if world_size == 1 else Rank0EnginesClient(inner, rank, world_size)), fleet
    engine = EngineClient(model, tokenizer, max_total_tokens=kv_tokens, mem_fraction_static=r.mem_fraction_static,
                          cuda_graph_max_bs=r.cuda_graph_max_bs, weights="copy" if world_size > 1 else r.engine_weights)
    return (engine if world_size == 1 else DataParallelEngineClient(engine, rank, world_size)), None


@runtime_checkable
class RolloutClient(Protocol):
    """What the loop asks of its rollout engines, on every layout (module docstring)."""

    kind: str
    """What generates, in words (the run's first line)."""
    runs_rollout: bool
    """Whether this process runs the rollout function: False on a data-parallel rank whose rollout
    comes from rank 0 (:class:`rlperf.loop.data_parallel.Rank0EnginesClient`)."""

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 return_routed_experts: bool = False) -> list[GenerationResult]:
        """One result per prompt, in order; ``params[i]`` samples ``prompts[i]`` (its own seed).
        ``return_routed_experts`` (MoE models): each result's ``routed_experts`` [seq_len - 1, MoE
        layers, k], or None where an engine sent none."""

    def load_weights(self, named_tensors: Iterable, version: str) -> SyncStats:
        """Load every ``(HF name, tensor)`` pair (all the weights, each once) into the engines, which then
        hold ``version``; an iterator is walked once, to its end."""

    def weights_checksum(self) -> str | None:
        """:func:`rlperf.sync.weights_checksum` (at ``SYNC_BUCKET_BYTES``) of the weights the engines
        hold after the latest :meth:`load_weights`; None where this process does not report it."""

    def close(self) -> None:
        """Release what the client holds (a weight-update group); the engines' processes are not its."""


class EngineClient:
    """In-process engine (module docstring); ``weights``: one of :data:`ENGINE_WEIGHTS`."""

    kind = "in-process engine"
    runs_rollout = True

    def __init__(self, model, tokenizer, max_total_tokens: int | None = None, mem_fraction_static: float | None = None,
                 cuda_graph_max_bs: int | None = None, weights: str = "buckets"):
        """``model``: the trainer's compute weights (``buckets``: copied; ``shared``: run as they are) or
        the engine's own full copy (``copy``); ``cuda_graph_max_bs``: None is serve's default
        (:func:`rlperf.rollout.cuda_graph.default_max_bs`)."""
        if weights not in ENGINE_WEIGHTS:
            raise ValueError(f"weights must be one of {ENGINE_WEIGHTS}, got {weights!r}")
        self.weights = weights
        if weights == "buckets":
            self.model = copy.deepcopy(model)
            for p in self.model.parameters():
                p.requires_grad_(False)
        else:
            self.model = model
        self.tokenizer = tokenizer
        if mem_fraction_static is None and self.model.device.type == "cuda":
            mem_fraction_static = TRAIN_MEM_FRACTION_STATIC
        if cuda_graph_max_bs is None:
            cuda_graph_max_bs = default_max_bs(self.model.device)
        config = EngineConfig(max_total_tokens=max_total_tokens, mem_fraction_static=mem_fraction_static,
                              cuda_graph_max_bs=cuda_graph_max_bs)
        if cuda_graph_max_bs:  # graphs on: the steps with prefill chunks too, as serve replays them
            config.cuda_graph_max_prefill_tokens = default_max_prefill_tokens(
                self.model.device, config.chunked_prefill_size, config.max_running_requests)
        self.engine = Engine(self.model, tokenizer, config)

    @property
    def shared(self) -> bool:
        return self.weights == "shared"

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 return_routed_experts: bool = False) -> list[GenerationResult]:
        return self.engine.generate(prompts, params, return_routed_experts=return_routed_experts)

    def load_weights(self, named_tensors, version: str) -> SyncStats:
        """``buckets``: flattened buckets -> (CPU: a shared-memory payload -> receive, checksum verified)
        -> load; ``shared``: check the engine still holds the very tensors given; ``copy``: copy each
        tensor in place as it comes (CUDA graphs captured on the weights stay valid). Then flush the
        KV cache. RuntimeError naming the weights that are not the engine's or that never came."""
        if self.weights == "shared":
            # the engine reads the trainer's weights: nothing moves; they must still be the same tensors
            own = self.model.hf_state_dict()
            stale = [n for n, t in named_tensors if n not in own or own[n].data_ptr() != t.data_ptr()
                     or own[n].dtype != t.dtype]
            if stale:
                raise RuntimeError(f"--engine-weights shared: the engine no longer holds the trainer's {stale[:3]}")
            stats = SyncStats(buckets=0, bytes=0)
        elif self.weights == "buckets":
            # same process, same GPU: CUDA cannot open a process's own IPC handle, and none is needed;
            # the bucket's views are copied straight into the engine's parameters
            transport = None if self.model.device.type == "cuda" else "shm"
            stats = sync_weights(dict(named_tensors), self.model.hf_state_dict(), config=SyncConfig(transport=transport))
        else:
            stats = self._copy_weights(named_tensors)
        self.engine.flush()
        self.engine.weight_version = version
        return stats

    def _copy_weights(self, named_tensors) -> SyncStats:
        import torch

        own = self.model.hf_state_dict()
        seen, nbytes = set(), 0
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in own:
                    raise RuntimeError(f"load_weights: {name!r} is not a weight of the engine's model")
                own[name].copy_(t)
                seen.add(name)
                nbytes += t.numel() * t.element_size()
        if len(seen) != len(own):
            missing = sorted(set(own) - seen)
            raise RuntimeError(f"load_weights: no tensor for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        return SyncStats(buckets=0, bytes=nbytes)

    def weights_checksum(self) -> str:
        """Of the engine's model (after a sync: the bits the trainer sent)."""
        return weights_checksum(self.model.hf_state_dict(), SYNC_BUCKET_BYTES)

    def close(self) -> None:
        """Nothing to release (the engine lives in this process)."""


class ServerAuthError(RuntimeError):
    """A router or server answered 401: the request carried no API key, or the wrong one."""


def _check_auth(what: str, status: int, reply, api_key: str | None) -> None:
    """:class:`ServerAuthError` when ``status`` is 401 (``what``: the request), saying how to pass the key."""
    if status != 401:
        return
    msg = reply.get("error", {}).get("message") if isinstance(reply, dict) and isinstance(reply.get("error"), dict) else reply
    how = ("the key given was refused" if api_key else
           f"it needs an API key: pass --sglang-api-key-file PATH (or --sglang-api-key KEY), or set {API_KEY_ENV}")
    raise ServerAuthError(f"{what} answered 401 ({msg or 'unauthorized'}): {how}")


def _auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def push_weights(url: str, named_tensors, *, config: SyncConfig | None = None, weight_version: str | None = None,
                 api_key: str | None = None, timeout: float = 600.0) -> int:
    """Send ``named_tensors`` (HF names -> tensors) to the server at ``url`` through
    ``/update_weights_from_tensor``, one bucket per request (``config``: transport and bucket size,
    default inline); returns the number of buckets.

    RuntimeError with the server's message when a bucket is refused (earlier buckets stay loaded);
    :class:`ServerAuthError` (a RuntimeError) when it answers 401.
    """
    config = config or SyncConfig(transport="inline")
    if config.transport is None:
        raise ValueError("push_weights needs a transport (inline, shm or cuda_ipc): the server is another process")
    headers = _auth_headers(api_key)
    buckets = flatten_buckets(named_tensors, bucket_bytes=config.bucket_bytes)
    for i, bucket in enumerate(buckets):
        handle = None
        try:
            payload, handle = bucket_payload(bucket, config.transport)
            body = {"load_format": "flattened_bucket", "serialized_named_tensors": [payload]}
            if weight_version is not None:
                body["weight_version"] = weight_version
            status, reply = http_json(url.rstrip("/") + "/update_weights_from_tensor", body, timeout=timeout, headers=headers)
        finally:
            release(handle)
        if status != 200:
            msg = reply.get("error", {}).get("message") if isinstance(reply, dict) else reply
            if status == 401:
                raise ServerAuthError(f"{url}: bucket {i + 1}/{len(buckets)} refused (401): {msg}"
                                      + ("" if api_key else f"; pass --sglang-api-key-file, --sglang-api-key or {API_KEY_ENV}"))
            raise RuntimeError(f"{url}: bucket {i + 1}/{len(buckets)} refused ({status}): {msg}")
    return len(buckets)


def _keeping(items, kept: list):
    """``items`` (name, tensor) as they come, a host copy of each appended to ``kept`` (fault tolerance)."""
    for name, t in items:
        kept.append((name, t.detach().to("cpu", copy=True)))
        yield name, t


class RequestFailed(RuntimeError):
    """A request answered with an error status (``status``)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


FAULT_SETTLE_S = 10.0
"""Seconds a failed request's cause (an engine or the router) is looked for before its error is raised as is."""
MAX_RETRIES = 3
"""Times a sample's request is sent again after it failed because an engine failed (fault tolerance)."""
ROUTER_MAX_INFLIGHT = 1024
"""``/generate`` requests a :class:`RouterClient` keeps in flight: a whole rollout at once, so every engine
behind the router runs as many sequences as it admits (its ``--max-running-requests``), as the
in-process engine does with the whole batch; 32 left two engines 16 sequences each."""


class RouterClient:
    """Rollout servers behind a running sglang-router (module docstring)."""

    kind = "sglang-router"
    runs_rollout = True

    def __init__(self, ip: str, port: int, tokenizer, colocate: bool = False, timeout: float = 600.0,
                 api_key: str | None = None, distributed: bool = False, health: HealthMonitor | None = None,
                 model_cfg=None):
        """``distributed``: weight sync by broadcast to disaggregated workers (module docstring), not
        flattened-bucket requests. ``health``: the monitor of the run's own engines
        (:mod:`rlperf.loop.health`): a rollout then watches it, and a failed engine ends the run or is
        replaced (``--use-fault-tolerance``). ``model_cfg`` (:class:`rlperf.model.ModelConfig`): what
        decodes SGLang's ``meta_info["routed_experts"]`` (layers, top-k) for ``return_routed_experts``."""
        self.url, self.tokenizer, self.colocate, self.timeout = f"http://{ip}:{port}", tokenizer, colocate, timeout
        self.model_cfg = model_cfg
        self.health = health
        self.api_key, self.headers = api_key, _auth_headers(api_key)
        self.max_inflight = ROUTER_MAX_INFLIGHT
        self.distributed = distributed
        self.broadcaster: WeightBroadcaster | None = None
        self._last_sync: SyncStats | None = None  # distributed: the latest broadcast's stats
        self._sent: dict | None = None  # otherwise: the tensors the latest sync pushed
        # --use-fault-tolerance (distributed): a host copy of the weights of the latest sync, its version and
        # device: what engines restarted between two syncs are given (every engine lost in a rollout)
        self._kept: tuple[list, str, object] | None = None
        self.workers()

    def workers(self) -> list[str]:
        status, reply = http_json(self.url + "/workers", timeout=30, headers=self.headers)
        _check_auth(f"router {self.url}: GET /workers", status, reply, self.api_key)
        if status != 200 or not isinstance(reply, dict) or not reply.get("workers"):
            raise RuntimeError(f"router {self.url}: GET /workers answered {status}: {reply!r}")
        return [w["url"] for w in reply["workers"]]

    def engine_memory(self) -> list[EngineMemory]:
        """Every worker's memory as it reports it (``GET /get_server_info``, asked of each worker the
        router lists, as the admin calls are), in the router's order; a worker that reports none
        (an SGLang server) is listed with ``peak_bytes`` None."""
        out = []
        for url in self.workers():
            status, reply = http_json(url + "/get_server_info", timeout=30, headers=self.headers)
            _check_auth(f"{url}/get_server_info", status, reply, self.api_key)
            if status != 200:
                raise RuntimeError(f"{url}/get_server_info answered {status}: {reply!r}")
            out.append(EngineMemory.from_server_info(url, reply))
        return out

    def _generate_one(self, ids: list[int], sp: SamplingParams, routed: bool = False,
                      url: str | None = None) -> GenerationResult:
        """One ``/generate`` through the router, or to worker ``url`` (routed experts: the router drops
        ``return_routed_experts``, docs/ARCHITECTURE.md "Measured facts")."""
        body = {"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "top_k": sp.top_k, "sampling_seed": sp.seed, "no_stop_trim": True}}
        if routed:
            body["return_routed_experts"] = True
        target = url or self.url
        what = f"router {self.url}" if url is None else f"worker {url}"
        status, reply = http_json(target + "/generate", body, timeout=self.timeout, headers=self.headers)
        _check_auth(f"{what}: /generate", status, reply, self.api_key)
        if status != 200:
            raise RequestFailed(f"{what}: /generate answered {status}: {reply!r}", status)
        meta = reply["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        output_ids = reply.get("output_ids") or [t[1] for t in triples]
        experts = None
        if routed and meta.get("routed_experts") is not None:
            # a reply without them stays None: routing replay then names the sample
            experts = decode_routed_experts(meta["routed_experts"], self.model_cfg, len(ids) + len(output_ids) - 1)
        return GenerationResult(output_ids=output_ids, output_logprobs=[t[0] for t in triples],
                                text=reply.get("text", ""), finish_reason=meta["finish_reason"], routed_experts=experts)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 return_routed_experts: bool = False) -> list[GenerationResult]:
        if return_routed_experts and self.model_cfg is None:
            raise ValueError("return_routed_experts: this client was given no model config to decode them with")
        if self.health is not None:
            return self._generate_watched(prompts, params, return_routed_experts)
        # one request per sample, all in flight at once (up to max_inflight): the router spreads them over
        # the workers, which queue what they cannot run yet, and each sample's tokens depend only on its
        # seed (batch-invariant engines), not on who served it
        n = len(prompts)
        urls = [None] * n
        if return_routed_experts:  # the router drops the field: spread the requests over its workers directly
            workers = self.workers()
            urls = [workers[i % len(workers)] for i in range(n)]
        with ThreadPoolExecutor(max(1, min(n, self.max_inflight))) as pool:
            return list(pool.map(self._generate_one, prompts, params, [return_routed_experts] * n, urls))

    def _generate_watched(self, prompts: list[list[int]], params: list[SamplingParams],
                          routed: bool = False) -> list[GenerationResult]:
        """:meth:`generate` with the engines' health watched (:mod:`rlperf.loop.health`): the requests run
        on daemon threads (one stuck on a stopped engine never holds the process); while they run, and
        whenever one fails, the monitor is asked. A failure ends the rollout (:class:`EngineFailure`,
        :class:`RouterFailure`), or, with fault tolerance, the failed engine is taken out and every
        request that failed is sent again (at most :data:`MAX_RETRIES` times each)."""
        n = len(prompts)
        results: list = [None] * n
        todo, done = queue.SimpleQueue(), queue.SimpleQueue()
        for i in range(n):
            todo.put(i)

        def work():
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    # routed experts: to a worker directly (the router drops the field), one the router lists now
                    url = None
                    if routed:
                        workers = self.workers()
                        url = workers[i % len(workers)]
                    done.put((i, self._generate_one(prompts[i], params[i], routed, url), None))
                except BaseException as exc:  # noqa: BLE001  (handed to the waiting thread)
                    done.put((i, None, exc))

        def start(count):
            for _ in range(count):
                threading.Thread(target=work, name="rlperf-generate", daemon=True).start()

        during = "during the rollout"
        self._handle(during)
        start(max(1, min(n, self.max_inflight)))
        remaining, retries = n, [0] * n
        while remaining:
            try:
                i, out, exc = done.get(timeout=0.25)
            except queue.Empty:
                if self._handle(during):  # raises, or takes a failed engine out (its requests then fail)
                    retries = [0] * n
                continue
            if exc is None:
                results[i], remaining = out, remaining - 1
                continue
            if isinstance(exc, ServerAuthError) or 400 <= getattr(exc, "status", 0) < 500:
                raise exc
            if not isinstance(exc, (OSError, RuntimeError)):
                raise exc
            # whose fault: an engine's, the router's? (a failure may show a moment after the request's error)
            deadline = time.monotonic() + min(self.health.config.timeout, FAULT_SETTLE_S)
            while True:
                self.health.check_now()
                if self._handle(during):  # raises without fault tolerance; with it, takes the engine out
                    retries = [0] * n  # every engine was restarted: the samples start over
                if self.health.router_down():
                    self.health.raise_router_down(during, exc)
                if self.health.fault_tolerance and (self.health.out or self.health.events):
                    break
                if time.monotonic() > deadline:
                    raise exc
                time.sleep(0.5)
            if retries[i] >= MAX_RETRIES:
                raise exc
            retries[i] += 1
            todo.put(i)
            start(1)
        return results

    def _handle(self, during: str) -> bool:
        """:meth:`HealthMonitor.handle`; with fault tolerance, when that leaves no engine in service, every
        engine is restarted now (:meth:`_recover_all`). Whether it was."""
        self.health.handle(during)
        if self.health.fault_tolerance and self.health.all_out():
            self._recover_all(during)
            return True
        return False

    def _recover_all(self, during: str) -> None:
        """Every engine is out of service in the middle of a rollout: start them all again, form the
        weight-update group anew and broadcast the host copy of the latest sync's weights (every engine's
        checksum checked against it), then put them back in the router. Before the first sync the
        engines serve the weights they start with, as at the run's start. A restart or a broadcast that
        fails ends the run (:class:`EngineFailure`: one line)."""
        outages = self._restart_taken_out()
        if self._kept is not None and self.distributed:
            kept, version, device = self._kept
            try:
                self._broadcast(((name, t.to(device)) for name, t in kept), version, device)
            except WeightSyncError as exc:
                raise EngineFailure(f"the rollout engines restarted {during} could not be given the current weights "
                                    f"({exc})".replace("\n", " ")) from None
        self.health.put_back(outages)

    def _restart_taken_out(self, engines: list[int] | None = None) -> list:
        """Start the engines taken out (or those of ``engines``) again (:meth:`HealthMonitor.restart`); the
        group that had them in it is closed (a new one is formed with every engine at the next broadcast)."""
        outages = self.health.restart(engines)
        if outages and self.broadcaster is not None:
            self.broadcaster, b = None, self.broadcaster
            b.close()
        return outages

    def _broadcast(self, items, version: str, device) -> SyncStats:
        """One broadcast of ``items`` to every engine (the group formed first if there is none)."""
        if self.broadcaster is None:
            urls = self.health.fleet.worker_urls if self.health is not None else self.workers()
            # the monitor's findings end a broadcast that an engine died or stopped in (within its bound)
            self.broadcaster = WeightBroadcaster(urls, device=device, api_key=self.api_key, timeout=self.timeout,
                                                 watch=self.health.found_failed if self.health is not None else None)
            self.broadcaster.connect()
        return self.broadcaster.update_weights(items, version)  # every engine's checksum checked

    def take_fault_events(self) -> list:
        """Engine outages that ended (restarted and back) since the last call (:mod:`rlperf.loop.health`)."""
        return self.health.take_events() if self.health is not None else []

    def load_weights(self, named_tensors, version: str) -> SyncStats:
        """Distributed (disaggregated engines): broadcast the pairs bucket by bucket as they come
        (:meth:`_broadcast_weights`). Otherwise: pause each worker, push the flattened buckets
        (:func:`push_weights`; CUDA IPC when colocated on CUDA, shared memory from CPU tensors, else
        inline), flush its cache and continue it."""
        if self.distributed:
            return self._broadcast_weights(named_tensors, version)
        named = dict(named_tensors)
        if not named:
            raise ValueError("load_weights got no tensors")
        first = next(iter(named.values()))
        transport = "cuda_ipc" if (self.colocate and first.device.type == "cuda") else (
            "shm" if first.device.type == "cpu" else "inline")
        config = SyncConfig(transport=transport)

        def admin(url, endpoint):
            status, reply = http_json(url + endpoint, {}, timeout=60, headers=self.headers)
            _check_auth(f"{url}{endpoint}", status, reply, self.api_key)
            if status != 200:
                raise RuntimeError(f"{url}{endpoint} answered {status}: {reply!r}")

        n = 0
        for url in self.workers():
            admin(url, "/pause_generation")
            try:
                n += push_weights(url, named, config=config, weight_version=version, api_key=self.api_key)
                admin(url, "/flush_cache")
            finally:
                admin(url, "/continue_generation")
        self._sent = named
        return SyncStats(buckets=n, bytes=sum(t.numel() * t.element_size() for t in named.values()))

    def _broadcast_weights(self, named_tensors, version: str) -> SyncStats:
        """Disaggregated workers: one broadcast per bucket from this process (trainer rank 0) through
        the weight-update group, formed with every worker the router lists at the first sync; every
        worker's checksum is checked (:meth:`WeightBroadcaster.update_weights`). ``named_tensors``:
        (name, tensor) pairs, e.g. a generator of full tensors gathered one by one from FSDP shards
        (drawn bucket by bucket, in the engines' ``hf_state_dict()`` order)."""
        items = iter(named_tensors)
        first = next(items, None)
        if first is None:
            raise ValueError("load_weights got no tensors")
        items = itertools.chain([first], items)
        device = first[1].device
        ft = self.health is not None and self.health.fault_tolerance
        kept: list = []
        if ft:
            items = _keeping(items, kept)
        outages = []
        if self.health is not None:
            # a dead weight receiver shows only at /health: probe every engine now, not at the next interval
            self.health.check_now()
            self.health.handle("before the weight sync")
            # engines taken out: started again, to join the group below (the group that had them is closed)
            outages = self._restart_taken_out()
        try:
            try:
                self._last_sync = self._broadcast(items, version, device)
            except WeightSyncError:
                if self.health is None:
                    raise
                # an engine that failed during the broadcast: named (without fault tolerance), or taken out,
                # restarted and given the whole host copy (the rest of the pairs is drawn into it first)
                self.health.check_now()
                failed = self.health.handle("during the weight sync")
                if not ft or not failed:
                    raise
                for _ in items:
                    pass
                outages = [*outages, *self._restart_taken_out(failed)]
                self._last_sync = self._broadcast(((n, t.to(device)) for n, t in kept), version, device)
            if ft:
                self._kept = (kept, version, device)
            if outages:
                self.health.put_back(outages)
            return self._last_sync
        except WeightSyncError as exc:
            if exc.status == 401:
                _check_auth("weight sync", 401, str(exc), self.api_key)
            raise

    def weights_checksum(self) -> str:
        """Distributed: the engines' ``weights_checksum`` at ``SYNC_BUCKET_BYTES``, which all must report
        alike (the latest sync checked them against the bytes sent; asked again only when its bucket size
        differs). Otherwise: of the tensors the latest sync pushed, as this process holds them (the
        servers checked each bucket's checksum on receipt)."""
        if not self.distributed:
            if self._sent is None:
                raise RuntimeError("weights_checksum: no weights were loaded yet")
            return weights_checksum(self._sent, SYNC_BUCKET_BYTES)
        if self.broadcaster is None:
            raise RuntimeError("weights_checksum: no weight sync has formed the engines' group yet")
        stats = self._last_sync
        if stats is not None and stats.weights_checksum and self.broadcaster.bucket_bytes == SYNC_BUCKET_BYTES:
            return stats.weights_checksum
        got = self.broadcaster.engine_checksums(SYNC_BUCKET_BYTES)
        if len(set(got)) != 1:
            raise WeightSyncError(f"the engines' weights differ: weights_checksum {got}")
        return got[0]

    def close(self) -> None:
        """Stop watching the engines' health; leave the weight-update group (distributed sync), if one
        was formed."""
        gone = []
        if self.health is not None:
            self.health.close()
            gone = self.health.failed_urls()
        if self.broadcaster is not None:
            self.broadcaster, b = None, self.broadcaster
            b.close(gone)  # an engine that failed is not asked to leave (it would not answer)


class SGLangClient(RouterClient):
    """Real SGLang engines behind the sglang-router (:mod:`rlperf.loop.sglang_engines`): generation is
    :class:`RouterClient`'s; weight sync uses SGLang's own endpoints (gap-free broadcast buckets, or the
    tensors' CUDA IPC handles when colocated)."""

    kind = "SGLang engines behind sglang-router"

    def __init__(self, ip: str, port: int, tokenizer, *, colocate: bool, tp_size: int = 1, timeout: float = 600.0,
                 model_cfg=None):
        self.tp_size = tp_size
        self._checksum: str | None = None
        super().__init__(ip, port, tokenizer, colocate=colocate, timeout=timeout, distributed=not colocate,
                         model_cfg=model_cfg)

    def load_weights(self, named_tensors, version: str) -> SyncStats:
        """Disaggregated: broadcast bucket by bucket (gap-free buckets, SGLang's layout); colocated: the
        tensors' IPC handles through ``/update_weights_from_tensor``, on every worker."""
        if not self.colocate:
            return self._broadcast_weights(named_tensors, version)
        named = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        n = sum(push_tensors_to_sglang(url, named, version, tp_size=self.tp_size, timeout=self.timeout)
                for url in self.workers())
        self._checksum = weights_checksum(dict(named), SYNC_BUCKET_BYTES)
        return SyncStats(buckets=n, bytes=sum(t.numel() * t.element_size() for _, t in named),
                         weights_checksum=self._checksum)

    def _broadcast_weights(self, named_tensors, version: str) -> SyncStats:
        items = iter(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        first = next(items, None)
        if first is None:
            raise ValueError("load_weights got no tensors")
        try:
            if self.broadcaster is None:
                self.broadcaster = SGLangBroadcaster(self.workers(), device=first[1].device, timeout=self.timeout,
                                                      tp_size=self.tp_size, bucket_bytes=SYNC_BUCKET_BYTES)
                self.broadcaster.connect()
            self._last_sync = self.broadcaster.update_weights(itertools.chain([first], items), version,
                                                              check_checksum=False, sglang_engines=True)
        except WeightSyncError as exc:
            if exc.status == 401:
                raise ServerAuthError(str(exc)) from None
            raise
        self._checksum = self._last_sync.weights_checksum
        return self._last_sync

    def weights_checksum(self) -> str:
        """The checksum of the weights the latest sync sent (SGLang reports none of its own)."""
        if self._checksum is None:
            raise RuntimeError("weights_checksum: no weights were loaded yet")
        return self._checksum


def sglang_client_for(config: RunConfig, model, tokenizer, push_weights: bool = True):
    """The :class:`SGLangClient` of a ``--rollout-backend sglang`` run and the fleet it started; with
    ``--sglang-load-format dummy`` the trainer's weights (``model``'s) are pushed before it is returned,
    unless ``push_weights`` is off (several ranks: the run's first sync, a collective, brings them)."""
    fleet = start_sglang_fleet(config, model)
    try:
        client = SGLangClient(HOST, fleet.router_port, tokenizer, colocate=config.rollout.colocate,
                              tp_size=config.rollout.sglang.tp_size, model_cfg=model.cfg)
        if config.rollout.sglang.load_format == "dummy" and push_weights:
            import torch

            with torch.no_grad():
                client.load_weights(model.hf_state_dict(), "0")
    except BaseException:
        fleet.close()
        raise
    return client, fleet
