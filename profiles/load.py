"""The built-in load generator of ``rlperf profile run``: requests through the router, a request log.

Prompts are random token ids (``input_len`` of them, drawn from ids 10..249, which every vocabulary
has, so a prompt is exactly ``input_len`` tokens for any tokenizer) or the lines of a jsonl file
(``{"text": ...}``, ``{"prompt": ...}`` or ``{"input_ids": [...]}``, optionally ``"max_new_tokens"``).
Every request asks for ``output_len`` tokens with ``ignore_eos`` (so decode lengths are what was
asked) and its own ``sampling_seed``; ``concurrency`` requests are in flight at a time.

Each request becomes a :class:`RequestRecord` (wall-clock start/end in seconds since the epoch,
the same clock as the workers' traces, and the token counts the server reported).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import threading
import time
from pathlib import Path

from rlperf.data.jsonl import iter_json_objects

from .control import ProfileError, ProfileUsageError, request

TOKEN_ID_RANGE = (10, 250)  # below every real vocabulary's size, and past control ids 0..9


@dataclasses.dataclass
class LoadSpec:
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    concurrency: int = 8
    dataset: str | None = None
    """A jsonl file of prompts; None: random token ids."""
    seed: int = 0
    temperature: float = 1.0


@dataclasses.dataclass
class RequestRecord:
    index: int
    start: float
    """Wall-clock seconds since the epoch when the request was sent."""
    end: float
    prompt_tokens: int
    completion_tokens: int
    ok: bool
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


def make_prompts(spec: LoadSpec) -> list[dict]:
    """One ``/generate`` body per request (without sampling params' seed, added per request);
    ProfileUsageError naming the flag when the numbers or the ``--dataset`` file are not usable."""
    if spec.num_prompts <= 0 or spec.output_len <= 0 or spec.concurrency <= 0:
        raise ProfileUsageError("--num-prompts, --output-len and --concurrency must be positive")
    rng = random.Random(spec.seed)
    if spec.dataset is None:
        if spec.input_len <= 0:
            raise ProfileUsageError("--input-len must be positive")
        return [{"input_ids": [rng.randrange(*TOKEN_ID_RANGE) for _ in range(spec.input_len)],
                 "max_new_tokens": spec.output_len} for _ in range(spec.num_prompts)]
    path = Path(spec.dataset)
    if not path.is_file():
        raise ProfileUsageError(f"--dataset {path}: no such file")
    rows = []
    for n, row in iter_json_objects(path, lambda message: ProfileUsageError(f"--dataset {message}")):
        text = row.get("text", row.get("prompt"))
        body = {"input_ids": row["input_ids"]} if "input_ids" in row else {"text": text}
        if body.get("text") is None and "input_ids" not in body:
            raise ProfileUsageError(f"--dataset {path}:{n}: needs 'text', 'prompt' or 'input_ids'")
        body["max_new_tokens"] = int(row.get("max_new_tokens", spec.output_len))
        rows.append(body)
    if not rows:
        raise ProfileUsageError(f"--dataset {path}: no prompts")
    # cycle through the file when asked for more prompts than it has
    return [dict(rows[i % len(rows)]) for i in range(spec.num_prompts)]


def run_load(router_url: str, spec: LoadSpec, api_key: str | None = None, timeout: float = 600.0,
             stop_event: threading.Event | None = None) -> tuple[list[RequestRecord], float, float]:
    """Send every prompt through ``POST {router}/generate``; returns (records, wall start, wall end)."""
    prompts = make_prompts(spec)
    url = router_url.rstrip("/") + "/generate"

    def one(i: int, body: dict) -> RequestRecord:
        n = body.pop("max_new_tokens")
        body["sampling_params"] = {"max_new_tokens": n, "ignore_eos": True, "temperature": spec.temperature,
                                   "sampling_seed": spec.seed * 1_000_003 + i}
        t0 = time.time()
        if stop_event is not None and stop_event.is_set():
            return RequestRecord(i, t0, t0, 0, 0, False, "not sent: the run was stopped")
        try:
            status, reply = request(url, body, timeout=timeout, api_key=api_key)
        except ProfileError as exc:
            return RequestRecord(i, t0, time.time(), 0, 0, False, str(exc))
        t1 = time.time()
        if status != 200 or not isinstance(reply, dict) or "meta_info" not in reply:
            return RequestRecord(i, t0, t1, 0, 0, False, f"HTTP {status}: {str(reply)[:300]}")
        m = reply["meta_info"]
        aborted = (m.get("finish_reason") or {}).get("type") == "abort"
        return RequestRecord(i, t0, t1, int(m.get("prompt_tokens", 0)), int(m.get("completion_tokens", 0)),
                             not aborted, str(m.get("finish_reason")) if aborted else None)

    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(spec.concurrency, thread_name_prefix="rlperf-load") as pool:
        records = list(pool.map(lambda ib: one(*ib), enumerate(prompts)))
    return records, start, time.time()
