"""The RL loop of ``rlperf train``: rollout -> rewards -> log-probs -> train -> weight sync, per step.

Sync mode (default)::

    for k in range(start, num_rollout):
        samples = rollout(k)                 # engines hold the weights after update k-1
        prepare (old + ref log-probs, advantages); num_steps_per_rollout optimizer steps
        weight sync (buckets) ; metrics line ; checkpoint every --save-interval

Async mode (``--async``, slime's ``train_async.py``): rollout k+1 is generated (in a second thread)
while the trainer trains on rollout k; the engines get update k only after rollout k+1 is in, so
every rollout is one step off-policy.

Per step one line goes to ``metrics.jsonl`` (:mod:`rlperf.loop.metrics`: ``rollout/*``, ``train/*``,
``perf/*``, ``memory/*`` measured by :class:`rlperf.telemetry.PhaseMeter`, and ``sync/weights_checksum``,
one 64-bit hash of all weights after the update: equal runs have equal checksums). In async mode the
rollout thread's phase overlaps training, so its memory and timeline slices overlap the train phase's.

``rlperf train`` (the CLI) runs the first-step gates before this loop; :func:`train` does not.
On stderr each step prints one summary line (:func:`summary_line`); a tqdm bar runs below them
only when stderr is a terminal (a log file or a pipe gets the plain lines alone).

``--precision`` (bf16 on CUDA, fp32 on CPU by default): the model is built or loaded in float32 as the
trainer's master weights; with bf16 the trainer runs forward/backward on a bf16 copy (its compute
weights, :class:`rlperf.train.Trainer`), which weight sync sends, the in-process engine runs (with
CUDA-graph decode, as ``rlperf serve``) and ``sync/weights_checksum`` hashes; checkpoints hold the
float32 masters.

``--mode`` and ``--kernel-backend`` set the kernel policy every phase runs under
(:func:`rlperf.loop.args.kernel_policy`); on CPU the ops run on the reference backend by default, with
``--num-threads`` intra-op threads (1 by default: fastest on shared cores). Every run writes
``OUTPUT_DIR/metrics.jsonl`` (one JSON object per rollout, slime's metric names; see
docs/ARCHITECTURE.md) and a phase timeline (:class:`rlperf.telemetry.PhaseTimeline`) with memory
counters; ``--profile-step-start/-end`` and ``--profile-target`` add torch.profiler traces of a
window of steps (:mod:`rlperf.telemetry.trainer_trace`).

The loop only orchestrates, through two seams: the trainer (:class:`rlperf.train.backend.TrainerBackend`,
built by :func:`rlperf.train.backend.build_trainer` from ``--train-backend`` and the layout flags) and the
engines (:class:`rlperf.loop.clients.RolloutClient`, :func:`rlperf.loop.clients.client_for`). It never
asks which trainer or how many ranks: on ``--actor-num-gpus-per-node N > 1`` every rank runs this loop in
lockstep and the backends and clients own the rank logic (:mod:`rlperf.loop.data_parallel`); rank 0 alone
writes ``metrics.jsonl``, the timeline, traces and checkpoints, and prints. The first-step gates' hook is
:func:`rlperf.loop.first_step.first_step`.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlperf import kernels as K
from rlperf.sync import SYNC_BUCKET_BYTES, weights_checksum
from rlperf.telemetry import PhaseMeter, PhaseTimeline, TrainerTrace, default_path
from rlperf.telemetry.loggers import open_loggers
from rlperf.telemetry.notice import SETUP_DESCRIPTIONS, slow_phase_notice
from rlperf.train.backend import LayoutError, TrainerSetup, build_trainer

from . import checkpoint as ckpt
from .args import UsageError, is_resolved
from .build import build_data, build_model, reference_model, usage_errors, warm_start_key, warm_up
from .clients import ServerAuthError, client_for
from .config import RunConfig
from .data_parallel import broadcast_from_rank0, max_over_ranks, rank_and_world
from .device import compute_dtype, kernel_policy, run_device, start_kernel_precompile
from .generation import DataSource, load_rollout_data, rollout_kv_tokens, save_rollout_data
from .metrics import (METRICS_FILE, fault_metrics, isatty, open_metrics, rollout_metrics, step_metrics, summary_line,
                      train_metrics)
from .resolve import parse_train_args, resolve_args


@contextlib.contextmanager
def _auth_errors():
    """A router or server that refuses the run's API key (or its lack of one) is bad usage: the
    :class:`UsageError` says which flag passes the key (the CLI exits 2 with it)."""
    try:
        yield
    except ServerAuthError as exc:
        raise UsageError(str(exc)) from None


class Run:
    """Everything a training run holds; building it runs no step (all input errors surface here).

    ``ns``: resolved ``rlperf train`` flags (:func:`rlperf.loop.resolve.resolve_args`), read once into
    :attr:`config` (:class:`rlperf.loop.config.RunConfig`); the namespace itself goes only to custom
    rollout, generate and reward functions (their contract: slime's ``args``). ``train_args``: the
    trainer's :class:`rlperf.train.TrainArgs`, when not ``ns.train_args`` (the first step asks for
    reference log-probs without changing the shared namespace).

    Built in four stages, each timed into :attr:`setup_seconds`: the model and tokenizer, the data
    (:mod:`rlperf.loop.build`), the trainer (:meth:`_build_trainer`: the warm-up, the reference, the
    backend, a resumed state) and the rollout client (:meth:`_build_client`). Afterwards :attr:`trainer`
    is the :class:`rlperf.train.backend.TrainerBackend` and :attr:`model` the model the engines are built
    from (the backend's ``engine_model``).
    """

    def __init__(self, ns, train_args=None):
        self.ns = ns
        self.config = config = RunConfig.from_args(ns, train_args)
        rt = config.runtime
        if rt.num_threads:
            torch.set_num_threads(rt.num_threads)
        if rt.deterministic:
            # cuBLAS (fast mode) refuses deterministic algorithms without a fixed workspace config
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(rt.seed)
        self.device = run_device(ns)
        self.policy = kernel_policy(ns, self.device)  # --mode, --kernel-backend
        self.precision = config.train.precision
        # several actor ranks: this process is rank `rank` of `world_size`; rank 0 alone writes files and prints
        self.rank, self.world_size = rank_and_world()
        # --precompile-kernels: worker processes fill Triton's cache while the run builds (one per host)
        self.precompile, self.kernel_recorder = start_kernel_precompile(
            rt.precompile_kernels, rt.record_kernels if self.rank == 0 else None, self.device, self.policy,
            local_leader=int(os.environ.get("LOCAL_RANK", self.rank)) == 0)
        self.last_sync = None  # the SyncStats of the latest weight sync
        self.last_checksum = None  # the engines' weights checksum read back by the latest sync(checksum=True)
        self.setup_seconds: dict[str, float] = {}  # where building this run went (the gates' report shows it)
        # rank 0 says what a phase is doing once it has run a few seconds (a large model on the CPU)
        self.notice = f"rlperf {getattr(ns, 'command', None) or 'train'}" if self.rank == 0 else None
        dtype = compute_dtype(self.precision)
        with self.kernels():
            with self._setup_stage("model"):
                parts = build_model(config, self.device, lambda cfg: warm_start_key(
                    cfg, rt.seed, self.device, dtype, self.policy), self.rank)
                self.model, self.tokenizer = parts.model, parts.tokenizer
                self.warm_started = parts.warm_started  # rlperf.loop.warm_start: weights an earlier run warmed
            with self._setup_stage("data"):
                data = build_data(config, self.tokenizer)
                self.dataset, self.reward_fn = data.dataset, data.reward_fn
                self.rollout_fn, self.custom_generate = data.rollout_fn, data.custom_generate
            with self._setup_stage("trainer"):
                self._build_trainer(parts, dtype)
        with self._setup_stage("engines"):
            self.client, self.fleet = self._build_client()  # fleet: the engine processes this run started, if any
        # MoE: the rollout returns every token's routed experts when the trainer replays them (and for
        # the first-step gates' routing agreement: record_routing)
        self.data_source = DataSource(self.dataset, self.client, self.tokenizer, self.reward_fn, self.custom_generate,
                                      return_routed_experts=config.train.moe.routing_replay)
        self.out = Path(config.telemetry.output_dir)
        self.timeline = PhaseTimeline(default_path(self.out)) if self.rank == 0 else None
        self.meter = PhaseMeter(self.device, self.timeline, notice=self.notice)
        self.trace = TrainerTrace(ns if self.rank == 0 else _without_profile(ns), self.out, self.start, self.device,
                                  error=UsageError)  # --profile-step-*
        self.finish_kernel_precompile()  # if it ended while the run was built, say so now

    @contextlib.contextmanager
    def _setup_stage(self, name: str):
        """Time one part of building the run into :attr:`setup_seconds` (device work included: CUDA is
        synchronized at both ends)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            with slow_phase_notice(SETUP_DESCRIPTIONS[name], self.notice or "", enabled=self.notice is not None):
                yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.setup_seconds[name] = time.perf_counter() - t0

    def _build_trainer(self, parts, dtype) -> None:
        """The embedded task's format warm-up (``self.warmup_loss``: its last loss where this process ran it or
        took its result, else None; :func:`rlperf.loop.build.warm_up`), the reference model, the trainer
        backend (:func:`rlperf.train.backend.build_trainer`: the model built above holds the float32 masters;
        the backend's compute weights, bf16 on CUDA, are what forward/backward, weight sync, the engine and
        the checksum see) and, with ``--load``, its state (``self.start``: the first rollout)."""
        c = self.config
        self.warmup_loss = warm_up(parts, dtype)
        ref = reference_model(c, self.model, self.device)
        setup = TrainerSetup(c.train, self.model, ref, self.device, dtype, c.runtime.seed,
                             engine_copy=not c.rollout.disaggregated, world_size=self.world_size)
        try:
            self.trainer = build_trainer(setup)
        except LayoutError as exc:
            raise UsageError(str(exc)) from None
        self.model = self.trainer.engine_model
        with usage_errors("--load", c.model.load):
            self.start = ckpt.load_trainer_state(c.model.load, self.trainer) if c.model.load else 0

    def _build_client(self):
        """The run's :class:`rlperf.loop.clients.RolloutClient` and the engine fleet it started (or None).
        An in-process engine's KV cache holds one rollout (:func:`rlperf.loop.generation.rollout_kv_tokens`)
        unless ``--sglang-mem-fraction-static`` sizes it; on several ranks each rank's engine is sized as
        the one-rank engine (a whole rollout: room to spare for its share)."""
        r = self.config.rollout
        kv_tokens = None
        if r.engine == "in-process" and r.mem_fraction_static is None:
            kv_tokens = rollout_kv_tokens(r, self.dataset.records, self.tokenizer, K.PAGE_SIZE)
        with _auth_errors():
            return client_for(self.config, self.model, self.tokenizer, kv_tokens=kv_tokens,
                              kernel_backend=self.policy.backend, rank=self.rank, world_size=self.world_size)

    def close(self) -> None:
        """Release what the run started: the engines' weight-update group and, with ``--rollout-num-gpus``,
        the engine and router processes (:mod:`rlperf.loop.engines`), then what the trainer backend set up;
        last the kernel precompile (stopped if still running) and the kernel recorder."""
        try:
            self.client.close()
        finally:
            try:
                if self.fleet is not None:
                    self.fleet.close()
            finally:
                try:
                    self.trainer.close()
                finally:
                    self.close_kernel_precompile()

    def finish_kernel_precompile(self, stop: bool = False) -> str | None:
        """The background precompile's one-line summary, once (rank 0 prints it): when it has ended, or
        at once with ``stop`` (stopping it: what it compiled stays in Triton's cache); None while it runs
        and ``stop`` is False, or when none ran."""
        if self.precompile is None or (self.precompile.running() and not stop):
            return None
        summary, self.precompile = self.precompile.finish(wait=False), None
        if self.rank == 0:
            print(f"{self.notice or 'rlperf'}: kernel precompile: {summary}", file=sys.stderr, flush=True)
        return summary

    def close_kernel_precompile(self) -> None:
        """Stop the kernel recorder and the background precompile (:meth:`finish_kernel_precompile`)."""
        if self.kernel_recorder is not None:
            self.kernel_recorder.__exit__(None, None, None)
            self.kernel_recorder = None
        self.finish_kernel_precompile(stop=True)

    def kernels(self):
        """The run's kernel policy, for a block (every phase enters it; the async rollout thread too)."""
        return K.use_policy(self.policy)

    # ---- phases ---------------------------------------------------------------------------------
    def rollout(self, k: int):
        """Samples of rollout ``k`` and its wall time (measured here: in async mode it overlaps training).
        Several ranks: every rank trains on rank 0's samples (:func:`broadcast_from_rank0`); a rank whose
        client does not run the rollout (rank 0 drives the engines) only receives them."""
        r = self.config.rollout
        t = time.perf_counter()
        with self.kernels(), self.meter.phase("rollout", k):
            if r.load_debug_data:
                samples = load_rollout_data(r.load_debug_data.format(rollout_id=k))
            elif self.client.runs_rollout:
                samples = self.rollout_fn(self.ns, k, self.data_source)
            else:
                samples = None
            samples = broadcast_from_rank0(samples)
        if r.save_debug_data and self.rank == 0:
            save_rollout_data(r.save_debug_data.format(rollout_id=k), samples)
        if len(samples) != r.batch_size * r.n_samples_per_prompt:
            raise RuntimeError(f"rollout {k}: the rollout function returned {len(samples)} samples, expected "
                               f"{r.batch_size} x {r.n_samples_per_prompt}")
        return samples, time.perf_counter() - t

    def train(self, k: int, samples, on_first_micro_step=None) -> dict:
        """Rollout ``k``'s training (:meth:`rlperf.train.backend.TrainerBackend.train`: its log-prob and train
        phases measured); the metrics averaged over its optimizer steps, and the rollout's log-prob means."""
        with self.kernels():
            steps = self.trainer.train(samples, on_first_micro_step=on_first_micro_step,
                                       phase=lambda name: self.meter.phase(name, k))
        self.last_train_samples = samples
        return train_metrics(steps, samples)

    def sync(self, k: int, checksum: bool = False):
        """Weight sync after rollout ``k``'s training: the engines get version ``k + 1`` of the trainer's
        compute weights (:meth:`rlperf.train.backend.TrainerBackend.compute_weights`: on several ranks
        gathered from the shards, every rank at once); the client's :class:`rlperf.sync.SyncStats`. With
        ``checksum``, the phase also reads back the engines' :meth:`weights_checksum` into
        ``self.last_checksum``: the verification belongs to the sync's time and trace slice, so no step work
        falls between phases."""
        with self.kernels(), self.meter.phase("weight_sync", k), torch.no_grad(), _auth_errors():
            self.last_sync = self.client.load_weights(self.trainer.compute_weights(SYNC_BUCKET_BYTES), str(k + 1))
            if checksum:
                self.last_checksum = self.weights_checksum(k)
        return self.last_sync

    def weights_checksum(self, k: int) -> str | None:
        """``sync/weights_checksum`` (:func:`rlperf.sync.weights_checksum` at ``SYNC_BUCKET_BYTES``) after
        update ``k``: of the weights the engines hold (:meth:`rlperf.loop.clients.RolloutClient.weights_checksum`),
        or, with ``--debug-train-only`` (no sync), of the trainer's compute weights (on several ranks
        gathered by every rank); None on ranks other than 0."""
        with self.kernels(), _auth_errors():
            if not self.config.debug_train_only:
                return self.client.weights_checksum()
            checksum = weights_checksum(self.trainer.compute_weights(SYNC_BUCKET_BYTES), SYNC_BUCKET_BYTES)
        return checksum if self.rank == 0 else None

    def fault_metrics(self) -> dict:
        """The engines restarted since the previous line (:func:`rlperf.loop.metrics.fault_metrics`)."""
        take = getattr(self.client, "take_fault_events", None)
        return fault_metrics(take() if take is not None else [])

    def phase_peaks(self) -> dict[str, int]:
        """Peak memory per phase of this step: the worst rank's on several ranks (a collective)."""
        return max_over_ranks(self.meter.peaks)

    def save_checkpoint(self, iteration: int, metrics_file) -> None:
        """Checkpoint ``iteration`` (:func:`rlperf.loop.checkpoint.save_checkpoint`) of what the trainer
        backend hands out (:meth:`rlperf.train.backend.TrainerBackend.checkpoint_state`: on several ranks
        gathered to rank 0, which alone writes the checkpoint one process writes), after the metrics line
        is on disk."""
        state = self.trainer.checkpoint_state()
        if state is None:  # a rank that writes nothing
            return
        os.fsync(metrics_file.fileno())
        ckpt.save_checkpoint(self.config.model.save, iteration, state.model, state.trainer_state)

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        from tqdm import tqdm

        c = self.config
        lead = self.rank == 0  # rank 0 alone writes the metrics and prints
        if lead:
            self.out.mkdir(parents=True, exist_ok=True)
            layout = self.trainer.describe()
            print(f"rlperf train: {'embedded task' if c.data.embedded else c.data.prompt_data} on {self.device} "
                  f"({self.client.kind}, {self.precision}{', ' + layout if layout else ''}), rollouts "
                  f"{self.start}..{c.num_rollout - 1}, {c.rollout.batch_size}x{c.rollout.n_samples_per_prompt} samples "
                  f"per rollout, {'async' if c.async_mode else 'sync'} mode; metrics -> {self.out / METRICS_FILE}",
                  file=sys.stderr)
        history = []
        self.sync(self.start - 1)  # the engines start from the trainer's weights (a router's servers loaded their own)
        # the bar redraws its line with carriage returns: on a terminal the step lines go above it
        # (tqdm.write); in a log file or a pipe there is no bar, only one plain line per step
        show_bar = lead and not c.telemetry.no_progress and isatty(sys.stderr)
        bar = tqdm(total=c.num_rollout, initial=self.start, disable=not show_bar, desc="rlperf train",
                   unit="rollout", file=sys.stderr)
        pool = ThreadPoolExecutor(1) if c.async_mode else None
        self.meter.trace = self.trace
        loggers = open_loggers(c.telemetry.loggers, self.rank)  # TensorBoard, W&B, --plot (rank 0; others: none)
        try:
            with (open_metrics(self.out / METRICS_FILE, self.start if c.model.load else None) if lead
                  else open(os.devnull, "w")) as mf:
                pending = None
                for k in range(self.start, c.num_rollout):
                    self.trace.step(k)
                    self.meter.reset()
                    step_start = time.perf_counter()
                    samples, rollout_time = pending.result() if pending is not None else self.rollout(k)
                    if pool is not None and k + 1 < c.num_rollout:
                        pending = pool.submit(self.rollout, k + 1)  # generated by weights before update k
                    else:
                        pending = None
                    m = {"rollout_id": k}
                    m.update(rollout_metrics(samples, rollout_time))
                    if not c.debug_rollout_only:
                        m.update(self.train(k, samples))
                        if pending is not None:
                            pending = _Done(pending.result())  # the engines must be idle to take weights
                        if not c.debug_train_only:
                            self.sync(k, checksum=True)
                            m["sync/weights_checksum"] = self.last_checksum
                        else:
                            m["sync/weights_checksum"] = self.weights_checksum(k)
                    m.update(self.fault_metrics())
                    m.update(step_metrics(samples, rollout_time, time.perf_counter() - step_start, self.meter.times,
                                          self.phase_peaks(), self.meter.kind))
                    # the line before the checkpoint: a kill in between leaves it ahead of the pointer, and
                    # the resume drops it (open_metrics); after it, never a rollout the metrics lack
                    mf.write(json.dumps(m) + "\n")
                    mf.flush()
                    loggers.log(m, step=k)
                    save, every = c.model.save, c.model.save_interval
                    if save and not c.debug_rollout_only and (
                            k + 1 == c.num_rollout or (every and (k + 1) % every == 0)):
                        self.save_checkpoint(k + 1, mf)
                        loggers.checkpoint(k + 1)
                    history.append(m)
                    bar.update(1)
                    if show_bar:
                        bar.write(summary_line(m, c.num_rollout), file=sys.stderr)
                    elif lead:
                        print(summary_line(m, c.num_rollout), file=sys.stderr, flush=True)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            bar.close()
            self.trace.close()
            if self.timeline is not None:
                self.timeline.save()
            loggers.close()
        return history


def _without_profile(ns):
    """``ns`` without a ``--profile-step-*`` window (ranks other than 0 write no torch traces)."""
    import copy

    ns = copy.copy(ns)
    ns.profile_step_start = ns.profile_step_end = None
    return ns


class _Done:
    """A finished future's stand-in (async mode waits for rollout k+1 before the weight sync)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def resolve(args):
    """``args`` (an argv list, a parsed or a resolved namespace) as resolved flags."""
    if isinstance(args, (list, tuple)) or args is None:
        return parse_train_args(list(args or []))
    if not is_resolved(args):
        return resolve_args(args)
    return args


def train(args=None) -> list[dict]:
    """Run ``rlperf train`` with ``args`` (argv list, or a parsed namespace); returns the metrics lines."""
    run = Run(resolve(args))
    try:
        return run.run()
    finally:
        run.close()
