"""Rollout: prompts -> generations with log-probs -> rewards, and weight sync into the engines.

Two places generate (:class:`RolloutClient`):

* :class:`EngineClient` — an in-process :class:`rlperf.rollout.engine.Engine` over its **own copy**
  of the model (the default when no ``--sglang-router-ip`` is given, e.g. the embedded CPU run).
  Weight sync on CPU goes through the path a server takes: ``flatten_buckets`` -> a shared-memory
  bucket payload -> ``receive_bucket`` (checks sizes and checksum) -> ``load_bucket`` into the
  engine's model; on one GPU the buckets are loaded directly (one copy launch per bucket). Then
  the KV cache is flushed.
* :class:`RouterClient` — ``POST /generate`` through a running sglang-router; weight sync pauses
  every worker the router lists (``/pause_generation``), pushes the buckets
  (``/update_weights_from_tensor``, ``push_weights``), flushes their caches and continues them.

Seeds: sample ``j`` of prompt ``i`` in rollout ``k`` is drawn with seed
:func:`sample_seed` ``(seed, k, i * n + j)``, so a rollout's tokens are a function of the weights and
these numbers only (deterministic runs, exact resume).

The default rollout function :func:`generate_rollout` has slime's signature
``fn(args, rollout_id, data_source, evaluation=False) -> list[RolloutSample]``; ``--rollout-function-path``
replaces it, ``--custom-generate-function-path`` replaces only the per-sample generation
(``fn(args, sample, sampling_params) -> sample`` filling ``response_ids``, ``rollout_log_probs``).
"""
from __future__ import annotations

import dataclasses
import json
import time

import torch

from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.weights import bucket_payload, load_bucket, receive_bucket, release
from rlperf.sync.buckets import DEFAULT_BUCKET_BYTES, flatten_buckets

# Weight-sync bucket size: 512 MiB, the flatten default. Each bucket costs a handle open, a
# checksum and a round trip: Qwen3-4B-shaped bf16 (8.04 GB) over cuda_ipc to another process took
# 163 ms in 64 MiB buckets and 41 ms in 512 MiB ones (H100, bench/BENCHMARKS.md "sync").
SYNC_BUCKET_BYTES = DEFAULT_BUCKET_BYTES
# The in-process engine shares the device with the trainer (weights, grads, AdamW state,
# activations): its KV cache may fill device memory up to this fraction (a server's default, 0.85,
# left the trainer too little at qwen3-0.6b: the oom_headroom gate failed at 96% of the card)
TRAIN_MEM_FRACTION_STATIC = 0.3
# the inline transport carries the bytes base64-encoded in the HTTP body: smaller requests
INLINE_BUCKET_BYTES = 64 << 20


@dataclasses.dataclass
class RolloutSample:
    """One generation: prompt, response and what the trainer needs (slime's ``Sample`` fields)."""

    index: int
    group: int
    prompt: str
    prompt_ids: list[int]
    label: str | None = None
    metadata: dict = dataclasses.field(default_factory=dict)
    seed: int = 0
    response: str = ""
    response_ids: list[int] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    reward: float = 0.0

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


def sample_seed(seed: int, rollout_id: int, index: int) -> int:
    return (seed * 1_000_003 + rollout_id * 100_003 + index) % (1 << 62)


def weights_checksum(named_tensors) -> str:
    """One 64-bit hex checksum of all weights: the bucket checksums of a fixed-size flattening, mixed."""
    from rlperf.sync.buckets import _mix64_int

    h = 0
    for b in flatten_buckets(named_tensors, bucket_bytes=SYNC_BUCKET_BYTES):
        h = _mix64_int((h + b.checksum) & ((1 << 64) - 1))
    return f"{h:016x}"


class EngineClient:
    """In-process engine over a private copy of the model (module docstring)."""

    kind = "in-process engine"

    def __init__(self, model, tokenizer, max_total_tokens: int | None = None, mem_fraction_static: float | None = None):
        import copy

        self.model = copy.deepcopy(model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        if mem_fraction_static is None and self.model.device.type == "cuda":
            mem_fraction_static = TRAIN_MEM_FRACTION_STATIC
        self.engine = Engine(self.model, tokenizer, EngineConfig(
            max_total_tokens=max_total_tokens, mem_fraction_static=mem_fraction_static, cuda_graph_max_bs=0))

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
        reqs = self.engine.generate(prompts, params)
        return [dict(output_ids=list(r.output_ids), logprobs=list(r.output_logprobs), text=r.text,
                     finish_reason=r.finish_reason["type"]) for r in reqs]

    def update_weights(self, named_tensors, version: str) -> dict:
        """Buckets -> payload -> receive (checksum verified) -> load; returns the sync's stats."""
        buckets = flatten_buckets(named_tensors, bucket_bytes=SYNC_BUCKET_BYTES)
        nbytes = 0
        for b in buckets:
            if self.model.device.type == "cuda":
                # same process, same GPU: CUDA cannot open a process's own IPC handle, and none is
                # needed; the bucket's views are copied straight into the engine's parameters
                load_bucket(self.model, b)
            else:
                payload, handle = bucket_payload(b, "shm")
                try:
                    load_bucket(self.model, receive_bucket(payload, self.model.device))
                finally:
                    release(handle)
            nbytes += b.nbytes
        self.engine.flush()
        self.engine.weight_version = version
        return {"buckets": len(buckets), "bytes": nbytes}


class RouterClient:
    """Rollout servers behind a running sglang-router (module docstring)."""

    kind = "sglang-router"

    def __init__(self, ip: str, port: int, tokenizer, colocate: bool = False, timeout: float = 600.0):
        from rlperf.rollout.router import http_json

        self.url, self.tokenizer, self.colocate, self.timeout = f"http://{ip}:{port}", tokenizer, colocate, timeout
        self.max_inflight = 32
        self._http = http_json
        status, reply = http_json(self.url + "/workers", timeout=30)
        if status != 200 or not isinstance(reply, dict) or not reply.get("workers"):
            raise RuntimeError(f"router {self.url}: GET /workers answered {status}: {reply!r}")

    def workers(self) -> list[str]:
        status, reply = self._http(self.url + "/workers", timeout=30)
        return [w["url"] for w in reply["workers"]]

    def _generate_one(self, ids: list[int], sp: SamplingParams) -> dict:
        body = {"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "top_k": sp.top_k, "sampling_seed": sp.seed, "no_stop_trim": True}}
        status, reply = self._http(self.url + "/generate", body, timeout=self.timeout)
        if status != 200:
            raise RuntimeError(f"router {self.url}: /generate answered {status}: {reply!r}")
        meta = reply["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        return dict(output_ids=reply.get("output_ids") or [t[1] for t in triples], logprobs=[t[0] for t in triples],
                    text=reply.get("text", ""), finish_reason=meta["finish_reason"]["type"])

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
        # one request per sample, many in flight: the router spreads them over the workers, and each
        # sample's tokens depend only on its seed (batch-invariant engines), not on who served it
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.max_inflight) as pool:
            return list(pool.map(self._generate_one, prompts, params))

    def update_weights(self, named_tensors, version: str) -> dict:
        from rlperf.rollout.weights import push_weights

        first = next(iter(named_tensors.values()))
        transport = "cuda_ipc" if (self.colocate and first.device.type == "cuda") else (
            "shm" if first.device.type == "cpu" else "inline")
        def admin(url, endpoint):
            status, reply = self._http(url + endpoint, {}, timeout=60)
            if status != 200:
                raise RuntimeError(f"{url}{endpoint} answered {status}: {reply!r}")

        n = 0
        for url in self.workers():
            admin(url, "/pause_generation")
            try:
                n += push_weights(url, named_tensors, transport=transport,
                                  bucket_bytes=INLINE_BUCKET_BYTES if transport == "inline" else SYNC_BUCKET_BYTES,
                                  weight_version=version)
                admin(url, "/flush_cache")
            finally:
                admin(url, "/continue_generation")
        return {"buckets": n, "bytes": sum(t.numel() * t.element_size() for t in named_tensors.values())}


@dataclasses.dataclass
class DataSource:
    """What a rollout function gets as ``data_source``: prompts, the client, tokenizer and reward."""

    dataset: object
    client: object
    tokenizer: object
    reward_fn: object
    custom_generate: object = None

    def prompts(self, rollout_id: int, size: int):
        return self.dataset.batch(rollout_id, size)


def sampling_params_for(args, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.rollout_max_response_len, temperature=args.rollout_temperature,
                          top_p=args.rollout_top_p, top_k=args.rollout_top_k, seed=seed)


def generate_rollout(args, rollout_id: int, data_source: DataSource, evaluation: bool = False) -> list[RolloutSample]:
    """The default rollout: ``rollout_batch_size`` prompts x ``n_samples_per_prompt`` generations, rewarded."""
    n, tok = args.n_samples_per_prompt, data_source.tokenizer
    samples = []
    for g, rec in enumerate(data_source.prompts(rollout_id, args.rollout_batch_size)):
        ids = tok.encode(rec.prompt)
        for j in range(n):
            samples.append(RolloutSample(index=g * n + j, group=g, prompt=rec.prompt, prompt_ids=ids, label=rec.label,
                                         metadata=dict(rec.metadata), seed=sample_seed(args.seed, rollout_id, g * n + j)))
    if data_source.custom_generate is not None:
        samples = [data_source.custom_generate(args, s, sampling_params_for(args, s.seed)) for s in samples]
    else:
        outs = data_source.client.generate([s.prompt_ids for s in samples],
                                           [sampling_params_for(args, s.seed) for s in samples])
        for s, o in zip(samples, outs):
            s.response_ids, s.rollout_log_probs = o["output_ids"], o["logprobs"]
            s.response, s.finish_reason = o["text"], o["finish_reason"]
    for s in samples:
        s.reward = float(data_source.reward_fn(args, s))
    return samples


def timed_rollout(fn, args, rollout_id, data_source):
    t = time.perf_counter()
    samples = fn(args, rollout_id, data_source)
    return samples, time.perf_counter() - t


def save_rollout_data(path, samples: list[RolloutSample]) -> None:
    """``--save-debug-rollout-data``: one JSON object per sample (plain data, never a pickle)."""
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in samples))
    tmp.replace(path)


def load_rollout_data(path) -> list[RolloutSample]:
    """``--load-debug-rollout-data``: the samples :func:`save_rollout_data` wrote (same floats, bit for bit)."""
    with open(path) as f:
        return [RolloutSample(**json.loads(line)) for line in f if line.strip()]


def to_train_samples(samples: list[RolloutSample]):
    """:class:`rlperf.train.Sample` objects (prompt + response tokens, rewards, rollout log-probs)."""
    from rlperf.train import Sample

    out = []
    for s in samples:
        if not s.response_ids:
            raise RuntimeError(f"sample {s.index} has an empty response (max_new_tokens 0?)")
        out.append(Sample(torch.tensor(s.prompt_ids + s.response_ids), len(s.response_ids), reward=s.reward,
                          rollout_log_probs=torch.tensor(s.rollout_log_probs, dtype=torch.float32)))
    return out
