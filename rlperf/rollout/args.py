"""``rlperf serve`` arguments (SGLang server-argument names); light to import (no torch, no aiohttp)."""
from __future__ import annotations

import argparse
import dataclasses
import os

from rlperf import flags


@dataclasses.dataclass
class ServerArgs:
    """Options of one rollout server."""

    model_path: str = "tiny"
    """A preset name (random weights from ``random_seed``) or a local HF checkpoint directory."""
    tokenizer_path: str | None = None
    """A local HF tokenizer directory; default the checkpoint's own, else the built-in byte tokenizer."""
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    """``auto`` (the checkpoint's; presets: bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16."""
    device: str = "auto"
    """``auto`` (cuda when present), ``cpu``, ``cuda``, ``cuda:N`` (:func:`add_device_arguments`)."""
    kernel_backend: str = "auto"
    """``auto`` (Triton on CUDA, the torch reference on CPU), ``triton``, ``interpreter``, ``reference``."""
    mode: str = "invariant"
    """``invariant`` (batch-invariant kernels) or ``fast``."""
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    context_length: int | None = None
    random_seed: int = 0
    api_key: str | None = None
    """Bearer key of the admin endpoints (:func:`resolve_api_key`: ``--api-key``, ``--api-key-file`` or
    :data:`API_KEY_ENV`); a launcher hands it to its children in that variable, never on their argv."""
    num_threads: int = 1
    """CPU intra-op threads (:data:`DEFAULT_NUM_THREADS`; 0 or None: torch's default)."""
    cuda_graph_max_bs: int | None = None
    """Replay decode steps of up to this many sequences from CUDA graphs; 0 disables. Default: 256 on a
    CUDA device (the GPU tests prove replayed steps give the eager bits), 0 on CPU (nothing to capture)."""
    cuda_graph_max_prefill_tokens: int | None = None
    """Replay steps with prefill chunks of up to this many tokens from CUDA graphs padded to token buckets;
    0 disables. Default: ``chunked_prefill_size + max_running_requests`` on a CUDA device (every step of
    the default chunking; the GPU tests prove replayed steps give the eager bits), 0 on CPU."""
    attention_backend: str = "rlperf"
    """``rlperf`` (the paged-attention kernel) or ``flashinfer`` (fast mode only, CUDA: FlashInfer's paged
    attention, ``rlperf.rollout.flashinfer_attention``)."""
    disable_overlap_schedule: bool = False
    """Read every decode step's tokens before launching the next (``EngineConfig.overlap_schedule``
    off): the same tokens, the GPU idle while the host works between graphed steps."""
    max_generate_body_bytes: int | None = None
    """Largest ``/generate`` body; default 1 MiB + 64 bytes per token of the context length
    (:func:`rlperf.rollout.server.generate_body_limit`). A larger one is refused (413) by its
    Content-Length before it is read."""
    max_weights_body_bytes: int | None = None
    """Largest ``/update_weights_from_tensor`` body (an inline bucket, base64); default 1 GiB."""
    profile_root: str | None = None
    """``/start_profile`` writes traces only below this directory; default the system temporary
    directory (:mod:`rlperf.rollout.profiler`)."""
    skip_warmup: bool = False
    """Answer /health 200 at once, without the start-up warm-up (debugging): the first requests then
    pay the kernel compiles and CUDA-graph captures (:meth:`rlperf.rollout.engine.Engine.warm_up`)."""


API_KEY_ENV = "RLPERF_API_KEY"
"""The API key of ``rlperf serve`` (its admin endpoints) and of ``rlperf train`` / ``rlperf profile``
(what they send): one variable for both sides, and the way a key reaches child processes (a key on
the command line shows in ``ps`` to every user of the host; a process's environment does not)."""


def resolve_api_key(key: str | None, key_file: str | None, flag: str = "--api-key") -> str | None:
    """The API key from ``flag KEY``, else ``flag-file PATH`` (the file's text without surrounding
    whitespace), else :data:`API_KEY_ENV`; None (no key) when none is set or it is empty.
    ValueError naming the flag when both flags are given or the file cannot be read or holds no key."""
    if key and key_file:
        raise ValueError(f"{flag} and {flag}-file exclude each other")
    if key:
        return key
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag}-file {key_file}: cannot read the key ({getattr(exc, 'strerror', None) or exc})") from None
        if not key:
            raise ValueError(f"{flag}-file {key_file}: the file is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


KERNEL_BACKENDS = ("auto", "triton", "interpreter", "reference")
"""``--kernel-backend`` values: ``auto`` and :data:`rlperf.kernels.BACKENDS` (kept equal by a test;
this module stays light to import, so it does not import the kernels)."""
ATTENTION_BACKENDS = ("rlperf", "flashinfer")
"""``--attention-backend`` values (``EngineConfig.attention_backend``)."""
KERNEL_MODES = ("invariant", "fast")
"""``--mode`` values: :data:`rlperf.kernels.MODES`."""


DEFAULT_NUM_THREADS = 1
"""``--num-threads``: CPU intra-op threads of ``rlperf serve``, ``train`` and ``gate`` (one thread is the
fastest for the tiny model on a shared machine; 0: torch's default, every core)."""


def add_device_arguments(p, here: bool = True) -> None:
    """``--device`` and ``--num-threads``: one definition for ``rlperf serve``, ``rlperf train`` and
    ``rlperf gate``. ``p``: a parser or an argument group; ``here``: the device must exist on this
    machine (a server), else only its name is checked now (a run's driver, whose ranks may sit on Ray's
    GPU bundles elsewhere; ``rlperf.loop.resolve`` checks the device where the run uses it)."""
    p.add_argument("--device", type=flags.device if here else flags.device_name, default="auto",
                   help="auto (cuda when present), cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--num-threads", type=flags.nonnegative_int, default=DEFAULT_NUM_THREADS,
                   help=f"CPU intra-op threads; 0: torch's default (default: {DEFAULT_NUM_THREADS}, the fastest on "
                        "shared cores)")


def add_kernel_arguments(p, auto_cpu: str) -> None:
    """``--mode`` and ``--kernel-backend``, the kernel policy of a command: one definition for
    ``rlperf serve``, ``rlperf train`` and ``rlperf gate``. ``p``: a parser or an argument group;
    ``auto_cpu``: what ``--kernel-backend auto`` runs on CPU in this command."""
    p.add_argument("--mode", default="invariant", choices=KERNEL_MODES,
                   help="invariant: batch-invariant kernels (a row's bits never depend on its batch); fast: stock "
                        "torch where it is faster (cuBLAS above 64 rows, SDPA), not batch-invariant (default: invariant)")
    p.add_argument("--kernel-backend", default="auto", choices=KERNEL_BACKENDS,
                   help=f"auto: triton on CUDA, on CPU {auto_cpu}; triton (CUDA only); interpreter (Triton's "
                        "interpreter on CPU, needs TRITON_INTERPRET=1); reference (float64 torch) (default: auto)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    p.add_argument("--model-path", default=d.model_path,
                   help="preset (tiny, qwen3-0.6b, qwen3-4b, qwen3-8b: random weights) or a local HF checkpoint directory "
                        "(default: tiny, which needs no files)")
    p.add_argument("--tokenizer-path", default=None,
                   help="local HF tokenizer directory (default: the checkpoint's, else the built-in byte tokenizer)")
    p.add_argument("--host", type=flags.host, default=d.host, help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", type=flags.port, default=d.port, help="port of the server (with --router N: of the first)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and compute dtype; auto: a checkpoint's saved dtype, a preset in bfloat16 on CUDA and "
                        "float32 on CPU")
    add_device_arguments(p)
    add_kernel_arguments(p, auto_cpu="the torch reference, or the Triton interpreter when TRITON_INTERPRET=1")
    p.add_argument("--mem-fraction-static", type=flags.fraction, default=None,
                   help="CUDA: fraction of GPU memory for weights + KV cache (default 0.85)")
    p.add_argument("--max-total-tokens", type=flags.positive_int, default=None,
                   help="KV cache size in tokens (overrides --mem-fraction-static; CPU default: a 64 MiB pool)")
    p.add_argument("--max-running-requests", type=flags.positive_int, default=d.max_running_requests,
                   help="sequences decoded together at most; more requests wait in the queue")
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="prefill tokens per engine step; <= 0 disables chunked prefill")
    p.add_argument("--context-length", type=flags.positive_int, default=None,
                   help="most tokens of prompt + response (default: the model's max_position_embeddings)")
    p.add_argument("--random-seed", type=flags.seed, default=d.random_seed,
                   help="seed of a preset's random weights and of the seeds given to requests that send none")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on admin endpoints (weights, pause, flush, abort, profile); "
                        f"with --router N the router requires it too. A key on the command line shows in ps: prefer "
                        f"--api-key-file or the {API_KEY_ENV} environment variable (default: {API_KEY_ENV}, else no key)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (surrounding whitespace stripped)")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="the engine's paged attention: rlperf (its kernel) or flashinfer (FlashInfer's, as SGLang "
                        "runs it by default; --mode fast and CUDA only: invariant mode's attention stays rlperf's "
                        "kernel, whose bits are the trainer's) (default: rlperf)")
    p.add_argument("--cuda-graph-max-bs", type=flags.nonnegative_int, default=d.cuda_graph_max_bs,
                   help="replay decode steps of up to N sequences from CUDA graphs; 0 disables "
                        "(default: 256 on CUDA, 0 on CPU)")
    p.add_argument("--cuda-graph-max-prefill-tokens", type=flags.nonnegative_int, default=d.cuda_graph_max_prefill_tokens,
                   metavar="N",
                   help="replay steps with prefill chunks of up to N tokens (chunks and decode rows together) from "
                        "CUDA graphs padded to token buckets, in either --mode (not with --attention-backend "
                        "flashinfer); 0 disables (default: "
                        "--chunked-prefill-size + --max-running-requests on CUDA, 0 on CPU)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens before launching the next one; by default a steady "
                        "CUDA-graph decode batch launches its next step first, so the host's work between "
                        "steps overlaps the GPU's (the same tokens and log-probs either way)")
    p.add_argument("--max-generate-body-bytes", type=flags.positive_int, default=None, metavar="N",
                   help="largest /generate request body; a larger one gets 413 before it is read "
                        "(default: 1 MiB + 64 bytes per token of the context length)")
    p.add_argument("--max-weights-body-bytes", type=flags.positive_int, default=None, metavar="N",
                   help="largest /update_weights_from_tensor body (an inline weight bucket, base64) (default: 1 GiB)")
    p.add_argument("--profile-root", type=flags.writable_dir, default=None, metavar="DIR",
                   help="/start_profile writes traces only below DIR: an output_dir elsewhere, a '..' or a symbolic "
                        "link is refused (default: the system temporary directory)")
    p.add_argument("--skip-warmup", action="store_true",
                   help="debugging: answer /health 200 at once instead of after the warm-up (kernel compiles, a "
                        "prefill, every CUDA-graph decode size); the first requests then pay for them")
    p.add_argument("--router", type=flags.nonnegative_int, default=0, metavar="N",
                   help="start N servers (ports --port, --port+1, ...) and the sglang-router in front of them")
    p.add_argument("--router-port", type=flags.port, default=30080, help="port of the sglang-router (with --router)")
    p.add_argument("--router-policy", default="round_robin",
                   choices=["random", "round_robin", "cache_aware", "power_of_two"],
                   help="how the sglang-router picks a worker for each request (with --router)")


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    """``ServerArgs`` of parsed ``rlperf serve`` flags; ValueError when ``--api-key-file`` cannot be read."""
    args = ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})
    return dataclasses.replace(args, api_key=resolve_api_key(args.api_key, getattr(ns, "api_key_file", None)))


def server_argv(args: ServerArgs) -> list[str]:
    """Command-line flags that reproduce ``args`` (for starting servers as subprocesses), all but the
    API key: the launcher passes ``args.api_key`` in :data:`API_KEY_ENV` (``ps`` shows argv to everyone)."""
    argv = []
    for f in dataclasses.fields(ServerArgs):
        v = getattr(args, f.name)
        if isinstance(v, bool):  # a store_true flag
            argv += [f"--{f.name.replace('_', '-')}"] if v else []
        elif v is not None and f.name != "api_key":
            argv += [f"--{f.name.replace('_', '-')}", str(v)]
    return argv
