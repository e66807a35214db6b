"""Memory sizes and peak measurement for the ``oom_headroom`` gate.

One place for: parsing ``--memory-limit`` ("8GiB", "512MiB", "1.5GB", "1000000"), printing byte
counts, and measuring a phase's peak — CUDA allocator peaks on a GPU, the process's resident set
(VmHWM) on the CPU. The loop wraps each phase in :func:`measure_phase` and puts the result in
:class:`rlperf.gates.record.PhaseMemory`.
"""
from __future__ import annotations

import contextlib
import re

from .record import PhaseMemory

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


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes; None where there is no procfs."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss_bytes() -> int | None:
    """The process's resident set now (VmRSS), bytes; None where unavailable."""
    return _proc_status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """The process's peak resident set (VmHWM since the last :func:`reset_peak_rss`), bytes.

    Falls back to ``getrusage``'s ``ru_maxrss`` (peak over the process's life: an over-estimate,
    which errs on the safe side for a headroom gate).
    """
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux kB


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write ``5`` to /proc/self/clear_refs); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _PhaseBox:
    """What :func:`measure_phase` yields; ``.record`` is filled when the block exits."""

    record: PhaseMemory | None = None


@contextlib.contextmanager
def measure_phase(phase: str, device=None):
    """Measure the peak memory of the enclosed block as ``PhaseMemory(phase, peak_bytes)``.

    ``device`` CUDA: ``torch.cuda.max_memory_allocated`` after a reset at entry (the allocator's
    peak; add ``max_memory_reserved`` headroom yourself if fragmentation matters). Otherwise the
    process's peak RSS (VmHWM, reset at entry where the kernel allows, else the lifetime peak).
    Usage: ``with measure_phase("train", dev) as m: ...; phases.append(m.record)``.
    """
    import torch

    box = _PhaseBox()
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()
    try:
        yield box
    finally:
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = peak_rss_bytes()
        box.record = PhaseMemory(phase, int(peak))


def system_memory_bytes() -> int | None:
    """The memory this process may use: the cgroup limit (v2 ``memory.max``, v1 ``limit_in_bytes``) when
    one is set, else the machine's MemTotal; None where neither can be read. The CPU capacity when
    ``--memory-limit`` is not given (a container's limit is what the OOM killer enforces)."""
    limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge v1 sentinel mean: no limit
            limits.append(int(text))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    return min(limits) if limits else None
