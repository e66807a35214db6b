"""The typed configuration of a training run: one frozen section per concern, built once from the
resolved flags (:func:`rlperf.loop.resolve.resolve_args`) by :meth:`RunConfig.from_args`.

The loop reads ``config.<section>.<field>``; nothing in it reads the parsed namespace by name. The
namespace itself still reaches one place: custom rollout and generate functions, whose contract
(slime's) is ``fn(args, rollout_id, data_source)`` with the flags as attributes.

Sections: :class:`DataConfig` (prompts, rewards), :class:`RolloutConfig` (sampling and where the
rollout runs: :attr:`RolloutConfig.engine`), :class:`ModelConfig` (initial, reference and saved
weights), :class:`TrainConfig` (the trainer's section, defined beside the trainers in :mod:`rlperf.train.config`:
the training core's :class:`rlperf.train.TrainArgs`, precision, steps, the backend and its layout),
:class:`RuntimeConfig` (device, threads, kernel policy, seed), :class:`PlacementConfig` (actor
ranks), :class:`TelemetryConfig` (outputs, progress). Light to import.
"""
from __future__ import annotations

import argparse
import dataclasses

from rlperf.telemetry.loggers import LoggerConfig
from rlperf.train.args import TrainArgs
from rlperf.train.config import MegatronConfig, MoEConfig, TrainConfig

from .args import DEFAULT_SGLANG_ATTENTION_BACKEND, DEFAULT_SGLANG_NUMERICS

RLPERF_ATTENTION_BACKEND = "rlperf"
"""The attention backend rlperf's SGLang plugin registers (``--sglang-numerics rlperf``): an engine started with
``--attention-backend rlperf`` runs rlperf's model classes, kernels and sampler."""

ROLLOUT_ENGINES = ("in-process", "router", "disaggregated")
"""Where a run's rollouts are generated (:attr:`RolloutConfig.engine`); :func:`rlperf.loop.clients.client_for`
builds the client of each."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompts and rewards (``--prompt-data`` and its keys, ``--rm-type``, ``--custom-rm-path``)."""

    prompt_data: str | None
    """A jsonl file of prompts; None: the embedded task (:data:`rlperf.data.embedded.EMBEDDED_TASK`)."""
    input_key: str
    label_key: str
    metadata_key: str
    apply_chat_template: bool
    """The input field is a list of chat messages, rendered with the tokenizer's chat template."""
    rm_type: str
    """Built-in rule reward (``exact``, ``boxed_math``) when no ``custom_rm_path``."""
    custom_rm_path: str | None
    """Python path of ``fn(args, sample) -> float``."""

    @property
    def embedded(self) -> bool:
        return self.prompt_data is None


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How each rollout is sampled and which engines generate it."""

    batch_size: int
    """Prompts per rollout (``--rollout-batch-size``)."""
    n_samples_per_prompt: int
    max_response_len: int
    rollout_function_path: str | None
    """Python path of ``fn(args, rollout_id, data_source) -> samples``; None: the default rollout."""
    custom_generate_function_path: str | None
    """Python path of ``fn(args, sample, sampling_params) -> sample``."""
    router_ip: str | None
    """A running sglang-router (``--sglang-router-ip``) with ``router_port``."""
    router_port: int | None
    api_key: str | None
    """The router's and its workers' bearer key (resolved: flag, key file or environment). Never shown."""
    colocate: bool
    disaggregated: bool
    """The run starts engines on GPUs (or CPU processes) of their own (``--rollout-num-gpus`` without ``--colocate``)."""
    num_engines: int
    """Engines of a disaggregated run: ``--rollout-num-gpus // --rollout-num-gpus-per-engine``."""
    engine_gpus: tuple[str, ...] | None
    """Each disaggregated engine's ``CUDA_VISIBLE_DEVICES`` entry; None on CPU and under ``--placement ray``."""
    engine_router_url: str | None
    """The router in front of engines that ``--placement ray`` started for the run (``http://IP:PORT``)."""
    engine_weights: str
    """In-process engine: ``buckets`` (its own copy) or ``shared`` (the trainer's compute weights)."""
    mem_fraction_static: float | None
    cuda_graph_max_bs: int | None
    save_debug_data: str | None
    """Path template with ``{rollout_id}``: each rollout's samples are saved there."""
    load_debug_data: str | None
    """Path template with ``{rollout_id}``: rollouts are loaded from there instead of generated."""
    health_check: HealthCheckConfig = dataclasses.field(default_factory=lambda: HealthCheckConfig())
    """How the disaggregated engines are probed and what a failure does (``--use-fault-tolerance``)."""
    backend: str = "rlperf"
    """``--rollout-backend``: ``rlperf`` (``rlperf serve`` engines or the in-process engine) or ``sglang``
    (real ``sglang.launch_server`` engines, :mod:`rlperf.loop.sglang_engines`)."""
    sglang: SGLangConfig | None = None
    """The SGLang engines' options (``backend == "sglang"`` only)."""

    @property
    def engine(self) -> str:
        """Where the rollouts run (:data:`ROLLOUT_ENGINES`): a running ``router``, the run's own
        ``disaggregated`` engines, or an ``in-process`` engine (one per data-parallel rank)."""
        if self.router_ip is not None:
            return "router"
        return "disaggregated" if self.disaggregated else "in-process"


@dataclasses.dataclass(frozen=True)
class SGLangConfig:
    """Real SGLang engines (``--rollout-backend sglang``): how each ``python -m sglang.launch_server`` starts."""

    tp_size: int = 1
    """``--rollout-num-gpus-per-engine``: GPUs (tensor-parallel ranks) per engine, SGLang's ``--tp-size``."""
    attention_backend: str = DEFAULT_SGLANG_ATTENTION_BACKEND
    """``--sglang-attention-backend``: ``flashinfer`` or ``triton`` (both run without FA3); the engines' attention
    with ``numerics`` ``sglang`` only (:attr:`engine_attention_backend`)."""
    deterministic: bool = True
    """``--sglang-enable-deterministic-inference``: SGLang's batch-invariant kernels."""
    load_format: str = "auto"
    """``--sglang-load-format``: ``auto`` (the weights rlperf saved) or ``dummy`` (random; the first weight
    sync, before rollout 0, brings the trainer's)."""
    launch_timeout: float = 600.0
    """``--sglang-launch-timeout``: seconds an engine may take to answer ``/health``."""
    numerics: str = DEFAULT_SGLANG_NUMERICS
    """``--sglang-numerics``: ``rlperf`` (the engines compute rlperf's kernels through rlperf's SGLang plugin,
    started with ``--attention-backend rlperf`` and rlperf's page size; their log-probs are the trainer's bit for
    bit) or ``sglang`` (SGLang's own kernels, ``attention_backend``)."""

    @property
    def engine_attention_backend(self) -> str:
        """The engines' ``--attention-backend``: ``rlperf`` (rlperf's plugin) with rlperf's numerics, else
        :attr:`attention_backend`."""
        return RLPERF_ATTENTION_BACKEND if self.numerics == "rlperf" else self.attention_backend


@dataclasses.dataclass(frozen=True)
class HealthCheckConfig:
    """Health checks of the run's own engines (:mod:`rlperf.loop.health`)."""

    fault_tolerance: bool = False
    """``--use-fault-tolerance``: a failed engine is restarted and the run goes on; else the run ends."""
    first_wait: float = 0.0
    """``--rollout-health-check-first-wait``: seconds before the first probe."""
    interval: float = 30.0
    """``--rollout-health-check-interval``: seconds between two probes of an engine."""
    timeout: float = 30.0
    """``--rollout-health-check-timeout``: seconds an engine may take to answer ``/health``."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The weights a run starts from and saves."""

    preset: str
    """``--model`` preset at random init when neither ``hf_checkpoint`` nor ``load`` is given."""
    hf_checkpoint: str | None
    """Initial weights and the tokenizer (an HF directory); with ``load``, the tokenizer only."""
    load: str | None
    """Resume from this ``--save`` directory."""
    ref_load: str | None
    save: str | None
    save_interval: int | None

    @property
    def init_path(self) -> str | None:
        """The directory the actor is loaded from (``--load``'s latest model, else ``--hf-checkpoint``),
        unresolved; None: the preset."""
        return self.load or self.hf_checkpoint


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """The process: device, threads, kernel policy, seed."""

    device: str
    """``--device`` as given (``auto``, ``cpu``, ``cuda``, ``cuda:N``); :func:`rlperf.loop.device.run_device` reads it."""
    num_threads: int
    """CPU intra-op threads; 0: torch's default."""
    mode: str
    kernel_backend: str
    seed: int
    deterministic: bool
    """``--deterministic-mode``: torch's deterministic algorithms (and cuBLAS's fixed workspace)."""
    precompile_kernels: str = "auto"
    """``--precompile-kernels``: ``auto``, ``off`` or a kernel manifest file (:mod:`rlperf.kernels.precompile`)."""
    record_kernels: str | None = None
    """``--record-kernels``: the kernel manifest this run appends its compiles to, or None."""


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Where the actor ranks run (``--actor-num-nodes``, ``--actor-num-gpus-per-node``, ``--placement``)."""

    num_nodes: int
    gpus_per_node: int
    placement: str
    ray_address: str | None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class TelemetryConfig:
    """What the run writes and shows."""

    output_dir: str
    """metrics.jsonl, the phase timeline, torch traces and engine logs go under it."""
    no_progress: bool
    loggers: LoggerConfig
    """Where each rollout's metrics also go (TensorBoard, W&B, ``--plot``): :mod:`rlperf.telemetry.loggers`."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a training run is configured with (module docstring)."""

    data: DataConfig
    rollout: RolloutConfig
    model: ModelConfig
    train: TrainConfig
    runtime: RuntimeConfig
    placement: PlacementConfig
    telemetry: TelemetryConfig
    num_rollout: int
    async_mode: bool
    """``--async``: rollout k+1 overlaps the training of rollout k (one step off-policy)."""
    true_on_policy: bool
    debug_rollout_only: bool
    debug_train_only: bool

    @classmethod
    def from_args(cls, ns: argparse.Namespace, train_args: TrainArgs | None = None) -> RunConfig:
        """The configuration of resolved flags (:func:`rlperf.loop.resolve.resolve_args` ran on ``ns``);
        ``train_args`` replaces ``ns.train_args`` (the first step's reference log-probs)."""
        return cls(
            data=DataConfig(ns.prompt_data, ns.input_key, ns.label_key, ns.metadata_key, ns.apply_chat_template,
                            ns.rm_type, ns.custom_rm_path),
            rollout=RolloutConfig(
                batch_size=ns.rollout_batch_size, n_samples_per_prompt=ns.n_samples_per_prompt,
                max_response_len=ns.rollout_max_response_len, rollout_function_path=ns.rollout_function_path,
                custom_generate_function_path=ns.custom_generate_function_path, router_ip=ns.sglang_router_ip,
                router_port=ns.sglang_router_port, api_key=ns.sglang_api_key, colocate=ns.colocate,
                disaggregated=ns.disaggregated,
                num_engines=ns.rollout_num_gpus // ns.rollout_num_gpus_per_engine,
                engine_gpus=None if ns.engine_gpus is None else tuple(ns.engine_gpus),
                engine_router_url=ns.engine_router_url,
                engine_weights=ns.engine_weights, mem_fraction_static=ns.sglang_mem_fraction_static,
                cuda_graph_max_bs=ns.sglang_cuda_graph_max_bs, save_debug_data=ns.save_debug_rollout_data,
                load_debug_data=ns.load_debug_rollout_data,
                health_check=HealthCheckConfig(ns.use_fault_tolerance, ns.rollout_health_check_first_wait,
                                               ns.rollout_health_check_interval, ns.rollout_health_check_timeout),
                backend=getattr(ns, "rollout_backend", "rlperf"), sglang=_sglang_config(ns)),
            model=ModelConfig(ns.model, ns.hf_checkpoint, ns.load, ns.ref_load, ns.save, ns.save_interval),
            train=TrainConfig(train_args or ns.train_args, ns.precision, ns.num_steps_per_rollout,
                              ns.train_backend, _megatron_config(ns),
                              MoEConfig(ns.use_rollout_routing_replay, ns.expert_model_parallel_size)),
            runtime=RuntimeConfig(ns.device, ns.num_threads, ns.mode, ns.kernel_backend, ns.seed,
                                  ns.deterministic_mode, getattr(ns, "precompile_kernels", "auto"),
                                  getattr(ns, "record_kernels", None)),
            placement=PlacementConfig(ns.actor_num_nodes, ns.actor_num_gpus_per_node, ns.placement, ns.ray_address),
            telemetry=TelemetryConfig(ns.output_dir, ns.no_progress, ns.logger_config),
            num_rollout=ns.num_rollout, async_mode=ns.async_mode, true_on_policy=ns.true_on_policy_mode,
            debug_rollout_only=ns.debug_rollout_only, debug_train_only=ns.debug_train_only)


def _megatron_config(ns: argparse.Namespace) -> MegatronConfig | None:
    if ns.train_backend != "megatron":
        return None
    return MegatronConfig(ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.recompute_granularity,
                          ns.recompute_method, ns.recompute_num_layers, ns.sequence_parallel,
                          ns.use_distributed_optimizer, ns.transformer_impl)


def _sglang_config(ns: argparse.Namespace) -> SGLangConfig | None:
    if ns.rollout_backend != "sglang":
        return None
    return SGLangConfig(ns.rollout_num_gpus_per_engine, ns.sglang_attention_backend or DEFAULT_SGLANG_ATTENTION_BACKEND,
                        ns.sglang_enable_deterministic_inference, ns.sglang_load_format, ns.sglang_launch_timeout,
                        numerics=ns.sglang_numerics)
