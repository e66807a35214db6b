"""Scheduling of ``/generate`` requests on the engine thread and their replies in SGLang's shape.

:class:`GenerateScheduler` queues a request's prompts on the engine thread (all or none), waits for
them on the event loop and turns each finished :class:`rlperf.rollout.engine.Request` into SGLang's
reply (``text``, ``output_ids``, ``meta_info``), or streams it as server-sent events: cumulative
chunks, then the final reply, then ``data: [DONE]``. A client that goes away has its requests aborted
in the engine; a request the engine failed is a :class:`rlperf.rollout.http_body.RequestFailed` with
the engine's status and message (a stream: an error event).
"""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from rlperf.model.moe import encode_routed_experts

from .engine import Engine, Request
from .engine_loop import EngineLoop
from .generate_request import GenerateRequest
from .http_body import RequestFailed


def engine_failure(reply: dict) -> tuple[int, str] | None:
    """(status, message) of a reply whose request the engine failed (an abort with a ``status_code``:
    :meth:`rlperf.rollout.engine.Engine.recover`), else None."""
    reason = reply["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort" and reason.get("status_code"):
        return reason["status_code"], reason.get("message", "the request failed")
    return None


def sse(chunk) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class GenerateScheduler:
    """Generation requests of one server: ``loop`` (its :class:`EngineLoop`) runs them, ``tokenizer``
    decodes stream chunks. Every method runs on the event loop."""

    def __init__(self, loop: EngineLoop, tokenizer):
        self.loop, self.tokenizer = loop, tokenizer

    @property
    def engine(self) -> Engine:
        return self.loop.engine

    async def _on_engine(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

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

    async def submit(self, prompts, params, rids, return_logprob, return_routed_experts=None) -> list[dict]:
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
            failure = engine_failure(reply)
            if failure is not None:  # as SGLang answers an abort with a status code: the request's error
                status, message = failure
                raise RequestFailed(status, message if len(results) == 1 else f"request {i} of the batch: {message}")
        return results

    def _chunk(self, r: Request, return_logprob: bool, t0: float, n: int, prev_text: str) -> dict:
        """A stream chunk of ``r``'s first ``n`` tokens; its text is ``prev_text`` while the new text
        ends in a character cut in the middle (U+FFFD), as SGLang holds it back."""
        text = self.tokenizer.decode(r.output_ids[:n], skip_special_tokens=r.params.skip_special_tokens)
        return self._reply(r, return_logprob, t0, n=n, text=prev_text if text.endswith("\ufffd") else text)

    async def stream(self, request: web.Request, req: GenerateRequest, prompts) -> web.StreamResponse:
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
                            failure = engine_failure(u)
                            if failure is not None:  # the request failed in the engine: its error event
                                chunk = {"error": {"message": failure[1], "code": failure[0]}}
                        else:
                            chunk = self._chunk(reqs[i], req.return_logprob[i], t0, u, texts[i])
                            texts[i] = chunk["text"]
                        out.append(sse({**chunk, "index": i} if req.is_batch else chunk))
                    await resp.write(b"".join(out))
            except ConnectionError:
                raise
            except Exception as exc:  # the headers are out: the error goes as an event, as SGLang sends it
                await resp.write(sse({"error": {"message": f"{type(exc).__name__}: {exc}", "code": 500}}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:  # cancelled (the client went away), a write to a closed connection, or an error above
            if not all(finished):
                self._abort_later([r for r, f in zip(reqs, finished) if not f], "the stream ended early")
