"""Memory sizes and capacity for the ``oom_headroom`` gate: the gate's side of memory, never a measurement.

One place for: parsing ``--memory-limit`` ("8GiB", "512MiB", "1.5GB", "1000000"), printing byte
counts, and the capacity a CPU run is held to (:func:`system_memory_bytes`, read where every memory
reading is: :mod:`rlperf.telemetry.memory`). The peaks themselves are measured by the loop's phase
meter (:class:`rlperf.telemetry.PhaseMeter`) and, for rollout engines of their own, by each engine
(``/get_server_info``); they reach the gate in :class:`rlperf.loop.record.FirstStepRecord`, and
:func:`rlperf.gates.checks.oom_headroom` compares them with ``(1 - headroom) x capacity``.
"""
from __future__ import annotations

import re

from rlperf.telemetry.memory import system_memory_bytes  # noqa: F401  (re-exported: the CPU capacity)

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
"""Suffixes: ``KiB/MiB/GiB/TiB`` and the bare ``K/M/G/T`` are binary (as docker and ulimit read them);
``kB/MB/GB/TB`` are decimal."""


def parse_memory_size(text: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"8G"``, ``"1.5GB"``, ``"512 MiB"`` or a plain integer; ValueError otherwise.

    Binary suffixes (KiB..TiB, K..T) are powers of 1024, decimal ones (kB..TB) powers of 1000.
    The result must be > 0.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot read memory size {text!r}: use a number of bytes or a size like 8GiB, 512MiB, 1.5GB")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"memory size must be > 0 bytes, got {text!r}")
    return value


def format_bytes(n: int | float | None) -> str:
    """``1536 MiB``-style text (binary units, 3 significant digits); ``-`` for None."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
