"""The rollout engine: continuous batching over a paged KV cache, on rlperf's batch-invariant kernels.

One :meth:`Engine.step` is one ``forward_paged`` call over a mixed batch:

* every running request whose KV cache is one token behind (decoding) adds 1 token;
* running requests still prefilling add their next chunk, and waiting requests are admitted
  (FIFO, up to ``max_running_requests``), while the step's prefill-token budget
  (``chunked_prefill_size``; <= 0 means whole prompts) lasts;
* a request whose whole sequence is now cached gets its last row's final hidden state and logits,
  samples its next token from the logits and records that token's log-prob from the hidden state.

Preemption: when a running request needs a page and none is free, the newest running request is
retracted (its pages freed, its tokens so far kept) and put at the front of the waiting queue; when
it is admitted again it re-prefills prompt + output and goes on. Because prefill, chunked prefill
and decode give the same bits (``rlperf.kernels`` contract) and sampling is a function of
``(seed, position)`` only, a retracted request produces exactly the tokens it would have produced.

Sampling and log-probs (per request):

* token ``i`` of a sequence (prompt + output, 0-based) is drawn by ``rlperf.kernels.sample`` with
  the request's seed and ``position = i`` as the counter, so it does not depend on the batch;
* its log-prob is ``fused_logprob(hidden, model.head_weight, token, T)`` (``rlperf.kernels``) of
  the sampled row's final hidden state [H] — the log-prob under ``softmax(hidden @ head_weight.T /
  T)`` with the request's temperature ``T``, *before* top-k / top-p filtering (SGLang's default,
  and what slime's trainer recomputes: it divides logits by ``--rollout-temperature``); greedy
  requests (``T == 0``) report the log-prob at ``T = 1``. Rows are grouped by temperature, one
  call per group (a row's bits do not depend on its group).

That is the trainer's one log-prob path (``rlperf.train.batching``): the same kernel, with the same
vocabulary-tile order, which never materialises [N, V] float32 logits. The engine has the step's [B, V]
logits for the sampling anyway, and where they are the lm-head product's bits of that kernel's logit
tiles (a 16-bit lm head on the Triton kernels: :func:`rlperf.kernels.logits_give_fused_logprob`), a step
of up to ``EngineConfig.logprob_from_logits_max_rows`` rows folds them instead of reading the lm head a
second time (:func:`rlperf.kernels.fused_logprob_of_logits`:
the same tiles, splits, update and reductions, so the same bits). ``fast`` mode, which promises no bits,
folds the logits in hand wherever the fold's kernels run (:meth:`Engine._folds_logits`): one read of the
[B, V] logits instead of a second lm-head product. So in ``invariant`` mode a response's
log-probs equal
``fused_logprob(model.forward_packed(prompt + response)[rows], model.head_weight, targets, T)``
bit for bit, ``rows`` being the positions just before the response tokens.

Finish reasons (SGLang's): ``{"type": "stop", "matched": token_id | stop_string}`` (EOS unless
``ignore_eos``, a ``stop_token_ids`` entry, or a ``stop`` string, which is trimmed from the text),
``{"type": "length", "length": n}`` (``max_new_tokens`` or the context length), ``{"type": "abort",
"message": ...}``.

Routed experts (MoE models, SGLang's ``return_routed_experts``): a request that asks for them gets,
for every token of prompt + output but the last (the last one is sampled, never forwarded), the
experts each MoE layer routed it to (``GenerationResult.routed_experts`` [seq_len - 1, L, k] int32,
L the MoE layers in order): what the trainer replays under rollout routing replay. A step with
such a request runs eagerly (the decode CUDA graphs do not record routing).

Overlap (``EngineConfig.overlap_schedule``, CUDA-graph decode steps): the host work of a step (reading
the sampled tokens, finish checks, callbacks, the next step's inputs) would leave the GPU idle between
steps. When every request of a graphed decode step will need another step whatever token it draws
(none is at its length or context limit, none aborted, nothing waiting, no suspect, pages for the
next token), the next step is launched before this one's tokens are read: its input ids are the
sampled tokens, copied on the device. Its tokens are read in the following :meth:`step` call, which
launches the one after in turn. A request that stops on this step's token (EOS, a stop token or
string) has one more step in flight; that step's row is dropped when read (its K/V write went to a
page it held). Each request's tokens and log-probs are those of the step-by-step engine: the same
kernels on the same inputs, sampling by ``(seed, position)``. :meth:`drain` reads a step still in
flight; every call that changes the engine from outside (:meth:`abort`, :meth:`retract_all`,
:meth:`flush`, the engine loop's calls between steps) drains first, so none of them sees a step in
flight, and :meth:`has_work` is true while one is.

The engine is single-threaded: :class:`rlperf.rollout.engine_loop.EngineLoop` drives it from one
thread and is the only thing that touches it while it runs.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import numbers
import uuid

import torch

from rlperf import kernels as K
from rlperf.model.moe import RoutingTrace

from .args import ATTENTION_BACKENDS
from .cuda_graph import step_launches
from .flashinfer_attention import for_this_mode
from .kv_cache import PagedKVCache, plan_num_pages
from .sampling_params import check_sampling_values, check_stop_limits
from .tokenizer import Tokenizer

# sampling_params keys SGLang clients (slime) send that need no work here, with the value that is
# a no-op; another value is refused rather than silently ignored.
RESERVE_STEPS = 8  # decode steps of page headroom kept back from admissions (see Engine._schedule)
_NEUTRAL_PARAMS = {"spaces_between_special_tokens": None,
                   "n": 1, "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                   "repetition_penalty": 1.0, "min_p": 0.0}


class BadRequest(ValueError):
    """A request the engine refuses; the message says why (the server answers 400 with it)."""


def _short(v, limit: int = 60) -> str:
    """``repr(v)`` cut to ``limit`` characters (a client's value echoed in an error message)."""
    r = repr(v) if not isinstance(v, int) or v.bit_length() < 200 else f"an integer of {len(str(abs(v)))} digits"
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _number(d, key, default, *, integer=False, lo=None, hi=None, lo_open=False):
    v = d.get(key, default)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise BadRequest(f"sampling_params.{key} must be {kind}, got {_short(v)}")
    if isinstance(v, numbers.Integral):
        v = int(v)  # exact, however many digits: compared with the bounds as an integer, never through float
        if not integer:
            try:
                v = float(v)
            except OverflowError:
                raise BadRequest(f"sampling_params.{key}={_short(v)} is not finite as a float") from None
    else:
        v = float(v)
        if integer:
            if not v.is_integer():
                raise BadRequest(f"sampling_params.{key} must be {kind}, got {_short(v)}")
            v = int(v)
    if (isinstance(v, float) and not math.isfinite(v)) or (lo is not None and (v <= lo if lo_open else v < lo)) \
            or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"sampling_params.{key}={_short(v)} is outside {rng}")
    return v


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters (the subset the engine implements).

    ``top_k`` <= 0 disables it (SGLang's -1); ``seed`` — JSON ``sampling_seed`` (SGLang's name, the
    one sglang-router forwards; it drops unknown keys such as ``seed``, which the server also
    accepts directly) — None means a random seed drawn by the engine; ``stop`` strings are searched
    in the decoded output text.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    no_stop_trim: bool = False
    """Keep a matched stop string in the text (slime sends True)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (the byte tokenizer always does)."""

    @classmethod
    def from_dict(cls, d) -> "SamplingParams":
        """Validate a JSON ``sampling_params`` object; BadRequest with a message on anything wrong."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise BadRequest(f"sampling_params must be an object, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if v is not None}  # routers forward unset fields as null
        known = {f.name for f in dataclasses.fields(cls)} | {"sampling_seed"} | set(_NEUTRAL_PARAMS)
        unknown = sorted(set(d) - known)
        if unknown:
            raise BadRequest(f"sampling_params: unsupported keys {unknown}")
        for key, neutral in _NEUTRAL_PARAMS.items():
            if key in d and neutral is not None and d[key] is not None and d[key] != neutral:
                raise BadRequest(f"sampling_params.{key}={_short(d[key])} is not supported (only {neutral!r})")
        stop = d.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise BadRequest(f"sampling_params.stop must be a non-empty string or a list of them, got {_short(stop)}")
        stop_ids = d.get("stop_token_ids") or ()
        if not isinstance(stop_ids, (list, tuple)):
            raise BadRequest(f"sampling_params.stop_token_ids must be a list of integers, got {_short(stop_ids)}")
        # how many (and how long) before what: a huge list is refused before it is walked
        check_stop_limits(stop, stop_ids, error=BadRequest)
        if not all(isinstance(s, str) and s for s in stop):
            raise BadRequest(f"sampling_params.stop must be a non-empty string or a list of them, got {_short(stop)}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise BadRequest(f"sampling_params.stop_token_ids must be a list of integers, got {_short(stop_ids)}")
        flags = {}
        for key in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
            flags[key] = d.get(key, getattr(cls, key))
            if not isinstance(flags[key], bool):
                raise BadRequest(f"sampling_params.{key} must be a boolean, got {_short(flags[key])}")
        seed = d.get("seed", d.get("sampling_seed"))
        if seed is not None:
            seed = _number({"seed": seed}, "seed", None, integer=True, lo=-(1 << 63), hi=(1 << 63) - 1)
        params = cls(
            max_new_tokens=_number(d, "max_new_tokens", cls.max_new_tokens, integer=True, lo=0),
            temperature=_number(d, "temperature", cls.temperature, lo=0),
            top_p=_number(d, "top_p", cls.top_p, lo=0, hi=1, lo_open=True),
            top_k=_number(d, "top_k", cls.top_k, integer=True, lo=-1),
            stop=tuple(stop), stop_token_ids=tuple(stop_ids), seed=seed, **flags,
        )
        # the sampling kernel's types (float32 temperature and top_p, int32 top_k): rlperf train checks the same
        check_sampling_values(params.temperature, params.top_p, params.top_k, error=BadRequest,
                              names={k: f"sampling_params.{k}" for k in ("temperature", "top_p", "top_k")})
        return params


@dataclasses.dataclass
class EngineConfig:
    """Engine limits (SGLang server-argument names)."""

    max_running_requests: int = 64
    """At most this many requests hold KV pages at once; the rest wait."""
    chunked_prefill_size: int = 512
    """Prefill tokens per step (all requests together); <= 0 disables chunking (whole sequences)."""
    max_total_tokens: int | None = None
    """KV-cache capacity in tokens (rounded up to pages); None sizes it from memory."""
    mem_fraction_static: float | None = None
    """CUDA: fraction of device memory for weights + KV cache (default 0.85)."""
    context_length: int | None = None
    """Longest prompt + output; default the model's ``max_position_embeddings``."""
    random_seed: int = 0
    """Seeds the engine's draw of per-request seeds when a request brings none."""
    poison_kv_cache: bool = False
    """Fill the KV pool with NaN (tests: a read of an unwritten slot shows up as NaN)."""
    cuda_graph_max_bs: int = 0
    """Replay decode steps of up to this many sequences from CUDA graphs (``rlperf.rollout.cuda_graph``);
    0 disables (the engine's default; ``rlperf serve`` uses 256 on CUDA). The GPU tests show the
    replayed steps give the eager bits."""
    cuda_graph_max_prefill_tokens: int = 0
    """Replay steps with prefill chunks of up to this many tokens (chunks and decode rows together) from
    CUDA graphs padded to token buckets (``rlperf.rollout.cuda_graph.PrefillGraphs``; both kernel modes, not
    with FlashInfer's attention); 0 disables (the engine's default; ``rlperf serve`` takes
    ``chunked_prefill_size + max_running_requests`` on CUDA). The GPU tests show that in invariant mode the
    replayed steps give the eager bits."""
    attention_backend: str = "rlperf"
    """``rlperf`` (the paged-attention kernel) or ``flashinfer``: FlashInfer's paged attention in fast
    mode (``rlperf.rollout.flashinfer_attention``; CUDA only); invariant mode keeps the kernel."""
    overlap_schedule: bool = True
    """Launch a steady decode batch's next graphed step before reading this one's tokens (module
    docstring, "Overlap"); False (``--disable-overlap-schedule``, SGLang's flag) reads every step's
    tokens before the next launch. The same tokens and log-probs either way."""
    fused_sampling: bool = False
    """Draw each step's tokens and their log-probs in one pass over the lm head
    (:func:`rlperf.kernels.fused_sample_logprob`) where the step allows it: invariant mode on the kernels,
    no tensor-parallel model, and a batch of one temperature without top-p / top-k. Decode graphs then
    leave out the [B, V] float32 logits (a batch that needs them computes them after the replay). The
    log-probs keep their bits (the same kernel programs); the tokens are the sampler's wherever the lm
    head's product gives the fused tile's logit bits (docs/kernels.md). Off by default: on an H200 the decode
    step took 1.11-1.27x the two passes' time at B = 1 to 256
    (``python -m rlperf.bench.fusion_ab --variants 'fused sampling'``, bench/BENCHMARKS.md)."""
    logprob_beside_sampler: bool = False
    """Where a step folds its logits for the log-probs (``logprob_from_logits_max_rows``) with one temperature
    on a GPU: run the fold (:func:`rlperf.kernels.fold_logits`, which needs no tokens) on a side CUDA stream
    beside the sampler's kernels, then merge it with the drawn tokens (:func:`rlperf.kernels.logprob_of_fold`),
    instead of folding after the draw. The same kernels on the same logits, so the same bits. Off by default:
    slower on an H200 (``python -m rlperf.bench.fusion_ab --variants 'logprob beside the sampler'``: 1.79 against
    1.29 ms a decode step at B = 1, no gain at 64 and 256; bench/BENCHMARKS.md)."""
    logprob_from_logits_max_rows: int = 1 << 30
    """A step of at most this many sampled rows (default: every step) computes their log-probs from its
    [B, V] float32 logits (:func:`rlperf.kernels.fused_logprob_of_logits`) where those are
    ``fused_logprob``'s logit tiles bit for bit (:func:`rlperf.kernels.logits_give_fused_logprob`: a 16-bit
    lm head on the Triton kernels, a one-process model), instead of a second pass over the [V, H] lm head;
    larger steps, and every step at 0, take the second pass. The same log-prob bits either way. On an H200
    (qwen3-0.6b shape, V = 151,936, bf16, CUDA graphs, bench/BENCHMARKS.md) the folding took 27-28 us at
    N = 1 to 64 rows and 64 us at 256, where the second pass took 107-154 us."""


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What one finished request gives back: SGLang's ``/generate`` reply fields, typed.

    ``output_ids`` and ``output_logprobs`` (one per output token: the log-prob of the token drawn,
    module docstring), the decoded ``text``, and SGLang's ``finish_reason``
    (``{"type": "stop" | "length" | "abort", ...}``).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict
    routed_experts: torch.Tensor | None = None
    """[seq_len - 1, L, k] int32 on the CPU (module docstring) when the request asked for them and
    ran at least one step (None otherwise)."""

    @property
    def finish_type(self) -> str:
        """``"stop"``, ``"length"`` or ``"abort"``."""
        return self.finish_reason["type"]


class Request:
    """One generation request and its state inside the engine."""

    _counter = itertools.count()

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int):
        self.rid, self.prompt_ids, self.params, self.seed = rid, prompt_ids, params, seed
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.pages: list[int] = []
        self.num_cached = 0              # tokens of prompt + output whose K/V are in the cache
        self.finish_reason: dict | None = None
        self.text = ""
        self.num_retractions = 0
        self.order = next(Request._counter)
        self.aborted: str | None = None
        self.on_finish = None            # callback(request), set by the caller
        self.on_token = None             # callback(request) after each token that does not finish it
        self.return_routed_experts = False
        self.routed_chunks: list[torch.Tensor] = []  # [n, L, k] per forwarded chunk, in position order

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_ids)
        return (self.prompt_ids[start:min(stop, p)] if start < p else []) + self.output_ids[max(start - p, 0):max(stop - p, 0)]

    def result(self) -> GenerationResult:
        """The finished request's :class:`GenerationResult` (copies of its lists)."""
        if self.finish_reason is None:
            raise RuntimeError(f"request {self.rid!r} has not finished")
        routed = None
        if self.return_routed_experts:
            routed = torch.cat(self.routed_chunks) if self.routed_chunks else None
        return GenerationResult(list(self.output_ids), list(self.output_logprobs), self.text, dict(self.finish_reason),
                                routed)


class _SamplingRows:
    """The per-request sampling parameters of one batch composition, on the device: ``floats [2, B]``
    (temperature, top_p) float32 and ``ints [2, B]`` (top_k, seed) int64, checked once on the host in the
    sampler's own types (no device sync: a value that would break the sampler fails the step here, as it
    would in the kernel), with ``filtered`` (any row with top_p < 1 or 0 < top_k < V), ``temps`` and the
    sorted distinct temperatures ``groups``. A steady decode batch (the same requests in the same order,
    ``reqs`` compared by identity) reuses them: only each row's counter (its sequence length) changes."""

    def __init__(self, reqs: list["Request"], device: torch.device, vocab: int):
        self.reqs, self.device, self.vocab = list(reqs), device, vocab
        self.temps = [r.params.temperature for r in reqs]
        floats = torch.tensor([self.temps, [r.params.top_p for r in reqs]], dtype=torch.float32)
        ints = torch.tensor([[max(r.params.top_k, 0) for r in reqs], [r.seed for r in reqs]], dtype=torch.int64)
        K.check_sampling_rows(floats[0], floats[1], ints[0])
        self.floats, self.ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
        self.filtered = any(r.params.top_p < 1 or 0 < r.params.top_k < vocab for r in reqs)
        self.groups = sorted(set(self.temps))


class _Sampled:
    """A step whose tokens were drawn on the device and not yet read: ``reqs`` (one row each); ``host``
    [2, B] float64 on the host (token ids, log-probs: both exact in float64), readable once ``ready``
    (a CUDA event; None: now); ``tokens`` [B] int64 on the device (a continuation's input ids);
    ``graphed``: the step replayed a decode graph (only those have continuations)."""

    __slots__ = ("reqs", "tokens", "host", "ready", "graphed")

    def __init__(self, reqs, tokens, host, ready, graphed):
        self.reqs, self.tokens, self.host, self.ready, self.graphed = reqs, tokens, host, ready, graphed


class Engine:
    """Continuous-batching engine over one model (module docstring)."""

    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig | None = None, attention=None):
        """``attention``: the fast mode's attention object (a ``FlashInferAttention``; default: made
        for ``config.attention_backend == "flashinfer"``, else None: rlperf's kernel)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        if cfg.max_running_requests <= 0:
            raise ValueError(f"max_running_requests must be positive, got {cfg.max_running_requests}")
        if cfg.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {cfg.attention_backend!r}")
        mcfg = model.cfg
        self.context_length = min(cfg.context_length or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        dtype, device = model.embed_tokens.dtype, model.device
        num_pages = plan_num_pages(mcfg, dtype, device, max_total_tokens=cfg.max_total_tokens,
                                   mem_fraction_static=cfg.mem_fraction_static)
        self.kv = PagedKVCache(mcfg, num_pages, dtype, device, poison=cfg.poison_kv_cache)
        max_pages = min(self.kv.pages_for(self.context_length), self.kv.num_pages)
        if attention is None and cfg.attention_backend == "flashinfer":
            from .flashinfer_attention import FlashInferAttention

            attention = FlashInferAttention(mcfg, self.kv.page_size, dtype, device, max_pages=max_pages)
        self.attention = attention
        self._sampling_rows: _SamplingRows | None = None  # the last batch composition's (_sample)
        self._fold_stream = None  # the side CUDA stream of EngineConfig.logprob_beside_sampler (_sample)
        self.graphs = None
        if cfg.cuda_graph_max_bs > 0:
            from .cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.kv.layers, min(cfg.cuda_graph_max_bs, cfg.max_running_requests),
                                       max_pages, attention=attention,
                                       logits_wanted=lambda: not self._draws_from_hidden())
        self.prefill_graphs = None
        if cfg.cuda_graph_max_prefill_tokens > 0:
            from .cuda_graph import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(model, self.kv.layers, cfg.cuda_graph_max_prefill_tokens,
                                                cfg.max_running_requests, max_pages)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seed_gen = torch.Generator().manual_seed(cfg.random_seed)
        self.num_steps = 0
        self.num_retractions = 0
        self.weight_version = "default"
        self._finished: list[Request] = []
        self._batch: list[Request] | None = None   # the requests of the step in progress
        self._suspects: collections.deque[Request] = collections.deque()  # see recover()
        self.num_failed_steps = 0
        self._in_flight: _Sampled | None = None  # a launched step whose tokens are not read (overlap)
        self._host_out: list[torch.Tensor] = []  # two pinned [2, max_bs] float64 buffers (CUDA), alternating
        self.num_overlapped_steps = 0

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, rid: str | None = None,
                    on_finish=None, on_token=None, return_routed_experts: bool = False) -> Request:
        """Queue a request (validated here; BadRequest with a message when it cannot run).

        ``on_finish(request)`` is called once, from the engine's thread, when it finishes;
        ``on_token(request)`` after each new token that does not finish it (streaming);
        ``return_routed_experts``: record the experts of every token (module docstring; MoE models only).
        """
        params = params or SamplingParams()
        if return_routed_experts and not self.model.cfg.moe_layers:
            raise BadRequest("return_routed_experts: the model has no MoE layers (num_experts is 0)")
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise BadRequest("the prompt must be a non-empty list of token ids")
        V = self.model.cfg.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V for t in prompt_ids):
            raise BadRequest(f"input_ids must be integers in [0, {V})")
        if len(prompt_ids) >= self.context_length:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens; the context length is {self.context_length} "
                             "(prompt + at least one new token must fit)")
        if len(prompt_ids) + 1 > self.kv.max_total_tokens:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens; the KV cache holds {self.kv.max_total_tokens}")
        rid = rid if rid is not None else uuid.uuid4().hex
        if rid in self.requests:
            raise BadRequest(f"request id {rid!r} is already in flight")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 1 << 62, (1,), generator=self._seed_gen))
        req = Request(rid, list(prompt_ids), params, seed)
        req.on_finish, req.on_token = on_finish, on_token
        req.return_routed_experts = bool(return_routed_experts)
        self.requests[rid] = req
        if params.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
        else:
            self.waiting.append(req)
        return req

    def abort(self, rid: str | None = None, message: str = "aborted by request") -> int:
        """Abort one request (or all when ``rid`` is None) now, between steps; returns how many."""
        self.drain()
        targets = list(self.requests.values()) if rid is None else [self.requests[rid]] if rid in self.requests else []
        for r in targets:
            r.aborted = message
        self._reap_aborted()
        return len(targets)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight is not None)

    def drain(self) -> list[Request]:
        """Read the step still in flight (overlap, module docstring), if any; returns the requests it
        finished. Afterwards nothing is in flight until the next :meth:`step`."""
        sampled, self._in_flight = self._in_flight, None
        if sampled is None:
            return []
        self._finished = finished = []
        self._batch = sampled.reqs  # the requests recover() suspects when the read fails
        self._read(sampled)
        self._batch = None
        return finished

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run one forward, sample; returns the requests that finished in this step.

        With a step in flight (overlap, module docstring): launch its continuation when it has one,
        then read the one in flight; the requests it finished are returned."""
        self._finished = finished = []  # _finish appends: aborts, cache-too-small, stops, lengths
        self._batch = None
        if self._in_flight is not None:
            sampled, self._in_flight = self._in_flight, None
            self._batch = sampled.reqs
            self._in_flight = self._continue(sampled)
            self._read(sampled)
            self._batch = None
            return finished
        self._reap_aborted()
        while self._suspects and self._suspects[0].finished:  # aborted while it waited for its solo steps
            self._suspects.popleft()
        suspect = self._suspects[0] if self._suspects else None
        batch = self._schedule() if suspect is None else self._schedule_alone(suspect)
        self._batch = [r for r, _ in batch]
        if not batch:
            return finished
        self.num_steps += 1
        model, dev = self.model, self.model.device
        # the batch per sequence: (request, first new position, new tokens); cu_seqlens, kv_lens and the rows
        # to sample as Python lists. The token rows (ids, positions, slots) are built for the path taken:
        # Python lists for the decode graphs and the eager forward (one tensor and one copy each: per-request
        # torch ops would cost more than a decode step of a small model), numpy segments for a prefill graph
        segments, cu, kv_lens, sample_rows, sample_reqs = [], [0], [], [], []
        for r, n in batch:
            start = r.num_cached
            segments.append((r, start, n))
            cu.append(cu[-1] + n)
            kv_lens.append(start + n)
            r.num_cached = start + n
            if r.num_cached == r.seq_len:
                sample_rows.append(cu[-1] - 1)
                sample_reqs.append(r)
        decode_only = len(sample_reqs) == len(batch) == cu[-1]
        routing = RoutingTrace() if any(r.return_routed_experts for r, _ in batch) else None
        # named ranges so a profile can split prefill from decode time (rlperf.profiles.summary)
        phase = torch.profiler.record_function("rlperf.decode" if decode_only else "rlperf.prefill")
        graphed = self.graphs is not None and decode_only and len(batch) <= self.graphs.max_bs and routing is None
        with torch.no_grad(), phase:
            if graphed:
                # a pure decode step: replay the captured graph of its batch-size bucket
                ids, pos, slots = self._token_rows(segments)
                hidden, logits = self.graphs.run(ids, pos, slots, [r.pages for r, _ in batch], kv_lens)
            elif self._prefill_graphed(cu[-1], len(batch), routing):
                # a step with prefill chunks: replay the captured graph of its token bucket
                hidden = self.prefill_graphs.run([(r.tokens(start, start + n), start, r.pages) for r, start, n in segments],
                                                 sample_rows)
                if sample_reqs:
                    logits = None if self._draws_from_hidden() else model.logits(hidden)
            else:
                ids, pos, slots = self._token_rows(segments)
                max_pages = max(len(r.pages) for r, _ in batch)
                table = [r.pages + [0] * (max_pages - len(r.pages)) for r, _ in batch]
                attention = for_this_mode(self.attention)
                if attention is not None:
                    attention.plan_step(table, cu, kv_lens)
                with step_launches(len(ids)):  # a large step's kernels launch plainly (cuda_graph.PDL_MAX_TOKENS)
                    hidden = model.forward_paged(
                        torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                        self.kv.layers, torch.tensor(slots, dtype=torch.int64, device=dev),
                        torch.tensor(table, dtype=torch.int32, device=dev), torch.tensor(cu, dtype=torch.int32, device=dev),
                        torch.tensor(kv_lens, dtype=torch.int32, device=dev), routing, attention=attention)
                if routing is not None:
                    self._keep_routing(batch, cu, routing.experts().cpu())
                if sample_reqs:
                    hidden = hidden[torch.tensor(sample_rows, device=dev)]
                    logits = None if self._draws_from_hidden() else model.logits(hidden)
            if sample_reqs:
                sampled = self._sample(hidden, logits, sample_reqs, [r.seq_len for r in sample_reqs], graphed)
                self._in_flight = self._continue(sampled)
                self._read(sampled)
        self._batch = None
        if suspect is not None and (suspect.finished or suspect in sample_reqs):
            # a whole step of its own went through: not a culprit; off the pages, so the next suspect
            # (or, when none is left, the normal schedule) has the cache to itself
            self._suspects.popleft()
            if suspect in self.running:
                self.retract(suspect)
        return finished

    def _token_rows(self, segments: list[tuple[Request, int, int]]) -> tuple[list[int], list[int], list[int]]:
        """The step's token rows as Python lists (ids, positions, KV slots), from each sequence's (request,
        first new position, new tokens)."""
        P = self.kv.page_size
        ids, pos, slots = [], [], []
        for r, start, n in segments:
            pages = r.pages
            if n == 1:  # a decode row (or a prompt's last token): no slices, no generators
                p = len(r.prompt_ids)
                ids.append(r.output_ids[start - p] if start >= p else r.prompt_ids[start])
                pos.append(start)
                slots.append(pages[start // P] * P + start % P)
            else:  # a chunk: its slots one page's run at a time
                ids.extend(r.tokens(start, start + n))
                pos.extend(range(start, start + n))
                for j in range(start // P, (start + n - 1) // P + 1):
                    base = pages[j] * P
                    slots.extend(range(base + max(start - j * P, 0), base + min(start + n - j * P, P)))
        return ids, pos, slots

    def _prefill_graphed(self, num_tokens: int, num_seqs: int, routing) -> bool:
        """Whether a step the decode graphs do not take replays a prefill graph (``PrefillGraphs``' limits: no
        routing record, no FlashInfer plan, a size its graphs take; either kernel mode)."""
        g = self.prefill_graphs
        return g is not None and routing is None and for_this_mode(self.attention) is None and g.takes(num_tokens, num_seqs)

    @staticmethod
    def _keep_routing(batch: list[tuple[Request, int]], cu: list[int], experts: torch.Tensor) -> None:
        """File the step's routed experts [T, L, k] under the requests that asked for them."""
        for i, (r, _) in enumerate(batch):
            if r.return_routed_experts:
                r.routed_chunks.append(experts[cu[i]:cu[i + 1]])

    def recover(self, exc: BaseException) -> list[Request]:
        """After :meth:`step` raised ``exc``: fail only the requests that make a step fail, not the batch.

        Which request of a failed batch broke it is not known, so the batch's requests become
        *suspects*: every running request is retracted (pages freed, tokens kept; the failed step
        left nothing else behind) and the following steps run one suspect at a time, alone, until it
        has sampled a token. A suspect whose step of its own fails is the culprit: it finishes with
        ``{"type": "abort", "message": ..., "status_code": 500}`` (SGLang's abort with a status, which
        the server answers as an HTTP error). The others go on with exactly the tokens they would
        have produced (retraction and re-prefill change no bits: module docstring); requests that
        arrive meanwhile wait. Returns the requests failed now (empty: suspects still to try).
        """
        self.num_failed_steps += 1
        self._in_flight = None  # a step launched ahead of the failed one: dropped with it (its requests retract)
        batch, self._batch = self._batch, None
        if self._suspects:  # a suspect's solo step failed: it is the culprit
            culprit = self._suspects.popleft()
            if not culprit.finished:
                self._fail(culprit, exc)
                return [culprit]
            return []
        # a failure outside any batch (a bug in scheduling) makes every request in flight a suspect
        suspects = [r for r in (batch if batch is not None else sorted(self.running, key=lambda x: x.order))
                    if not r.finished]
        if len(suspects) == 1 and batch is not None and len(self.running) <= 1:
            self._fail(suspects[0], exc)  # it ran alone: no need to try it again
            return suspects
        self.retract_all()
        self._suspects.extend(suspects)
        return []

    def _fail(self, r: Request, exc: BaseException) -> None:
        self._finish(r, {"type": "abort", "status_code": 500,
                         "message": f"the engine step failed on this request: {type(exc).__name__}: {exc}"})

    def _schedule_alone(self, r: Request) -> list[tuple[Request, int]]:
        """One step of suspect ``r`` alone (:meth:`recover`); nothing else holds pages meanwhile."""
        if r in self.waiting:
            self.waiting.remove(r)
            self.running.append(r)
        need = r.seq_len - r.num_cached
        chunk = self.config.chunked_prefill_size
        n = need if need == 1 or chunk <= 0 else min(need, chunk)
        cap = self._capacity(r)
        if cap < 1:
            self._suspects.popleft()
            self._finish(r, {"type": "abort", "message": f"the KV cache ({self.kv.max_total_tokens} tokens) "
                                                         "cannot hold this request"})
            return []
        n = min(n, cap)
        self._grow(r, n)
        return [(r, n)]

    def _draws_from_hidden(self) -> bool:
        """Whether a step may draw its tokens from the hidden rows alone (``EngineConfig.fused_sampling``
        where it applies: invariant mode on the kernels, no tensor-parallel or tree-mode model); a batch
        that also asks for top-p / top-k or holds several temperatures still takes the logits."""
        m = self.model
        return (self.config.fused_sampling and K.mode() == "invariant" and K.backend(m.device) != "reference"
                and getattr(m, "reduction_leaves", None) is None and getattr(m, "tp_group", None) is None)

    def _logits_are_the_fused_tiles(self, weight: torch.Tensor) -> bool:
        """Whether this engine's [B, V] logits, folded by :func:`rlperf.kernels.fused_logprob_of_logits`,
        give ``fused_logprob``'s bits (a one-process model whose logits are ``K.linear(hidden, head_weight)``,
        and :func:`rlperf.kernels.logits_give_fused_logprob`); whether a step takes them is
        ``EngineConfig.logprob_from_logits_max_rows``'s."""
        return getattr(self.model, "tp_group", None) is None and K.logits_give_fused_logprob(weight)

    def _folds_logits(self, weight: torch.Tensor, B: int) -> bool:
        """Whether a step of ``B`` sampled rows takes its log-probs from its [B, V] logits
        (:func:`rlperf.kernels.fused_logprob_of_logits`) rather than from a second pass over the lm head: up to
        ``EngineConfig.logprob_from_logits_max_rows`` rows of a one-process model, in invariant mode where the
        fold gives ``fused_logprob``'s bits (:meth:`_logits_are_the_fused_tiles`), in fast mode wherever the
        fold's kernels run (a 16-bit lm head, the Triton kernels or the interpreter). Fast mode promises no bits,
        and its second pass (``fused_logprob``'s stock path: the lm-head product again, then ``log_softmax`` and its
        copies) took ~0.22 ms of GPU time in a B = 64 step on an H200 (``kernel_profile decode --mode fast``,
        bench/BENCHMARKS.md)."""
        if B > self.config.logprob_from_logits_max_rows:
            return False
        if K.mode() == "fast":
            return (getattr(self.model, "tp_group", None) is None and weight.dtype in (torch.bfloat16, torch.float16)
                    and K.backend(weight.device) != "reference")
        return self._logits_are_the_fused_tiles(weight)

    def _sample(self, hidden: torch.Tensor, logits: torch.Tensor | None, reqs: list[Request], counters: list[int],
                graphed: bool = False) -> _Sampled:
        """Draw tokens from ``logits`` [B, V] float32 and their log-probs [B] from ``hidden`` [B, H], the
        final hidden rows the logits came from (module docstring), row ``b``'s token drawn at position
        ``counters[b]``; launched, not read: :meth:`_read` reads them. ``logits`` None (a step that
        :meth:`_draws_from_hidden`): one pass over the lm head draws both where the batch allows it, else
        the logits are computed here."""
        dev, B, V = hidden.device, len(reqs), self.model.cfg.vocab_size
        rows = self._sampling_rows
        if rows is None or rows.reqs != reqs or rows.device != dev or rows.vocab != V:
            rows = self._sampling_rows = _SamplingRows(reqs, dev, V)
        temps, groups = rows.temps, rows.groups
        counters = torch.tensor(counters, dtype=torch.int64).to(dev, non_blocking=True)
        weight = self.model.head_weight
        if logits is None and not rows.filtered and len(groups) == 1:
            tokens, logprobs = K.fused_sample_logprob(hidden, weight, rows.floats[0], rows.ints[1], counters,
                                                      groups[0] if groups[0] > 0 else 1.0)
            return self._launched(reqs, tokens, logprobs, graphed)
        if logits is None:
            logits = self.model.logits(hidden)
        # the trainer's log-prob bits (its kernel on the same hidden rows, or the same folding of the logits
        # in hand); one temperature per call, and a row's bits do not depend on the other rows of the
        # launch, so grouping is exact
        tree = getattr(self.model, "reduction_leaves", None) is not None  # tensor-parallel-invariant tree mode
        of_logits = not tree and self._folds_logits(weight, B)
        if of_logits and len(groups) == 1 and self.config.logprob_beside_sampler and logits.is_cuda:
            return self._sample_beside_fold(logits, rows, counters, groups[0] if groups[0] > 0 else 1.0, weight.dtype,
                                            reqs, graphed)
        tokens = K.sample(logits, rows.floats[0], rows.floats[1], rows.ints[0], rows.ints[1], counters,
                          check_values=False, filtered=rows.filtered)

        def logprob(rows, tok, t):  # rows None: every row of the step
            if tree:
                return self.model.token_logprobs(hidden if rows is None else hidden[rows], tok, t)
            if of_logits:  # the same bits from the logits in hand (module docstring)
                return K.fused_logprob_of_logits(logits if rows is None else logits[rows], tok, t, weight.dtype)
            return K.fused_logprob(hidden if rows is None else hidden[rows], weight, tok, t)

        if len(groups) == 1:
            logprobs = logprob(None, tokens, groups[0] if groups[0] > 0 else 1.0)
        else:
            logprobs = torch.empty(B, dtype=torch.float32, device=dev)
            for t in groups:
                rows = torch.tensor([i for i, x in enumerate(temps) if x == t], device=dev)
                logprobs[rows] = logprob(rows, tokens[rows], t if t > 0 else 1.0)
        return self._launched(reqs, tokens, logprobs, graphed)

    def _sample_beside_fold(self, logits: torch.Tensor, rows: _SamplingRows, counters: torch.Tensor, temperature: float,
                            dtype: torch.dtype, reqs: list[Request], graphed: bool) -> _Sampled:
        """:meth:`_sample`'s draw and folded log-probs with the fold on a side stream beside the sampler
        (``EngineConfig.logprob_beside_sampler``): both read ``logits``; the merge waits for both."""
        main = torch.cuda.current_stream(logits.device)
        if self._fold_stream is None or self._fold_stream.device != logits.device:
            self._fold_stream = torch.cuda.Stream(device=logits.device)
        side = self._fold_stream
        side.wait_stream(main)  # the logits are written
        with torch.cuda.stream(side):
            fold = K.fold_logits(logits, temperature, dtype)
        fold.parts.record_stream(main)  # allocated on the side stream, read by the merge on this one
        tokens = K.sample(logits, rows.floats[0], rows.floats[1], rows.ints[0], rows.ints[1], counters,
                          check_values=False, filtered=rows.filtered)
        main.wait_stream(side)
        return self._launched(reqs, tokens, K.logprob_of_fold(fold, tokens), graphed)

    def _launched(self, reqs: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor, graphed: bool) -> _Sampled:
        """The step's tokens [B] int64 and log-probs [B] float32 on the device, on their way to the host."""
        dev, B = tokens.device, len(reqs)
        # one device-to-host copy (and one wait, in _read) for both: token ids and float32 log-probs are
        # exact in float64
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])
        if dev.type != "cuda":
            return _Sampled(reqs, tokens, both, None, graphed)
        if not self._host_out or self._host_out[0].shape[1] < B:
            width = max(B, self.graphs.max_bs if self.graphs is not None else 0)
            self._host_out = [torch.empty(2, width, dtype=torch.float64, pin_memory=True) for _ in range(2)]
        # alternate: the other buffer may belong to the step in flight, whose copy is not read yet
        host = self._host_out[self.num_steps % 2].view(-1)[:2 * B].view(2, B)  # contiguous
        host.copy_(both, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Sampled(reqs, tokens, host, ready, graphed)

    def _read(self, sampled: _Sampled) -> None:
        """Wait for ``sampled``'s tokens and log-probs and hand them to their requests (finish checks,
        streaming callbacks). A request finished meanwhile (its previous token stopped it while this
        step was in flight) drops its row."""
        if sampled.ready is not None:
            sampled.ready.synchronize()
        tokens, logprobs = sampled.host.tolist()
        for r, t, lp in zip(sampled.reqs, tokens, logprobs):
            if r.finished:
                continue
            t = int(t)
            r.output_ids.append(t)
            r.output_logprobs.append(lp)
            reason = self._check_finished(r, t)
            if reason is not None:
                self._finish(r, reason)
            elif r.on_token is not None:
                r.on_token(r)

    def _continue(self, prev: _Sampled) -> _Sampled | None:
        """Launch the next decode step of ``prev``'s requests before ``prev``'s tokens are read, when
        each of them needs that step whatever token it draws (module docstring, "Overlap"); its input
        ids are ``prev``'s tokens on the device. None when it does not apply."""
        if (not prev.graphed or not self.config.overlap_schedule or self.waiting or self._suspects
                or for_this_mode(self.attention) is not None):  # FlashInfer's plan: host buffers per step
            return None
        # rows of requests that finished on the token before prev's (prev was in flight) go; the rest
        # must be every running request
        keep = [i for i, r in enumerate(prev.reqs) if not r.finished]
        reqs = [prev.reqs[i] for i in keep]
        if not reqs or len(reqs) != len(self.running):
            return None
        for r in reqs:  # prev's token is output number len(output_ids) + 1, at position r.num_cached
            if (r.aborted is not None or r.return_routed_experts or len(r.output_ids) + 1 >= r.params.max_new_tokens
                    or r.seq_len + 1 >= self.context_length):
                return None
        P = self.kv.page_size
        if sum(len(r.pages) * P <= r.num_cached for r in reqs) > self.kv.num_free_pages:
            return None
        pos, slots, kv_lens = [], [], []
        for r in reqs:
            start = r.num_cached
            self._grow(r, 1)
            pos.append(start)
            slots.append(r.pages[start // P] * P + start % P)
            kv_lens.append(start + 1)
            r.num_cached = start + 1
        self.num_steps += 1
        self.num_overlapped_steps += 1
        ids = prev.tokens
        if len(keep) < len(prev.reqs):
            ids = ids[torch.tensor(keep, device=ids.device)]
        with torch.no_grad(), torch.profiler.record_function("rlperf.decode"):
            hidden, logits = self.graphs.run(ids, pos, slots, [r.pages for r in reqs], kv_lens)
            # the token drawn now is at position start + 1 = r.seq_len once prev's token is appended
            return self._sample(hidden, logits, reqs, kv_lens, graphed=True)

    def _check_finished(self, r: Request, token: int) -> dict | None:
        p = r.params
        if (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids:
            return {"type": "stop", "matched": token}
        if p.stop:
            # a stop string that was not in the text before ends in the newest token: decoding a tail
            # of (4 bytes per char + slack) tokens finds it without re-decoding the whole output
            tail = r.output_ids[-(4 * max(map(len, p.stop)) + 8):]
            skip = p.skip_special_tokens
            hits = []
            if any(s in self.tokenizer.decode(tail, skip_special_tokens=skip) for s in p.stop):
                text = self.tokenizer.decode(r.output_ids, skip_special_tokens=skip)
                hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                idx, s = min(hits)
                r.text = text if p.no_stop_trim else text[:idx]
                return {"type": "stop", "matched": s}
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(r.output_ids)}
        if r.seq_len >= self.context_length:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _finish(self, r: Request, reason: dict) -> None:
        r.finish_reason = reason
        if not (reason["type"] == "stop" and isinstance(reason.get("matched"), str)):
            r.text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        self.kv.free(r.pages)
        r.pages = []
        if r in self.running:
            self.running.remove(r)
        self.requests.pop(r.rid, None)
        self._finished.append(r)
        if r.on_finish is not None:
            r.on_finish(r)

    def _reap_aborted(self) -> None:
        for r in [r for r in list(self.waiting) + self.running if r.aborted is not None]:
            if r in self.waiting:
                self.waiting.remove(r)
            self._finish(r, {"type": "abort", "message": r.aborted})

    # ---- scheduling -------------------------------------------------------------------------
    def _capacity(self, r: Request) -> int:
        """Tokens ``r`` can add with its pages plus every free page."""
        return (len(r.pages) + self.kv.num_free_pages) * self.kv.page_size - r.num_cached

    def _grow(self, r: Request, n: int) -> None:
        need = self.kv.pages_for(r.num_cached + n) - len(r.pages)
        if need > 0:
            r.pages.extend(self.kv.allocate(need))

    def retract(self, r: Request) -> None:
        """Take running request ``r`` off its pages (freed) to the front of the waiting queue; its
        tokens so far are kept and re-prefilled when it is admitted again (module docstring)."""
        self.kv.free(r.pages)
        r.pages, r.num_cached = [], 0
        r.routed_chunks = []  # the re-prefill records them again from position 0
        r.num_retractions += 1
        self.num_retractions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    def _schedule(self) -> list[tuple[Request, int]]:
        chunk = self.config.chunked_prefill_size
        budget = chunk if chunk > 0 else math.inf
        batch: list[tuple[Request, int]] = []
        P = self.kv.page_size
        retracted = set()  # taken off their pages below for an older request
        # running requests, oldest first; a newer one is retracted when an older one needs its pages
        for r in sorted(self.running, key=lambda x: x.order):
            if r in retracted:
                continue
            need = r.seq_len - r.num_cached
            if need == 1 and len(r.pages) * P > r.num_cached:  # a decode row whose pages hold its next token
                batch.append((r, 1))
                continue
            n = 1 if need == 1 else min(need, budget)
            if n <= 0:
                continue
            while self._capacity(r) < 1:
                newer = [x for x in self.running if x.order > r.order]
                if not newer:
                    break
                victim = max(newer, key=lambda x: x.order)
                self.retract(victim)
                retracted.add(victim)
            cap = self._capacity(r)
            if cap < 1:
                if len(self.running) == 1 and not batch:
                    self._finish(r, {"type": "abort", "message": f"the KV cache ({self.kv.max_total_tokens} tokens) "
                                                                 "cannot hold this request"})
                else:
                    self.retract(r)
                continue
            n = min(n, cap)
            self._grow(r, n)
            batch.append((r, n))
            if need > 1:
                budget -= n
        # admit waiting requests (FIFO; retracted ones are at the front), keeping back the pages the
        # decoding requests will need within RESERVE_STEPS steps, so an admission does not force a
        # retraction right away (correctness never depends on this; it only avoids churn)
        admitting = self.waiting and len(self.running) < self.config.max_running_requests and budget > 0
        reserve = sum(1 for r, n in batch if r.seq_len - r.num_cached == 1
                      and len(r.pages) * P - (r.num_cached + 1) < RESERVE_STEPS) if admitting else 0
        while self.waiting and len(self.running) < self.config.max_running_requests and budget > 0:
            r = self.waiting[0]
            free_tokens = (self.kv.num_free_pages - (reserve if batch else 0)) * P
            n = min(r.seq_len, budget, free_tokens)
            if n < 1:
                break
            self.waiting.popleft()
            self.running.append(r)
            self._grow(r, n)
            batch.append((r, n))
            budget -= n
        return batch

    # ---- helpers ----------------------------------------------------------------------------
    def run_until_done(self, max_steps: int = 1_000_000) -> None:
        """Step until nothing is waiting or running (tests, offline use)."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def retract_all(self) -> int:
        """:meth:`retract` every running request, newest first; returns how many (between steps)."""
        self.drain()
        running = sorted(self.running, key=lambda x: -x.order)
        for r in running:
            self.retract(r)
        return len(running)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 return_routed_experts: bool = False) -> list[GenerationResult]:
        """Run ``prompts`` to completion together; returns their results in order (with
        ``return_routed_experts``, each one's ``routed_experts``: :meth:`add_request`)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp, return_routed_experts=return_routed_experts) for p, sp in zip(prompts, plist)]
        self.run_until_done()
        return [r.result() for r in reqs]

    def graph_failures(self) -> list[dict]:
        """The CUDA-graph captures that failed, each ``{"graphs": "decode" | "prefill", "key": [mode, bucket,
        ...], "error": text}``: those steps run eagerly (the same bits, without the graph's launch savings;
        ``rlperf.graph_capture.capture_or_fall_back``). Empty when every capture succeeded."""
        out = []
        for what, graphs in (("decode", self.graphs), ("prefill", self.prefill_graphs)):
            if graphs is not None:
                out += [{"graphs": what, "key": list(key), "error": err} for key, err in graphs.failed.items()]
        return out

    def warm_up(self, prompt_lengths: tuple[int, ...] = ()) -> int:
        """Compile and warm the kernels before any client comes (``rlperf serve`` runs it at start):
        capture every CUDA-graph decode size, then run one request per entry of ``prompt_lengths``
        (prompts cut to what the context and the cache hold) for 2 tokens: a prefill of that
        length, chunked as a client's would be (capturing the prefill graphs of its steps' token
        buckets), and a decode step. Returns how many graphs were captured.

        Nothing a client can see changes: only when idle; the requests carry their own seed (the
        engine's seed draw is untouched); afterwards the KV pool is as new (every page free, contents
        refilled: :meth:`PagedKVCache.reset_contents`) and ``num_steps`` is restored. Later requests get
        the bits they would get without it: the kernels and graphs are the ones they would compile
        and capture themselves, and a row's bits never depend on what ran before. A capture that fails
        is not counted; :meth:`graph_failures` lists it.
        """
        if self.has_work():
            raise RuntimeError("warm_up needs an idle engine")
        num_steps, V = self.num_steps, self.model.cfg.vocab_size
        try:
            captured = self.graphs.capture_all() if self.graphs is not None else 0
            prefill_graphs = self.prefill_graphs.graphs if self.prefill_graphs is not None else {}
            before = len(prefill_graphs)
            params = SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True, seed=0)
            for n in prompt_lengths:
                n = max(1, min(n, self.context_length - 2, self.kv.max_total_tokens - 2))
                self.generate([[(7 * i + 1) % V for i in range(n)]], params)
            captured += len(prefill_graphs) - before
        finally:
            self.abort(None, "warm-up")
            self.kv.reset_contents()
            self.num_steps = num_steps
        return captured

    def flush(self) -> None:
        """Free every page; only when idle (nothing running or waiting)."""
        self.drain()
        if self.has_work():
            raise BadRequest(f"cannot flush the cache: {len(self.running)} running and {len(self.waiting)} waiting requests")
        self.kv.reset()
