"""Start and stop torch.profiler traces on every worker behind an ``sglang-router``.

What slime's ``tools/profile_rollout.py`` does: ``GET {router}/workers``, then ``POST
{worker}/start_profile`` (or ``/stop_profile``) on each worker it lists. The body of
``/start_profile`` uses SGLang's field names (``output_dir``, ``num_steps``, ``activities``,
``profile_by_stage``, ``with_stack``, ``record_shapes``), so any SGLang-compatible worker takes it.

Every failure is a :class:`ProfileError` whose message names the URL and what it answered; the
CLI prints it and exits 1.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import socket
import urllib.error
import urllib.request

ACTIVITIES = ("GPU", "CPU", "MEM")
"""Values of ``--activities`` (SGLang's names; ``MEM`` is SGLang's memory snapshot, which an rlperf server
refuses as unknown)."""


class ProfileError(RuntimeError):
    """A router or worker that cannot be reached, lists nothing, or refuses a profile command."""


class ProfileUsageError(ProfileError):
    """Bad flags or input files of ``rlperf profile`` (exit 2, not 1): found before anything starts."""


@dataclasses.dataclass
class StartOptions:
    """The ``/start_profile`` body (SGLang's ``ProfileReqInput`` field names)."""

    output_dir: str | None = None
    """Where each worker writes ``{profile_id}-TP-{rank}.trace.json.gz`` (a path on the worker's host)."""
    num_steps: int | None = None
    """Stop by itself after this many engine steps (None: run until ``/stop_profile``)."""
    activities: list[str] | None = None
    """Subset of :data:`ACTIVITIES`; None lets the worker choose (CPU, plus GPU when it has one)."""
    profile_by_stage: bool = False
    with_stack: bool = False
    record_shapes: bool = False

    def body(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        for flag in ("profile_by_stage", "with_stack", "record_shapes"):
            if not out[flag]:
                del out[flag]  # only send what was asked for: older SGLang builds reject unknown keys
        return out


def http(url: str, body=None, timeout: float = 30.0, api_key: str | None = None) -> tuple[int, bytes, dict]:
    """``(status, body bytes, headers)`` of a GET (``body`` None) or JSON POST; 4xx/5xx are returned.

    ProfileError when the URL cannot be reached at all.
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers or {})
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ProfileError(f"cannot reach {url}: {reason}") from None


def request(url: str, body=None, timeout: float = 30.0, api_key: str | None = None):
    """``(status, decoded JSON or text)`` of :func:`http`."""
    status, payload, _ = http(url, body, timeout, api_key)
    try:
        return status, json.loads(payload) if payload else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return status, payload.decode(errors="replace")


def _message(payload) -> str:
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err or payload.get("message") or payload)
    return str(payload)[:500]


def list_workers(router_url: str, api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    """Worker URLs the router lists at ``GET /workers``, sorted; ProfileError if none or unreachable."""
    router_url = router_url.rstrip("/")
    status, body = request(router_url + "/workers", timeout=timeout, api_key=api_key)
    if status == 401:  # a router started with a key (rlperf serve --router N --api-key) asks for it here too
        raise ProfileError(f"{router_url}/workers answered HTTP 401: " + (
            "the router refused the API key" if api_key else "the router needs the API key (--api-key or RLPERF_API_KEY)"))
    if status != 200:
        raise ProfileError(f"{router_url}/workers answered HTTP {status}: {_message(body)}")
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list):
        raise ProfileError(f"{router_url}/workers did not answer a worker list (is this an sglang-router?): {body!r:.300}")
    urls = sorted({w["url"] if isinstance(w, dict) else str(w) for w in workers if w})
    if not urls:
        raise ProfileError(f"the router at {router_url} lists no workers: nothing to profile")
    return urls


@dataclasses.dataclass
class WorkerReply:
    url: str
    trace_path: str | None
    """The trace path the worker reports (rlperf servers do; SGLang does not)."""
    message: str


def _each(workers: list[str], path: str, body: dict, api_key: str | None, timeout: float):
    """(replies of the workers that accepted, messages of those that refused or could not be reached).

    The workers are asked at the same time: starting or stopping torch.profiler takes seconds, and
    one after another would give each worker a different window.
    """
    def ask(url: str):
        try:
            status, payload = request(url.rstrip("/") + path, body, timeout=timeout, api_key=api_key)
        except ProfileError as exc:
            return None, str(exc)
        if status != 200 or (isinstance(payload, dict) and payload.get("success") is False):
            return None, f"{url}{path} refused (HTTP {status}): {_message(payload)}"
        trace = payload.get("trace_path") if isinstance(payload, dict) else None
        return WorkerReply(url, trace, _message(payload) if isinstance(payload, dict) else str(payload)), None

    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(workers), 32))) as pool:
        answers = list(pool.map(ask, workers))
    return [r for r, _ in answers if r is not None], [f for _, f in answers if f is not None]


def start(workers: list[str], options: StartOptions, api_key: str | None = None, timeout: float = 60.0) -> list[WorkerReply]:
    """POST ``/start_profile`` to every worker; ProfileError naming each one that refused.

    All or nothing: when one refuses, the workers that did start are stopped again (their traces are
    written, as any stop writes them) so a failed start leaves no profiler running.
    """
    bad = [a for a in options.activities or [] if a not in ACTIVITIES]
    if bad:
        raise ProfileError(f"unknown activities {bad}; choose from {list(ACTIVITIES)}")
    replies, failures = _each(workers, "/start_profile", options.body(), api_key, timeout)
    if failures:
        undone = ""
        if replies:
            stopped, _ = _each([r.url for r in replies], "/stop_profile", {}, api_key, 300.0)
            undone = f"\n(stopped again on {', '.join(r.url for r in stopped)}, which had started)"
        raise ProfileError("\n".join(failures) + undone)
    return replies


def stop(workers: list[str], api_key: str | None = None, timeout: float = 300.0) -> list[WorkerReply]:
    """POST ``/stop_profile`` to every worker (writing a trace can take a while: long timeout)."""
    replies, failures = _each(workers, "/stop_profile", {}, api_key, timeout)
    if failures:
        done = f"\n(it stopped on {', '.join(r.url for r in replies)})" if replies else ""
        raise ProfileError("\n".join(failures) + done)
    return replies
