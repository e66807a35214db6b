"""The flags of ``rlperf train`` and ``rlperf gate`` (slime's names): the one parser module of the loop.

Light to import (the standard library and the other commands' flag modules only): ``rlperf train
--help`` parses without torch. Every flag is defined once with one default (:func:`add_loop_arguments`);
flags whose default depends on the task parse to None and :func:`fill_task_defaults` fills them
(:data:`TASK_DEFAULTS`, or the embedded task's :data:`rlperf.data.embedded.EMBEDDED_DEFAULTS` when
``--prompt-data`` is absent); :func:`check_flag_values` checks the values and relations that need
nothing but the flags (the batch relation ``rollout_batch_size * n_samples_per_prompt ==
global_batch_size * num_steps_per_rollout``, conflicting modes, sampling values, ranges). What needs
the host (the device, the GPUs, the kernel backend) is :mod:`rlperf.loop.device`'s, what reads or
writes files is :mod:`rlperf.loop.resolve`'s, which runs all of it (:func:`rlperf.loop.resolve.resolve_args`);
the run reads the result as typed configuration (:class:`rlperf.loop.config.RunConfig`). Every message
names the flag (:class:`UsageError`: the CLI exits 2).

This is the only module that reads the parsed namespace by name with defaults (``getattr``): the
namespaces of ``rlperf gate`` with a hand-made first step carry the training core's flags only.
"""
from __future__ import annotations

import argparse
import os

from rlperf import flags
from rlperf.rollout.args import API_KEY_ENV, add_device_arguments, add_kernel_arguments
from rlperf.telemetry.loggers import add_logger_arguments
from rlperf.telemetry.trainer_trace import add_trace_window_arguments, check_profile_args
from rlperf.train.args import TrainArgs, add_train_arguments


class UsageError(ValueError):
    """Bad flags or inputs, found before any step (the CLI exits 2 with the message)."""


TASK_DEFAULTS = dict(
    rollout_batch_size=32, n_samples_per_prompt=8, global_batch_size=None, num_steps_per_rollout=1, num_rollout=100,
    rollout_max_response_len=1024, rollout_temperature=1.0, lr=TrainArgs.lr, rm_type="boxed_math", model="tiny",
    use_dynamic_batch_size=TrainArgs.use_dynamic_batch_size, max_tokens_per_gpu=TrainArgs.max_tokens_per_gpu,
)
"""Defaults of the flags that depend on the task, for ``--prompt-data`` runs (the embedded task has its
own: :data:`rlperf.data.embedded.EMBEDDED_DEFAULTS`); these flags parse to None."""
OUTPUT_DIRS = {"train": "rlperf-train", "gate": "rlperf-gate"}
"""The default ``--output-dir`` of each command (relative to the working directory)."""
PRECISIONS = {"auto": None, "bf16": "bfloat16", "fp32": "float32"}
"""``--precision`` values and their compute dtypes (:func:`rlperf.loop.device.compute_dtype`)."""
PLACEMENTS = ("local", "ray")
"""``--placement`` values (``ray``: :mod:`rlperf.loop.ray_placement`)."""
TRAIN_BACKENDS = ("fsdp", "megatron")
"""``--train-backend`` values: rlperf's model under FSDP2, or megatron-core (:mod:`rlperf.train.megatron`)."""
MEGATRON_FLAGS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                  "sequence_parallel": False, "recompute_granularity": None, "recompute_method": None,
                  "recompute_num_layers": None, "use_distributed_optimizer": False, "transformer_impl": "local"}
"""The megatron backend's flags and their defaults: any other value needs ``--train-backend megatron``."""


def add_loop_arguments(p: argparse.ArgumentParser, command: str = "train") -> None:
    """Every flag of ``rlperf train`` (``command``: ``train``, or ``gate``, which differs only in the
    default ``--output-dir``): the loop's, the training core's (:func:`rlperf.train.add_train_arguments`),
    the trainer traces' and the placement's. Each flag is defined once, here or in the module it names;
    flags whose default depends on the task (:data:`TASK_DEFAULTS`) parse to None."""
    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", default=None, help="jsonl prompts (default: the embedded task)")
    g.add_argument("--input-key", default="input", help="--prompt-data: the field of each line that holds the prompt")
    g.add_argument("--label-key", default="label",
                   help="--prompt-data: the field holding the label the reward compares against (optional)")
    g.add_argument("--metadata-key", default="metadata",
                   help="--prompt-data: the field holding an optional object passed to custom rewards as sample.metadata")
    g.add_argument("--apply-chat-template", action="store_true", help="the input field is a list of chat messages")
    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-batch-size", type=int, default=None, help="prompts per rollout")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="optimizer steps per rollout (rollout-batch-size x n-samples-per-prompt = global-batch-size x this)")
    g.add_argument("--num-rollout", type=int, default=None, help="rollouts (steps) to run")
    g.add_argument("--rollout-max-response-len", type=flags.positive_int, default=None,
                   help="tokens a response may have (at most the model's context length less the prompt)")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches this (1: all)")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: all)")
    g.add_argument("--rollout-function-path", default=None,
                   help="python path of fn(args, rollout_id, data_source, evaluation=False) -> samples")
    g.add_argument("--custom-generate-function-path", default=None,
                   help="python path of fn(args, sample, sampling_params) -> sample (one generation)")
    g.add_argument("--custom-rm-path", default=None, help="python path of fn(args, sample) -> float")
    g.add_argument("--rm-type", default=None, choices=["exact", "boxed_math"], help="built-in rule reward")
    g.add_argument("--sglang-router-ip", type=flags.host, default=None,
                   help="rollout through this sglang-router (default: an in-process engine)")
    g.add_argument("--sglang-router-port", type=flags.port, default=None, help="port of --sglang-router-ip's router")
    g.add_argument("--sglang-api-key", default=None, metavar="KEY",
                   help="API key of the router and its rlperf serve workers (their --api-key), sent as 'Authorization: "
                        f"Bearer KEY' on every request. On the command line it shows in ps: prefer --sglang-api-key-file "
                        f"or the {API_KEY_ENV} environment variable (default: {API_KEY_ENV}, else no key)")
    g.add_argument("--sglang-api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (surrounding whitespace stripped)")
    g.add_argument("--colocate", action="store_true", help="trainer and engines share the GPU (weights by CUDA IPC); an SGLang engine of K ranks "
                        "(--rollout-num-gpus-per-engine K) takes the trainer's GPU and the K - 1 after it")
    g.add_argument("--rollout-num-gpus", type=int, default=0, metavar="N",
                   help="disaggregated engines (without --colocate): start N rlperf serve engines, one per GPU after the "
                        "actor's, behind the sglang-router, and sync the weights to them by NCCL broadcast from the "
                        "trainer; with --device cpu, N engine processes and gloo (default 0: one in-process engine)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, metavar="K",
                   help="GPUs per engine (only 1 for now: no tensor-parallel engines)")
    g.add_argument("--sglang-cuda-graph-max-bs", type=int, default=None,
                   help="in-process engine: replay decode steps of up to this many sequences from CUDA graphs, as "
                        "rlperf serve --cuda-graph-max-bs, and then steps with prefill chunks from CUDA graphs of "
                        "their token bucket too (default: serve's, 256 on CUDA; 0: eager decode and prefill, the "
                        "debuggable path; CPU is always eager)")
    g.add_argument("--engine-weights", default="auto", choices=["auto", "buckets", "shared"],
                   help="in-process engine's weights: its own copy loaded from flattened buckets at each sync, or "
                        "shared: it runs on the trainer's compute weights (no copy; sync mode only); auto: shared on "
                        "CUDA in sync mode, buckets otherwise")
    g.add_argument("--sglang-mem-fraction-static", type=float, default=None,
                   help="in-process engine on CUDA: the fraction of device memory that everything allocated "
                        "before it plus its KV cache may fill (default: no fraction; the KV cache holds one "
                        "rollout, rollout-batch-size x n-samples-per-prompt sequences of the longest prompt plus "
                        "--rollout-max-response-len, and the rest of the device is the trainer's); engines on "
                        "GPUs of their own (--rollout-num-gpus): the fraction of their GPU for weights + KV cache "
                        "(default 0.8, under the first-step gate's headroom); servers behind a router you started "
                        "take rlperf serve --mem-fraction-static")
    add_sglang_backend_arguments(p)
    g = p.add_argument_group("fault tolerance (engines of --rollout-num-gpus)")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="an engine that dies or stops answering its health check is taken out of the router, its "
                        "in-flight samples are retried on the others, and it is restarted, given the current weights "
                        "and put back at the next weight sync; without it such a failure ends the run with one line "
                        "naming the engine (docs/train.md, Fault tolerance)")
    g.add_argument("--rollout-health-check-first-wait", type=flags.nonnegative_seconds, default=0.0, metavar="S",
                   help="seconds after the engines start before the first /health probe (default 0)")
    g.add_argument("--rollout-health-check-interval", type=flags.positive_seconds, default=30.0, metavar="S",
                   help="seconds between two /health probes of each engine (default 30); an engine process that "
                        "exits is seen at once")
    g.add_argument("--rollout-health-check-timeout", type=flags.positive_seconds, default=30.0, metavar="S",
                   help="seconds an engine may take to answer /health before it counts as failed (default 30)")
    g = p.add_argument_group("model and checkpoints")
    g.add_argument("--model", default=None, help="preset (tiny, qwen3-0.6b, qwen3-4b, ...: random weights) when no "
                   "--hf-checkpoint/--load")
    g.add_argument("--hf-checkpoint", default=None, help="initial weights (HF safetensors directory)")
    g.add_argument("--load", default=None, help="resume from this --save directory")
    g.add_argument("--ref-load", default=None, help="reference model (HF directory or a --save directory)")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int, default=None, help="save every N rollouts (and after the last)")
    g.add_argument("--overwrite-save", action="store_true",
                   help="let a run that does not resume from --save write into it although it holds checkpoints "
                        "(its pointer moves to this run's checkpoints)")
    add_device_arguments(g, here=False)  # checked in resolve: --placement ray's driver may have no GPU
    g = p.add_argument_group("precision")
    g.add_argument("--precision", default="auto", choices=list(PRECISIONS),
                   help="compute dtype of the trainer's forward/backward and of the in-process engine: bf16 (float32 "
                        "master weights, gradient accumulation and AdamW state, as Megatron) or fp32; auto: bf16 on "
                        "CUDA, fp32 on CPU (bf16 on CPU runs the torch reference in bf16: a test path)")
    g.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="--precision bf16 (slime's name)")
    g.add_argument("--fp32", dest="precision", action="store_const", const="fp32", help="--precision fp32")
    g = p.add_argument_group("kernels")
    add_kernel_arguments(g, auto_cpu="the torch reference (the trainer's CPU path)")
    g.add_argument("--precompile-kernels", default="auto", metavar="auto|off|FILE",
                   help="CUDA: compile the Triton kernels a kernel manifest lists in worker processes while the run "
                        "builds its model, so its first launches load them from Triton's cache instead of compiling "
                        "one by one (docs/gate.md, cold start); auto: the manifest shipped for this GPU and Triton "
                        "version, if any; FILE: a manifest --record-kernels wrote (default: auto)")
    g.add_argument("--record-kernels", default=None, metavar="FILE",
                   help="append every Triton kernel specialization this run compiles to FILE, a kernel manifest "
                        "for --precompile-kernels (CUDA; lines already in FILE are kept)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=flags.seed, default=1234,
                   help="seeds the initial weights, the data order and every sample's sampling")
    g.add_argument("--output-dir", default=OUTPUT_DIRS[command],
                   help="every file the run writes goes under it: metrics.jsonl, the phase timeline, torch traces, "
                        f"engine logs (default: {OUTPUT_DIRS[command]}, printed when the command starts)")
    if command == "train":  # the gate's one step writes its own files afresh each time: nothing to refuse there
        g.add_argument("--overwrite-output-dir", action="store_true",
                       help="let a run that does not resume (no --load) replace the metrics.jsonl an earlier run "
                            "left in --output-dir (without it such a run stops with exit 2)")
    g.add_argument("--async", dest="async_mode", action="store_true",
                   help="overlap rollout k+1 with training k (one step off-policy)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="torch's deterministic algorithms (torch.use_deterministic_algorithms; cuBLAS's fixed "
                        "workspace) for the ops outside rlperf's kernels")
    g.add_argument("--true-on-policy-mode", action="store_true",
                   help="train on the rollout's own policy: needs sync mode and --num-steps-per-rollout 1; the "
                        "logprob_abs_diff gate then requires train_rollout_logprob_abs_diff exactly 0 (engine and "
                        "trainer compute log-probs with the same fused kernel; with --rollout-backend sglang that "
                        "takes --sglang-numerics rlperf: SGLang's own kernels are not 0)")
    g.add_argument("--debug-rollout-only", action="store_true",
                   help="rollouts and rewards only: no training, no weight sync, no gates (with "
                        "--save-debug-rollout-data: record rollouts to replay)")
    g.add_argument("--debug-train-only", action="store_true",
                   help="train on rollouts recorded by --save-debug-rollout-data (needs --load-debug-rollout-data): "
                        "no generation, no gates")
    g.add_argument("--save-debug-rollout-data", default=None, help="path template with {rollout_id}")
    g.add_argument("--load-debug-rollout-data", default=None, help="path template with {rollout_id}")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (summary lines still print; there is none when stderr is not a terminal)")
    add_trace_window_arguments(p)
    add_logger_arguments(p)
    add_train_arguments(p, task_defaults=tuple(TASK_DEFAULTS))
    g = p.add_argument_group("trainer backend")
    g.add_argument("--train-backend", default="fsdp", choices=TRAIN_BACKENDS,
                   help="fsdp: rlperf's model (FSDP2 over several actor ranks); megatron: megatron-core's GPTModel on "
                        "rlperf's kernels with tensor / pipeline / data parallelism and TP-invariant reductions "
                        "(pip install -e \".[megatron]\")")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="TP",
                   help="megatron: actor ranks that split each layer's weights")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="PP",
                   help="megatron: pipeline stages that split the layers (data parallel over the ranks left: "
                        "actor ranks / (TP x PP))")
    g.add_argument("--context-parallel-size", type=int, default=1, metavar="CP",
                   help="megatron: only 1 (context parallelism is not implemented)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="megatron: the activations between the tensor-parallel layers split over the tokens (a "
                        "no-op at TP 1); the same bits as without it")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="megatron: activation recomputation of whole layers (full, CUDA only); selective is refused")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="megatron, with --recompute-granularity full")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="megatron, with --recompute-granularity full")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="megatron: AdamW's moments sharded over the data-parallel replicas (the same bits as without)")
    g.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                   help="megatron: local (rlperf's kernels in the layer spec) or transformer_engine (needs Transformer "
                        "Engine and CUDA; refused with what is missing)")
    g = p.add_argument_group("mixture of experts (MoE models)")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="rollout routing replay (R3): the rollout returns the experts every MoE layer routed each "
                        "token to (return_routed_experts) and every training forward routes the token to those "
                        "experts, with the weights its own router gives them; a sample without them is an error "
                        "naming it. MoE models only")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="EP",
                   help="split each MoE layer's experts over EP actor ranks (tokens go to their experts' rank and "
                        "back by all-to-all, NCCL on CUDA, gloo on CPU); EP must divide the experts and the actor "
                        "ranks (--actor-num-nodes x --actor-num-gpus-per-node), which stay data parallel. MoE "
                        "models, --train-backend fsdp (default 1: every rank holds every expert)")
    g = p.add_argument_group("placement")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="nodes of actor (trainer) ranks")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=1,
                   help="actor ranks per node: data-parallel FSDP2 ranks, one GPU each on CUDA (one process each "
                        "on the CPU, gloo); each runs its own in-process engine on its share of the rollout, or, with "
                        "--rollout-num-gpus, rank 0 alone drives the disaggregated engines and shares the rollout")
    g.add_argument("--placement", default="local", choices=PLACEMENTS,
                   help="local: rlperf starts the ranks on this host (multiprocessing, spawn); a process started by "
                        "torchrun is a rank itself; ray: the ranks (and --rollout-num-gpus engines) as Ray actors on "
                        "a placement group of GPU bundles, on one node or several (ray start; --ray-address)")
    g.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="--placement ray: the Ray cluster, HOST:PORT of its head (ray start --head prints it; "
                        "default 6379), 'auto' (the cluster ray start started on this host) or 'local' (a new "
                        "Ray instance on this host). Default: RAY_ADDRESS, else the cluster ray start started "
                        "on this host if it answers, else a new local instance")
    # --placement ray sets it on its ranks when it started the run's engines (their router's URL:
    # rlperf.loop.ray_placement.ENGINE_ROUTER_ATTR); no flag sets it
    p.set_defaults(engine_router_url=None)
    _state_task_defaults(p)


def _state_task_defaults(p: argparse.ArgumentParser) -> None:
    """End the help of every flag whose default depends on the task with both defaults: the embedded
    task's (:data:`rlperf.data.embedded_defaults.EMBEDDED_DEFAULTS`) and :data:`TASK_DEFAULTS`."""
    from rlperf.data.embedded_defaults import EMBEDDED_DEFAULTS

    def shown(dest: str, value) -> str:
        if value is None:
            return {"global_batch_size": "rollout-batch-size x n-samples-per-prompt / num-steps-per-rollout",
                    "max_tokens_per_gpu": "none"}[dest]
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value)

    for action in p._actions:
        if action.dest in TASK_DEFAULTS and action.option_strings and action.help != argparse.SUPPRESS:
            action.help = (f"{action.help} (default: {shown(action.dest, EMBEDDED_DEFAULTS[action.dest])} for the "
                           f"embedded task, {shown(action.dest, TASK_DEFAULTS[action.dest])} with --prompt-data)")


ROLLOUT_BACKENDS = ("rlperf", "sglang")
"""``--rollout-backend`` values: rlperf's engines, or real SGLang engines (:mod:`rlperf.loop.sglang_engines`)."""
SGLANG_ATTENTION_BACKENDS = ("flashinfer", "triton")
"""``--sglang-attention-backend`` values: SGLang's attention backends that run without FlashAttention 3."""
DEFAULT_SGLANG_ATTENTION_BACKEND = "flashinfer"
"""``--sglang-attention-backend`` when not given (with ``--sglang-numerics sglang``)."""
SGLANG_NUMERICS = ("rlperf", "sglang")
"""``--sglang-numerics`` values: ``rlperf``: the engines compute rlperf's kernels through rlperf's SGLang plugin
(``--attention-backend rlperf``; their log-probs are the trainer's bit for bit); ``sglang``: SGLang's own kernels."""
DEFAULT_SGLANG_NUMERICS = "rlperf"
"""Default ``--sglang-numerics`` (proved on H200s: abs diff 0 against real SGLang 0.5.17, dense and MoE), except
where the plugin cannot match the trainer: an explicit ``--sglang-attention-backend``, or engines of several GPUs
(``--tp-size`` > 1 runs the plugin's tree numerics) beside a trainer other than ``--train-backend megatron``, resolve
to ``sglang`` (:func:`check_sglang_backend_flags`)."""
SGLANG_LOAD_FORMATS = ("auto", "dummy")
"""``--sglang-load-format`` values: the weights rlperf saved, or random ones replaced before rollout 0."""
SGLANG_LAUNCH_TIMEOUT_S = 600.0
"""Default ``--sglang-launch-timeout``: SGLang's start loads the weights, JIT-compiles FlashInfer's kernels on a
cold cache (1-3 minutes each) and captures its CUDA graphs before ``/health`` answers."""


def add_sglang_backend_arguments(p: argparse.ArgumentParser) -> None:
    """``--rollout-backend`` and the options of the real SGLang engines it starts (docs/train.md, "Real SGLang")."""
    g = p.add_argument_group("rollout backend")
    g.add_argument("--rollout-backend", default="rlperf", choices=ROLLOUT_BACKENDS,
                   help="rlperf: rlperf's own engines (in-process, or rlperf serve with --rollout-num-gpus); sglang: "
                        "real `python -m sglang.launch_server` engines behind the sglang-router, on --rollout-num-gpus "
                        "GPUs of their own (weights by NCCL broadcast, SGLang's /update_weights_from_distributed) or on "
                        "the trainer's GPU with --colocate (SGLang's /update_weights_from_tensor, CUDA IPC)")
    g.add_argument("--sglang-numerics", default=None, choices=SGLANG_NUMERICS,
                   help="--rollout-backend sglang: whose kernels the engines compute with. rlperf: rlperf's kernels "
                        "through rlperf's SGLang plugin (engines started with --attention-backend rlperf and the "
                        "page size of rlperf's attention), exact against rlperf's trainer (abs diff 0, as "
                        "--true-on-policy-mode requires); sglang: SGLang's own kernels (--sglang-attention-backend), "
                        f"~0.03 nats/token apart from the trainer's log-probs (default {DEFAULT_SGLANG_NUMERICS}; "
                        "sglang when --sglang-attention-backend is given). Engines of several GPUs "
                        "(--rollout-num-gpus-per-engine > 1) compute the trainer's numerics too: the tree beside "
                        "--train-backend megatron, the plain numerics in plain tensor parallelism beside fsdp")
    g.add_argument("--sglang-attention-backend", default=None, choices=SGLANG_ATTENTION_BACKENDS,
                   help=f"--rollout-backend sglang --sglang-numerics sglang: the engines' --attention-backend (default "
                        f"{DEFAULT_SGLANG_ATTENTION_BACKEND}; both run without FlashAttention 3); not with "
                        "--sglang-numerics rlperf, whose engines run rlperf's attention")
    g.add_argument("--sglang-enable-deterministic-inference", default=True, action=argparse.BooleanOptionalAction,
                   help="--rollout-backend sglang: start the engines with --enable-deterministic-inference (SGLang's "
                        "batch-invariant kernels; default on)")
    g.add_argument("--sglang-load-format", default="auto", choices=SGLANG_LOAD_FORMATS,
                   help="--rollout-backend sglang: auto: the engines load the model rlperf saves under --output-dir; "
                        "dummy: random weights (only config.json is written), replaced by a weight sync before "
                        "rollout 0 (benchmarks; always with several actor ranks, whose weights are sharded)")
    g.add_argument("--sglang-launch-timeout", type=flags.positive_seconds, default=SGLANG_LAUNCH_TIMEOUT_S,
                   metavar="S", help=f"--rollout-backend sglang: seconds an engine may take to answer /health "
                                     f"(default {SGLANG_LAUNCH_TIMEOUT_S:g}); an engine that exits fails at once")


def check_sglang_backend_flags(ns: argparse.Namespace) -> None:
    """``--rollout-backend sglang``'s layout and options: :class:`UsageError` naming the flag for what it
    cannot run (the host's GPUs are :func:`rlperf.loop.device.resolve_engine_layout`'s). With
    ``--sglang-numerics sglang`` a ``--sglang-attention-backend`` left out becomes
    :data:`DEFAULT_SGLANG_ATTENTION_BACKEND`; with ``rlperf`` it stays None (the engines run rlperf's attention)
    and giving it is an error naming both flags."""
    if getattr(ns, "rollout_backend", "rlperf") != "sglang":
        for flag, default in (("sglang_attention_backend", None), ("sglang_load_format", "auto"),
                              ("sglang_numerics", None)):
            if getattr(ns, flag, default) != default:
                raise UsageError(f"--{flag.replace('_', '-')} needs --rollout-backend sglang")
        return
    if ns.sglang_numerics is None:  # the default, where the plugin can run it (DEFAULT_SGLANG_NUMERICS)
        ns.sglang_numerics = "sglang" if ns.sglang_attention_backend is not None else DEFAULT_SGLANG_NUMERICS
    if ns.sglang_numerics == "rlperf" and ns.sglang_attention_backend is not None:
        raise UsageError(f"--sglang-attention-backend {ns.sglang_attention_backend} and --sglang-numerics rlperf "
                         "exclude each other: with rlperf's numerics the engines run rlperf's attention "
                         "(--attention-backend rlperf, rlperf's SGLang plugin); drop --sglang-attention-backend, or "
                         "use --sglang-numerics sglang for SGLang's own kernels")
    if ns.sglang_numerics == "sglang" and ns.sglang_attention_backend is None:
        ns.sglang_attention_backend = DEFAULT_SGLANG_ATTENTION_BACKEND
    if ns.sglang_router_ip is not None:
        raise UsageError("--rollout-backend sglang starts its own SGLang engines and router; --sglang-router-ip uses "
                         "running ones (any SGLang-compatible router: leave --rollout-backend at rlperf)")
    if not ns.colocate and ns.rollout_num_gpus < 1:
        raise UsageError("--rollout-backend sglang needs --rollout-num-gpus N (engines on GPUs of their own) or "
                         "--colocate (one engine on the trainer's GPU and, with --rollout-num-gpus-per-engine K, the K - 1 "
                         "GPUs after it)")
    if ns.rollout_num_gpus_per_engine < 1 or (ns.rollout_num_gpus and ns.rollout_num_gpus % ns.rollout_num_gpus_per_engine):
        raise UsageError(f"--rollout-num-gpus {ns.rollout_num_gpus} must be a multiple of --rollout-num-gpus-per-engine "
                         f"{ns.rollout_num_gpus_per_engine} (>= 1): each SGLang engine takes that many GPUs (--tp-size)")
    if ns.use_fault_tolerance:
        raise UsageError("--use-fault-tolerance restarts rlperf serve engines; it is not built for "
                         "--rollout-backend sglang")
    if ns.placement == "ray":
        raise UsageError("--placement ray starts rlperf serve engines; --rollout-backend sglang runs with "
                         "--placement local")
    if ns.actor_num_nodes * ns.actor_num_gpus_per_node != 1:
        if ns.colocate:
            raise UsageError("--rollout-backend sglang --colocate puts one engine on the trainer's GPU: with several "
                             "actor ranks (--actor-num-gpus-per-node, --actor-num-nodes) give the engines GPUs of their "
                             "own (--rollout-num-gpus N) instead")
        # rank 0 starts the engines, and its model is not the trainer's sharded weights: the engines start
        # on a config.json alone and get the weights from the first sync, which every rank takes part in
        ns.sglang_load_format = "dummy"
    if ns.sglang_api_key or ns.sglang_api_key_file:
        raise UsageError("--rollout-backend sglang: the SGLang engines it starts take no API key (SGLang reads its "
                         "key from its command line only, which ps shows to every user of the host)")
    frac = ns.sglang_mem_fraction_static
    if ns.colocate and frac is None:
        raise UsageError("--rollout-backend sglang --colocate: give --sglang-mem-fraction-static (the share of the GPU "
                         "SGLang may take beside the trainer, e.g. 0.4)")


def fill_task_defaults(ns: argparse.Namespace) -> None:
    """Set ``ns.embedded`` (no ``--prompt-data``) and every task-dependent flag left None (:data:`TASK_DEFAULTS`
    or the embedded task's), then ``--global-batch-size`` from the batch relation when not given."""
    from rlperf.data.embedded import EMBEDDED_DEFAULTS  # imports torch: only once flags are parsed

    ns.embedded = ns.prompt_data is None
    defaults = EMBEDDED_DEFAULTS if ns.embedded else TASK_DEFAULTS
    for k, v in defaults.items():
        if getattr(ns, k, None) is None:
            setattr(ns, k, v)
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.rollout_batch_size * ns.n_samples_per_prompt // ns.num_steps_per_rollout


def check_flag_values(ns: argparse.Namespace) -> None:
    """:class:`UsageError` naming the flag for a value or a relation between flags that cannot run (module
    docstring); reads nothing but ``ns`` (its task defaults filled)."""
    from rlperf.rollout.sampling_params import check_sampling_values

    for flag in ("rollout_batch_size", "num_steps_per_rollout", "num_rollout", "rollout_max_response_len"):
        if getattr(ns, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.num_threads is not None and ns.num_threads < 0:
        raise UsageError(f"--num-threads must be >= 1 (or 0: torch's default), got {ns.num_threads}")
    if ns.precompile_kernels not in ("auto", "off") and not os.path.isfile(ns.precompile_kernels):
        raise UsageError(f"--precompile-kernels {ns.precompile_kernels}: no such manifest file (auto, off or a file "
                         f"--record-kernels wrote)")
    # the sampling kernel's types; the rollout server checks its sampling_params with the same function
    check_sampling_values(ns.rollout_temperature, ns.rollout_top_p, ns.rollout_top_k, positive_temperature=True,
                          error=UsageError, names={"temperature": "--rollout-temperature",
                                                   "top_p": "--rollout-top-p", "top_k": "--rollout-top-k"})
    if ns.rollout_batch_size * ns.n_samples_per_prompt != ns.global_batch_size * ns.num_steps_per_rollout:
        raise UsageError(
            f"batch relation broken: --rollout-batch-size {ns.rollout_batch_size} x --n-samples-per-prompt "
            f"{ns.n_samples_per_prompt} = {ns.rollout_batch_size * ns.n_samples_per_prompt} samples per rollout, but "
            f"--global-batch-size {ns.global_batch_size} x --num-steps-per-rollout {ns.num_steps_per_rollout} = "
            f"{ns.global_batch_size * ns.num_steps_per_rollout}")
    if ns.true_on_policy_mode and ns.async_mode:
        raise UsageError("--true-on-policy-mode needs sync mode: --async trains one step off-policy")
    if ns.true_on_policy_mode and ns.num_steps_per_rollout != 1:
        raise UsageError("--true-on-policy-mode needs --num-steps-per-rollout 1 (later steps train an updated actor)")
    if ns.debug_rollout_only and ns.debug_train_only:
        raise UsageError("--debug-rollout-only and --debug-train-only exclude each other")
    if ns.debug_train_only and not ns.load_debug_rollout_data:
        raise UsageError("--debug-train-only needs --load-debug-rollout-data")
    if (ns.sglang_router_ip is None) != (ns.sglang_router_port is None):
        raise UsageError("give both --sglang-router-ip and --sglang-router-port (or neither: in-process engine)")
    frac = ns.sglang_mem_fraction_static
    if frac is not None and not 0 < frac < 1:
        raise UsageError(f"--sglang-mem-fraction-static must be in (0, 1), got {frac}")
    if ns.save_interval is not None and ns.save_interval < 1:
        raise UsageError(f"--save-interval must be >= 1, got {ns.save_interval}")
    if ns.save_interval is not None and not ns.save:
        raise UsageError("--save-interval needs --save")
    if ns.sglang_cuda_graph_max_bs is not None and ns.sglang_cuda_graph_max_bs < 0:
        raise UsageError(f"--sglang-cuda-graph-max-bs must be >= 0, got {ns.sglang_cuda_graph_max_bs}")
    for flag in ("actor_num_nodes", "actor_num_gpus_per_node"):
        if getattr(ns, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.use_fault_tolerance and not ns.rollout_num_gpus:
        raise UsageError("--use-fault-tolerance restarts the engines the run starts: it needs --rollout-num-gpus N")
    check_profile_args(ns, error=UsageError)
    check_megatron_flags(ns)
    check_sglang_backend_flags(ns)
    check_moe_flags(ns)


def check_moe_flags(ns: argparse.Namespace) -> None:
    """The MoE flags against the other flags: ``--expert-model-parallel-size`` >= 1, dividing the actor
    ranks, with the fsdp backend's own expert-parallel trainer; neither MoE flag with the megatron
    backend. Whether the model has experts (and how many) is checked when it is built
    (:func:`check_moe_model`)."""
    ep = ns.expert_model_parallel_size
    if ep < 1:
        raise UsageError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    ranks = ns.actor_num_nodes * ns.actor_num_gpus_per_node
    if ranks % ep:
        raise UsageError(f"--expert-model-parallel-size {ep} does not divide the {ranks} actor rank(s) "
                         f"(--actor-num-nodes x --actor-num-gpus-per-node)")
    if ns.train_backend == "megatron":
        for flag, on in (("--expert-model-parallel-size", ep != 1),
                         ("--use-rollout-routing-replay", ns.use_rollout_routing_replay)):
            if on:
                raise UsageError(f"{flag} needs --train-backend fsdp (the megatron backend has no MoE layer)")


def check_moe_model(cfg, expert_model_parallel_size: int, routing_replay: bool) -> None:
    """The MoE flags against the model the run built (``cfg``: :class:`rlperf.model.ModelConfig`):
    :class:`UsageError` naming the flag when the model is dense, or when the expert-parallel size does
    not divide its experts."""
    for flag, on in (("--use-rollout-routing-replay", routing_replay),
                     (f"--expert-model-parallel-size {expert_model_parallel_size}", expert_model_parallel_size > 1)):
        if on and not cfg.moe_layers:
            raise UsageError(f"{flag}: the model is dense (num_experts is 0; no MoE layer to "
                             f"{'replay' if 'replay' in flag else 'split'})")
    if cfg.moe_layers and cfg.num_experts % expert_model_parallel_size:
        raise UsageError(f"--expert-model-parallel-size {expert_model_parallel_size} does not divide the model's "
                         f"num_experts={cfg.num_experts}")


def check_megatron_flags(ns: argparse.Namespace) -> None:
    """The megatron backend's flags (:data:`MEGATRON_FLAGS`): only with ``--train-backend megatron``,
    sizes >= 1, and what the backend does not implement refused, each naming its flag. Recompute's
    device (full needs CUDA) and the ranks' split (TP x PP divides the actor ranks) are
    :func:`rlperf.loop.resolve.probe_host`'s, and so is whether ``--transformer-impl transformer_engine``
    loads."""
    if ns.train_backend != "megatron":
        for flag, default in MEGATRON_FLAGS.items():
            if getattr(ns, flag) != default:
                raise UsageError(f"--{flag.replace('_', '-')} needs --train-backend megatron (the {ns.train_backend} "
                                 f"backend has no such option)")
        return
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        if getattr(ns, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.context_parallel_size != 1:
        raise UsageError(f"--context-parallel-size {ns.context_parallel_size}: context parallelism is not implemented "
                         f"by the megatron backend (use 1)")
    if ns.recompute_granularity == "selective":
        raise UsageError("--recompute-granularity selective: rlperf's layer spec has no selectively recomputed "
                         "submodule (its attention keeps no [L, L] scores); use full (CUDA)")
    if ns.recompute_granularity == "full":
        if ns.recompute_method is None:
            raise UsageError("--recompute-granularity full needs --recompute-method uniform or block")
        if ns.recompute_num_layers is None or ns.recompute_num_layers < 1:
            raise UsageError("--recompute-granularity full needs --recompute-num-layers >= 1")
    elif ns.recompute_method is not None or ns.recompute_num_layers is not None:
        flag = "--recompute-method" if ns.recompute_method is not None else "--recompute-num-layers"
        raise UsageError(f"{flag} needs --recompute-granularity full")


def has_loop_flags(ns: argparse.Namespace) -> bool:
    """Whether ``ns`` was parsed with :func:`add_loop_arguments` (``rlperf gate`` with a hand-made first
    step parses the gate and training-core flags only)."""
    return hasattr(ns, "true_on_policy_mode")


def is_resolved(ns: argparse.Namespace) -> bool:
    """Whether :func:`rlperf.loop.resolve.resolve_args` already ran on ``ns`` (``rlperf gate`` hands its
    placement the flags unresolved)."""
    return hasattr(ns, "train_args")


def memory_limit(ns: argparse.Namespace):
    """``--memory-limit`` (a gate flag, in bytes once the gates parsed it), or None where the namespace
    has no gate flags (:func:`rlperf.loop.resolve.parse_train_args`)."""
    return getattr(ns, "memory_limit", None)
