"""Package exports that load on first use (PEP 562), so that importing a package, or one light
submodule of it (its flags, for ``rlperf <command> --help``), does not import torch or the kernels.

A package lists ``_EXPORTS = {name: ".submodule"}`` and sets ``__getattr__ = lazy_exports(__name__,
_EXPORTS)``; the first ``package.name`` imports the submodule and caches the value in the package.
Imports nothing of rlperf.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: ``exports`` maps each exported name to the relative
    name of the submodule that defines it; any other name raises AttributeError."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
