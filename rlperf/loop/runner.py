"""The RL loop of ``rlperf train``: rollout -> rewards -> log-probs -> train -> weight sync, per step.

Sync mode (default)::

    for k in range(start, num_rollout):
        samples = rollout(k)                 # engines hold the weights after update k-1
        prepare (old + ref log-probs, advantages); num_steps_per_rollout optimizer steps
        weight sync (buckets) ; metrics line ; checkpoint every --save-interval

Async mode (``--async``, slime's ``train_async.py``): rollout k+1 is generated (in a second thread)
while the trainer trains on rollout k; the engines get update k only after rollout k+1 is in, so
every rollout is one step off-policy.

Per step the metrics line holds ``rollout/*`` (raw_reward, response_length, log_probs,
ref_log_probs, rollout_log_probs), ``train/*`` (the trainer's, averaged over the rollout's
optimizer steps), ``perf/*`` (rollout_time, log_prob_time, train_time, update_weights_time,
longest_sample_tokens_per_sec), ``memory/{phase}_peak_bytes`` (CUDA: the allocator's peak within
the phase; CPU: the process's peak resident set within the phase; ``memory/kind`` says which; both
measured by :class:`rlperf.telemetry.PhaseMeter`) and
``sync/weights_checksum`` (one 64-bit hash of all weights after the update: equal runs have equal
checksums). In async mode the rollout thread's phase overlaps training, so its memory and
timeline slices overlap the train phase's.

``rlperf train`` (the CLI) runs the first-step gates before this loop; :func:`train` does not.
On stderr each step prints one summary line (:func:`summary_line`); a tqdm bar runs below them
only when stderr is a terminal (a log file or a pipe gets the plain lines alone).

Embedded default (measured on the shared 2-core CI box, 1 thread): mean reward 0.25 (chance) at
rollout 1, ~0.98 at rollout 80, in about 35 s.

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

Data parallel (``--actor-num-gpus-per-node N > 1``): every rank runs this loop in lockstep, with an
:class:`rlperf.train.fsdp.FSDPTrainer` and its own engine (:mod:`rlperf.loop.data_parallel`), or, with
``--rollout-num-gpus``, rank 0 alone drives the disaggregated engines (rollout through their router,
broadcast to the other ranks; weights gathered on every rank and broadcast to the engines by rank 0);
rank 0 alone writes ``metrics.jsonl``, the timeline, traces and checkpoints, and prints.

:func:`first_step` is the hook of the first-step gates: one rollout and one train step, returned
as a :class:`rlperf.loop.record.FirstStepRecord` (the gates import it from the loop, never the reverse).
"""
from __future__ import annotations

import contextlib
import dataclasses
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

from . import checkpoint as ckpt
from . import warm_start
from .args import UsageError, check_moe_model, is_resolved, memory_limit
from .clients import ServerAuthError, client_for
from .config import RunConfig
from .device import compute_dtype, kernel_policy, run_device
from .probe import worst_case_probe
from .record import PHASES, EngineMemory, FirstStepRecord, PhaseMemory
from .resolve import parse_train_args, resolve_args
from .data_parallel import RankFailure, broadcast_from_rank0, max_over_ranks, rank_and_world
from .generation import DataSource, generate_rollout, load_rollout_data, rollout_kv_tokens, save_rollout_data

METRICS_FILE = "metrics.jsonl"
SECRET_FLAGS = ("sglang_api_key",)
"""Flags no record, report or log of the run may show."""


@contextlib.contextmanager
def _usage_errors(flag: str, path):
    """A checkpoint that cannot be loaded (missing files, an unsupported config.json, mismatched
    tensors) is bad input: :class:`UsageError` naming the flag (the CLI exits 2 with it)."""
    try:
        yield
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: {exc}") from None


@contextlib.contextmanager
def _auth_errors():
    """A router or server that refuses the run's API key (or its lack of one) is bad usage: the
    :class:`UsageError` says which flag passes the key (the CLI exits 2 with it)."""
    try:
        yield
    except ServerAuthError as exc:
        raise UsageError(str(exc)) from None


def _mean_over_tokens(tensors) -> float:
    ts = [t for t in tensors if t is not None]
    return float(torch.cat(ts).double().mean()) if ts else float("nan")


class Run:
    """Everything a training run holds; building it runs no step (all input errors surface here).

    ``ns``: resolved ``rlperf train`` flags (:func:`rlperf.loop.resolve.resolve_args`), read once into
    :attr:`config` (:class:`rlperf.loop.config.RunConfig`); the namespace itself goes only to custom
    rollout, generate and reward functions (their contract: slime's ``args``). ``train_args``: the
    trainer's :class:`rlperf.train.TrainArgs`, when not ``ns.train_args`` (the first step asks for
    reference log-probs without changing the shared namespace).

    Built in four parts, in this order: the model and tokenizer (:meth:`_build_model`), the data
    (:meth:`_build_data`), the trainer (:meth:`_build_trainer`: the embedded task's format warm-up,
    the reference, the precision, data parallel or not, a resumed state) and the rollout client
    (:meth:`_build_client`, :func:`rlperf.loop.clients.client_for`).
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
        # data parallel (--actor-num-gpus-per-node > 1): this process is rank `rank` of `world_size`
        # (rlperf.loop.data_parallel); rank 0 alone writes files and prints
        self.rank, self.world_size = rank_and_world()
        self.last_sync = None  # the SyncStats of the latest weight sync
        self.last_checksum = None  # the engines' weights checksum read back by the latest sync(checksum=True)
        self.setup_seconds: dict[str, float] = {}  # where building this run went (the gates' report shows it)
        # rank 0 says what a phase is doing once it has run a few seconds (a large model on the CPU)
        self.notice = f"rlperf {getattr(ns, 'command', None) or 'train'}" if self.rank == 0 else None
        with self.kernels():
            with self._setup_stage("model"):
                self._build_model()
            with self._setup_stage("data"):
                self._build_data()
            with self._setup_stage("trainer"):
                self._build_trainer(config.train.args)
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

    def _build_model(self) -> None:
        """``self.model`` (float32): ``--load`` > ``--hf-checkpoint`` > the ``--model`` preset at random
        init, or warmed already when an earlier run of this process kept its warm-up's result for the
        same key (``self.warm_started``, :mod:`rlperf.loop.warm_start`); ``self.tokenizer``."""
        from rlperf.model import preset
        from rlperf.model.qwen3 import Qwen3ForCausalLM
        from rlperf.rollout.tokenizer import load_tokenizer

        m = self.config.model
        init_path = ckpt.model_dir(m.load) if m.load else m.hf_checkpoint
        self.warm_started = None  # the warmed weights of an earlier run of this process, when they apply
        self.warm_key = self._warm_start_key(preset(m.preset)) if self._warms_up() else None  # rlperf.loop.warm_start
        if init_path:
            with _usage_errors("--load" if m.load else "--hf-checkpoint", m.load or init_path):
                self.model = Qwen3ForCausalLM.from_pretrained(init_path, dtype=torch.float32, device=self.device)
        elif self.warm_key is not None and (kept := warm_start.lookup(self.warm_key)):
            self.warm_started = kept  # rlperf.loop.warm_start: no random init, no warm-up
            self.model = Qwen3ForCausalLM(preset(m.preset), torch.float32, self.device)
            kept.load_into(self.model)
        else:
            self.model = Qwen3ForCausalLM.random(preset(m.preset), seed=self.config.runtime.seed, device=self.device)
        self.tokenizer = load_tokenizer(m.hf_checkpoint, self.model.cfg.vocab_size)
        moe = self.config.train.moe
        check_moe_model(self.model.cfg, moe.expert_model_parallel_size, moe.routing_replay)

    def _warms_up(self) -> bool:
        """Whether this process gives the model the embedded task's format warm-up: a preset model (no
        ``--load`` / ``--hf-checkpoint``) on the embedded task, on rank 0 (the others take its weights)."""
        return self.config.data.embedded and not self.config.model.init_path and self.rank == 0

    def _warm_start_key(self, cfg) -> tuple:
        """Everything the warm-up's result depends on (:mod:`rlperf.loop.warm_start`): the preset model
        ``cfg`` and the seed it is drawn from, the device, the compute dtype, the kernels (mode and the
        backend they resolve to here), the CPU threads, deterministic algorithms, the task and the
        warm-up function itself."""
        from rlperf.data.embedded import EMBEDDED_TASK, format_warmup

        return (cfg, self.config.runtime.seed, str(self.device), compute_dtype(self.precision), self.policy.mode,
                self.policy.backend_for(self.device), torch.get_num_threads(),
                torch.are_deterministic_algorithms_enabled(), EMBEDDED_TASK, format_warmup)

    def _build_data(self) -> None:
        """The prompts (``self.dataset``), the reward, the rollout function and the custom generate
        function; a bad file or python path is a :class:`UsageError`."""
        from rlperf.data.embedded import EMBEDDED_TASK
        from rlperf.data.jsonl import DataError, PromptDataset, load_prompt_data
        from rlperf.data.rewards import load_python_path, reward_fn_for

        d, r, seed = self.config.data, self.config.rollout, self.config.runtime.seed
        try:
            if d.embedded:
                self.dataset = PromptDataset(EMBEDDED_TASK.records(), seed)
            else:
                self.dataset = PromptDataset(load_prompt_data(
                    d.prompt_data, d.input_key, d.label_key, d.metadata_key, d.apply_chat_template, self.tokenizer), seed)
            self.reward_fn = reward_fn_for(d.rm_type, d.custom_rm_path)
            self.rollout_fn = (load_python_path(r.rollout_function_path, "--rollout-function-path")
                               if r.rollout_function_path else generate_rollout)
            self.custom_generate = (load_python_path(r.custom_generate_function_path, "--custom-generate-function-path")
                                    if r.custom_generate_function_path else None)
        except (DataError, ValueError) as exc:
            raise UsageError(str(exc)) from None

    def _build_trainer(self, train_args) -> None:
        """The embedded task's format warm-up (a preset model only; rank 0 alone runs it), the reference
        model (``--ref-load``, else a frozen copy of the actor when a KL term needs one), on several
        ranks rank 0's actor and reference broadcast to every rank, the trainer (data parallel:
        :meth:`_shard_trainer`; expert parallel: :meth:`_expert_parallel_trainer`; megatron:
        :meth:`_megatron_trainer`) and, with ``--load``, its state (``self.start``: the first rollout).

        A preset model whose warmed weights an earlier run of this process kept (the gates' run before
        the training run: :mod:`rlperf.loop.warm_start`) was loaded with them and is not warmed up again.

        ``self.warmup_loss``: the warm-up's last loss where this process ran it (or took its result), else None (a
        ``--prompt-data`` run, a loaded model, a rank other than 0). The other ranks skip the warm-up
        because nothing reads their actor before the broadcast overwrites it with rank 0's warmed
        weights (their reference, a copy of their unwarmed actor, is overwritten with rank 0's warmed
        reference alike); the warm-up draws no random numbers, so the ranks' generators stay alike."""
        from rlperf.data.embedded import EMBEDDED_TASK, format_warmup
        from rlperf.model.qwen3 import Qwen3ForCausalLM
        from rlperf.train import Trainer, frozen_copy

        m = self.config.model
        self.warmup_loss = None
        if self.warm_started is not None:
            self.warmup_loss = self.warm_started.loss
        elif self.warm_key is not None:
            self.warmup_loss = format_warmup(self.model, EMBEDDED_TASK, self.tokenizer,
                                             compute_dtype=compute_dtype(self.precision))
            warm_start.keep(self.warm_key, self.model, self.warmup_loss)
        ref = None
        if m.ref_load:
            with _usage_errors("--ref-load", m.ref_load):
                ref = Qwen3ForCausalLM.from_pretrained(ckpt.model_dir(m.ref_load), dtype=torch.float32,
                                                       device=self.device)
        elif train_args.use_kl_loss or train_args.kl_coef:
            ref = frozen_copy(self.model)  # the actor as it starts (slime asks for --ref-load)
        if self.world_size > 1:
            # every rank starts from rank 0's weights, whatever each built or loaded (and rank 0 alone
            # warmed up): every layout below (fsdp, expert parallel, megatron) shards these
            from rlperf.train.fsdp import broadcast_parameters

            broadcast_parameters(self.model)
            if ref is not None:
                broadcast_parameters(ref)
        # the model built above holds the float32 master weights; the trainer's compute copy (bf16 on
        # CUDA) is what forward/backward, weight sync, the engine and the checksum see
        if self.config.train.backend == "megatron":
            self._megatron_trainer(train_args, ref)
        elif self.config.train.moe.expert_model_parallel_size > 1:
            self._expert_parallel_trainer(train_args, ref, engine_copy=not self.config.rollout.disaggregated)
        elif self.world_size > 1:
            # disaggregated engines take the weights from the gathered shards: no engine copy on the ranks
            self._shard_trainer(train_args, ref, engine_copy=not self.config.rollout.disaggregated)
        else:
            self.trainer = Trainer(self.model, train_args, ref, compute_dtype=compute_dtype(self.precision),
                                   routing_replay=self.config.train.moe.routing_replay)
            self.master_model, self.model = self.model, self.trainer.model
        with _usage_errors("--load", m.load):
            self.start = ckpt.load_trainer_state(m.load, self.trainer) if m.load else 0

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

    def _shard_trainer(self, train_args, ref, engine_copy: bool = True) -> None:
        """Data parallel: every rank starts from rank 0's weights (broadcast by :meth:`_build_trainer`),
        the actor (and reference) are sharded by FSDP2 (:class:`rlperf.train.fsdp.FSDPTrainer`: its
        shards are the float32 masters), and with ``engine_copy`` ``self.model`` becomes the rank's engine copy in the compute dtype (full
        weights, loaded from the shards at every sync). Without it (disaggregated engines: the weights
        go to them from the gathered shards) there is no full copy and ``self.model`` is the sharded
        master model."""
        from rlperf.train.fsdp import FSDPTrainer

        dtype = compute_dtype(self.precision)
        engine_model = self._engine_copy(dtype, engine_copy)
        self.trainer = FSDPTrainer(self.model, train_args, ref, compute_dtype=dtype,
                                   routing_replay=self.config.train.moe.routing_replay)
        self.master_model = self.trainer.master_model
        self.model = engine_model if engine_copy else self.master_model

    def _engine_copy(self, dtype, engine_copy: bool):
        """With ``engine_copy``, the rank's engine copy of ``self.model`` in ``dtype`` (its weights loaded
        at every sync), else None."""
        if not engine_copy:
            return None
        engine_model = type(self.model)(self.model.cfg, dtype, self.device)
        engine_model.requires_grad_(False)
        return engine_model

    def _expert_parallel_trainer(self, train_args, ref, engine_copy: bool = True) -> None:
        """``--expert-model-parallel-size EP > 1``: every rank starts from rank 0's weights (broadcast by
        :meth:`_build_trainer`), keeps its share of the experts
        (:class:`rlperf.train.expert_parallel.ExpertParallelTrainer`) and, with
        ``engine_copy``, a full engine copy in the compute dtype (``self.model``), loaded from the
        gathered weights at every sync (as the data-parallel ranks' engines)."""
        from rlperf.train.expert_parallel import ExpertParallelTrainer

        dtype = compute_dtype(self.precision)
        engine_model = self._engine_copy(dtype, engine_copy)
        moe = self.config.train.moe
        self.trainer = ExpertParallelTrainer(self.model, train_args, ref, compute_dtype=dtype,
                                             routing_replay=moe.routing_replay,
                                             expert_parallel_size=moe.expert_model_parallel_size)
        self.master_model = self.trainer.master_model
        self.model = engine_model if engine_copy else self.master_model

    def _megatron_trainer(self, train_args, ref) -> None:
        """``--train-backend megatron``: megatron's tensor / pipeline / data-parallel groups over the actor
        ranks (a one-rank group of this process alone when there is no default group), this rank's stage
        and shards of a ``GPTModel`` (and of the reference) loaded from rank 0's full HF weights (broadcast
        by :meth:`_build_trainer`), and a :class:`rlperf.train.megatron.trainer.MegatronTrainer`.
        ``self.model`` becomes this rank's engine copy: rlperf's model in the compute dtype, in the tree
        mode (``reduction_leaves``) whose bits are the trainer's at any TP / PP (true on-policy), loaded
        at every sync from the gathered shards."""
        import torch.distributed as dist

        from rlperf.kernels.tree_reduce import TREE_LEAVES
        from rlperf.model.qwen3 import Qwen3ForCausalLM
        from rlperf.train.megatron.model import RecomputeConfig, build_gpt_model
        from rlperf.train.megatron.runtime import ParallelLayout, initialize_model_parallel
        from rlperf.train.megatron.trainer import MegatronTrainer

        mc = self.config.train.megatron
        if not dist.is_initialized():
            # one process: an in-memory store, no TCP port that another process could take first
            dist.init_process_group("gloo" if self.device.type == "cpu" else "cpu:gloo,cuda:nccl",
                                    store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        flags = (f"--tensor-model-parallel-size {mc.tensor_model_parallel_size} --pipeline-model-parallel-size "
                 f"{mc.pipeline_model_parallel_size}" + (" --sequence-parallel" if mc.sequence_parallel else ""))
        try:
            initialize_model_parallel(ParallelLayout(mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size,
                                                     sequence_parallel=mc.sequence_parallel),
                                      seed=self.config.runtime.seed)
            self._megatron_groups = True
            recompute = RecomputeConfig(mc.recompute_granularity, mc.recompute_method, mc.recompute_num_layers)

            def shards(model):
                gpt = build_gpt_model(model.cfg, torch.float32, TREE_LEAVES, recompute, device=self.device,
                                      sequence_parallel=mc.sequence_parallel)
                gpt.load_hf_tensors(model.hf_state_dict())
                return gpt

            actor, ref_gpt = shards(self.model), (shards(ref) if ref is not None else None)
        except (ValueError, AssertionError) as exc:  # the model does not split into this layout
            raise UsageError(f"--train-backend megatron {flags}: {exc}") from None
        dtype = compute_dtype(self.precision)
        self.trainer = MegatronTrainer(actor, train_args, ref_gpt, compute_dtype=dtype,
                                       distributed_optimizer=mc.use_distributed_optimizer)
        self.master_model = None  # the float32 masters are shards: checkpoints gather them (gather_model)
        engine = Qwen3ForCausalLM(self.model.cfg, dtype, self.device, reduction_leaves=TREE_LEAVES)
        engine.requires_grad_(False)
        self.model = engine

    def close(self) -> None:
        """Release what the run started: the engines' weight-update group and, with
        ``--rollout-num-gpus``, the engine and router processes (:mod:`rlperf.loop.engines`); with the
        megatron backend its process groups (and the one-rank default group it made)."""
        try:
            self.client.close()
        finally:
            if self.fleet is not None:
                self.fleet.close()
            if getattr(self, "_megatron_groups", False):
                from rlperf.train.megatron.runtime import destroy_model_parallel

                destroy_model_parallel()
                self._megatron_groups = False
            if getattr(self, "_own_group", False):
                import torch.distributed as dist

                dist.destroy_process_group()
                self._own_group = False

    def kernels(self):
        """The run's kernel policy, for a block (every phase enters it; the async rollout thread too)."""
        return K.use_policy(self.policy)

    # ---- phases ---------------------------------------------------------------------------------
    def rollout(self, k: int):
        """Samples of rollout ``k`` and its wall time (measured here: in async mode it overlaps training).
        Data parallel: every rank trains on rank 0's samples (:func:`broadcast_from_rank0`); a rank whose
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
            if self.world_size > 1:
                samples = broadcast_from_rank0(samples)
        if r.save_debug_data and self.rank == 0:
            save_rollout_data(r.save_debug_data.format(rollout_id=k), samples)
        if len(samples) != r.batch_size * r.n_samples_per_prompt:
            raise RuntimeError(f"rollout {k}: the rollout function returned {len(samples)} samples, expected "
                               f"{r.batch_size} x {r.n_samples_per_prompt}")
        return samples, time.perf_counter() - t

    def train(self, k: int, samples, on_first_micro_step=None) -> dict:
        """Rollout ``k``'s training (:meth:`rlperf.train.Trainer.train`: its log-prob and train phases
        measured); the metrics averaged over its optimizer steps, and the rollout's log-prob means."""
        with self.kernels():
            steps = self.trainer.train(samples, on_first_micro_step=on_first_micro_step,
                                       phase=lambda name: self.meter.phase(name, k))
        m = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
        m["rollout/log_probs"] = _mean_over_tokens(s.log_probs for s in samples)
        m["rollout/rollout_log_probs"] = _mean_over_tokens(s.rollout_log_probs_tensor() for s in samples)
        if any(s.ref_log_probs is not None for s in samples):
            m["rollout/ref_log_probs"] = _mean_over_tokens(s.ref_log_probs for s in samples)
        self.last_train_samples = samples
        return m

    def sync(self, k: int, checksum: bool = False):
        """Weight sync after rollout ``k``'s training: the engines get version ``k + 1`` of the trainer's
        compute weights (:meth:`rlperf.train.Trainer.compute_weights`: on several ranks gathered from the
        shards, every rank at once); the client's :class:`rlperf.sync.SyncStats`. With ``checksum``, the
        phase also reads back the engines' :meth:`weights_checksum` into ``self.last_checksum``: the
        verification belongs to the sync's time and trace slice, so no step work falls between phases."""
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
        """``--use-fault-tolerance``: the engines restarted since the previous line (restarted, synced and
        back in the router during this step): ``rollout/engine_restarts`` (how many),
        ``rollout/engines_restarted`` (their indices, comma-separated) and ``rollout/engine_out_s`` (the
        longest time one was out of service, from the failure found to back in the router). Empty
        without restarts."""
        take = getattr(self.client, "take_fault_events", None)
        events = take() if take is not None else []
        if not events:
            return {}
        return {"rollout/engine_restarts": len(events),
                "rollout/engines_restarted": ",".join(str(e.engine) for e in events),
                "rollout/engine_out_s": max(e.out_s for e in events)}

    def phase_peaks(self) -> dict[str, int]:
        """Peak memory per phase of this step: the worst rank's in data parallel (a collective)."""
        return max_over_ranks(self.meter.peaks) if self.world_size > 1 else dict(self.meter.peaks)

    def save_checkpoint(self, iteration: int, metrics_file) -> None:
        """Checkpoint ``iteration`` (:func:`rlperf.loop.checkpoint.save_checkpoint`), after the metrics
        line is on disk. Data parallel: the float32 masters and the full optimizer state are gathered
        to rank 0 (collectives), which alone writes the same consolidated checkpoint one rank writes."""
        model, trainer = self.master_model, self.trainer
        if self.world_size > 1 or self.config.train.backend == "megatron":
            model, state = self.trainer.gather_model(), self.trainer.state_dict()
            if self.rank != 0:
                return
            trainer = _SavedTrainerState(state)
        os.fsync(metrics_file.fileno())
        ckpt.save_checkpoint(self.config.model.save, iteration, model, trainer)

    def rollout_metrics(self, samples, rollout_time: float) -> dict:
        rewards = [s.reward for s in samples]
        lengths = [s.response_length for s in samples]
        return {"rollout/raw_reward": sum(rewards) / len(rewards),
                "rollout/response_length": sum(lengths) / len(lengths),
                "perf/longest_sample_tokens_per_sec": max(lengths) / rollout_time if rollout_time > 0 else 0.0}

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        from tqdm import tqdm

        c = self.config
        lead = self.rank == 0  # data parallel: rank 0 alone writes the metrics and prints
        if lead:
            self.out.mkdir(parents=True, exist_ok=True)
        history = []
        if lead:
            ranks = f", {self.world_size} data-parallel ranks" if self.world_size > 1 else ""
            mc = c.train.megatron
            ep = c.train.moe.expert_model_parallel_size
            if ep > 1:
                ranks += f", experts split over {ep} ranks (expert parallel)"
            if mc is not None:
                ranks = (f", megatron backend on {self.world_size} rank(s): TP {mc.tensor_model_parallel_size} x PP "
                         f"{mc.pipeline_model_parallel_size} x DP "
                         f"{self.world_size // (mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size)}")
            print(f"rlperf train: {'embedded task' if c.data.embedded else c.data.prompt_data} on {self.device} "
                  f"({self.client.kind}, {self.precision}{ranks}), rollouts {self.start}..{c.num_rollout - 1}, "
                  f"{c.rollout.batch_size}x{c.rollout.n_samples_per_prompt} samples per rollout, "
                  f"{'async' if c.async_mode else 'sync'} mode; metrics -> {self.out / METRICS_FILE}", file=sys.stderr)
        self.sync(self.start - 1)  # the engines start from the trainer's weights (a router's servers loaded their own)
        # the bar redraws its line with carriage returns: on a terminal the step lines go above it
        # (tqdm.write); in a log file or a pipe there is no bar, only one plain line per step
        show_bar = lead and not c.telemetry.no_progress and _isatty(sys.stderr)
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
                    m.update(self.rollout_metrics(samples, rollout_time))
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
                    m["perf/rollout_time"] = rollout_time
                    # step = rollout (or waiting for the overlapped one) + train + weight sync
                    m["perf/step_time"] = time.perf_counter() - step_start
                    tokens = sum(s.total_length for s in samples)
                    m["rollout/total_tokens"] = tokens
                    m["perf/tokens_per_sec"] = tokens / m["perf/step_time"]
                    for phase, key in (("train", "perf/train_time"), ("log_prob", "perf/log_prob_time"),
                                       ("weight_sync", "perf/update_weights_time")):
                        if phase in self.meter.times:
                            m[key] = self.meter.times[phase]
                    for phase, peak in self.phase_peaks().items():
                        m[f"memory/{phase}_peak_bytes"] = peak
                    m["memory/kind"] = self.meter.kind
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


def open_metrics(path: Path, resume_from: int | None):
    """``metrics.jsonl`` opened for the run's lines. A fresh run (``resume_from`` None) starts it empty;
    a run resuming from the checkpoint of iteration ``resume_from`` keeps only the lines of rollouts
    before it: lines a killed run wrote after its last checkpoint (and a torn last line) go, so every
    rollout is in the file exactly once."""
    if resume_from is None:
        return open(path, "w")
    if path.exists():
        kept, dropped = [], 0
        for line in path.read_text().splitlines():
            try:
                rid = json.loads(line).get("rollout_id")
            except (ValueError, AttributeError):
                rid = None
            if isinstance(rid, int) and rid < resume_from:
                kept.append(line + "\n")
            elif line.strip():
                dropped += 1
        if dropped:
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            print(f"rlperf train: {path}: dropped {dropped} line(s) of rollouts >= {resume_from} (written after "
                  f"the checkpoint this run resumes from)", file=sys.stderr)
    return open(path, "a")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class _SavedTrainerState:
    """A trainer state gathered before the save (data parallel), in the shape ``save_checkpoint`` asks for."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


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


def summary_line(m: dict, total: int) -> str:
    def f(key, fmt="{:.4f}"):
        v = m.get(key)
        return "-" if v is None else fmt.format(v)

    return (f"rollout {m['rollout_id'] + 1}/{total} | reward {f('rollout/raw_reward', '{:.3f}')} | "
            f"loss {f('train/loss')} | pg_clipfrac {f('train/pg_clipfrac', '{:.3f}')} | ppo_kl {f('train/ppo_kl', '{:.2e}')}"
            f" | grad_norm {f('train/grad_norm', '{:.3f}')} | abs_diff {f('train/train_rollout_logprob_abs_diff', '{:.2e}')}"
            f" | rollout {f('perf/rollout_time', '{:.2f}')}s train {f('perf/train_time', '{:.2f}')}s "
            f"sync {f('perf/update_weights_time', '{:.3f}')}s")


def _resolve(args):
    if isinstance(args, (list, tuple)) or args is None:
        return parse_train_args(list(args or []))
    if not is_resolved(args):
        return resolve_args(args)
    return args


def train(args=None) -> list[dict]:
    """Run ``rlperf train`` with ``args`` (argv list, or a parsed namespace); returns the metrics lines."""
    run = Run(_resolve(args))
    try:
        return run.run()
    finally:
        run.close()


def first_step(args=None):
    """One rollout and one train step (no checkpoint), then the worst-case memory probe, as the gates' record.

    ``args``: argv list (``rlperf train`` flags) or a parsed namespace. The reference model is
    ``--ref-load``, else a frozen copy of the actor at step 0, and reference log-probs are always
    computed. Returns :class:`rlperf.loop.record.FirstStepRecord`.
    """
    ns = _resolve(args)
    ta = ns.train_args
    if not (ta.use_kl_loss or ta.kl_coef):
        # the trainer computes reference log-probs (and builds the reference, a frozen copy of the
        # actor) only when the loss needs them: this step's trainer asks for a KL loss of
        # coefficient 0, which leaves the loss as it is; ns.train_args stays untouched
        ta = dataclasses.replace(ta, use_kl_loss=True, kl_loss_coef=0.0)
    t_setup = time.perf_counter()
    try:
        run = Run(ns, train_args=ta)
    except UsageError:
        raise
    except Exception as exc:
        if rank_and_world()[1] > 1:  # the gates cannot report it: the other ranks wait in a collective
            raise RankFailure(f"the first step failed: {type(exc).__name__}: {exc}") from exc
        raise
    setup_seconds = time.perf_counter() - t_setup
    try:
        record = _first_step_record(run, ns)
        record.stage_seconds = {"setup": setup_seconds, **record.stage_seconds}
        record.setup_seconds = dict(run.setup_seconds)
        return record
    except Exception as exc:
        if run.world_size > 1:  # the gates cannot report it: the other ranks wait in a collective
            raise RankFailure(f"rank {run.rank}: the first step failed: {type(exc).__name__}: {exc}") from exc
        raise
    finally:
        run.close()


def _first_step_record(run: Run, ns) -> FirstStepRecord:
    first: dict = {}
    moe = bool(run.model.cfg.moe_layers)
    if moe:  # the routing_agreement gate compares the rollout's routing with the trainer's
        run.data_source.return_routed_experts = True
    t_step = time.perf_counter()
    run.sync(-1)
    run.meter.reset()
    samples, rollout_time = run.rollout(0)
    train_routed = None
    if moe:  # the trainer's own routers, on the weights the rollout ran (before this step's update)
        with run.kernels():
            train_routed = run.trainer.train_routed_experts(samples)
    m = run.rollout_metrics(samples, rollout_time)
    m.update(run.train(0, samples, on_first_micro_step=first.update))
    run.sync(0)
    engines = _engine_memory(run)  # after the rollout and the weight sync: each engine's peak so far
    # worst case: the longest prompt of this step plus a full-length response, packed as densely as
    # the run packs (max_tokens_per_gpu or micro_batch_size samples); weights and grads untouched
    longest_prompt = max(s.prompt_length for s in run.last_train_samples)
    t_probe = time.perf_counter()
    with run.kernels():
        probe = worst_case_probe(run.trainer, longest_prompt + int(run.config.rollout.max_response_len))
    stages = {"step": t_probe - t_step, "probe": time.perf_counter() - t_probe}
    peaks = run.phase_peaks()  # data parallel: the worst rank's
    if run.world_size > 1:
        probe.peak_bytes = max_over_ranks({"probe": probe.peak_bytes})["probe"]
    if run.timeline is not None:
        run.timeline.save()
    cap = None
    if run.device.type == "cuda":
        cap = torch.cuda.get_device_properties(run.device).total_memory
    elif memory_limit(ns):
        cap = int(memory_limit(ns))
    config = {k: v for k, v in vars(ns).items()  # the gates' reports show it: never the API key
              if isinstance(v, (str, int, float, bool, type(None))) and k not in SECRET_FLAGS}
    return FirstStepRecord(
        samples=run.last_train_samples, first_micro_step=first, step_metrics=m,
        phases=[PhaseMemory(p, peaks[p]) for p in PHASES],
        capacity_bytes=cap, memory_kind=run.meter.kind, probe=probe, true_on_policy=run.config.true_on_policy,
        sglang_numerics=run.config.rollout.sglang.numerics if run.config.rollout.sglang is not None else None,
        config=config, engines=engines, ranks=run.world_size, train_routed_experts=train_routed,
        stage_seconds=stages)


def _engine_memory(run: Run) -> list[EngineMemory]:
    """With engines of the run's own (``--rollout-num-gpus``): each one's memory as it reports it
    (:meth:`rlperf.loop.clients.RouterClient.engine_memory`; on several ranks rank 0 asks and every rank
    gets the answer, so every rank's gates check the same record). With engine processes on the trainer's
    GPU (``--colocate``: SGLang's engine, or rlperf serve workers behind ``--sglang-router-ip``): each one's,
    marked ``colocated`` (its fraction, where it reports none, the run's ``--sglang-mem-fraction-static``),
    for the oom_headroom gate to subtract from the trainer's limit. Else nothing: the in-process engine
    lives in the trainer's process, its memory in the phases' peaks."""
    r = run.config.rollout
    if r.disaggregated:
        return run.client.engine_memory()
    if not r.colocate or not hasattr(run.client, "engine_memory"):
        return []
    engines = run.client.engine_memory()
    for e in engines:
        e.colocated = True
        if e.fraction is None:
            e.fraction = r.mem_fraction_static
    return engines
