"""The weight-update endpoints of ``rlperf serve`` (SGLang's names and fields).

* ``/update_weights_from_tensor`` (``load_format: "flattened_bucket"``): one bucket, received and checked
  by :mod:`rlperf.sync.transports` off the event loop, loaded on the engine thread between steps.
* ``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``:
  disaggregated weight sync, a broadcast from rank 0 of a weight-update group
  (:mod:`rlperf.rollout.weight_groups`); with gloo the bytes arrive in the group's child process while
  generation goes on.
* ``GET /weights_checksum``: :func:`rlperf.sync.weights_checksum` of the engine's weights and its
  ``weight_version``, what a sender compares after any update.

Every load copies into the engine's parameters in place, so the engine's CUDA graphs and the cached
Hugging Face views (:meth:`WeightUpdates.hf_weights`) stay valid. A failed rendezvous or broadcast is
SGLang's ``{"success": false, "message"}`` with status 400.
"""
from __future__ import annotations

import asyncio

import torch
from aiohttp import web

from rlperf.sync import SYNC_BUCKET_BYTES, load_bucket, receive_bucket, weights_checksum

from .engine import BadRequest, Engine
from .engine_loop import EngineLoop
from .http_body import failed_reply, json_body
from .weight_groups import DistributedUpdateRequest, InitGroupRequest, WeightGroupError, WeightGroups, group_name_of


class WeightUpdates:
    """The weight-update routes of one server whose engine thread is ``loop``; :attr:`groups` holds the
    weight-update groups the engine joined (SGLang's ``/init_weights_update_group``)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        model = loop.engine.model
        self.groups = WeightGroups(model.device)
        self.weights_bytes = sum(t.numel() * t.element_size() for t in model.hf_state_dict().values())
        """Bytes of the engine's weights: the most one ``/update_weights_from_distributed`` may announce."""

    @property
    def engine(self) -> Engine:
        return self.loop.engine

    async def _on_engine(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

    async def update_from_tensor(self, request):
        body = await json_body(request)
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
        bucket = await asyncio.to_thread(receive_bucket, payloads[0], self.engine.model.device)

        def apply(engine: Engine):
            if abort_all:
                engine.abort(None, "aborted for a weight update")
            names = load_bucket(bucket, engine.model.hf_state_dict())
            self._loaded(engine, version, flush)
            return names
        names = await self._on_engine(apply)
        return web.json_response({"success": True, "message": f"loaded {len(names)} tensors",
                                  "weight_version": self.engine.weight_version})

    def hf_weights(self, engine: Engine) -> dict:
        """``engine.model.hf_state_dict()``, built once per model (hundreds of views: a bucket request of
        a large model would rebuild them every time); they stay valid because every load copies into
        the parameters in place."""
        cached = getattr(self, "_hf_weights_cache", None)
        if cached is None or cached[0] is not engine.model:
            cached = self._hf_weights_cache = (engine.model, engine.model.hf_state_dict())
        return cached[1]

    def _loaded(self, engine: Engine, version: str | None, flush: bool, synchronize: bool = False) -> None:
        """On the engine thread, after either update endpoint loaded weights: the new ``weight_version``,
        and with ``flush`` a KV-cache flush when idle; ``synchronize`` waits for the device, so the reply
        means the weights are in place (not only queued)."""
        if version is not None:
            engine.weight_version = version
        if flush and not engine.has_work():
            engine.flush()
        if synchronize and engine.model.device.type == "cuda":
            torch.cuda.synchronize(engine.model.device)

    async def checksum(self, request):
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
    async def init_group(self, request):
        req = InitGroupRequest.from_json(await json_body(request))
        try:
            message = await self.groups.join(req)
        except WeightGroupError as exc:
            return failed_reply(str(exc))
        return web.json_response({"success": True, "message": message})

    async def update_from_distributed(self, request):
        req = DistributedUpdateRequest.from_json(await json_body(request), self.weights_bytes)
        groups = self.groups
        groups.require(req.group_name)
        received = None
        if groups.isolated(req.group_name):  # gloo: the bytes arrive in the group's child, generation goes on
            try:
                received = await groups.receive_isolated(req)
            except WeightGroupError as exc:
                return failed_reply(str(exc))

        def apply(engine: Engine):
            if req.abort_all_requests:
                engine.abort(None, "aborted for a weight update")
            if received is not None:
                n = groups.load_received(req, received, self.hf_weights(engine))
            else:
                n = groups.receive(req, self.hf_weights(engine))
            self._loaded(engine, req.weight_version, req.flush_cache, synchronize=req.flush_cache)
            return n
        try:
            n = await self._on_engine(apply)
        except WeightGroupError as exc:
            return failed_reply(str(exc))
        message = "Succeeded to update parameter online."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return web.json_response({"success": True, "message": message, "num_tensors": n,
                                  "weight_version": self.engine.weight_version})

    async def destroy_group(self, request):
        name = group_name_of(await json_body(request, allow_empty=True))
        if not await self._on_engine(lambda engine: self.groups.leave(name)):
            return failed_reply(f"The group to be destroyed does not exist: this engine is in no group named {name!r}.")
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})
