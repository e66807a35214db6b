"""Summary, merge and collection logic on hand-built traces (no servers): SGLang-shaped files with
GPU kernels, per-stage files, nested CPU ops, request logs. Expected values are computed from the
events the test builds, by the obvious method."""
import gzip
import json
import os
import random
import time

import pytest

from rlperf.cli import main
from rlperf.profiles import harness
from rlperf.profiles.control import ProfileError, WorkerReply
from rlperf.profiles.load import LoadSpec, RequestRecord, make_prompts
from rlperf.profiles.summary import _percentile, request_stats, stage_times, summarize, top_ops
from rlperf.profiles.traces import load_worker_trace, merge, read_json, split_merged, stage_of, to_epoch, write_trace

BASE_NS = 1_790_000_000_000_000_000  # kineto's baseTimeNanoseconds: an epoch time in ns


def _kineto(events, base_ns=BASE_NS, gpu=True):
    """A torch.profiler-shaped trace: CPU process 100 and GPU device 0, with their metadata."""
    meta = [{"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_labels", "pid": 100, "tid": 0, "args": {"labels": "CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 100, "tid": 100, "args": {"name": "thread 100 (python)"}}]
    if gpu:
        meta += [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
                 {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
                 {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}}]
    return {"schemaVersion": 1, "baseTimeNanoseconds": base_ns, "traceEvents": meta + events}


def _x(name, cat, ts, dur, pid=100, tid=100, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def _kernels(rng, n, names, ts0=1000.0):
    out, ts = [], ts0
    for _ in range(n):
        d = rng.uniform(1, 50)
        out.append(_x(rng.choice(names), "kernel", ts, d, pid=0, tid=7))
        ts += d + rng.uniform(0, 5)
    return out


def test_top_kernels_rank_gpu_time_over_every_worker(tmp_path):
    rng = random.Random(0)
    names = ["gemm_a", "attn_b", "rmsnorm_c", "sample_d"]
    docs = [_kineto(_kernels(rng, 200, names) + [_x("aten::mm", "cpu_op", 900.0, 5000.0)]) for _ in range(2)]
    paths = []
    for i, d in enumerate(docs):  # SGLang's gzip naming, one file per worker
        paths.append(write_trace(d, tmp_path / f"17000{i}.5-TP-0.trace.json.gz"))
    workers = [load_worker_trace(p) for p in paths]
    kind, rows = top_ops(workers, top_n=3)
    assert kind == "gpu"
    totals = {}
    for d in docs:
        for e in d["traceEvents"]:
            if e.get("cat") == "kernel":
                totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
    want = sorted(totals, key=lambda k: -totals[k])[:3]
    assert [r["name"] for r in rows] == want
    for r in rows:
        assert r["total_ms"] == pytest.approx(totals[r["name"]] / 1e3)
    assert sum(r["percent"] for r in top_ops(workers, 10)[1]) == pytest.approx(100.0)
    each = summarize(workers)["per_worker"]
    assert [w["total_ms"] for w in each] == pytest.approx(
        [sum(e["dur"] for e in d["traceEvents"] if e.get("cat") == "kernel") / 1e3 for d in docs])
    assert [w["events"] for w in each] == [200, 200]
    # the CLI prints the same ranking for SGLang's files
    assert main(["profile", "summarize", *map(str, paths), "--top-n", "3", "--json", str(tmp_path / "s.json")]) == 0
    assert [r["name"] for r in json.loads((tmp_path / "s.json").read_text())["top"]] == want


def test_cpu_ops_rank_by_self_time():
    # linear [0, 100) holds matmul [10, 70) which holds copy [20, 30); add [100, 105) stands alone
    ev = [_x("aten::linear", "cpu_op", 0.0, 100.0), _x("aten::matmul", "cpu_op", 10.0, 60.0),
          _x("aten::copy_", "cpu_op", 20.0, 10.0), _x("aten::add", "cpu_op", 100.0, 5.0),
          _x("aten::linear", "cpu_op", 0.0, 30.0, tid=101)]  # another thread: not a child of the first
    kind, rows = top_ops([to_epoch(_kineto(ev, gpu=False), "w")], 10)
    got = {r["name"]: r["total_ms"] * 1e3 for r in rows}
    assert kind == "cpu"
    assert got == pytest.approx({"aten::linear": 40.0 + 30.0, "aten::matmul": 50.0, "aten::copy_": 10.0, "aten::add": 5.0})


def test_stage_times_from_annotations_and_from_stage_files(tmp_path):
    ev = [_x("prefill", "user_annotation", 0.0, 30.0), _x("decode", "user_annotation", 40.0, 5.0),
          _x("decode", "user_annotation", 50.0, 6.0), _x("decode", "gpu_user_annotation", 50.0, 6.0, pid=0, tid=7),
          _x("forward_extend", "user_annotation", 60.0, 10.0)]
    st = stage_times([to_epoch(_kineto(ev), "w")])
    assert st["prefill"] == {"count": 2, "total_ms": pytest.approx(0.040)}
    assert st["decode"] == {"count": 2, "total_ms": pytest.approx(0.011)}
    assert stage_times([to_epoch(_kineto([_x("aten::mm", "cpu_op", 0.0, 1.0)]), "w")]) is None

    rng = random.Random(1)
    files = {"EXTEND": _kernels(rng, 20, ["k"]), "DECODE": _kernels(rng, 50, ["k"])}
    paths = [write_trace(_kineto(v), tmp_path / f"1700.1-TP-0-{k}.trace.json.gz") for k, v in files.items()]
    assert [stage_of(p) for p in paths] == ["prefill", "decode"] and stage_of("1700.1-TP-0.trace.json.gz") is None
    st = stage_times([load_worker_trace(p) for p in paths])
    assert st["prefill"]["total_ms"] == pytest.approx(sum(e["dur"] for e in files["EXTEND"]) / 1e3)
    assert st["decode"]["total_ms"] == pytest.approx(sum(e["dur"] for e in files["DECODE"]) / 1e3)


def test_request_stats_match_the_log():
    rng = random.Random(2)
    t0 = 1_790_000_000.0
    recs = []
    for i in range(37):
        s = t0 + rng.uniform(0, 2)
        recs.append(RequestRecord(i, s, s + rng.uniform(0.05, 1.0), rng.randint(1, 9), rng.randint(1, 60), True))
    recs.append(RequestRecord(37, t0 + 0.5, t0 + 0.7, 0, 0, False, "HTTP 500"))
    st = request_stats(recs)
    ok = recs[:-1]
    wall = max(r.end for r in recs) - min(r.start for r in recs)
    assert (st["requests"], st["succeeded"], st["failed"]) == (38, 37, 1)
    assert st["output_tokens"] == sum(r.completion_tokens for r in ok)
    assert st["output_tokens_per_s"] == pytest.approx(st["output_tokens"] / wall)
    assert st["requests_per_s"] == pytest.approx(37 / wall)
    lat = sorted(r.latency for r in ok)
    rank = 0.9 * (len(lat) - 1)  # linear interpolation between ranks (numpy's default)
    lo = int(rank)
    assert st["latency_ms"]["p90"] == pytest.approx(1e3 * (lat[lo] + (lat[lo + 1] - lat[lo]) * (rank - lo)))
    longest = max(ok, key=lambda r: (r.completion_tokens, -r.latency))
    assert st["longest_sample"]["tokens_per_s"] == pytest.approx(longest.completion_tokens / longest.latency)
    assert _percentile([3.0], 99) == 3.0 and request_stats([]) is None


def test_merge_puts_workers_on_one_clock_and_split_undoes_it(tmp_path):
    # worker b's kineto base is 2.5 ms later: its ts=0 event happens after worker a's ts=1000 event
    flow = [{"ph": "s", "id": 5, "pid": 100, "tid": 100, "ts": 995.0, "cat": "ac2g", "name": "launch"},
            {"ph": "f", "id": 5, "pid": 0, "tid": 7, "ts": 1000.0, "cat": "ac2g", "name": "launch", "bp": "e"}]
    a = to_epoch(_kineto([_x("k1", "kernel", 1000.0, 10.0, pid=0, tid=7), _x("aten::mm", "cpu_op", 990.0, 30.0)]
                         + flow), "http://a")
    b = to_epoch(_kineto([_x("k2", "kernel", 0.0, 20.0, pid=0, tid=7)] + flow, base_ns=BASE_NS + 2_500_000), "http://b")
    start = BASE_NS / 1e9
    reqs = [RequestRecord(0, start, start + 0.004, 3, 4, True), RequestRecord(1, start + 0.001, start + 0.002, 3, 2, True)]
    doc = merge([a, b], reqs, (start, start + 0.005))
    path = write_trace(doc, tmp_path / "m.json.gz")
    with gzip.open(path, "rt") as f:
        back = json.load(f)
    ev = back["traceEvents"]
    k1, = [e for e in ev if e.get("name") == "k1"]
    k2, = [e for e in ev if e.get("name") == "k2"]
    assert k2["ts"] - k1["ts"] == pytest.approx(1500.0)
    assert (k1["pid"], k2["pid"]) == (1, 2)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
    assert threads[(1, k1["tid"])] == "GPU 0 / stream 7"
    mm, = [e for e in ev if e.get("name") == "aten::mm"]
    assert threads[(1, mm["tid"])] == "CPU / thread 100 (python)" and mm["tid"] != k1["tid"]
    ids = {(e["pid"], e["ph"]): e["id"] for e in ev if e.get("cat") == "ac2g"}
    assert ids[(1, "s")] == ids[(1, "f")] != ids[(2, "s")] == ids[(2, "f")]  # arrows stay within their worker
    assert all(isinstance(i, int) for i in ids.values())
    req = sorted((e for e in ev if e.get("cat") == "request"), key=lambda e: e["args"]["index"])
    assert [e["tid"] for e in req] == [1, 2]  # overlapping requests get separate lanes
    workers, slices = split_merged(back)
    assert [w.name for w in workers] == ["http://a", "http://b"] and len(slices) == 2
    assert request_stats(slices)["output_tokens"] == 6
    s = summarize(workers, slices)
    assert s["top_kind"] == "gpu" and {r["name"] for r in s["top"]} == {"k1", "k2"}


def test_collect_matches_unreported_sglang_traces_by_new_files(tmp_path):
    old = write_trace(_kineto([]), tmp_path / "1.0-TP-0.trace.json.gz")
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # a file from an earlier run is not ours
    since = time.time()
    a = write_trace(_kineto([_x("ka", "kernel", 0.0, 1.0, pid=0, tid=7)]), tmp_path / "2.0-TP-0.trace.json.gz")
    os.utime(a, (since + 1, since + 1))
    b = write_trace(_kineto([_x("kb", "kernel", 0.0, 1.0, pid=0, tid=7)]), tmp_path / "3.0-TP-0.trace.json.gz")
    os.utime(b, (since + 2, since + 2))
    workers = ["http://w1", "http://w2"]
    replies = [WorkerReply(w, None, "ok") for w in workers]
    traces, sources = harness.collect(workers, replies, replies, str(tmp_path), since)
    assert sources == {"http://w1": str(a), "http://w2": str(b)}
    assert [t.events[-1]["name"] for t in traces] == ["ka", "kb"]
    # --profile-by-stage: a third worker's two stage files share one profile id
    for stage, t in (("EXTEND", 3), ("DECODE", 4)):
        f = write_trace(_kineto([_x("k" + stage, "kernel", 0.0, 1.0, pid=0, tid=7)]),
                        tmp_path / f"4.0-TP-0-{stage}.trace.json.gz")
        os.utime(f, (since + t, since + t))
    traces, sources = harness.collect(workers + ["http://w3"], replies + [WorkerReply("http://w3", None, "ok")], [],
                                      str(tmp_path), since)
    assert [(t.name, t.stage) for t in traces] == [("http://w1", None), ("http://w2", None),
                                                   ("http://w3", "prefill"), ("http://w3", "decode")]
    doc = merge(traces)
    names = sorted(e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name")
    assert names == ["http://w1", "http://w2", "http://w3 [decode]", "http://w3 [prefill]"]
    back, _ = split_merged(doc)
    assert [(t.name, t.stage) for t in back] == [(t.name, t.stage) for t in traces]
    assert stage_times(back)["decode"]["total_ms"] == pytest.approx(1e-3)
    with pytest.raises(ProfileError, match="cannot tell which is whose"):
        harness.collect(workers + ["http://w3", "http://w4"], replies, [], str(tmp_path), since)
    with pytest.raises(ProfileError, match="pass --output-dir"):
        harness.collect(workers, replies, [], None, since)


def test_prompts_random_and_jsonl(tmp_path):
    p = make_prompts(LoadSpec(num_prompts=5, input_len=33, output_len=7))
    assert len(p) == 5 and all(len(x["input_ids"]) == 33 and x["max_new_tokens"] == 7 for x in p)
    assert p == make_prompts(LoadSpec(num_prompts=5, input_len=33, output_len=7))  # seeded
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "hi"}\n\n{"prompt": "yo", "max_new_tokens": 3}\n{"input_ids": [5, 6]}\n')
    rows = make_prompts(LoadSpec(num_prompts=4, output_len=9, dataset=str(f)))
    assert rows == [{"text": "hi", "max_new_tokens": 9}, {"text": "yo", "max_new_tokens": 3},
                    {"input_ids": [5, 6], "max_new_tokens": 9}, {"text": "hi", "max_new_tokens": 9}]
    f.write_text('{"other": 1}\n')
    with pytest.raises(ProfileError, match="needs 'text'"):
        make_prompts(LoadSpec(dataset=str(f)))
    f.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ProfileError, match=r"p.jsonl:2: not valid JSON"):
        make_prompts(LoadSpec(dataset=str(f)))
    f.write_text('["a list"]\n')
    with pytest.raises(ProfileError, match=r"p.jsonl:1: expected a JSON object"):
        make_prompts(LoadSpec(dataset=str(f)))
    with pytest.raises(ProfileError, match="must be positive"):
        make_prompts(LoadSpec(concurrency=0))


def test_summarize_rejects_an_unreadable_file(tmp_path, capsys):
    bad = tmp_path / "x.trace.json.gz"
    bad.write_bytes(b"not a trace")
    assert main(["profile", "summarize", str(bad)]) == 1
    assert "not a readable Chrome trace" in capsys.readouterr().err
    assert read_json(write_trace({"traceEvents": []}, tmp_path / "plain.json")) == {"traceEvents": []}


def test_per_worker_phase_bars(tmp_path, png_ink):
    pytest.importorskip("matplotlib")
    rng = random.Random(2)
    annotated = _kernels(rng, 100, ["k"]) + [_x("prefill", "user_annotation", 0.0, 300.0),
                                             _x("decode", "user_annotation", 400.0, 900.0)]
    paths = [write_trace(_kineto(annotated), tmp_path / "1700.1-TP-0.trace.json.gz"),
             write_trace(_kineto(_kernels(rng, 30, ["k"])), tmp_path / "1700.2-TP-0.trace.json.gz")]
    png = tmp_path / "phases.png"
    assert main(["profile", "summarize", *map(str, paths), "--json", str(tmp_path / "s.json"), "--png", str(png)]) == 0
    each = json.loads((tmp_path / "s.json").read_text())["per_worker"]
    assert (each[0]["prefill_ms"], each[0]["decode_ms"]) == (pytest.approx(0.3), pytest.approx(0.9))
    assert each[1]["prefill_ms"] is None and each[1]["decode_ms"] is None  # the second trace has no ranges
    stats = png_ink(png)
    rgb = stats["rgb"]
    for c in ((0.122, 0.467, 0.706), (1.0, 0.498, 0.055), (0.173, 0.627, 0.173)):  # busy, prefill, decode
        assert (abs(rgb - c).max(axis=-1) < 0.1).sum() > 200, c
