"""The process's memory, read in one place: the resident set on the host, torch's allocator on CUDA.

* :func:`rss_bytes` — the resident set now (``/proc/self/statm``);
* :func:`peak_rss_bytes` / :func:`reset_peak_rss` — the resident set's high-water mark (``VmHWM``)
  and its reset (``/proc/self/clear_refs``), which the phase meter (:mod:`rlperf.telemetry.meter`)
  uses for a CPU phase's peak;
* :func:`memory_kind`, :func:`capacity_bytes`, :func:`system_memory_bytes` — what a peak is held to:
  the device's memory on CUDA, the host's (cgroup limit or MemTotal) for a ``cpu_rss`` process;
* :func:`process_memory` — one process's memory now: kind, capacity, current and peak bytes, the
  numbers a rollout server reports in ``/get_server_info`` (the trainer's phases measure the same
  counters with the meter);
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


def memory_kind(device) -> str:
    """``"cuda"`` (allocator peaks) for a CUDA device, else ``"cpu_rss"`` (the process's resident set)."""
    return "cuda" if str(device).startswith("cuda") else "cpu_rss"


def capacity_bytes(device) -> int | None:
    """What ``device``'s peaks are held to: the CUDA device's total memory, else :func:`system_memory_bytes`."""
    if memory_kind(device) == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return system_memory_bytes()


def process_memory(device) -> dict:
    """This process's memory on ``device`` now, in bytes: ``kind`` (:func:`memory_kind`), ``capacity_bytes``
    (:func:`capacity_bytes`), ``current_bytes`` and ``peak_bytes`` (CUDA: ``memory_allocated`` and
    ``max_memory_allocated``, the counter the phase meter reads, plus ``reserved_bytes``,
    ``memory_reserved``; CPU: the resident set and its high-water mark, :func:`peak_rss_bytes`)."""
    kind = memory_kind(device)
    out = {"kind": kind, "capacity_bytes": capacity_bytes(device)}
    if kind == "cuda":
        import torch

        d = torch.device(device)
        out.update(current_bytes=int(torch.cuda.memory_allocated(d)), peak_bytes=int(torch.cuda.max_memory_allocated(d)),
                   reserved_bytes=int(torch.cuda.memory_reserved(d)))
    else:
        out.update(current_bytes=rss_bytes(), peak_bytes=peak_rss_bytes(), reserved_bytes=None)
    return out


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
