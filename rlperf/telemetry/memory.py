"""The process's memory, read in one place: the resident set on the host, torch's allocator on CUDA.

* :func:`rss_bytes` — the resident set now (``/proc/self/statm``);
* :func:`peak_rss_bytes` / :func:`reset_peak_rss` — the resident set's high-water mark (``VmHWM``)
  and its reset (``/proc/self/clear_refs``), which the phase meter (:mod:`rlperf.telemetry.meter`)
  uses for a CPU phase's peak;
* :func:`memory_counters` — the counters the phase timeline samples at phase edges (MiB).

Nothing here imports torch at module level: the timeline stays importable without it, and CUDA
is never initialised just to be sampled.
"""
from __future__ import annotations

import os

MIB = 1 << 20


def rss_bytes() -> int | None:
    """The process's resident set now, bytes (resident pages of ``/proc/self/statm``); None without procfs."""
    try:
        with open("/proc/self/statm") as f:  # resident pages are the second field
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


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


def lifetime_peak_rss_bytes() -> int:
    """``getrusage``'s ``ru_maxrss`` in bytes: the peak over the process's life (never reset)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux kB


def peak_rss_bytes() -> int:
    """The process's peak resident set (VmHWM since the last :func:`reset_peak_rss`), bytes.

    Falls back to the lifetime peak (:func:`lifetime_peak_rss_bytes`): an over-estimate, which errs
    on the safe side for a headroom check.
    """
    hwm = _proc_status_bytes("VmHWM")
    return hwm if hwm is not None else lifetime_peak_rss_bytes()


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write ``5`` to /proc/self/clear_refs); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_counters() -> dict[str, float]:
    """Host RSS and, per CUDA device torch has initialised, allocated/reserved/peak MiB."""
    out = {}
    rss = rss_bytes()
    if rss is not None:
        out["host rss MiB"] = rss / MIB
    else:
        out["host peak rss MiB"] = lifetime_peak_rss_bytes() / MIB
    try:
        import torch
    except ImportError:
        return out
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never initialise CUDA just to sample it
        for d in range(torch.cuda.device_count()):
            out[f"cuda:{d} allocated MiB"] = torch.cuda.memory_allocated(d) / MIB
            out[f"cuda:{d} reserved MiB"] = torch.cuda.memory_reserved(d) / MIB
            out[f"cuda:{d} peak allocated MiB"] = torch.cuda.max_memory_allocated(d) / MIB
    return out
