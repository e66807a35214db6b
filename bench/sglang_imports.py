"""Import SGLang's launch-path modules from the unpacked pack (bench/pack_sglang.sh trims the pack to what
these import) and print each module that is missing on a line of its own:

    missing NAME (imported by MODULE)
    error MODULE: ExceptionType: message

A missing module is answered with a placeholder so the walk goes on and one run names every missing
module, not just the first. Exit 0 when everything imported, 1 otherwise.

    python3 bench/sglang_imports.py                  # the launch path below
    python3 bench/sglang_imports.py MODULE...        # these modules instead
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import traceback
import types

# What `python -m sglang.launch_server --attention-backend rlperf|flashinfer|triton`, the router and
# `sglang.bench_one_batch` import, and the SGLang modules rlperf's plugin imports.
LAUNCH_PATH = [
    "sglang", "sgl_kernel", "flashinfer", "sglang_router", "transformers",
    "sglang.launch_server", "sglang.bench_one_batch", "sglang_router.launch_router",
    "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.scheduler", "sglang.srt.managers.tp_worker",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.data_parallel_controller",
    "sglang.srt.model_executor.model_runner", "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.model_executor.cuda_graph_config", "sglang.srt.model_executor.forward_context",
    "sglang.srt.plugins.hook_registry", "sglang.srt.server_args", "sglang.srt.runtime_context",
    "sglang.srt.layers.attention.attention_registry", "sglang.srt.layers.attention.base_attn_backend",
    "sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.sampler", "sglang.srt.layers.logits_processor", "sglang.srt.layers.logprob_processor",
    "sglang.srt.mem_cache", "sglang.srt.models.registry", "sglang.srt.models.qwen3", "sglang.srt.models.qwen3_moe",
    "sglang.srt.configs.model_config", "sglang.srt.model_loader",
]
PLUGIN = "rlperf.sglang_plugin"  # imported too once it exists


class _Placeholder:
    """Stands for anything a missing module would have held."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __mro_entries__(self, bases):
        return (object,)


class _Stand(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the imports of the modules found missing so far (and their submodules)."""

    def __init__(self):
        self.names: set[str] = set()

    def covers(self, name: str) -> bool:
        return any(name == n or name.startswith(n + ".") for n in self.names)

    def find_spec(self, name, path=None, target=None):
        if self.covers(name):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def getattr_(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Placeholder()

        module.__getattr__ = getattr_
        return module

    def exec_module(self, module):
        pass


def _importer(exc: BaseException) -> str:
    """The module whose import statement failed: the last frame of the traceback outside importlib."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "importlib" not in f.filename and not f.filename.startswith("<frozen")]
    if not frames:
        return "?"
    path = frames[-1].filename
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == path:
            return name
    for root in sorted((p for p in sys.path if p), key=len, reverse=True):  # a module whose import failed
        if path.startswith(root.rstrip("/") + "/") and path.endswith(".py"):
            name = path[len(root.rstrip("/")) + 1:-3].replace("/", ".")
            return name[: -len(".__init__")] if name.endswith(".__init__") else name
    return path


def check(modules: list[str]) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """Import each module; returns ({missing: importer}, {module: error}, [modules imported])."""
    stand = _Stand()
    sys.meta_path.insert(0, stand)
    missing: dict[str, str] = {}
    errors: dict[str, str] = {}
    imported: list[str] = []
    for module in modules:
        for _ in range(200):  # one missing module a round
            try:
                importlib.import_module(module)
                imported.append(module)
                break
            except ModuleNotFoundError as exc:
                name = exc.name
                if not name or stand.covers(name) or name in missing:
                    errors[module] = f"{type(exc).__name__}: {exc}"
                    break
                missing[name] = _importer(exc)
                stand.names.add(name)
            except BaseException as exc:  # noqa: BLE001 - any failure is worth its line
                errors[module] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                break
    sys.meta_path.remove(stand)
    return missing, errors, imported


def main(argv: list[str]) -> int:
    modules = argv or list(LAUNCH_PATH)
    if not argv and importlib.util.find_spec(PLUGIN.split(".")[0]) is not None:
        try:
            if importlib.util.find_spec(PLUGIN) is not None:
                modules.append(PLUGIN)
        except ModuleNotFoundError:
            pass
    missing, errors, imported = check(modules)
    for name, importer in sorted(missing.items()):
        print(f"missing {name} (imported by {importer})")
    for module, error in errors.items():
        print(f"error {module}: {error}")
    versions = []
    for dist in ("sglang", "sgl_kernel", "flashinfer", "transformers", "torch"):
        module = sys.modules.get(dist)
        version = getattr(module, "__version__", None) if module is not None else None
        if isinstance(version, str):
            versions.append(f"{dist} {version}")
    print(f"sglang_imports: {len(imported)} of {len(modules)} modules imported, {len(missing)} missing, "
          f"{len(errors)} errors; {', '.join(versions)}")
    return 0 if not missing and not errors else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
