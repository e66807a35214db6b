"""The phase timeline writer: nested phases and memory counters, as Chrome JSON and as Perfetto protobuf.

These tests drive it the way the loop does (through :class:`rlperf.telemetry.PhaseMeter`), with a
counter sampler that returns known values so every counter can be checked."""
import gzip
import itertools
import json
import time

import pytest

from rlperf.telemetry.memory import memory_counters
from rlperf.telemetry.timeline import PHASES, PhaseTimeline, default_path, perfetto_available


def _timeline(path):
    n = itertools.count()

    def sample():  # a known sequence: the i-th sample is i
        i = next(n)
        return {"host rss MiB": float(i), "cuda:0 allocated MiB": 10.0 * i}
    return PhaseTimeline(path, process_name="rlperf train test", sample_memory=sample)


def _drive(tl, steps=2):
    for step in range(steps):
        with tl.phase("rollout", step=step):
            time.sleep(0.002)
        with tl.phase("train", step=step, note="x"):
            with tl.phase("actor_log_probs", step=step):
                time.sleep(0.001)
    with pytest.raises(RuntimeError):  # a failing phase is still recorded, and the depth recovers
        with tl.phase("gate", step=steps):
            raise RuntimeError("gate failed")


def test_chrome_json_phases_nest_and_counters_bracket_each_phase(tmp_path):
    tl = _timeline(tmp_path / "t.json.gz")
    _drive(tl)
    path = tl.save()
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    ev = doc["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert [e["name"] for e in xs] == ["rollout", "train", "actor_log_probs"] * 2 + ["gate"]
    assert all(e["name"] in PHASES for e in xs)
    assert [e["args"]["step"] for e in xs] == [0, 0, 0, 1, 1, 1, 2] and xs[1]["args"]["note"] == "x"
    assert xs[0]["dur"] >= 2000 and xs[2]["dur"] >= 1000  # µs: at least the sleeps
    for outer, inner in ((xs[1], xs[2]), (xs[4], xs[5])):
        assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    for a, b in zip(xs, xs[1:]):  # phases of one thread never overlap unless nested
        if b["name"] != "actor_log_probs":
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    cs = [e for e in ev if e["ph"] == "C"]
    # 7 phases x 2 edges x 2 counters, values in sampling order
    rss = [e["args"]["MiB"] for e in cs if e["name"] == "host rss MiB"]
    assert rss == [float(i) for i in range(14)]
    assert [e["args"]["MiB"] for e in cs if e["name"] == "cuda:0 allocated MiB"] == [10.0 * i for i in range(14)]
    # wall clock: the origin is an epoch time in ns within this test's lifetime
    assert abs(doc["baseTimeNanoseconds"] / 1e9 - time.time()) < 60
    assert len({e["pid"] for e in ev}) == 1


def test_perfetto_protobuf_has_balanced_slices_and_counter_tracks(tmp_path):
    pytest.importorskip("perfetto.trace_builder.proto_builder")
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    tl = _timeline(tmp_path / "t.pftrace")
    _drive(tl)
    trace = Trace.FromString(tl.save().read_bytes())
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in trace.packet if p.HasField("track_descriptor")}
    process = [t for t in tracks.values() if t.HasField("process")]
    assert len(process) == 1 and process[0].process.process_name == "rlperf train test"
    counters = {t.name: u for u, t in tracks.items() if t.HasField("counter")}
    assert set(counters) == {"host rss MiB", "cuda:0 allocated MiB"}
    events = [p for p in trace.packet if p.HasField("track_event")]
    assert [p.timestamp for p in events if p.track_event.type != TrackEvent.TYPE_COUNTER] == sorted(
        p.timestamp for p in events if p.track_event.type != TrackEvent.TYPE_COUNTER)
    stack, closed = [], []
    for p in events:
        e = p.track_event
        if e.type == TrackEvent.TYPE_SLICE_BEGIN:
            stack.append((e.name, {a.name: a for a in e.debug_annotations}))
        elif e.type == TrackEvent.TYPE_SLICE_END:
            closed.append(stack.pop())
    assert not stack
    assert [n for n, _ in closed] == ["rollout", "actor_log_probs", "train"] * 2 + ["gate"]
    assert [a["step"].int_value for _, a in closed] == [0, 0, 0, 1, 1, 1, 2]
    rss = [p.track_event.double_counter_value for p in events
           if p.track_event.type == TrackEvent.TYPE_COUNTER and p.track_event.track_uuid == counters["host rss MiB"]]
    assert rss == [float(i) for i in range(14)]
    assert len({p.trusted_packet_sequence_id for p in trace.packet}) == 1


def test_default_path_and_real_memory_counters(tmp_path):
    assert default_path(tmp_path).suffix == (".pftrace" if perfetto_available() else ".gz")
    m = memory_counters()
    assert m.get("host rss MiB", m.get("host peak rss MiB", 0)) > 10  # this Python process holds torch
    tl = PhaseTimeline(tmp_path / "real.json")
    with tl.phase("rollout", step=0):
        pass
    doc = json.loads(tl.save().read_text())
    assert {e["name"] for e in doc["traceEvents"] if e["ph"] == "C"} == set(m)
