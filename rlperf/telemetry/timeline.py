"""The phase timeline every training run writes: one slice per phase, memory counters beside them.

The loop wraps each phase of a step::

    timeline = PhaseTimeline("run/timeline.pftrace")
    for step in range(num_steps):
        with timeline.phase("rollout", step=step):
            ...
        with timeline.phase("train", step=step):
            with timeline.phase("actor_log_probs", step=step):  # phases nest
                ...
    timeline.save()

Standard phase names are :data:`PHASES` (any name is accepted). At the start and end of every phase
the memory counters are sampled (:func:`rlperf.telemetry.memory.memory_counters`): host RSS, and per
CUDA device the allocated, reserved and peak allocated bytes of torch's caching allocator (MiB).

Timestamps are wall-clock (``time.time_ns``), the clock of the rollout servers' traces and of
``rlperf profile run``'s merged trace, so the files line up when opened together.

Output by file name: ``*.pftrace`` is a Perfetto protobuf trace built with the ``perfetto``
package's ``TraceProtoBuilder`` (``pip install perfetto``; an ImportError names it when missing);
``*.json`` / ``*.json.gz`` is Chrome trace JSON, which Perfetto and chrome://tracing also open.
:func:`default_path` picks ``.pftrace`` when the package is importable, else ``.json.gz``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import threading
import time
from pathlib import Path

from .memory import memory_counters

PHASES = ("rollout", "reward", "ref_log_probs", "actor_log_probs", "train", "weight_sync", "gate")
"""The phases of one RL step, in order (``gate``: the first-step gates)."""

_SEQUENCE_ID = 0x5E7  # one writer: every packet of the trace is on this one packet sequence


def perfetto_available() -> bool:
    try:
        import perfetto.trace_builder.proto_builder  # noqa: F401
    except ImportError:
        return False
    return True


def default_path(directory: str | os.PathLike, name: str = "timeline") -> Path:
    return Path(directory) / (f"{name}.pftrace" if perfetto_available() else f"{name}.json.gz")


@dataclasses.dataclass
class _Slice:
    name: str
    start_ns: int
    end_ns: int
    depth: int
    args: dict


class PhaseTimeline:
    """Phase slices and memory counters of one process, written by :meth:`save`.

    ``path``: the output file (its suffix picks the format, see the module docstring);
    ``process_name``: the track's name; ``memory``: sample memory counters at phase edges.
    """

    def __init__(self, path: str | os.PathLike, process_name: str = "rlperf train", memory: bool = True,
                 sample_memory=memory_counters):
        self.path = Path(path)
        self.process_name = process_name
        self.memory = memory
        self._sample = sample_memory
        self.slices: list[_Slice] = []
        self.counters: list[tuple[int, str, float]] = []
        self._depth = 0
        self._lock = threading.Lock()

    def counter(self, values: dict[str, float] | None = None, ts_ns: int | None = None) -> None:
        """Record counter values now (default: the memory counters)."""
        ts = time.time_ns() if ts_ns is None else ts_ns
        with self._lock:
            self.counters.extend((ts, k, float(v)) for k, v in (values if values is not None else self._sample()).items())

    @contextlib.contextmanager
    def phase(self, name: str, **args):
        """Time the ``with`` block as one slice named ``name``; ``args`` (e.g. ``step``) go on the slice."""
        if self.memory:
            self.counter()
        depth = self._depth
        self._depth += 1
        start = time.time_ns()
        try:
            yield
        finally:
            end = time.time_ns()
            self._depth = depth
            with self._lock:
                self.slices.append(_Slice(name, start, end, depth, dict(args)))
            if self.memory:
                self.counter(ts_ns=time.time_ns())

    # ---- writers ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike | None = None) -> Path:
        path = Path(path) if path is not None else self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".pftrace":
            data = self._perfetto()
        else:
            raw = json.dumps(self.chrome_trace(), separators=(",", ":")).encode()
            data = gzip.compress(raw) if path.suffix == ".gz" else raw
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a reader (or a crash mid-write) never sees half a trace
        return path

    def chrome_trace(self) -> dict:
        """Chrome trace JSON: complete events on one thread, counter events per counter name."""
        stamps = [s.start_ns for s in self.slices] + [t for t, _, _ in self.counters]
        origin = min(stamps) if stamps else time.time_ns()
        pid, tid = os.getpid(), 1
        ev = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": self.process_name}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": "phases"}}]
        for s in sorted(self.slices, key=lambda s: (s.start_ns, s.depth)):
            ev.append({"ph": "X", "cat": "phase", "name": s.name, "pid": pid, "tid": tid,
                       "ts": (s.start_ns - origin) / 1e3, "dur": (s.end_ns - s.start_ns) / 1e3, "args": s.args})
        for ts, name, value in sorted(self.counters):
            ev.append({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": (ts - origin) / 1e3, "args": {"MiB": value}})
        return {"traceEvents": ev, "displayTimeUnit": "ms", "baseTimeNanoseconds": origin,
                "otherData": {"producer": "rlperf timeline"}}

    def _perfetto(self) -> bytes:
        try:
            from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent
            from perfetto.trace_builder.proto_builder import TraceProtoBuilder
        except ImportError as exc:
            raise ImportError(f"{self.path.name}: writing .pftrace needs the perfetto package (pip install perfetto); "
                              f"or save to a .json.gz path ({exc})") from None
        b = TraceProtoBuilder()
        pid = os.getpid()
        process_uuid, phase_uuid = 1, 2

        def packet(ts: int | None = None):
            p = b.add_packet()
            p.trusted_packet_sequence_id = _SEQUENCE_ID
            if ts is not None:
                p.timestamp = ts
            return p

        p = packet()
        p.track_descriptor.uuid = process_uuid
        p.track_descriptor.process.pid = pid
        p.track_descriptor.process.process_name = self.process_name
        p = packet()
        p.track_descriptor.uuid = phase_uuid
        p.track_descriptor.parent_uuid = process_uuid
        p.track_descriptor.name = "phases"
        counter_uuid = {}
        for name in dict.fromkeys(n for _, n, _ in self.counters):
            counter_uuid[name] = 100 + len(counter_uuid)
            p = packet()
            p.track_descriptor.uuid = counter_uuid[name]
            p.track_descriptor.parent_uuid = process_uuid
            p.track_descriptor.name = name
            p.track_descriptor.counter.unit_name = "MiB"
        # begin/end events in time order; at equal times ends first, and an outer begin before an inner one
        edges = [(s.start_ns, 1, s.depth, s) for s in self.slices] + [(s.end_ns, 0, -s.depth, s) for s in self.slices]
        for ts, is_begin, _, s in sorted(edges, key=lambda e: e[:3]):
            p = packet(ts)
            p.track_event.track_uuid = phase_uuid
            if is_begin:
                p.track_event.type = TrackEvent.TYPE_SLICE_BEGIN
                p.track_event.name = s.name
                for k, v in s.args.items():
                    a = p.track_event.debug_annotations.add()
                    a.name = str(k)
                    if isinstance(v, bool):
                        a.bool_value = v
                    elif isinstance(v, int):
                        a.int_value = v
                    elif isinstance(v, float):
                        a.double_value = v
                    else:
                        a.string_value = str(v)
            else:
                p.track_event.type = TrackEvent.TYPE_SLICE_END
        for ts, name, value in sorted(self.counters):
            p = packet(ts)
            p.track_event.type = TrackEvent.TYPE_COUNTER
            p.track_event.track_uuid = counter_uuid[name]
            p.track_event.double_counter_value = value
        return b.serialize()
