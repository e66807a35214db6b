"""The SGLang anchors of ``rlperf bench rollout``: which SGLang variants exist, the flags of each, and
``--sglang-variants``. Imports neither torch nor SGLang (``rlperf bench --help`` stays light).

Run as a module, ``python -m rlperf.bench.sglang_anchor ARGS`` is ``python -m sglang.bench_one_batch
ARGS`` with SGLang's general plugins loaded first (:func:`main`). SGLang 0.5.17 loads the plugins of the
entry point group ``sglang.srt.plugins`` in ``sglang.launch_server``, its ``Engine`` and its scheduler,
but not in ``sglang.bench_one_batch``, whose argument parser would then refuse ``--attention-backend
rlperf`` (a choice only rlperf's plugin adds). The ``plugin`` variant starts this module instead, with
``SGLANG_PLUGINS`` naming rlperf's entry points alone; the other variants run SGLang's module as it is,
with no plugin loaded.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

SGLANG_BENCH_MODULE = "sglang.bench_one_batch"
SGLANG_ANCHOR_MODULE = "rlperf.bench.sglang_anchor"
"""This module: ``sglang.bench_one_batch`` after SGLang's ``load_plugins()``."""
PLUGIN_GROUP = "sglang.srt.plugins"
"""SGLang's entry point group of general plugins (rlperf's: ``rlperf = rlperf.sglang_plugin:register``)."""


@dataclasses.dataclass(frozen=True)
class SGLangVariant:
    """One SGLang anchor: its ``--sglang-variants`` name, the label of its rows (their ``anchor``, or
    their ``kernel`` where the plugin is measured against SGLang), its attention backend and the other
    ``bench_one_batch`` flags it adds; ``plugin``: started through :data:`SGLANG_ANCHOR_MODULE` with
    rlperf's plugin loaded."""

    name: str
    label: str
    attention_backend: str
    flags: tuple[str, ...] = ()
    plugin: bool = False


SGLANG_VARIANTS = {v.name: v for v in (
    SGLangVariant("fast", "sglang fast", "flashinfer"),
    SGLangVariant("det-flashinfer", "sglang deterministic", "flashinfer", ("--enable-deterministic-inference",)),
    SGLangVariant("det-triton", "sglang deterministic triton", "triton", ("--enable-deterministic-inference",)),
    SGLangVariant("plugin", "sglang rlperf plugin", "rlperf", ("--page-size", "128", "--enable-deterministic-inference"),
                  plugin=True),
)}
"""The SGLang variants in the order they run (whatever the order of ``--sglang-variants``)."""
PLUGIN_VARIANT = "plugin"
PLUGIN_TARGETS = {"det-flashinfer": (1.0, None), "fast": (0.9, 64)}
"""The plugin's decode step against these variants (issue #36): ``name -> (target ratio, largest batch it
holds at or None for every batch)``: >= 1.0x SGLang's deterministic mode (flashinfer) at every batch,
>= 0.9x its fast mode at batch <= 64."""


def plugin_target(anchor_label: str, batch: int) -> float | None:
    """The target of the plugin's decode row against the variant labelled ``anchor_label`` at ``batch``."""
    for name, (target, max_batch) in PLUGIN_TARGETS.items():
        if SGLANG_VARIANTS[name].label == anchor_label:
            return target if max_batch is None or batch <= max_batch else None
    return None


def parse_sglang_variants(text: str) -> tuple[str, ...]:
    """``--sglang-variants``: comma-separated names of :data:`SGLANG_VARIANTS`, ``all`` or ``none``;
    the names in their run order, once each. argparse.ArgumentTypeError naming what is wrong."""
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected SGLang variants, comma-separated: {', '.join(SGLANG_VARIANTS)}, "
                                         f"all or none")
    if names == ["all"]:
        return tuple(SGLANG_VARIANTS)
    if names == ["none"]:
        return ()
    unknown = [n for n in names if n not in SGLANG_VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown SGLang variant(s) {', '.join(unknown)}: choose from "
                                         f"{', '.join(SGLANG_VARIANTS)} (comma-separated), all or none")
    return tuple(n for n in SGLANG_VARIANTS if n in names)


def rlperf_plugin_entry_points() -> list[str]:
    """The names of the installed ``sglang.srt.plugins`` entry points that load rlperf code (rlperf's
    plugin is installed when this is not empty: ``pip install -e .`` registers it)."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=PLUGIN_GROUP)
                   if ep.value.split(":")[0].split(".")[0].strip() == "rlperf"})


def main(argv: list[str] | None = None) -> None:
    """``sglang.bench_one_batch`` with ``argv`` (default: this process's arguments), after SGLang's
    ``load_plugins()`` (the module docstring says why)."""
    import runpy

    from sglang.srt.plugins import load_plugins

    load_plugins()
    sys.argv = [SGLANG_BENCH_MODULE, *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module(SGLANG_BENCH_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
