"""``--rollout-backend sglang``: real SGLang engines (``python -m sglang.launch_server``) behind the sglang-router.

What the run does with them, in order (docs/train.md, "Real SGLang"; docs/ARCHITECTURE.md, "SGLang's
weight-update endpoints"):

1. **The model on disk**: the trainer's compute weights as they are before rollout 0 (after the embedded
   task's warm-up, in the compute dtype) are written in HF layout (``config.json`` + safetensors,
   :meth:`rlperf.model.qwen3.Qwen3ForCausalLM.save_pretrained`) to ``OUTPUT_DIR/sglang-model``; with
   ``--sglang-load-format dummy`` only ``config.json`` is written and the engines start on random
   weights, which the client replaces before rollout 0 (:func:`sglang_client_for`).
2. **The engines**: one ``python -m sglang.launch_server`` per engine (:func:`sglang_launch_argv`: model,
   port, ``--tp-size``, dtype, ``--attention-backend``, ``--mem-fraction-static``, ``--random-seed``,
   ``--skip-tokenizer-init`` — rlperf sends token ids and reads token ids, so the saved model needs no
   tokenizer — ``--load-format``, ``--enable-deterministic-inference``), each on its own GPUs
   (``CUDA_VISIBLE_DEVICES``), the trainer's GPU with ``--colocate`` (an engine of K ranks: the trainer's GPU
   and the K - 1 after it), or ``--device cpu`` on a CPU run,
   with the trainer's ``NCCL_CUMEM_ENABLE`` and ``NCCL_NVLS_ENABLE`` (:func:`use_weight_sync_nccl_settings`,
   :func:`engine_nccl_env`). ``--sglang-numerics rlperf`` starts them with ``--attention-backend rlperf
   --page-size`` rlperf's page size (:func:`numerics_argv`): rlperf's SGLang plugin (an entry point of
   SGLang's plugin group, loaded by every engine process) serves that backend with rlperf's model classes,
   kernels and seeded sampler, and :func:`engine_plugin_env` adds it to a ``SGLANG_PLUGINS`` whitelist that
   leaves it out; ``sglang`` starts them with ``--sglang-attention-backend``, SGLang's own kernels.
   Before any is started, :func:`check_sglang_installed` looks for the packages; an engine that exits
   while starting fails the start at once with its last output, and one whose output shows a missing
   module is :class:`SGLangUnavailable` (a usage error: the command exits 2 naming the module). One
   that does not answer ``/health`` within ``--sglang-launch-timeout`` fails the start too.
3. **The router**: the real sglang-router in front of them, started as ``rlperf serve --router N`` starts
   its own (:func:`rlperf.rollout.router.start_router`).
4. **Generation**: ``POST /generate`` through the router, one request per sample with ``input_ids``,
   ``return_logprob`` and ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``,
   ``top_k``, ``sampling_seed``, ``no_stop_trim``; every sample its own seed,
   :func:`rlperf.loop.generation.sample_seed`: SGLang's deterministic inference draws every request
   without one from one default seed, so the n samples of a prompt would be alike); the reply's ``output_ids`` and
   ``meta_info.output_token_logprobs`` (``[logprob, token_id, null]`` triples) are the sample
   (:class:`rlperf.loop.clients.RouterClient`, which :class:`rlperf.loop.clients.SGLangClient` extends).
5. **Weight sync**, with SGLang's own endpoints, on every worker the router lists:

   - engines on GPUs of their own: one process group of trainer rank 0 and every engine's TP ranks
     (``POST /init_weights_update_group`` with ``master_address``, ``master_port``, ``rank_offset``,
     ``world_size``, ``group_name``, ``backend``; engine i's first rank is ``1 + i * tp_size``), then per
     bucket ``POST /update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``, ``group_name``,
     ``load_format: "flattened_bucket"``, ``flush_cache`` on the last, ``weight_version``) with one
     broadcast of the bucket's bytes from rank 0 (:class:`rlperf.sync.distributed.WeightBroadcaster`,
     the engines paused around it). SGLang answers once its broadcast is received and loaded.
   - colocated (``--colocate``, CUDA): ``/pause_generation``, then per bucket ``POST
     /update_weights_from_tensor`` whose ``serialized_named_tensors`` holds, once per TP rank, the
     base64 of a pickled list of ``(name, tensor)`` pairs (torch's CUDA IPC reductions, the device named
     by its UUID: every rank opens the trainer's memory on the trainer's GPU, whatever its own
     ``CUDA_VISIBLE_DEVICES`` numbers it; nothing is copied through HTTP), ``flush_cache`` on the last bucket,
     ``weight_version``; then ``/continue_generation`` (:func:`push_tensors_to_sglang`).

SGLang has no ``/weights_checksum``: the run's ``sync/weights_checksum`` is the checksum of the bytes
sent, and the first-step gate's ``logprob_abs_diff`` measures what the engines did with them.
"""
from __future__ import annotations

import base64
import concurrent.futures
import importlib.util
import io
import os
import re
import sys
from pathlib import Path

from rlperf.rollout.router import (Cluster, ProcessExited, _kill, free_port, http_json, spawn,
                                   start_router_on_free_port, wait_until)
from rlperf.sync import SYNC_BUCKET_BYTES
from rlperf.sync.distributed import (INIT_ENDPOINT, WeightBroadcaster, WeightSyncError, _address_towards, _in_thread,
                                     init_weight_update_group, master_store)

from .args import UsageError
from .config import RunConfig, SGLangConfig
from .engines import HOST, LOG_DIR, EngineFleet, EngineFleetError

SGLANG_LAUNCH_MODULE = "sglang.launch_server"
"""The module each engine runs (``python -m``)."""
MODEL_DIR = "sglang-model"
"""Where, under ``--output-dir``, the model the engines load is written."""
SGLANG_PACKAGES = {"sglang": "sglang", "sglang_router": "sglang-router"}
"""Module -> package the backend needs in this Python before it starts anything."""
INSTALL_HINT = ("install SGLang's pinned set beside this torch (bench/pack_sglang.sh packs it for machines without "
                "network; docs/gpu.md, 'SGLang and FlashInfer'), or use --rollout-backend rlperf")
_MISSING_MODULE = re.compile(r"No module named '([^']+)'|cannot import name '([^']+)'")
_IMPORT_FAILED = re.compile(r"\b(ModuleNotFoundError|ImportError)\b")
SGLANG_PLUGIN = "rlperf"
"""The name of rlperf's SGLang plugin: its entry point in SGLang's group ``sglang.srt.plugins``, which a
whitelist in ``SGLANG_PLUGINS`` must name (:func:`engine_plugin_env`)."""
SGLANG_PLUGINS_ENV = "SGLANG_PLUGINS"
"""SGLang's plugin whitelist (comma-separated entry-point names; unset: every installed plugin loads)."""
TENSOR_BUCKET_BYTES = SYNC_BUCKET_BYTES
"""Bytes of tensors per colocated ``/update_weights_from_tensor`` request (handles only travel)."""


class SGLangUnavailable(UsageError):
    """SGLang (or a module its import chain needs) is missing here: the command exits 2 naming it."""


def check_sglang_installed(find_spec=importlib.util.find_spec) -> None:
    """:class:`SGLangUnavailable` naming each package of :data:`SGLANG_PACKAGES` this Python lacks."""
    missing = [pkg for module, pkg in SGLANG_PACKAGES.items() if find_spec(module) is None]
    if missing:
        raise SGLangUnavailable(f"--rollout-backend sglang: {' and '.join(missing)} not installed in {sys.executable}; "
                                f"{INSTALL_HINT}")


def sglang_launch_argv(model_path: str, port: int, cfg: SGLangConfig, *, dtype: str, mem_fraction_static: float,
                       seed: int, device: str = "cuda", host: str = HOST, routed_experts: bool = False) -> list[str]:
    """The arguments of ``python -m sglang.launch_server`` for one engine (module docstring, step 2).
    ``dtype``: ``bfloat16`` or ``float32`` (the trainer's compute dtype); ``device``: ``cuda`` or ``cpu``.
    With ``cfg.numerics`` ``rlperf``: ``--attention-backend rlperf --page-size`` rlperf's page size
    (:func:`numerics_argv`). ``routed_experts`` (MoE models): ``--enable-return-routed-experts``, so a
    request can ask for every token's experts (the routing-agreement gate, routing replay)."""
    argv = ["--model-path", str(model_path), "--host", host, "--port", str(port), "--tp-size", str(cfg.tp_size),
            "--dtype", dtype, *numerics_argv(cfg),
            "--mem-fraction-static", f"{mem_fraction_static:g}", "--random-seed", str(seed),
            "--skip-tokenizer-init", "--load-format", cfg.load_format]
    if cfg.deterministic:
        argv.append("--enable-deterministic-inference")
    if device == "cpu":
        argv += ["--device", "cpu"]
    if routed_experts:
        argv.append("--enable-return-routed-experts")
    return argv


def numerics_argv(cfg: SGLangConfig) -> list[str]:
    """The engine flags of ``cfg.numerics``: ``--attention-backend`` SGLang's (``sglang``), or ``--attention-backend
    rlperf --page-size`` :data:`rlperf.kernels.attention.PAGE_SIZE` (``rlperf``: rlperf's SGLang plugin serves that
    backend with rlperf's model, kernels and sampler; its KV cache pages are the attention kernel's KV blocks)."""
    if cfg.numerics != "rlperf":
        return ["--attention-backend", cfg.engine_attention_backend]
    from rlperf.kernels.attention import PAGE_SIZE

    return ["--attention-backend", cfg.engine_attention_backend, "--page-size", str(PAGE_SIZE)]


def describe_numerics(cfg: SGLangConfig) -> str:
    """The engines' numerics as the start-up line names them."""
    if cfg.numerics == "rlperf":
        return f"--sglang-numerics rlperf: rlperf's kernels through rlperf's SGLang plugin, {' '.join(numerics_argv(cfg))}"
    return f"--sglang-numerics sglang: SGLang's kernels, --attention-backend {cfg.engine_attention_backend}"


def engine_plugin_env(cfg: SGLangConfig, environ=None) -> dict[str, str]:
    """What each engine's environment needs so that rlperf's SGLang plugin loads (``--sglang-numerics rlperf``):
    SGLang loads every plugin of its entry-point group (``sglang.srt.plugins``) unless ``SGLANG_PLUGINS`` holds a
    value, which makes it a whitelist of comma-separated names (each stripped). A whitelist without
    :data:`SGLANG_PLUGIN` gets it appended (the value is kept as it is); unset or empty, nothing is added. Empty
    for ``--sglang-numerics sglang``."""
    environ = os.environ if environ is None else environ
    value = environ.get(SGLANG_PLUGINS_ENV, "")
    if cfg.numerics != "rlperf" or not value:
        return {}
    if SGLANG_PLUGIN in {x.strip() for x in value.split(",")}:
        return {}
    names = value.rstrip(", \t")
    return {SGLANG_PLUGINS_ENV: f"{names},{SGLANG_PLUGIN}" if names else SGLANG_PLUGIN}


def missing_module(output: str) -> str | None:
    """The module an engine's output says it could not import, or None."""
    if not _IMPORT_FAILED.search(output):
        return None
    m = None
    for m in _MISSING_MODULE.finditer(output):
        pass  # the last one: the innermost failure of the import chain
    return (m.group(1) or m.group(2)) if m else "a module of its import chain"


def _share_gpus(a: str | None, b: str | None) -> bool:
    """Whether two engines with ``CUDA_VISIBLE_DEVICES`` ``a`` and ``b`` (None: unset, every GPU) may use one
    GPU: unset on either side, or a device named by both."""
    if a is None or b is None:
        return True
    named = [{d.strip() for d in v.split(",")} - {""} for v in (a, b)]
    return bool(named[0] & named[1])


def start_sglang_servers(argvs: list[list[str]], envs: list[dict], log_dir: Path | None, timeout: float,
                         env=None) -> tuple[list, list[str]]:
    """Start one ``python -m sglang.launch_server`` per ``argvs[i]`` (with ``envs[i]`` added to the
    environment) and return (processes, URLs) once each answers ``GET /health``. Engines on GPUs of their
    own start together; an engine that shares a GPU with an earlier one (:func:`_share_gpus`) starts once
    that one answers: SGLang sizes its pools from the memory its weights' load took, and a neighbour
    allocating its own pools meanwhile made that look too large (two engines at ``--mem-fraction-static
    0.3`` on one H200: "Loaded weights leave no GPU memory for the KV cache"). An engine that exits
    first stops them all: :class:`SGLangUnavailable` when its output shows a failed import, else
    :class:`EngineFleetError` quoting it; :class:`EngineFleetError` after ``timeout`` seconds without an
    answer."""
    base = dict(os.environ if env is None else env)
    procs, urls, gpus, answered = [], [], [], set()

    def wait_for(i):
        url = urls[i]
        wait_until(lambda: http_json(url + "/health", timeout=5)[0] == 200, timeout, f"SGLang engine {i} at {url}",
                   procs)
        answered.add(i)

    try:
        for i, (argv, extra) in enumerate(zip(argvs, envs)):
            gpus.append({**base, **extra}.get("CUDA_VISIBLE_DEVICES"))
            for j in range(i):
                if j not in answered and _share_gpus(gpus[j], gpus[i]):
                    wait_for(j)
            log = str(log_dir / f"sglang-{i}.log") if log_dir else None
            procs.append(spawn([sys.executable, "-m", SGLANG_LAUNCH_MODULE, *argv], env={**base, **extra}, log_path=log,
                               die_with_parent=True))
            host, port = argv[argv.index("--host") + 1], argv[argv.index("--port") + 1]
            urls.append(f"http://{host}:{port}")
        for i in range(len(urls)):
            if i not in answered:
                wait_for(i)
    except ProcessExited as exc:
        _kill(procs)
        module = missing_module(exc.output)
        if module is not None:
            raise SGLangUnavailable(f"--rollout-backend sglang: `python -m {SGLANG_LAUNCH_MODULE}` cannot start here: "
                                    f"{module} cannot be imported ({exc}); {INSTALL_HINT}") from None
        raise EngineFleetError(f"the SGLang engines did not start: {exc}") from None
    except TimeoutError as exc:
        _kill(procs)
        raise EngineFleetError(f"the SGLang engines did not start: {exc} (--sglang-launch-timeout)") from None
    except BaseException:
        _kill(procs)
        raise
    return procs, urls


WEIGHT_SYNC_NCCL_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
"""NCCL settings the trainer and its SGLang engines share (why: :func:`use_weight_sync_nccl_settings`)."""


def use_weight_sync_nccl_settings(environ=None) -> dict[str, str]:
    """Put :data:`WEIGHT_SYNC_NCCL_DEFAULTS` into this process's environment where it has no value of its
    own, before any NCCL communicator exists (NCCL reads them once per process), and return the values
    in force. ``rlperf train --rollout-backend sglang`` calls it while it resolves its flags, so the
    actor ranks it starts inherit them, and :func:`engine_nccl_env` hands the same values to the engines.

    ``NCCL_CUMEM_ENABLE=0``: every rank of the weight-update group must agree on it (a trainer with
    NCCL's default, on, against SGLang's, which sets 0 where the environment is silent, fails the first
    broadcast with "Cuda failure 'invalid argument'"), and with it on in both, SGLang's side of the first
    broadcast failed ("Failed to CUDA calloc async 8 bytes"; 4x H200, SGLang 0.5.17, NCCL 2.28.9,
    2026-11-27). Off on both sides is the setting RL frameworks run SGLang's weight sync with.
    ``NCCL_NVLS_ENABLE=0`` (NVLink multicast): SGLang also sets it to 0 where the environment is silent,
    while NCCL's default uses it where the NVSwitch offers it; off on both sides keeps the ranks alike
    there too. A value the user set is kept, and given to the engines as it is."""
    environ = os.environ if environ is None else environ
    for key, value in WEIGHT_SYNC_NCCL_DEFAULTS.items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in WEIGHT_SYNC_NCCL_DEFAULTS}


def engine_nccl_env(environ=None) -> dict[str, str]:
    """The NCCL settings each engine must share with the trainer, from the trainer's environment (its
    own value of each :data:`WEIGHT_SYNC_NCCL_DEFAULTS` key, else the default): SGLang would otherwise
    choose its own (:func:`use_weight_sync_nccl_settings`)."""
    environ = os.environ if environ is None else environ
    return {key: environ.get(key, value) for key, value in WEIGHT_SYNC_NCCL_DEFAULTS.items()}


def _visible_gpu(index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of this process's CUDA device ``index``."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in listed.split(",")] if listed else None
    return ids[index] if ids else str(index)


def save_engine_model(model, path: Path, load_format: str) -> Path:
    """Write ``model`` (rlperf's Qwen3, its weights as the engines must start with them) where the engines
    load it: ``config.json`` and safetensors, or with ``load_format`` ``dummy`` ``config.json`` only. A model
    in the tree numerics (``reduction_leaves``: the megatron backend's engine copy) names its leaf count in
    ``config.json`` (``rlperf_reduction_leaves``), so that rlperf's SGLang plugin computes the same tree, at
    any ``--tp-size``."""
    import json

    from rlperf.model.qwen3 import CONFIG_FILE, config_to_hf

    path.mkdir(parents=True, exist_ok=True)
    if load_format != "dummy":
        model.save_pretrained(path)
    hf = config_to_hf(model.cfg, model.embed_tokens.dtype, getattr(model, "reduction_leaves", None))
    (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2))
    return path


def start_sglang_fleet(config: RunConfig, model, *, env=None) -> EngineFleet:
    """The run's SGLang engines and their router (module docstring, steps 1-3), as an
    :class:`rlperf.loop.engines.EngineFleet` (closing it stops them). ``model``: the trainer's compute
    model (its dtype and device decide the engines'). :class:`SGLangUnavailable` (exit 2) when SGLang
    cannot start here; :class:`UsageError` for ``--colocate`` off CUDA."""
    r, s = config.rollout, config.rollout.sglang
    check_sglang_installed()
    out = Path(config.telemetry.output_dir)
    log_dir = out / LOG_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    model_path = save_engine_model(model, out / MODEL_DIR, s.load_format)
    dtype = str(model.embed_tokens.dtype).removeprefix("torch.")
    device = model.device.type
    if r.colocate:
        if device != "cuda":
            raise UsageError("--rollout-backend sglang --colocate needs CUDA: SGLang's /update_weights_from_tensor "
                             "takes the tensors' CUDA IPC handles (on the CPU use --rollout-num-gpus N)")
        first = model.device.index or 0  # rank 0 on the trainer's GPU, ranks 1..tp-1 on the GPUs after it
        gpus = [",".join(_visible_gpu(first + k) for k in range(s.tp_size))]
        n = 1
    else:
        n = r.num_engines
        gpus = None if r.engine_gpus is None else [
            ",".join(r.engine_gpus[i * s.tp_size:(i + 1) * s.tp_size]) for i in range(n)]
    frac = r.mem_fraction_static if r.mem_fraction_static is not None else 0.8
    argvs = [sglang_launch_argv(model_path, free_port(HOST), s, dtype=dtype, mem_fraction_static=frac,
                                seed=config.runtime.seed, device=device, routed_experts=bool(model.cfg.moe_layers))
             for _ in range(n)]
    common = {**engine_nccl_env(), **engine_plugin_env(s, os.environ if env is None else env)}
    envs = [{"CUDA_VISIBLE_DEVICES": g, **common} for g in gpus] if gpus is not None else [dict(common) for _ in range(n)]
    where = f"GPUs {' | '.join(gpus)}" if gpus is not None else device.upper()
    print(f"rlperf train: starting {n} SGLang engine(s) ({model_path}, {dtype}, --tp-size {s.tp_size}, "
          f"{describe_numerics(s)}) on {where} behind the sglang-router; logs in {log_dir}",
          file=sys.stderr, flush=True)
    servers, urls = start_sglang_servers(argvs, envs, log_dir, s.launch_timeout, env=env)
    try:
        router, port = start_router_on_free_port(urls, HOST, env=env, log_dir=str(log_dir), die_with_parent=True)
    except BaseException as exc:
        Cluster(servers, None, urls, "").close()
        if isinstance(exc, (RuntimeError, TimeoutError)):
            raise EngineFleetError(f"the sglang-router in front of the SGLang engines did not start: {exc}") from None
        raise
    return EngineFleet(Cluster(servers, router, urls, f"http://{HOST}:{port}"), gpus, log_dir)


# ---- colocated weight push ------------------------------------------------------------------------


CUDA_REDUCTION_DEVICE_ARG = 6
"""Where torch's ``reduce_tensor`` puts a CUDA tensor's device index among ``rebuild_cuda_tensor``'s
arguments (torch 2.x: class, size, stride, offset, storage class, dtype, **device**, handle, ...)."""


def _cuda_reduction_by_uuid(t):
    """torch's IPC reduction of the CUDA tensor ``t`` with its device index replaced by the device's UUID:
    an index means a different GPU in a process whose ``CUDA_VISIBLE_DEVICES`` differs (a rank of a
    colocated engine of several GPUs sees the trainer's GPU under its own numbering). SGLang's workers
    rebuild with reductions that turn a UUID into their own index (they patch torch's
    ``rebuild_cuda_tensor`` before they unpickle; an int passes through unchanged)."""
    import torch
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(t)
    args = list(args)
    index = args[CUDA_REDUCTION_DEVICE_ARG]
    if isinstance(index, str):  # a process whose reductions already name the UUID (SGLang's patch)
        return rebuild, tuple(args)
    if not isinstance(index, int) or isinstance(index, bool):
        raise RuntimeError(f"torch's reduce_tensor changed: argument {CUDA_REDUCTION_DEVICE_ARG} is {index!r}, "
                           "not the device index")
    args[CUDA_REDUCTION_DEVICE_ARG] = str(torch.cuda.get_device_properties(index).uuid)
    return rebuild, tuple(args)


def serialize_named_tensors(named: list) -> str:
    """One entry of ``serialized_named_tensors``: base64 of the ``(name, tensor)`` list pickled with
    torch's multiprocessing reductions (a CUDA tensor becomes its IPC handle on the device named by UUID,
    :func:`_cuda_reduction_by_uuid`; SGLang's ``MultiprocessingSerializer.deserialize`` rebuilds it in
    the engine)."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    class _Pickler(ForkingPickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                return _cuda_reduction_by_uuid(obj)
            return NotImplemented

    buf = io.BytesIO()
    _Pickler(buf).dump([(name, t.detach()) for name, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def tensor_groups(named_tensors, group_bytes: int = TENSOR_BUCKET_BYTES) -> list[list]:
    """``(name, tensor)`` pairs in order, cut into groups of at most ``group_bytes`` (a larger tensor alone)."""
    groups, current, size = [], [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > group_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        groups.append(current)
    return groups


def push_tensors_to_sglang(url: str, named_tensors, version: str, *, tp_size: int = 1,
                           group_bytes: int = TENSOR_BUCKET_BYTES, timeout: float = 600.0) -> int:
    """Colocated weight push to the SGLang engine at ``url`` (module docstring, step 5): paused, one
    ``/update_weights_from_tensor`` per group of tensors (the same list for each of its ``tp_size``
    ranks), continued. Returns the number of requests; RuntimeError with the engine's message when it
    refuses one (it is continued all the same)."""
    groups = tensor_groups(named_tensors, group_bytes)
    if not groups:
        raise ValueError("load_weights got no tensors")

    def post(endpoint, body):
        status, reply = http_json(url + endpoint, body, timeout=timeout)
        ok = status == 200 and not (isinstance(reply, dict) and reply.get("success") is False)
        if not ok:
            msg = reply.get("message") if isinstance(reply, dict) else reply
            raise RuntimeError(f"{url}{endpoint} answered {status}: {msg}")

    post("/pause_generation", {})
    try:
        for i, group in enumerate(groups):
            entry = serialize_named_tensors(group)
            post("/update_weights_from_tensor", {
                "serialized_named_tensors": [entry] * tp_size, "load_format": None,
                "flush_cache": i == len(groups) - 1, "abort_all_requests": False, "weight_version": version})
    finally:
        post("/continue_generation", {})
    return len(groups)


class SGLangBroadcaster(WeightBroadcaster):
    """A :class:`rlperf.sync.distributed.WeightBroadcaster` whose engines are SGLang servers of ``tp_size``
    ranks each: engine i's ranks are ``1 + i * tp_size ...`` of a group of ``1 + engines * tp_size``
    (SGLang adds its TP rank to ``rank_offset``)."""

    def __init__(self, engine_urls, *, tp_size: int = 1, **kwargs):
        super().__init__(engine_urls, **kwargs)
        self.tp_size = tp_size

    def connect(self) -> None:
        """Ask every engine to join (concurrently), then join as rank 0; a refusal fails at once."""
        if self.group is not None:
            return
        address = self.master_address or _address_towards(self.urls[0])
        store = master_store(address, self.timeout)
        world = 1 + len(self.urls) * self.tp_size
        engines = [_in_thread(self._call, url, INIT_ENDPOINT, {
            "master_address": address, "master_port": store.port, "rank_offset": 1 + i * self.tp_size,
            "world_size": world, "group_name": self.group_name, "backend": self.backend})
            for i, url in enumerate(self.urls)]
        joined = _in_thread(init_weight_update_group, address, store.port, 0, world, group_name=self.group_name,
                            backend=self.backend, device=self.device, timeout=self.timeout, store=store)
        pending = set(engines) | {joined}
        while pending:
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                exc = f.exception()
                if exc is None and f is not joined and f.result().get("success") is False:
                    exc = WeightSyncError(str(f.result().get("message", "refused")))
                if exc is not None:
                    raise WeightSyncError(f"the weight-update group {self.group_name!r} was not formed: {exc}",
                                          getattr(exc, "status", 0))
        self.group = joined.result()
