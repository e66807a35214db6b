"""Weight-sync benchmark (bench/sync.py): both sync paths are exact, the child process is robust.

CPU: the cross-process path runs with the "shm" transport (the same code as "cuda_ipc" but the
transport); the GPU variant (marked ``gpu``) uses "cuda_ipc" on one device.
"""
import pytest
import torch

from rlperf.bench import sync as S
from rlperf.sync import weights_checksum

# odd sizes, mixed dtypes, a 0-dim and an empty tensor
SPECS = [
    ("embed", (33, 7), torch.bfloat16),
    ("norm", (127,), torch.float32),
    ("q", (5, 3, 2), torch.float16),
    ("scale", (), torch.float32),
    ("count", (7,), torch.int64),
    ("mask", (1, 9), torch.bool),
    ("empty", (0, 4), torch.bfloat16),
    ("bytes", (1,), torch.uint8),
]


def _named(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dtype in SPECS:
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            t = torch.randint(-1000 if dtype != torch.uint8 else 0, 255, shape, generator=g).to(dtype)
        out[name] = t.to(device)
    return out


def _transports():
    return [pytest.param("shm", "cpu", id="shm-cpu"),
            pytest.param("cuda_ipc", "cuda", id="cuda_ipc-gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("bucket_bytes", [48, 256, 1 << 20])  # many buckets (a tensor each), a few, one
def test_in_process_sync_is_bit_exact(bucket_bytes):
    src = _named()
    dst = {n: torch.empty_like(t) for n, t in src.items()}
    S.poison_(dst)
    assert not S.bits_equal(dst["norm"], src["norm"])  # the poison shows until the sync writes
    n = S.sync_in_process(src, dst, bucket_bytes)
    assert n >= 1 and (n > 1) == (bucket_bytes < 1 << 20)
    for name, t in src.items():
        assert S.bits_equal(dst[name], t), name


def test_poison_sets_every_byte_and_bits_equal_sees_nan_payloads():
    t = {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "s": torch.zeros((), dtype=torch.float32)}
    S.poison_(t)
    assert t["a"].view(torch.uint8).eq(0xFF).all() and torch.isnan(t["a"]).all() and torch.isnan(t["s"])
    assert S.bits_equal(t["a"], t["a"].clone())  # NaN == NaN bitwise, unlike torch.equal on floats
    assert not S.bits_equal(t["a"], t["a"].float())


@pytest.mark.parametrize("transport,device", _transports())
@pytest.mark.parametrize("ack_each_bucket", [True, False])
def test_cross_process_sync_matches_parent_checksum(transport, device, ack_each_bucket):
    src = _named(device)
    with S.SyncChild(S.SyncChild.specs_of(src), device, transport, ready_timeout=300) as child:
        assert child.checksum() != weights_checksum(src)  # poisoned: the check can fail
        n = child.sync(src, 64, ack_each_bucket=ack_each_bucket)
        assert n > 1
        assert child.checksum() == weights_checksum(src)
        # a second sync of different weights replaces every byte, and poison + sync restores them
        src2 = _named(device, seed=1)
        child.sync(src2, 1 << 20, ack_each_bucket=ack_each_bucket)
        assert child.checksum() == weights_checksum(src2) != weights_checksum(src)
        child.poison()
        assert child.checksum() != weights_checksum(src2)
        child.sync(src2, 1 << 20, ack_each_bucket=ack_each_bucket)
        assert child.checksum() == weights_checksum(src2)
        proc = child.process
    assert not proc.is_alive() and proc.exitcode == 0


@pytest.mark.parametrize("ack_each_bucket", [True, False])
def test_child_failure_surfaces_its_traceback_and_the_child_is_gone(ack_each_bucket):
    src = _named()
    specs = S.SyncChild.specs_of(src)
    specs = [(n, [4, 4] if n == "norm" else shape, d) for n, shape, d in specs]  # the child expects another shape
    child = S.SyncChild(specs, "cpu", "shm", ready_timeout=300)
    try:
        with pytest.raises(S.SyncChildError, match=r"(?s)failed:.*Traceback.*'norm'.*shape"):
            child.sync(src, 64, ack_each_bucket=ack_each_bucket)
    finally:
        child.close()
    assert not child.process.is_alive() and child.process.exitcode is not None
    with pytest.raises((S.SyncChildError, OSError)):  # a closed child refuses further work
        child.checksum()


def test_child_exits_when_the_parent_closes_the_pipe():
    child = S.SyncChild(S.SyncChild.specs_of(_named()), "cpu", "shm", ready_timeout=300)
    try:
        child._conn.close()  # no "close" message: only EOF
        child.process.join(60)
        assert not child.process.is_alive() and child.process.exitcode == 0
    finally:
        child.close()


def test_child_that_cannot_start_reports_why():
    with pytest.raises(S.SyncChildError, match="unknown dtype name"):
        S.SyncChild([("w", [3], "float13")], "cpu", "shm", ready_timeout=300)


def test_measure_end_to_end_on_cpu_rows_and_summary():
    shapes = [("model.embed_tokens.weight", (97, 16)), ("model.layers.0.input_layernorm.weight", (16,)),
              ("model.layers.0.mlp.down_proj.weight", (16, 33)), ("model.norm.weight", (16,))]
    total = 2 * (97 * 16 + 16 + 16 * 33 + 16)
    timer = lambda fn: S.wall_time(fn, warmup=1, reps=2, device=torch.device("cpu"))  # noqa: E731
    rows = S.measure(shapes, torch.device("cpu"), timer, transport="shm", bucket_sizes=(1024, 4096))
    kernels = [r.kernel for r in rows]
    assert kernels == ["sync in-process (0.000976562 MiB buckets)", "sync in-process (0.00390625 MiB buckets)",
                       "sync shm (0.000976562 MiB buckets)", "sync shm, one ack (0.000976562 MiB buckets)",
                       "sync shm (0.00390625 MiB buckets)", "sync shm, one ack (0.00390625 MiB buckets)"]
    for r in rows:
        assert r.anchor == "d2d copy" and r.work == total and r.unit == "GB/s" and r.kernel_ms > 0 and r.anchor_ms > 0
        assert r.ratio == pytest.approx(r.anchor_ms / r.kernel_ms)
    assert rows[0].extra["buckets"] > rows[1].extra["buckets"] >= 1
    assert "cold_ms" in rows[2].extra and all("cold_ms" not in r.extra for r in rows[3:])
    summary = S.summarize(rows)
    assert summary["target_50ms_in_process"] in ("met", "missed") and summary["target_50ms_shm"] in ("met", "missed")
    assert summary["in_process_ms"] == rows[0].kernel_ms and summary["shm_one_ack_ms"] == rows[3].kernel_ms
    assert summary["in_process_0.00390625MiB_ms"] == rows[1].kernel_ms and "shm_cold_ms" in summary


def test_wall_time_takes_the_median():
    calls = []
    t = S.wall_time(lambda: calls.append(1), warmup=2, reps=5, device=torch.device("cpu"))
    assert len(calls) == 7 and t.reps == 5 and 0 <= t.p20_ms <= t.median_ms <= t.p80_ms


@pytest.mark.gpu
def test_measure_on_gpu_cuda_ipc_small():
    shapes = [("a", (1000, 37)), ("b", (129,)), ("c", (4096, 64))]
    device = torch.device("cuda")
    timer = lambda fn: S.wall_time(fn, warmup=1, reps=3, device=device)  # noqa: E731
    rows = S.measure(shapes, device, timer, transport="cuda_ipc", bucket_sizes=(64 * 1024, 1 << 20))
    assert any(r.kernel.startswith("sync cuda_ipc") for r in rows) and "cuda_ipc_cold_ms" in S.summarize(rows)
