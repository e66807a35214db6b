"""``rlperf serve``: the SGLang-compatible HTTP server in front of one rollout engine.

Web stack: **aiohttp**. The engine runs on its own thread (:mod:`rlperf.rollout.engine_loop`), so
the server only needs an asyncio loop that parses JSON, hands work to that thread and awaits futures.
aiohttp is that and nothing more: one package that is both the server and the client (the router
launcher and the tools use its client side), no ASGI layer, and no schema layer between the wire
and our validation — FastAPI/pydantic would coerce ``"5"`` into ``5`` and answer type errors with
422 in its own shape, whereas every malformed request here gets a 400 with one readable message
(``{"error": {"message": ..., "code": 400}}``) from the same checks the engine uses.

Endpoints (SGLang's names and reply fields; docs/ARCHITECTURE.md, "Rollout server"):

* ``GET /health``, ``/health_generate``: 503 until the start-up warm-up is over (as SGLang answers
  before its own): the engine thread's first command compiles the kernels and captures every
  CUDA-graph decode size (:meth:`Engine.warm_up <rlperf.rollout.engine.Engine.warm_up>`), which
  leaves nothing a client can see; then 200 (``--skip-warmup``: at once). A request that comes
  earlier waits behind the warm-up. ``/health`` answers 503 too while a weight-update group's
  receiver child (:class:`rlperf.sync.receiver.GlooReceiver`) has died: the engine could not take
  the next weight sync, so it has failed (a run's fault tolerance restarts it). ``GET /model_info``,
  ``/get_model_info``, ``/server_info``,
  ``/get_server_info`` (with ``warmup_seconds``; ``internal_states[0]["memory"]``: the process's memory,
  :meth:`RolloutServer.memory`; ``internal_states[0]["cuda_graph_failures"]``: the CUDA-graph captures that
  failed, whose steps run eagerly, :meth:`Engine.graph_failures <rlperf.rollout.engine.Engine.graph_failures>`),
  ``/get_weight_version``.
* ``GET /v1/models``: the OpenAI model list (one card: ``id`` and ``root`` are ``--model-path``).
* ``POST /generate``: ``text`` or ``input_ids``, single or batched; ``sampling_params`` (one object
  or one per prompt), ``return_logprob``, ``rid``, ``stream`` (parsed by
  :meth:`GenerateRequest.from_json
  <rlperf.rollout.generate_request.GenerateRequest.from_json>`). Reply ``{text, output_ids, meta_info: {id, finish_reason,
  prompt_tokens, completion_tokens, cached_tokens, weight_version, e2e_latency,
  output_token_logprobs: [[logprob, token_id, null], ...]}}`` (a list for a batch). MoE models:
  ``return_routed_experts`` (a boolean, or one per prompt) adds ``meta_info["routed_experts"]`` to
  the final reply: base64 of int32 [prompt + output tokens - 1, num_hidden_layers, top_k], -1 in
  dense layers (:func:`rlperf.model.moe.encode_routed_experts`), what routing replay reads.
  With ``"stream": true`` the reply is server-sent events, as SGLang sends them by default (no
  ``--incremental-streaming-output``): one ``data: {json}\n\n`` per new token or group of tokens,
  each *cumulative* — ``text`` and ``output_ids`` so far, ``meta_info`` with ``finish_reason: null``,
  ``completion_tokens`` so far and (``return_logprob``) every ``output_token_logprobs`` triple so far;
  the last chunk is the non-streamed reply itself (``finish_reason``, ``e2e_latency``), then
  ``data: [DONE]\n\n``. A batch streams its requests interleaved, each chunk with ``index`` (its
  position in the batch). A client that disconnects has its requests aborted in the engine.
* admin (``Authorization: Bearer <api-key>`` when the server has ``--api-key``):
  ``/pause_generation`` (``mode``: ``abort`` (SGLang's default) aborts what is in flight,
  ``retract`` and ``in_place`` keep it), ``/continue_generation``, ``/flush_cache`` (only when idle),
  ``/abort_request`` (``rid`` or ``abort_all``), ``/start_profile`` and ``/stop_profile`` (GET or
  POST, as SGLang), ``/profile_trace``, ``/update_weights_from_tensor`` (``load_format:
  "flattened_bucket"``; received and checked by :mod:`rlperf.sync.transports`).
* admin, disaggregated weight sync (SGLang's names and fields; :mod:`rlperf.rollout.weight_groups`):
  ``/init_weights_update_group``, ``/update_weights_from_distributed`` (a broadcast from rank 0 of
  the group, received on the engine thread), ``/destroy_weights_update_group``; ``GET
  /weights_checksum`` (``?bucket_bytes=``, default :data:`rlperf.sync.SYNC_BUCKET_BYTES`): the
  :func:`rlperf.sync.weights_checksum` of the engine's weights and its ``weight_version``, what a
  sender compares after any weight update.

This module is the routes: the application, its route table, the info and admin handlers, the
start-up warm-up and ``serve``. The other jobs live beside it, one file each:

* :mod:`rlperf.rollout.http_body` — the wire: request-body limits (413 by Content-Length before a
  byte is read), reading (408 and the connection closed when a body stops arriving), JSON decoding and
  checks (400), the error replies and the middleware every route shares. Client errors are 4xx with
  one message, never 500 (docs/security.md); no request body is ever unpickled;
* :mod:`rlperf.rollout.generate_request` — the ``/generate`` request model (:class:`GenerateRequest`);
* :mod:`rlperf.rollout.scheduling` — requests queued on the engine thread, their replies and streams;
  a request that makes an engine step fail fails alone (:meth:`rlperf.rollout.engine.Engine.recover`);
* :mod:`rlperf.rollout.weight_updates` — the weight-update endpoints and ``/weights_checksum``.

A stopping server (SIGTERM) first kills its weight-update children, so a join or receive under way
ends at once, then gives the other requests :data:`SHUTDOWN_TIMEOUT_S`. Profile traces go only below
``--profile-root`` (:mod:`rlperf.rollout.profiler`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from aiohttp import web

from rlperf import kernels as K
from rlperf.sync.receiver import sweep_dead_segments
from rlperf.telemetry.memory import process_memory

from .args import ServerArgs
from .engine import BadRequest, Engine, EngineConfig, SamplingParams
from .engine_loop import PAUSE_MODES, EngineLoop
from .generate_request import GenerateRequest
from .http_body import (BODY_LIMITS, DISTRIBUTED_BODY_BYTES, WEIGHTS_BODY_BYTES, RequestFailed, body_limit_middleware,
                        error_middleware, error_reply, generate_body_limit, json_body)
from .scheduling import GenerateScheduler
from .tokenizer import has_hf_tokenizer, load_tokenizer
from .weight_updates import WeightUpdates

VERSION = "rlperf-0.1.0"

SHUTDOWN_TIMEOUT_S = 5.0
"""Seconds a stopping server (SIGTERM, SIGINT) waits for the requests still running before it cancels
them: weight-update joins and receives end at once (their child processes are killed first)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(args: ServerArgs):
    """(model, tokenizer) from a preset name or a checkpoint directory."""
    from rlperf.model import PRESETS
    from rlperf.model.qwen3 import Qwen3ForCausalLM

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.dtype != "auto" and args.dtype not in _DTYPES:
        raise ValueError(f"--dtype {args.dtype!r}: choose auto or one of {sorted(_DTYPES)}")
    if args.model_path in PRESETS:
        dtype = _DTYPES.get(args.dtype) or (torch.bfloat16 if device == "cuda" else torch.float32)
        model = Qwen3ForCausalLM.random(PRESETS[args.model_path], seed=args.random_seed, dtype=dtype, device=device)
        tok_path = args.tokenizer_path
    elif Path(args.model_path).is_dir():
        model = Qwen3ForCausalLM.from_pretrained(args.model_path, dtype=_DTYPES.get(args.dtype), device=device)
        tok_path = args.tokenizer_path or (args.model_path if has_hf_tokenizer(args.model_path) else None)
    else:
        raise ValueError(f"--model-path {args.model_path!r} is neither a preset ({sorted(PRESETS)}) nor a directory")
    return model, load_tokenizer(tok_path, model.cfg.vocab_size)


def _model_type(cfg) -> dict:
    """``model_type`` and ``architectures`` as transformers names the model (dense or MoE)."""
    if cfg.num_experts:
        return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}



WARMUP_PROMPT_LENGTHS = (7, 1000)
"""Prompt lengths of ``rlperf serve``'s warm-up on a GPU (:meth:`rlperf.rollout.engine.Engine.warm_up`):
a short prefill and a long-ish one that spans two chunks of the default ``--chunked-prefill-size``.
On CPU only the short one runs (nothing is compiled there; it only proves the path)."""
WARMUP_DELAY_ENV = "RLPERF_TEST_WARMUP_DELAY_S"
"""Tests only: seconds the warm-up sleeps before it ends, so a test sees /health answer 503 meanwhile."""


def warmup_prompt_lengths(device: torch.device) -> tuple[int, ...]:
    return WARMUP_PROMPT_LENGTHS if device.type == "cuda" else WARMUP_PROMPT_LENGTHS[:1]


def default_cuda_graph_max_bs(args: ServerArgs, model) -> int:
    """``--cuda-graph-max-bs`` as given, else 256 on a CUDA device and 0 on CPU."""
    from .cuda_graph import default_max_bs

    if args.cuda_graph_max_bs is not None:
        return args.cuda_graph_max_bs
    return default_max_bs(model.device)


def default_cuda_graph_max_prefill_tokens(args: ServerArgs, model) -> int:
    """``--cuda-graph-max-prefill-tokens`` as given, else the most tokens a step holds on a CUDA device
    (:func:`rlperf.rollout.cuda_graph.default_max_prefill_tokens`) and 0 on CPU."""
    from .cuda_graph import default_max_prefill_tokens

    if args.cuda_graph_max_prefill_tokens is not None:
        return args.cuda_graph_max_prefill_tokens
    return default_max_prefill_tokens(model.device, args.chunked_prefill_size, args.max_running_requests)


class RolloutServer:
    """The aiohttp application around one :class:`EngineLoop`."""

    def __init__(self, args: ServerArgs, model, tokenizer):
        self.args, self.model, self.tokenizer = args, model, tokenizer
        config = EngineConfig(max_running_requests=args.max_running_requests,
                              chunked_prefill_size=args.chunked_prefill_size, max_total_tokens=args.max_total_tokens,
                              mem_fraction_static=args.mem_fraction_static, context_length=args.context_length,
                              random_seed=args.random_seed, cuda_graph_max_bs=default_cuda_graph_max_bs(args, model),
                              cuda_graph_max_prefill_tokens=default_cuda_graph_max_prefill_tokens(args, model),
                              attention_backend=args.attention_backend,
                              overlap_schedule=not args.disable_overlap_schedule)
        self.engine = Engine(model, tokenizer, config)
        backend = None if args.kernel_backend == "auto" else args.kernel_backend
        self.loop = EngineLoop(self.engine, backend, profile_root=args.profile_root)
        self.started = time.time()
        self.ready = False
        """True once the warm-up is over (or skipped): /health and /health_generate answer 503 until then."""
        self.warmup_seconds: float | None = None
        self.warmup_error: str | None = None
        # (limit, flag) per route; any other route: OTHER_BODY_BYTES (module constants)
        self.body_limits = {
            "/generate": (args.max_generate_body_bytes or generate_body_limit(self.engine.context_length),
                          "--max-generate-body-bytes"),
            "/update_weights_from_tensor": (args.max_weights_body_bytes or WEIGHTS_BODY_BYTES, "--max-weights-body-bytes"),
            "/update_weights_from_distributed": (DISTRIBUTED_BODY_BYTES, None)}
        self.scheduler = GenerateScheduler(self.loop, tokenizer)
        self.weights = WeightUpdates(self.loop)
        self.weight_groups = self.weights.groups
        """Disaggregated weight sync: the process groups this engine joined (SGLang's /init_weights_update_group)."""
        for limit, flag in self.body_limits.values():
            if flag and limit <= 0:
                raise ValueError(f"{flag} must be positive, got {limit}")
        self.app = web.Application(middlewares=[error_middleware, body_limit_middleware],
                                   client_max_size=max(limit for limit, _ in self.body_limits.values()))
        self.app[BODY_LIMITS] = self.body_limits
        self.app.on_startup.append(self._startup)
        self.app.on_shutdown.append(self._shutdown)
        self.app.on_cleanup.append(self._cleanup)
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_get("/v1/models", self.models)
        r.add_post("/generate", self.generate)
        admin = {"/pause_generation": self.pause, "/continue_generation": self.resume, "/flush_cache": self.flush,
                 "/abort_request": self.abort, "/start_profile": self.start_profile, "/stop_profile": self.stop_profile,
                 "/update_weights_from_tensor": self.weights.update_from_tensor,
                 "/init_weights_update_group": self.weights.init_group,
                 "/update_weights_from_distributed": self.weights.update_from_distributed,
                 "/destroy_weights_update_group": self.weights.destroy_group}
        for path, handler in admin.items():
            r.add_post(path, self._admin(handler))
        for path in ("/flush_cache", "/start_profile", "/stop_profile"):  # SGLang takes GET there too
            r.add_get(path, self._admin(admin[path]))
        r.add_get("/profile_trace", self._admin(self.profile_trace))
        r.add_get("/weights_checksum", self._admin(self.weights.checksum))

    async def _startup(self, app):
        self.loop.start()
        if self.args.skip_warmup:
            self.ready = True
            return
        # the engine thread's first command, ahead of any request; HTTP answers meanwhile (/health: 503)
        self.loop.call(self._warm_up).add_done_callback(self._warmed)

    def _warm_up(self, engine: Engine) -> float:
        t0 = time.perf_counter()
        graphs = engine.warm_up(warmup_prompt_lengths(self.model.device))
        if torch.cuda.is_available() and self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        delay = float(os.environ.get(WARMUP_DELAY_ENV) or 0)
        if delay > 0:
            time.sleep(delay)
        seconds = time.perf_counter() - t0
        failures = engine.graph_failures()
        failed = (f"; {len(failures)} failed, those steps run eagerly: {failures[0]['error'].splitlines()[0]}"
                  if failures else "")
        print(f"rlperf serve: warm-up done in {seconds:.1f} s ({graphs} CUDA graphs captured{failed})", flush=True)
        return seconds

    def _warmed(self, fut) -> None:
        """On the engine thread: the warm-up's end. A failed warm-up keeps /health at 503 with its error."""
        exc = fut.exception()
        if exc is not None:
            self.warmup_error = "".join(traceback.format_exception(exc)).strip()
            print(f"rlperf serve: warm-up failed; /health answers 503\n{self.warmup_error}", file=sys.stderr, flush=True)
            return
        self.warmup_seconds = fut.result()
        self.ready = True

    def _not_ready(self) -> web.Response | None:
        """503 while the server cannot serve yet (as SGLang answers before its warm-up is done), else None."""
        if not self.loop.alive:
            return error_reply(503, f"the engine thread is not running: {self.loop.error or 'stopped'}")
        if self.warmup_error is not None:
            return error_reply(503, "the warm-up failed: " + self.warmup_error.splitlines()[-1])
        if not self.ready:
            return error_reply(503, "warming up: compiling kernels and capturing CUDA graphs")
        return None

    async def _shutdown(self, app):
        """First step of a stop (SIGTERM, SIGINT): before aiohttp waits for the handlers still running,
        the weight-update children die, so a join or receive under way ends now, not at its timeout."""
        self.weight_groups.close_all()

    async def _cleanup(self, app):
        self.weight_groups.close_all()
        self.loop.close()

    def _admin(self, handler):
        async def wrapped(request: web.Request):
            key = self.args.api_key
            if key:
                # exactly one header, exactly "Bearer <key>" (SGLang's check), compared in constant time; aiohttp
                # hands non-UTF-8 header bytes over as surrogates, which encode back to those bytes
                given = request.headers.getall("Authorization", [])
                raw = given[0].encode("utf-8", "surrogateescape") if len(given) == 1 else b""
                if not hmac.compare_digest(raw, f"Bearer {key}".encode("utf-8", "surrogateescape")):
                    return error_reply(401, "this endpoint needs the server's API key (Authorization: Bearer <key>)")
            return await handler(request)
        return wrapped

    async def _on_engine(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

    # ---- info ---------------------------------------------------------------------------------
    async def health(self, request):
        broken = self.weight_groups.broken()
        if broken:
            return error_reply(503, "; ".join(broken) + ": this engine cannot take a weight update")
        return self._not_ready() or web.Response(text="")

    async def health_generate(self, request):
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        if self.loop.paused:  # a paused engine would hold the probe until /continue_generation
            return error_reply(503, "generation is paused")
        try:
            results = await self.scheduler.submit([[0]], [SamplingParams(max_new_tokens=1, temperature=0.0)], [None], [False])
        except RequestFailed as exc:
            return error_reply(503, f"health generate failed: {exc}")
        if results[0]["meta_info"]["finish_reason"]["type"] == "abort":
            return error_reply(503, "health generate was aborted: " + str(results[0]["meta_info"]["finish_reason"]))
        return web.Response(text="")

    async def model_info(self, request):
        return web.json_response({
            "model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path or getattr(self.tokenizer, "name", None),
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
            **_model_type(self.engine.model.cfg), "has_image_understanding": False,
            "has_audio_understanding": False})

    async def server_info(self, request):
        e = self.engine
        info = {k: v for k, v in dataclasses.asdict(self.args).items() if k != "api_key"}
        info.update(max_generate_body_bytes=self.body_limits["/generate"][0],
                    max_weights_body_bytes=self.body_limits["/update_weights_from_tensor"][0],
                    profile_root=str(self.loop.profiler.root), warmup_seconds=self.warmup_seconds)
        info.update(version=VERSION, uptime_s=time.time() - self.started, max_total_num_tokens=e.kv.max_total_tokens, page_size=e.kv.page_size,
                    context_length=e.context_length, weight_version=e.weight_version, kernel_mode=K.mode(),
                    tp_size=1, dp_size=1, weight_update_groups=self.weight_groups.names(),
                    internal_states=[{"num_running_reqs": len(e.running), "num_waiting_reqs": len(e.waiting),
                                      "num_free_pages": e.kv.num_free_pages, "num_steps": e.num_steps,
                                      "num_retractions": e.num_retractions, "num_failed_steps": e.num_failed_steps,
                                      "cuda_graph_failures": e.graph_failures(),
                                      "paused": self.loop.paused, "memory": self.memory()}])
        return web.json_response(info)

    def memory(self) -> dict:
        """The engine process's memory, bytes (:func:`rlperf.telemetry.memory.process_memory`, as the trainer
        measures its own): ``kind`` (``cuda``: allocator counters; ``cpu_rss``: resident set), ``device``,
        ``capacity_bytes`` (the device's memory; CPU: the cgroup limit or MemTotal), ``current_bytes``,
        ``peak_bytes`` (since the process started: warm-up, rollouts and weight loads included),
        ``reserved_bytes`` (CUDA's caching allocator, else None) and ``kv_pool_bytes`` (the KV cache's
        page pools, part of the current bytes). An rlperf key: SGLang's clients read the others."""
        device = self.engine.model.device
        return {**process_memory(device), "device": str(device), "kv_pool_bytes": self.engine.kv.pool_bytes}

    async def weight_version(self, request):
        return web.json_response({"weight_version": self.engine.weight_version})

    # ---- generate -----------------------------------------------------------------------------
    async def generate(self, request):
        req = GenerateRequest.from_json(await json_body(request))
        prompts = req.prompt_ids(self.tokenizer)
        if req.stream:
            return await self.scheduler.stream(request, req, prompts)
        results = await self.scheduler.submit(prompts, req.sampling_params, req.rid, req.return_logprob,
                                     req.return_routed_experts)
        return web.json_response(results if req.is_batch else results[0])

    async def models(self, request):
        """``GET /v1/models``: OpenAI's model list, one card (what ``sglang.bench_serving`` reads)."""
        name = self.args.model_path
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(self.started), "owned_by": "rlperf", "root": name,
            "max_model_len": self.engine.context_length}]})

    # ---- admin --------------------------------------------------------------------------------
    async def pause(self, request):
        body = await json_body(request, allow_empty=True)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
        await asyncio.wrap_future(self.loop.pause(mode))
        return web.json_response({"success": True, "message": f"generation paused (mode={mode})"})

    async def resume(self, request):
        await asyncio.wrap_future(self.loop.resume())
        return web.json_response({"success": True, "message": "generation continues"})

    async def flush(self, request):
        await self._on_engine(lambda engine: engine.flush())
        return web.json_response({"success": True, "message": "Cache flushed."})

    async def abort(self, request):
        body = await json_body(request)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool) or (rid is not None and not isinstance(rid, str)):
            raise BadRequest("abort_request takes 'rid' (string) or 'abort_all' (boolean)")
        if not abort_all and rid is None:
            raise BadRequest("abort_request needs 'rid' or 'abort_all': true")
        n = await self._on_engine(lambda engine: engine.abort(None if abort_all else rid))
        return web.json_response({"success": True, "num_aborted": n})

    async def start_profile(self, request):
        body = await json_body(request, allow_empty=True)
        kw = {}
        for key, kind in (("output_dir", str), ("num_steps", int), ("with_stack", bool), ("record_shapes", bool),
                          ("profile_by_stage", bool), ("profile_id", str)):
            v = body.get(key)
            if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
                raise BadRequest(f"start_profile: '{key}' must be a {kind.__name__}, got {v!r}")
            if v is not None and key != "profile_by_stage":  # one trace covers prefill and decode together
                kw[key] = v
        acts = body.get("activities")
        if acts is not None and (not isinstance(acts, list) or not all(isinstance(a, str) for a in acts)):
            raise BadRequest("start_profile: 'activities' must be a list of strings (CPU, GPU)")

        def start(engine):
            try:
                return str(self.loop.profiler.start(activities=acts, **kw))
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        path = await self._on_engine(start)
        return web.json_response({"success": True, "message": "Start profiling.", "trace_path": path})

    async def stop_profile(self, request):
        def stop(engine):
            try:
                return str(self.loop.profiler.stop())
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        path = await self._on_engine(stop)
        return web.json_response({"success": True, "message": "Stop profiling.", "trace_path": path})

    async def profile_trace(self, request):
        """The gzip trace the last profile wrote, so ``rlperf profile run`` collects it from another host;
        its path is in the ``X-Trace-Path`` header (a caller waiting for a ``num_steps`` trace compares it)."""
        last = await self._on_engine(lambda engine: self.loop.profiler.open_last_trace())
        if last is None:
            return error_reply(404, "no profile trace has been written yet (POST /start_profile, then /stop_profile)")
        path, f = last
        with f:
            data = await asyncio.to_thread(f.read)
        return web.Response(body=data, content_type="application/gzip", headers={"X-Trace-Path": str(path)})


def serve(args: ServerArgs) -> int:
    """Load the model, start the engine thread and serve HTTP until interrupted."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    K.set_mode(args.mode)
    swept = sweep_dead_segments()  # receive files of engines killed before (SIGKILL, or with their trainer)
    if swept:
        print(f"rlperf serve: removed {len(swept)} weight-receive file(s) of exited engines: {', '.join(swept)}",
              flush=True)
    model, tokenizer = load_model(args)
    server = RolloutServer(args, model, tokenizer)
    print(f"rlperf serve: {args.model_path} on {model.device} ({type(tokenizer).__name__}), "
          f"KV cache {server.engine.kv.max_total_tokens} tokens, http://{args.host}:{args.port}", flush=True)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its requests
    web.run_app(server.app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True,
                shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    return 0

