"""Import SGLang 0.5.17 on a CPU test machine (imported first by the plugin tests' subprocesses).

SGLang's utilities import torchvision at import time (an image decoder and transforms for multimodal
models); the CPU build of torch the tests run on has no torchvision wheel that loads beside it. This
module answers every ``torchvision`` import with a module whose attributes are placeholders that raise
when called, and tells transformers that torchvision is absent, so nothing takes the placeholders for
the real package. Text models, the plugin's path, never call them.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _Absent:
    """A torchvision attribute: further attributes are placeholders; calling one raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed on this test machine")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Finder())
import transformers.utils as _utils  # noqa: E402
import transformers.utils.import_utils as _import_utils  # noqa: E402

_import_utils.is_torchvision_available = _utils.is_torchvision_available = lambda: False
