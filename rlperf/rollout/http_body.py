"""The wire of ``rlperf serve``: request-body limits, reading a body, decoding and checking its JSON,
and the error replies every route shares.

Client errors are 4xx with one message, never 500 (docs/security.md): a body over its route's limit is
413 by its Content-Length before it is read (:data:`GENERATE_BODY_BASE_BYTES` and the flags
``--max-generate-body-bytes``, ``--max-weights-body-bytes``); a body that is not UTF-8 JSON, holds a
lone surrogate or nests deeper than :data:`MAX_JSON_DEPTH` is 400, as is any value the engine or the
sampling kernel cannot take; a body that stops arriving for :data:`BODY_IDLE_TIMEOUT_S` is 408 and its
connection is closed. No request body is ever unpickled.
"""
from __future__ import annotations

import asyncio
import json
import re

from aiohttp import web

from rlperf.sync import PayloadError

from .engine import BadRequest

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
MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and arrays a body may have (a /generate batch needs 3)."""
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def generate_body_limit(context_length: int) -> int:
    """The default ``/generate`` body limit for a context length (:data:`GENERATE_BODY_BASE_BYTES`)."""
    return GENERATE_BODY_BASE_BYTES + GENERATE_BODY_BYTES_PER_TOKEN * context_length


_MAX_MESSAGE = 2000


def error_reply(status: int, message: str) -> web.Response:
    """The reply to a refused request: ``{"error": {"message", "code"}}`` with ``status``."""
    if len(message) > _MAX_MESSAGE:  # a message that quotes a client's value stays short
        message = message[:_MAX_MESSAGE - 3] + "..."
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def failed_reply(message: str) -> web.Response:
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


def body_limit_of(request: web.Request) -> tuple[int, str | None]:
    return request.app.get(BODY_LIMITS, {}).get(request.path, (OTHER_BODY_BYTES, None))


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every route's exceptions as replies: a refused body 413 or 408 (connection closed), a failed request its
    status, a refused request or weight bucket 400, anything else 500 with its message (the server goes on)."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except BodyTooLarge as exc:  # the rest of the body is not read: the connection closes after the reply
        resp = error_reply(413, str(exc))
        resp.force_close()
        return resp
    except BodyTimeout as exc:  # the reply, then the connection closes now (no lingering read of a body
        resp = error_reply(408, str(exc))  # that is not coming)
        resp.force_close()
        await resp.prepare(request)
        await resp.write_eof()
        if request.protocol is not None:
            request.protocol.force_close()
        return resp
    except RequestFailed as exc:
        return error_reply(exc.status, str(exc))
    except (BadRequest, PayloadError) as exc:  # a refused request, or a refused weight bucket
        return error_reply(400, str(exc))
    except Exception as exc:  # the server keeps serving; the client learns what went wrong
        return error_reply(500, f"{type(exc).__name__}: {exc}")


@web.middleware
async def body_limit_middleware(request: web.Request, handler):
    """Refuse a body by its Content-Length before anything reads it (:func:`_read_body` bounds the rest)."""
    if request.content_length is not None and request.content_length > body_limit_of(request)[0]:
        raise _too_large(request, str(request.content_length))
    return await handler(request)


def _too_large(request: web.Request, size: str) -> BodyTooLarge:
    limit, flag = body_limit_of(request)
    how = f" (rlperf serve {flag})" if flag else ""
    return BodyTooLarge(f"the request body is {size} bytes; {request.path} takes at most {limit} bytes{how}")


async def _read_body(request: web.Request) -> bytes:
    """The body, refused (:class:`BodyTooLarge`) by its Content-Length before reading, or as soon as
    a body without one (chunked) passes the route's limit; :class:`BodyTimeout` when no byte of it
    arrives for :data:`BODY_IDLE_TIMEOUT_S`."""
    limit, _ = body_limit_of(request)
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


async def json_body(request: web.Request, allow_empty: bool = False) -> dict:
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
