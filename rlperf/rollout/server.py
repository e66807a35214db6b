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
  :meth:`RolloutServer.memory`), ``/get_weight_version``.
* ``GET /v1/models``: the OpenAI model list (one card: ``id`` and ``root`` are ``--model-path``).
* ``POST /generate``: ``text`` or ``input_ids``, single or batched; ``sampling_params`` (one object
  or one per prompt), ``return_logprob``, ``rid``, ``stream`` (parsed by
  :meth:`GenerateRequest.from_json`). Reply ``{text, output_ids, meta_info: {id, finish_reason,
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

Client errors are 4xx with a message, never 500 (docs/security.md): a body over its route's limit
is 413 by its Content-Length before it is read (:data:`GENERATE_BODY_BASE_BYTES` and the flags
``--max-generate-body-bytes``, ``--max-weights-body-bytes``); a body that is not UTF-8 JSON, holds
a lone surrogate or nests deeper than :data:`MAX_JSON_DEPTH` is 400, as is any value the engine or
the sampling kernel cannot take; a body that stops arriving for :data:`BODY_IDLE_TIMEOUT_S` is 408
and its connection is closed. A stopping server (SIGTERM) first kills its weight-update children, so
a join or receive under way ends at once, then gives the other requests :data:`SHUTDOWN_TIMEOUT_S`. A request that still makes an engine step fail fails alone: its
reply is an HTTP error with the engine's message (a stream: an error event), and the other
requests go on (:meth:`rlperf.rollout.engine.Engine.recover`). Profile traces go only below
``--profile-root`` (:mod:`rlperf.rollout.profiler`). No request body is ever unpickled.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch
from aiohttp import web

from rlperf import kernels as K
from rlperf.sync import SYNC_BUCKET_BYTES, PayloadError, load_bucket, receive_bucket, weights_checksum
from rlperf.telemetry.memory import process_memory

from rlperf.model.moe import encode_routed_experts
from rlperf.sync.receiver import sweep_dead_segments

from .args import ServerArgs
from .engine import BadRequest, Engine, EngineConfig, Request, SamplingParams
from .engine_loop import PAUSE_MODES, EngineLoop
from .tokenizer import has_hf_tokenizer, load_tokenizer
from .weight_groups import DistributedUpdateRequest, InitGroupRequest, WeightGroupError, WeightGroups, group_name_of

VERSION = "rlperf-0.1.0"

# Request-body limits, checked against Content-Length before a byte is read (413), and while reading
# a body without one (chunked). /generate: sized to the context length (--max-generate-body-bytes);
# /update_weights_from_tensor: inline weight buckets arrive base64-encoded (--max-weights-body-bytes);
# every other route takes a small JSON object.
GENERATE_BODY_BASE_BYTES = 1 << 20
GENERATE_BODY_BYTES_PER_TOKEN = 64
"""Default /generate limit: 1 MiB plus 64 bytes per token of the context length (a token id, or a
token's text escaped as JSON, takes far less; a batch of prompts shares it)."""
WEIGHTS_BODY_BYTES = 1 << 30
"""Default limit of ``/update_weights_from_tensor`` (one inline bucket, base64: 4/3 of its bytes)."""
DISTRIBUTED_BODY_BYTES = 8 << 20
"""Limit of ``/update_weights_from_distributed`` (names, dtypes and shapes of one bucket's tensors;
the bytes travel by broadcast)."""
OTHER_BODY_BYTES = 64 << 10
BODY_IDLE_TIMEOUT_S = 30.0
"""Seconds a request body may go without a byte arriving (a client that sends its headers and then
nothing, or stops halfway): the request gets 408 and its connection is closed."""
SHUTDOWN_TIMEOUT_S = 5.0
"""Seconds a stopping server (SIGTERM, SIGINT) waits for the requests still running before it cancels
them: weight-update joins and receives end at once (their child processes are killed first)."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and arrays a body may have (a /generate batch needs 3)."""
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


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


def generate_body_limit(context_length: int) -> int:
    """The default ``/generate`` body limit for a context length (:data:`GENERATE_BODY_BASE_BYTES`)."""
    return GENERATE_BODY_BASE_BYTES + GENERATE_BODY_BYTES_PER_TOKEN * context_length


_MAX_MESSAGE = 2000


def _error(status: int, message: str) -> web.Response:
    if len(message) > _MAX_MESSAGE:  # a message that quotes a client's value stays short
        message = message[:_MAX_MESSAGE - 3] + "..."
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _failed(message: str) -> web.Response:
    """SGLang's reply to an accepted request whose operation failed (a rendezvous, a broadcast):
    ``{"success": false, "message"}`` with status 400."""
    return web.json_response({"success": False, "message": message[:_MAX_MESSAGE]}, status=400)


class BodyTooLarge(BadRequest):
    """A request body over its route's limit: 413."""


class BodyTimeout(BadRequest):
    """A request body that stopped arriving (:data:`BODY_IDLE_TIMEOUT_S`): 408, connection closed."""


class RequestFailed(Exception):
    """A request the engine failed (SGLang's abort with a ``status_code``): answered with that status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


BODY_LIMITS = web.AppKey("rlperf_body_limits", dict)
"""The application's ``{path: (limit in bytes, the flag that sets it)}``; other paths: OTHER_BODY_BYTES."""
BODY_IDLE_TIMEOUT = web.AppKey("rlperf_body_idle_timeout", float)
"""The application's body idle timeout in seconds (default :data:`BODY_IDLE_TIMEOUT_S`)."""


def _body_limit(request: web.Request) -> tuple[int, str | None]:
    return request.app.get(BODY_LIMITS, {}).get(request.path, (OTHER_BODY_BYTES, None))


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except BodyTooLarge as exc:  # the rest of the body is not read: the connection closes after the reply
        resp = _error(413, str(exc))
        resp.force_close()
        return resp
    except BodyTimeout as exc:  # the reply, then the connection closes now (no lingering read of a body
        resp = _error(408, str(exc))  # that is not coming)
        resp.force_close()
        await resp.prepare(request)
        await resp.write_eof()
        if request.protocol is not None:
            request.protocol.force_close()
        return resp
    except RequestFailed as exc:
        return _error(exc.status, str(exc))
    except (BadRequest, PayloadError) as exc:  # a refused request, or a refused weight bucket
        return _error(400, str(exc))
    except Exception as exc:  # the server keeps serving; the client learns what went wrong
        return _error(500, f"{type(exc).__name__}: {exc}")


def _too_large(request: web.Request, size: str) -> BodyTooLarge:
    limit, flag = _body_limit(request)
    how = f" (rlperf serve {flag})" if flag else ""
    return BodyTooLarge(f"the request body is {size} bytes; {request.path} takes at most {limit} bytes{how}")


async def _read_body(request: web.Request) -> bytes:
    """The body, refused (:class:`BodyTooLarge`) by its Content-Length before reading, or as soon as
    a body without one (chunked) passes the route's limit; :class:`BodyTimeout` when no byte of it
    arrives for :data:`BODY_IDLE_TIMEOUT_S`."""
    limit, _ = _body_limit(request)
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request, str(request.content_length))
    chunks, size = [], 0
    idle = request.app.get(BODY_IDLE_TIMEOUT, BODY_IDLE_TIMEOUT_S)
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), idle)
        except asyncio.TimeoutError:
            raise BodyTimeout(f"no byte of the request body arrived for {idle:g} s "
                              f"({size} bytes read); the connection is closed") from None
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise _too_large(request, f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _not_a_json_constant(name):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def _check_tree(body, strings: bool) -> None:
    """BadRequest for nesting deeper than :data:`MAX_JSON_DEPTH` or (``strings``) a string or key with
    a lone surrogate (a ``\\ud800`` escape without its pair: not text, and no tokenizer takes it)."""
    stack = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
        values = v.values() if isinstance(v, dict) else v
        if strings:
            for t in (*v, *values) if isinstance(v, dict) else values:
                if isinstance(t, str) and not t.isascii():
                    try:
                        t.encode("utf-8")
                    except UnicodeEncodeError:
                        raise BadRequest("a string in the JSON body holds a lone surrogate (an unpaired "
                                         "\\ud800-\\udfff escape): not Unicode text") from None
        stack.extend((x, depth + 1) for x in values if type(x) is dict or type(x) is list)


async def _json_body(request: web.Request, allow_empty: bool = False) -> dict:
    """The body as a JSON object; BadRequest (400) or BodyTooLarge (413) with a message otherwise."""
    raw = await _read_body(request)
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_not_a_json_constant)
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8: {exc}") from None
    except RecursionError:
        raise BadRequest(f"the JSON body nests too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # JSONDecodeError, an integer of more than 4300 digits, NaN
        raise BadRequest(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_tree(body, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _model_type(cfg) -> dict:
    """``model_type`` and ``architectures`` as transformers names the model (dense or MoE)."""
    if cfg.num_experts:
        return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}


@dataclasses.dataclass
class GenerateRequest:
    """A ``/generate`` body, checked and normalised to one entry per prompt (SGLang's ``GenerateReqInput``).

    Exactly one of ``text`` and ``input_ids`` is set. ``is_batch`` says whether the body was a batch
    (the reply is then a list, or stream chunks carry ``index``). Other fields SGLang clients send
    (``lora_path: null``, ``logprob_start_len``, ``return_text_in_logprobs``, ...) are ignored.
    """

    text: list[str] | None
    input_ids: list[list[int]] | None
    sampling_params: list[SamplingParams]
    return_logprob: list[bool]
    rid: list[str | None]
    stream: bool = False
    is_batch: bool = False
    return_routed_experts: list[bool] | None = None

    def __len__(self) -> int:
        return len(self.sampling_params)

    @classmethod
    def from_json(cls, body: dict) -> "GenerateRequest":
        """Parse a decoded JSON body; :class:`BadRequest` naming the field on anything wrong."""
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise BadRequest("give exactly one of 'text' and 'input_ids'")
        if text is not None:
            if isinstance(text, str):
                batch, text = False, [text]
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                batch, text = True, list(text)
            else:
                raise BadRequest("'text' must be a string or a non-empty list of strings")
            n = len(text)
        else:
            if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
                batch, input_ids = True, [list(p) for p in input_ids]
            elif isinstance(input_ids, list):
                batch, input_ids = False, [list(input_ids)]
            else:
                raise BadRequest("'input_ids' must be a list of token ids or a non-empty list of such lists")
            for p in input_ids:
                if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise BadRequest("'input_ids' must hold non-empty lists of integers")
            n = len(input_ids)

        def per_prompt(key, default, check, what):
            v = body.get(key, default)
            if v is None:
                v = default
            if batch and isinstance(v, list):
                if len(v) != n:
                    raise BadRequest(f"'{key}' has {len(v)} entries for {n} prompts")
                vals = v
            else:
                vals = [v] * n
            for x in vals:
                if not check(x):
                    raise BadRequest(f"'{key}' must be {what}, got {x!r}")
            return vals

        sps = [SamplingParams.from_dict(d) for d in per_prompt("sampling_params", {}, lambda x: isinstance(x, dict), "an object")]
        lps = per_prompt("return_logprob", False, lambda x: isinstance(x, bool), "a boolean")
        routed = per_prompt("return_routed_experts", False, lambda x: isinstance(x, bool), "a boolean")
        rid = body.get("rid")
        if rid is None:
            rids = [None] * n
        elif batch and isinstance(rid, list) and len(rid) == n and all(isinstance(x, str) for x in rid):
            rids = list(rid)
        elif isinstance(rid, str):
            rids = [rid] if not batch else [f"{rid}-{i}" for i in range(n)]
        else:
            raise BadRequest("'rid' must be a string (or a list of strings, one per prompt)")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest(f"'stream' must be a boolean, got {stream!r}")
        return cls(text=text, input_ids=input_ids, sampling_params=sps, return_logprob=lps, rid=rids,
                   stream=bool(stream), is_batch=batch, return_routed_experts=routed)

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """The prompts as token ids (``text`` encoded with ``tokenizer``)."""
        return self.input_ids if self.input_ids is not None else [tokenizer.encode(t) for t in self.text]


def _failure(reply: dict) -> tuple[int, str] | None:
    """(status, message) of a reply whose request the engine failed (an abort with a ``status_code``:
    :meth:`rlperf.rollout.engine.Engine.recover`), else None."""
    reason = reply["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort" and reason.get("status_code"):
        return reason["status_code"], reason.get("message", "the request failed")
    return None


def _sse(chunk) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


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


class RolloutServer:
    """The aiohttp application around one :class:`EngineLoop`."""

    def __init__(self, args: ServerArgs, model, tokenizer):
        self.args, self.model, self.tokenizer = args, model, tokenizer
        config = EngineConfig(max_running_requests=args.max_running_requests,
                              chunked_prefill_size=args.chunked_prefill_size, max_total_tokens=args.max_total_tokens,
                              mem_fraction_static=args.mem_fraction_static, context_length=args.context_length,
                              random_seed=args.random_seed, cuda_graph_max_bs=default_cuda_graph_max_bs(args, model),
                              attention_backend=args.attention_backend)
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
        self.weight_groups = WeightGroups(model.device)
        """Disaggregated weight sync: the process groups this engine joined (SGLang's /init_weights_update_group)."""
        self.weights_bytes = sum(t.numel() * t.element_size() for t in model.hf_state_dict().values())
        for limit, flag in self.body_limits.values():
            if flag and limit <= 0:
                raise ValueError(f"{flag} must be positive, got {limit}")

        @web.middleware
        async def body_limit(request: web.Request, handler):
            """Refuse a body by its Content-Length before anything reads it (:func:`_read_body` bounds the rest)."""
            if request.content_length is not None and request.content_length > _body_limit(request)[0]:
                raise _too_large(request, str(request.content_length))
            return await handler(request)

        self.app = web.Application(middlewares=[_errors, body_limit],
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
                 "/update_weights_from_tensor": self.update_weights,
                 "/init_weights_update_group": self.init_weights_update_group,
                 "/update_weights_from_distributed": self.update_weights_from_distributed,
                 "/destroy_weights_update_group": self.destroy_weights_update_group}
        for path, handler in admin.items():
            r.add_post(path, self._admin(handler))
        for path in ("/flush_cache", "/start_profile", "/stop_profile"):  # SGLang takes GET there too
            r.add_get(path, self._admin(admin[path]))
        r.add_get("/profile_trace", self._admin(self.profile_trace))
        r.add_get("/weights_checksum", self._admin(self.weights_checksum))

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
        print(f"rlperf serve: warm-up done in {seconds:.1f} s ({graphs} CUDA graphs captured)", flush=True)
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
            return _error(503, f"the engine thread is not running: {self.loop.error or 'stopped'}")
        if self.warmup_error is not None:
            return _error(503, "the warm-up failed: " + self.warmup_error.splitlines()[-1])
        if not self.ready:
            return _error(503, "warming up: compiling kernels and capturing CUDA graphs")
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
                    return _error(401, "this endpoint needs the server's API key (Authorization: Bearer <key>)")
            return await handler(request)
        return wrapped

    async def _on_engine(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

    # ---- info ---------------------------------------------------------------------------------
    async def health(self, request):
        broken = self.weight_groups.broken()
        if broken:
            return _error(503, "; ".join(broken) + ": this engine cannot take a weight update")
        return self._not_ready() or web.Response(text="")

    async def health_generate(self, request):
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        if self.loop.paused:  # a paused engine would hold the probe until /continue_generation
            return _error(503, "generation is paused")
        try:
            results = await self._submit([[0]], [SamplingParams(max_new_tokens=1, temperature=0.0)], [None], [False])
        except RequestFailed as exc:
            return _error(503, f"health generate failed: {exc}")
        if results[0]["meta_info"]["finish_reason"]["type"] == "abort":
            return _error(503, "health generate was aborted: " + str(results[0]["meta_info"]["finish_reason"]))
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
    def _reply(self, r: Request, return_logprob: bool, t0: float, n: int | None = None, text: str | None = None) -> dict:
        """SGLang's reply for ``r``: the final one, or (``n``) a stream chunk of its first ``n`` tokens.

        A chunk is read on the event loop while the engine thread appends to ``r``: tokens before
        ``n`` (and their log-probs) are already written and never change.
        """
        final = n is None
        ids = list(r.output_ids) if final else r.output_ids[:n]
        meta = {"id": r.rid, "finish_reason": r.finish_reason if final else None, "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": self.engine.weight_version}
        if final:
            meta["e2e_latency"] = time.time() - t0
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.output_logprobs, ids)]
        if final and r.return_routed_experts and r.routed_chunks:  # none when it never ran a step
            meta["routed_experts"] = encode_routed_experts(r.result().routed_experts, self.engine.model.cfg)
        return {"text": r.text if final else text, "output_ids": ids, "meta_info": meta}

    async def _start(self, prompts, params, rids, return_logprob, on_finish, on_token=None,
                     return_routed_experts=None) -> tuple[list[Request], float]:
        """Queue the requests (all or none) and return them with their start time.

        On the event loop: ``on_finish(i, reply)`` once when request ``i`` finishes, and
        ``on_token(i, n)`` when it has ``n`` tokens and goes on (streaming only).
        """
        aio = asyncio.get_running_loop()
        t0 = time.time()
        routed = return_routed_experts or [False] * len(prompts)

        def add_all(engine: Engine):
            added = []
            try:
                for i, (p, sp, rid, lp, re) in enumerate(zip(prompts, params, rids, return_logprob, routed)):
                    def done(r, i=i, lp=lp):
                        aio.call_soon_threadsafe(on_finish, i, self._reply(r, lp, t0))

                    def token(r, i=i):
                        aio.call_soon_threadsafe(on_token, i, len(r.output_ids))
                    added.append(engine.add_request(p, sp, rid, on_finish=done, on_token=token if on_token else None,
                                                    return_routed_experts=re))
            except BaseException:
                for r in added:  # all or nothing: a bad prompt in a batch runs none of it
                    r.on_finish = r.on_token = None
                    engine.abort(r.rid)
                raise
            return added

        return await self._on_engine(add_all), t0

    def _abort_later(self, reqs: list[Request], message: str = "client disconnected") -> None:
        """Abort those of ``reqs`` still in the engine (between steps; nobody waits for it)."""
        def abort(engine: Engine):
            for r in reqs:
                if engine.requests.get(r.rid) is r:
                    engine.abort(r.rid, message)
        self.loop.call(abort)

    async def _submit(self, prompts, params, rids, return_logprob, return_routed_experts=None) -> list[dict]:
        futures = [asyncio.get_running_loop().create_future() for _ in prompts]

        def finished(i, reply):
            if not futures[i].done():
                futures[i].set_result(reply)

        reqs, _ = await self._start(prompts, params, rids, return_logprob, finished,
                                    return_routed_experts=return_routed_experts)
        try:
            results = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # the client went away: stop spending steps on it
            self._abort_later(reqs)
            raise
        for i, reply in enumerate(results):
            failure = _failure(reply)
            if failure is not None:  # as SGLang answers an abort with a status code: the request's error
                status, message = failure
                raise RequestFailed(status, message if len(results) == 1 else f"request {i} of the batch: {message}")
        return results

    def _chunk(self, r: Request, return_logprob: bool, t0: float, n: int, prev_text: str) -> dict:
        """A stream chunk of ``r``'s first ``n`` tokens; its text is ``prev_text`` while the new text
        ends in a character cut in the middle (U+FFFD), as SGLang holds it back."""
        text = self.tokenizer.decode(r.output_ids[:n], skip_special_tokens=r.params.skip_special_tokens)
        return self._reply(r, return_logprob, t0, n=n, text=prev_text if text.endswith("\ufffd") else text)

    async def _stream(self, request: web.Request, req: GenerateRequest, prompts) -> web.StreamResponse:
        """Server-sent events of ``req`` (module docstring): cumulative chunks, then ``[DONE]``."""
        updates: asyncio.Queue = asyncio.Queue()  # (i, n tokens so far) or (i, final reply), in engine order
        reqs, t0 = await self._start(prompts, req.sampling_params, req.rid, req.return_logprob,
                                     on_finish=lambda i, reply: updates.put_nowait((i, reply)),
                                     on_token=lambda i, n: updates.put_nowait((i, n)),
                                     return_routed_experts=req.return_routed_experts)
        finished, texts = [False] * len(reqs), [""] * len(reqs)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            try:
                while not all(finished):
                    latest = dict([await updates.get()])
                    while not updates.empty():  # the engine ran ahead of the client: one chunk per request
                        i, u = updates.get_nowait()
                        latest[i] = u
                    out = []
                    for i, u in sorted(latest.items()):
                        if isinstance(u, dict):
                            chunk, finished[i] = u, True
                            failure = _failure(u)
                            if failure is not None:  # the request failed in the engine: its error event
                                chunk = {"error": {"message": failure[1], "code": failure[0]}}
                        else:
                            chunk = self._chunk(reqs[i], req.return_logprob[i], t0, u, texts[i])
                            texts[i] = chunk["text"]
                        out.append(_sse({**chunk, "index": i} if req.is_batch else chunk))
                    await resp.write(b"".join(out))
            except ConnectionError:
                raise
            except Exception as exc:  # the headers are out: the error goes as an event, as SGLang sends it
                await resp.write(_sse({"error": {"message": f"{type(exc).__name__}: {exc}", "code": 500}}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:  # cancelled (the client went away), a write to a closed connection, or an error above
            if not all(finished):
                self._abort_later([r for r, f in zip(reqs, finished) if not f], "the stream ended early")

    async def generate(self, request):
        req = GenerateRequest.from_json(await _json_body(request))
        prompts = req.prompt_ids(self.tokenizer)
        if req.stream:
            return await self._stream(request, req, prompts)
        results = await self._submit(prompts, req.sampling_params, req.rid, req.return_logprob,
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
        body = await _json_body(request, allow_empty=True)
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
        body = await _json_body(request)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool) or (rid is not None and not isinstance(rid, str)):
            raise BadRequest("abort_request takes 'rid' (string) or 'abort_all' (boolean)")
        if not abort_all and rid is None:
            raise BadRequest("abort_request needs 'rid' or 'abort_all': true")
        n = await self._on_engine(lambda engine: engine.abort(None if abort_all else rid))
        return web.json_response({"success": True, "num_aborted": n})

    async def start_profile(self, request):
        body = await _json_body(request, allow_empty=True)
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
            return _error(404, "no profile trace has been written yet (POST /start_profile, then /stop_profile)")
        path, f = last
        with f:
            data = await asyncio.to_thread(f.read)
        return web.Response(body=data, content_type="application/gzip", headers={"X-Trace-Path": str(path)})

    async def update_weights(self, request):
        body = await _json_body(request)
        if body.get("load_format") != "flattened_bucket":
            raise BadRequest(f"load_format must be 'flattened_bucket', got {body.get('load_format')!r}")
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != 1:
            raise BadRequest("serialized_named_tensors must be a list with one bucket payload (tp_size is 1)")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise BadRequest(f"weight_version must be a string, got {version!r}")
        flush = body.get("flush_cache", False)
        abort_all = body.get("abort_all_requests", False)
        if not isinstance(flush, bool) or not isinstance(abort_all, bool):
            raise BadRequest("flush_cache and abort_all_requests must be booleans")
        bucket = await asyncio.to_thread(receive_bucket, payloads[0], self.model.device)

        def apply(engine: Engine):
            if abort_all:
                engine.abort(None, "aborted for a weight update")
            names = load_bucket(bucket, engine.model.hf_state_dict())
            self._weights_loaded(engine, version, flush)
            return names
        names = await self._on_engine(apply)
        return web.json_response({"success": True, "message": f"loaded {len(names)} tensors",
                                  "weight_version": self.engine.weight_version})

    def _hf_weights(self, engine: Engine) -> dict:
        """``engine.model.hf_state_dict()``, built once per model (hundreds of views: a bucket request of
        a large model would rebuild them every time); they stay valid because every load copies into
        the parameters in place."""
        cached = getattr(self, "_hf_weights_cache", None)
        if cached is None or cached[0] is not engine.model:
            cached = self._hf_weights_cache = (engine.model, engine.model.hf_state_dict())
        return cached[1]

    def _weights_loaded(self, engine: Engine, version: str | None, flush: bool, synchronize: bool = False) -> None:
        """On the engine thread, after either update endpoint loaded weights: the new ``weight_version``,
        and with ``flush`` a KV-cache flush when idle; ``synchronize`` waits for the device, so the reply
        means the weights are in place (not only queued)."""
        if version is not None:
            engine.weight_version = version
        if flush and not engine.has_work():
            engine.flush()
        if synchronize and engine.model.device.type == "cuda":
            torch.cuda.synchronize(engine.model.device)

    async def weights_checksum(self, request):
        """``GET /weights_checksum``: :func:`rlperf.sync.weights_checksum` of the engine's weights (computed
        on the engine thread, between steps), with ``weight_version``: what a sender compares after a sync."""
        raw = request.query.get("bucket_bytes")
        bucket_bytes = SYNC_BUCKET_BYTES
        if raw is not None:
            if not raw.isascii() or not raw.isdigit() or len(raw) > 14 or not 0 < int(raw) <= 1 << 40:
                raise BadRequest(f"'bucket_bytes' must be an integer in [1, {1 << 40}], got {raw[:40]!r}")
            bucket_bytes = int(raw)
        checksum, version = await self._on_engine(
            lambda engine: (weights_checksum(engine.model.hf_state_dict(), bucket_bytes), engine.weight_version))
        return web.json_response({"weights_checksum": checksum, "weight_version": version, "bucket_bytes": bucket_bytes})

    # ---- disaggregated weight sync (rlperf.rollout.weight_groups) ------------------------------------
    async def init_weights_update_group(self, request):
        req = InitGroupRequest.from_json(await _json_body(request))
        try:
            message = await self.weight_groups.join(req)
        except WeightGroupError as exc:
            return _failed(str(exc))
        return web.json_response({"success": True, "message": message})

    async def update_weights_from_distributed(self, request):
        req = DistributedUpdateRequest.from_json(await _json_body(request), self.weights_bytes)
        groups = self.weight_groups
        groups.require(req.group_name)
        received = None
        if groups.isolated(req.group_name):  # gloo: the bytes arrive in the group's child, generation goes on
            try:
                received = await groups.receive_isolated(req)
            except WeightGroupError as exc:
                return _failed(str(exc))

        def apply(engine: Engine):
            if req.abort_all_requests:
                engine.abort(None, "aborted for a weight update")
            if received is not None:
                n = groups.load_received(req, received, self._hf_weights(engine))
            else:
                n = groups.receive(req, self._hf_weights(engine))
            self._weights_loaded(engine, req.weight_version, req.flush_cache, synchronize=req.flush_cache)
            return n
        try:
            n = await self._on_engine(apply)
        except WeightGroupError as exc:
            return _failed(str(exc))
        message = "Succeeded to update parameter online."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return web.json_response({"success": True, "message": message, "num_tensors": n,
                                  "weight_version": self.engine.weight_version})

    async def destroy_weights_update_group(self, request):
        name = group_name_of(await _json_body(request, allow_empty=True))
        if not await self._on_engine(lambda engine: self.weight_groups.leave(name)):
            return _failed(f"The group to be destroyed does not exist: this engine is in no group named {name!r}.")
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})


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

