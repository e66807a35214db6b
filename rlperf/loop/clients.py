"""Where the loop's rollouts are generated, and how the weights get there: the two engine clients.

Both have ``generate(prompts, params) -> list[GenerationResult]`` (one typed result per prompt,
:class:`rlperf.rollout.engine.GenerationResult`) and ``update_weights(named_tensors, version)``:

* :class:`EngineClient` — an in-process :class:`rlperf.rollout.engine.Engine` (the default when no
  ``--sglang-router-ip`` is given, e.g. the embedded CPU run): the engine ``rlperf serve`` runs, in the
  trainer's compute dtype (bf16 on CUDA), with CUDA-graph decode up to serve's default batch size
  (:func:`rlperf.rollout.cuda_graph.default_max_bs`; ``--sglang-cuda-graph-max-bs 0`` keeps the eager,
  debuggable path; on CPU it is eager). Its weights (``--engine-weights``):

  - ``buckets`` — the engine runs its **own copy** of the model; weight sync is
    :func:`rlperf.sync.sync_weights`: on CPU through the path a server takes (``flatten_buckets`` ->
    a shared-memory bucket payload -> ``receive_bucket``, which checks sizes and checksum ->
    ``load_bucket`` into the engine's model); on one GPU the buckets are loaded directly (one copy
    launch per bucket).
  - ``shared`` — the engine runs on the trainer's compute weights themselves (no copy, no second
    set of weights in memory): the trainer updates them in place after each optimizer step (CUDA
    graphs captured on them stay valid), and weight sync only checks that the engine still holds
    those very tensors. Sync mode only: in ``--async`` the rollout would read weights mid-update.

  Then the KV cache is flushed.
* :class:`RouterClient` — ``POST /generate`` through a running sglang-router, one request per
  sample; weight sync pauses every worker the router lists (``/pause_generation``), pushes the
  buckets to each (:func:`push_weights`, ``/update_weights_from_tensor``), flushes their caches and
  continues them. The router answers 404 for those admin endpoints (DESIGN, "Measured facts"), so
  the client finds the workers with ``GET /workers`` and calls them directly, as slime does. With
  an API key (``--sglang-api-key``, ``--sglang-api-key-file`` or ``RLPERF_API_KEY``) every request,
  to the router and to the workers, carries ``Authorization: Bearer <key>``; a 401 is a
  :class:`ServerAuthError` that says how to pass the key. With ``distributed=True`` (disaggregated
  engines on their own GPUs, :mod:`rlperf.loop.engines`) the weights go by broadcast instead:
  :class:`rlperf.sync.distributed.WeightBroadcaster` forms one process group with the workers at the
  first sync (SGLang's ``/init_weights_update_group``), pauses them, broadcasts bucket by bucket
  (``/update_weights_from_distributed``), checks every worker's ``weights_checksum`` against the
  trainer's and continues them; :meth:`RouterClient.load_weights` does the same from an iterator that
  yields the full tensors as they are gathered (a data-parallel trainer's rank 0);
  :meth:`RouterClient.close` leaves the group.

Bucket sizes and transports are :class:`rlperf.sync.SyncConfig`'s.
"""
from __future__ import annotations

import copy
import itertools
from concurrent.futures import ThreadPoolExecutor

from rlperf.rollout.args import API_KEY_ENV
from rlperf.rollout.cuda_graph import default_max_bs
from rlperf.rollout.engine import Engine, EngineConfig, GenerationResult, SamplingParams
from rlperf.rollout.router import http_json
from rlperf.sync import SyncConfig, SyncStats, bucket_payload, flatten_buckets, release, sync_weights
from rlperf.sync.distributed import WeightBroadcaster, WeightSyncError

from .record import EngineMemory

TRAIN_MEM_FRACTION_STATIC = 0.3
"""The in-process engine shares the device with the trainer (weights, grads, AdamW state,
activations): its KV cache may fill device memory up to this fraction (a server's default, 0.85,
left the trainer too little at qwen3-0.6b: the oom_headroom gate failed at 96% of the card)."""


class EngineClient:
    """In-process engine over a private copy of the model (module docstring)."""

    kind = "in-process engine"

    def __init__(self, model, tokenizer, max_total_tokens: int | None = None, mem_fraction_static: float | None = None,
                 cuda_graph_max_bs: int | None = None, share_weights: bool = False):
        """``model``: the trainer's compute weights (copied unless ``share_weights``);
        ``cuda_graph_max_bs``: None is serve's default (:func:`rlperf.rollout.cuda_graph.default_max_bs`)."""
        self.shared = share_weights
        if share_weights:
            self.model = model
        else:
            self.model = copy.deepcopy(model)
            for p in self.model.parameters():
                p.requires_grad_(False)
        self.tokenizer = tokenizer
        if mem_fraction_static is None and self.model.device.type == "cuda":
            mem_fraction_static = TRAIN_MEM_FRACTION_STATIC
        if cuda_graph_max_bs is None:
            cuda_graph_max_bs = default_max_bs(self.model.device)
        self.engine = Engine(self.model, tokenizer, EngineConfig(
            max_total_tokens=max_total_tokens, mem_fraction_static=mem_fraction_static,
            cuda_graph_max_bs=cuda_graph_max_bs))

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
        return self.engine.generate(prompts, params)

    def update_weights(self, named_tensors, version: str) -> SyncStats:
        """Buckets -> (CPU: a shared-memory payload -> receive, checksum verified) -> load; flush."""
        if self.shared:
            # the engine reads the trainer's weights: nothing moves; they must still be the same tensors
            own = self.model.hf_state_dict()
            stale = [n for n, t in named_tensors.items() if n not in own or own[n].data_ptr() != t.data_ptr()
                     or own[n].dtype != t.dtype]
            if stale:
                raise RuntimeError(f"--engine-weights shared: the engine no longer holds the trainer's {stale[:3]}")
            self.engine.flush()
            self.engine.weight_version = version
            return SyncStats(buckets=0, bytes=0)
        # same process, same GPU: CUDA cannot open a process's own IPC handle, and none is needed;
        # the bucket's views are copied straight into the engine's parameters
        transport = None if self.model.device.type == "cuda" else "shm"
        stats = sync_weights(named_tensors, self.model.hf_state_dict(), config=SyncConfig(transport=transport))
        self.engine.flush()
        self.engine.weight_version = version
        return stats

    def load_weights(self, named_tensors, version: str) -> SyncStats:
        """Copy ``(HF name, tensor)`` pairs into the engine's model as they come, then flush its KV cache.

        ``named_tensors`` may be an iterator that gathers the weights bucket by bucket (a data-parallel
        rank's engine: :meth:`rlperf.train.fsdp.FSDPTrainer.iter_hf_weights`): each tensor is copied
        before the next is asked for, in place (CUDA graphs captured on the weights stay valid). Every
        weight must come; RuntimeError naming the missing ones otherwise.
        """
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
        self.engine.flush()
        self.engine.weight_version = version
        return SyncStats(buckets=0, bytes=nbytes)

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
        payload, handle = bucket_payload(bucket, config.transport)
        body = {"load_format": "flattened_bucket", "serialized_named_tensors": [payload]}
        if weight_version is not None:
            body["weight_version"] = weight_version
        try:
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


ROUTER_MAX_INFLIGHT = 1024
"""``/generate`` requests a :class:`RouterClient` keeps in flight: a whole rollout at once, so every engine
behind the router runs as many sequences as it admits (its ``--max-running-requests``), as the
in-process engine does with the whole batch; 32 left two engines 16 sequences each."""


class RouterClient:
    """Rollout servers behind a running sglang-router (module docstring)."""

    kind = "sglang-router"

    def __init__(self, ip: str, port: int, tokenizer, colocate: bool = False, timeout: float = 600.0,
                 api_key: str | None = None, distributed: bool = False):
        """``distributed``: weight sync by broadcast to disaggregated workers (module docstring), not
        flattened-bucket requests."""
        self.url, self.tokenizer, self.colocate, self.timeout = f"http://{ip}:{port}", tokenizer, colocate, timeout
        self.api_key, self.headers = api_key, _auth_headers(api_key)
        self.max_inflight = ROUTER_MAX_INFLIGHT
        self.distributed = distributed
        self.broadcaster: WeightBroadcaster | None = None
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

    def _generate_one(self, ids: list[int], sp: SamplingParams) -> GenerationResult:
        body = {"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "top_k": sp.top_k, "sampling_seed": sp.seed, "no_stop_trim": True}}
        status, reply = http_json(self.url + "/generate", body, timeout=self.timeout, headers=self.headers)
        _check_auth(f"router {self.url}: /generate", status, reply, self.api_key)
        if status != 200:
            raise RuntimeError(f"router {self.url}: /generate answered {status}: {reply!r}")
        meta = reply["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        return GenerationResult(output_ids=reply.get("output_ids") or [t[1] for t in triples],
                                output_logprobs=[t[0] for t in triples], text=reply.get("text", ""),
                                finish_reason=meta["finish_reason"])

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
        # one request per sample, all in flight at once (up to max_inflight): the router spreads them over
        # the workers, which queue what they cannot run yet, and each sample's tokens depend only on its
        # seed (batch-invariant engines), not on who served it
        with ThreadPoolExecutor(max(1, min(len(prompts), self.max_inflight))) as pool:
            return list(pool.map(self._generate_one, prompts, params))

    def update_weights(self, named_tensors, version: str) -> SyncStats:
        if self.distributed:
            return self._broadcast_weights(named_tensors, version)
        first = next(iter(named_tensors.values()))
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
                n += push_weights(url, named_tensors, config=config, weight_version=version, api_key=self.api_key)
                admin(url, "/flush_cache")
            finally:
                admin(url, "/continue_generation")
        return SyncStats(buckets=n, bytes=sum(t.numel() * t.element_size() for t in named_tensors.values()))

    def _broadcast_weights(self, named_tensors, version: str) -> SyncStats:
        """Disaggregated workers: one broadcast per bucket from this process (trainer rank 0) through
        the weight-update group, formed with every worker the router lists at the first sync; every
        worker's checksum is checked (:meth:`WeightBroadcaster.update_weights`). ``named_tensors``: a
        mapping, or (name, tensor) pairs, e.g. a generator of full tensors gathered one by one from
        FSDP shards (drawn bucket by bucket, in the engines' ``hf_state_dict()`` order)."""
        items = iter(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        first = next(items, None)
        if first is None:
            raise ValueError("update_weights got no tensors")
        items = itertools.chain([first], items)
        try:
            if self.broadcaster is None:
                self.broadcaster = WeightBroadcaster(self.workers(), device=first[1].device, api_key=self.api_key,
                                                     timeout=self.timeout)
                self.broadcaster.connect()
            return self.broadcaster.update_weights(items, version)
        except WeightSyncError as exc:
            if exc.status == 401:
                _check_auth("weight sync", 401, str(exc), self.api_key)
            raise

    def load_weights(self, named_tensors, version: str) -> SyncStats:
        """Distributed sync only: broadcast ``(HF name, tensor)`` pairs as they come (a data-parallel
        trainer's rank 0 passes the iterator that gathers the FSDP shards bucket by bucket:
        :meth:`rlperf.train.fsdp.FSDPTrainer.iter_hf_weights`); see :meth:`_broadcast_weights`."""
        if not self.distributed:
            raise RuntimeError("load_weights streams the weights to disaggregated engines (distributed=True); "
                               "servers behind a running router take update_weights")
        return self._broadcast_weights(named_tensors, version)

    def engine_checksum(self, bucket_bytes: int) -> str:
        """Distributed sync, after one: the engines' ``weights_checksum`` at ``bucket_bytes``, which all
        must report alike (:meth:`rlperf.sync.distributed.WeightBroadcaster.engine_checksums`)."""
        if self.broadcaster is None:
            raise RuntimeError("engine_checksum: no weight sync has formed the engines' group yet")
        got = self.broadcaster.engine_checksums(bucket_bytes)
        if len(set(got)) != 1:
            raise WeightSyncError(f"the engines' weights differ: weights_checksum {got}")
        return got[0]

    def close(self) -> None:
        """Leave the weight-update group (distributed sync), if one was formed."""
        if self.broadcaster is not None:
            self.broadcaster, b = None, self.broadcaster
            b.close()
