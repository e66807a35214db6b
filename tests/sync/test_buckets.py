"""rlperf.sync (flatten, buckets, checksum) and the rlperf._C multi-tensor copy: layout, exact round trips,
checks, checksum.

CPU tests run the C++ CPU path of the extension (and the pure-torch fallback, which must give the
same bytes); ``gpu`` tests run the CUDA kernels on larger, bf16-heavy inputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from rlperf import sync as B
from rlperf.sync import extension as E
from rlperf.sync.flatten import align_up

REPO = Path(__file__).resolve().parents[2]
U64 = (1 << 64) - 1
BACKENDS = ["extension", "torch"]


# ---------------------------------------------------------------------------------------------
# helpers


def random_tensor(shape, dtype, device="cpu", gen=None):
    """Random values of every dtype (never all zeros, so unwritten bytes show)."""
    if dtype == torch.bool:
        return (torch.rand(shape, generator=gen) > 0.5).to(device)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * 3).to(dtype).to(device)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype).to(device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8).cpu(), b.contiguous().reshape(-1).view(torch.uint8).cpu())
    )


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """Same shape/dtype/device, every byte 0xA5: a destination that was not written shows."""
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    out.reshape(-1).view(torch.uint8).fill_(0xA5)
    return out


def mixed_tensors(device="cpu", n_repeat=1, scale=1):
    """Odd shapes over fp32, bf16, fp16, fp64, int64, int32, bool, uint8, zero-size and 0-d tensors."""
    gen = torch.Generator().manual_seed(1234)
    specs = [
        ((3, 5), torch.float32),
        ((7,), torch.bfloat16),
        ((33, 1), torch.float16),
        ((127,), torch.int64),
        ((1,), torch.bool),
        ((13, 3), torch.uint8),
        ((), torch.float32),
        ((0,), torch.bfloat16),
        ((2, 0, 3), torch.int64),
        ((5, 7), torch.float64),
        ((11,), torch.int32),
        ((33,), torch.bool),
        ((1, 127), torch.bfloat16),
    ]
    out = {}
    for r in range(n_repeat):
        for i, (shape, dtype) in enumerate(specs):
            shape = tuple(s * scale if s > 1 else s for s in shape)
            out[f"layer{r}.t{i}.{str(dtype)[6:]}"] = random_tensor(shape, dtype, device, gen)
    return out


def flatten_with(backend, named, bucket_bytes):
    if backend == "torch":
        with B.use_torch_fallback():
            return B.flatten_buckets(named, bucket_bytes)
    assert B.copy_backend("cpu") == "extension"
    return B.flatten_buckets(named, bucket_bytes)


def ref_mix64(z: int) -> int:
    z &= U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def ref_checksum(data: bytes) -> int:
    """The documented formula, word by word in Python integers."""
    n = len(data)
    padded = data + bytes(-n % 8)
    s = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        s = (s + ref_mix64(w + (i + 1) * 0x9E3779B97F4A7C15)) & U64
    return ref_mix64(s + n)


# ---------------------------------------------------------------------------------------------
# the extension is there


def test_extension_is_built():
    if os.environ.get("RLPERF_NO_EXTENSION") == "1":
        pytest.skip("RLPERF_NO_EXTENSION=1: installed without rlperf._C")
    assert B.extension_available("cpu"), f"rlperf._C did not load: {E._EXTENSION_ERROR}"


needs_extension = pytest.mark.skipif(not B.extension_available("cpu"), reason="rlperf._C not built (RLPERF_NO_EXTENSION=1?)")


# ---------------------------------------------------------------------------------------------
# planning


def test_plan_layout_by_hand():
    named = [
        ("a", torch.zeros(15, dtype=torch.float32)),  # 60 B
        ("b", torch.zeros(7, dtype=torch.bfloat16)),  # 14 B
        ("c", torch.zeros(3, dtype=torch.bool)),  # 3 B
        ("d", torch.zeros(5, dtype=torch.int64)),  # 40 B
        ("e", torch.zeros(0, 4)),  # 0 B
        ("f", torch.zeros(30, dtype=torch.float32)),  # 120 B > 64: a bucket of its own
        ("g", torch.zeros(1, dtype=torch.float16)),  # 2 B
    ]
    plan = B.plan_buckets(named, bucket_bytes=64)
    layout = [[(m.name, m.start_idx, m.end_idx) for m in bucket] for bucket in plan]
    assert layout == [
        [("a", 0, 60)],
        [("b", 0, 14), ("c", 16, 19)],
        [("d", 0, 40), ("e", 48, 48)],
        [("f", 0, 120)],
        [("g", 0, 2)],
    ]
    # numel is SGLang's: the byte count end_idx - start_idx, not the element count
    assert plan[1][0].shape == (7,) and plan[1][0].dtype == torch.bfloat16 and plan[1][0].numel == 14
    assert plan[1][0].nelements == 7 and plan[0][0].numel == 60 and plan[2][1].numel == 0
    assert all(m.numel == m.end_idx - m.start_idx == m.nbytes for bucket in plan for m in bucket)


@pytest.mark.parametrize("bucket_bytes", [16, 100, 1000, 4096])
def test_plan_limits_alignment_and_order(bucket_bytes):
    gen = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float16]
    named = []
    for i in range(200):
        n = int(torch.randint(0, 400, (1,), generator=gen))
        named.append((f"p{i}", torch.zeros(n, dtype=dtypes[i % len(dtypes)])))
    plan = B.plan_buckets(named, bucket_bytes)
    flat = [m for bucket in plan for m in bucket]
    assert [m.name for m in flat] == [n for n, _ in named]  # order kept, nothing lost
    for bucket in plan:
        assert all(m.start_idx % B.ALIGNMENT == 0 for m in bucket)
        end = bucket[-1].end_idx
        if end > bucket_bytes:  # only a single oversized tensor may exceed the limit
            assert len([m for m in bucket if m.nbytes]) == 1 and max(m.nbytes for m in bucket) > bucket_bytes
        for prev, cur in zip(bucket, bucket[1:]):
            assert cur.start_idx >= prev.end_idx
    # greedy: the first tensor of each bucket after the first did not fit in the previous one
    for prev, cur in zip(plan, plan[1:]):
        first = cur[0]
        assert align_up(prev[-1].end_idx) + first.nbytes > bucket_bytes


def test_oversized_tensor_gets_its_own_bucket():
    named = [("small0", torch.ones(4)), ("big", torch.arange(100.0)), ("small1", torch.ones(4))]
    buckets = B.flatten_buckets(named, bucket_bytes=64)
    assert [b.names for b in buckets] == [["small0"], ["big"], ["small1"]]
    assert buckets[1].nbytes == 400
    assert torch.equal(buckets[1].unflatten()["big"], torch.arange(100.0))


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "512"])
def test_bad_bucket_bytes(bad):
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        B.flatten_buckets([("a", torch.ones(2))], bad)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="'w' appears twice"):
        B.flatten_buckets([("w", torch.ones(2)), ("w", torch.ones(3))])
    with pytest.raises(ValueError, match="'x' is a list"):
        B.flatten_buckets([("x", [1, 2])])
    with pytest.raises(ValueError, match="names must be strings"):
        B.flatten_buckets([(3, torch.ones(2))])
    with pytest.raises(ValueError, match="'s' has layout"):
        B.flatten_buckets([("s", torch.eye(3).to_sparse())])
    with pytest.raises(ValueError, match="'m' is on meta"):
        B.flatten_buckets([("c", torch.ones(2)), ("m", torch.ones(2, device="meta"))])


# ---------------------------------------------------------------------------------------------
# round trips


@needs_extension
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bucket_bytes", [64, 1000, B.SYNC_BUCKET_BYTES])
def test_round_trip_mixed_dtypes_exact(backend, bucket_bytes):
    named = mixed_tensors()
    buckets = flatten_with(backend, named, bucket_bytes)
    assert sorted(n for b in buckets for n in b.names) == sorted(named)
    if bucket_bytes == B.SYNC_BUCKET_BYTES:
        assert len(buckets) == 1
    for bucket in buckets:
        views = bucket.unflatten()
        for name, view in views.items():
            assert same_bits(view, named[name]), name
        # load_into poisoned destinations restores every byte
        dsts = {name: poisoned_like(named[name]) for name in bucket.names}
        if backend == "torch":
            with B.use_torch_fallback():
                bucket.load_into(dsts)
        else:
            bucket.load_into(dsts)
        for name in bucket.names:
            assert same_bits(dsts[name], named[name]), name


@needs_extension
def test_many_tensors_and_multithreaded_chunks():
    # 600 tensors (many chunks per bucket) plus a 5 MiB tensor spread over several 1 MiB CPU chunks
    named = mixed_tensors(n_repeat=46)
    named["big.fp32"] = torch.randn(5 * 1024 * 1024 // 4 + 3)
    assert len(named) == 599
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        buckets = B.flatten_buckets(named, bucket_bytes=3000)
        params = {n: poisoned_like(t) for n, t in named.items()}
        for b in buckets:
            b.load_into(params)
    finally:
        torch.set_num_threads(previous)
    for name, t in named.items():
        assert same_bits(params[name], t), name


@needs_extension
def test_unflatten_views_are_zero_copy():
    named = {"a": torch.randn(4, 3), "b": torch.arange(10, dtype=torch.int16)}
    (bucket,) = B.flatten_buckets(named)
    views = bucket.unflatten()
    base = bucket.buffer.data_ptr()
    for name, v in views.items():
        meta = next(m for m in bucket.metadata if m.name == name)
        assert v.data_ptr() == base + meta.start_idx
        assert v.is_contiguous() and v.shape == named[name].shape and v.dtype == named[name].dtype
    views["a"][0, 0] = 42.0
    assert bucket.buffer[0:4].view(torch.float32).item() == 42.0


@needs_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_sources_are_made_contiguous(backend):
    base = torch.randn(9, 6)
    named = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": torch.randn(1, 5).expand(4, 5),
        "bf16_slice": base.to(torch.bfloat16)[1:8:3],
    }
    assert not any(t.is_contiguous() for t in named.values())
    buckets = flatten_with(backend, named, 128)
    for b in buckets:
        for name, v in b.unflatten().items():
            assert v.shape == named[name].shape
            assert torch.equal(v, named[name]), name


@needs_extension
def test_gap_bytes_are_zero_not_garbage():
    srcs = [torch.full((3,), 7, dtype=torch.uint8), torch.full((5,), 9, dtype=torch.uint8)]
    for pack in ("extension", "torch"):
        buffer = torch.full((40,), 0xFF, dtype=torch.uint8)
        if pack == "extension":
            torch.ops.rlperf.multi_tensor_pack(srcs, buffer, [16, 2])
        else:
            with B.use_torch_fallback():
                E.multi_tensor_pack(srcs, buffer, [16, 2])
        expected = torch.zeros(40, dtype=torch.uint8)
        expected[16:19] = 7
        expected[2:7] = 9
        assert torch.equal(buffer, expected), pack


def test_empty_list_and_zero_size_tensors():
    assert B.flatten_buckets([]) == []
    assert B.flatten_buckets({}) == []
    assert B.plan_buckets([]) == []
    named = {"z0": torch.empty(0), "z1": torch.empty(3, 0, dtype=torch.bfloat16), "z2": torch.empty(0, dtype=torch.bool)}
    (bucket,) = B.flatten_buckets(named)
    assert bucket.nbytes == 0
    views = bucket.unflatten()
    assert {n: (tuple(v.shape), v.dtype) for n, v in views.items()} == {n: (tuple(t.shape), t.dtype) for n, t in named.items()}
    bucket.load_into({n: torch.empty_like(t) for n, t in named.items()})  # a no-op that must not fail
    assert bucket.checksum == ref_checksum(b"")


@needs_extension
def test_parameters_that_require_grad():
    model = torch.nn.Linear(7, 3)
    named = dict(model.named_parameters())
    (bucket,) = B.flatten_buckets(named)
    target = torch.nn.Linear(7, 3)
    bucket.load_into(dict(target.named_parameters()))
    assert torch.equal(target.weight, model.weight) and torch.equal(target.bias, model.bias)
    assert target.weight.requires_grad


# ---------------------------------------------------------------------------------------------
# load_into rejects mismatches by name, before copying anything


@needs_extension
def test_load_into_mismatches_are_named_and_nothing_is_written():
    named = {"first": torch.randn(4), "second": torch.randn(2, 3)}
    (bucket,) = B.flatten_buckets(named)

    def fresh():
        return {"first": torch.zeros(4), "second": torch.zeros(2, 3)}

    cases = [
        (lambda p: p.pop("second"), "'second' of the bucket has no destination"),
        (lambda p: p.__setitem__("second", torch.zeros(3, 2)), r"'second' has shape \[2, 3\] in the bucket but \[3, 2\]"),
        (lambda p: p.__setitem__("second", torch.zeros(2, 3, dtype=torch.float64)), "'second' is torch.float32 in the bucket but torch.float64"),
        (lambda p: p.__setitem__("second", torch.zeros(3, 2).t()), "destination 'second' is not contiguous"),
        (lambda p: p.__setitem__("second", torch.zeros(2, 3, device="meta")), "'second' is on meta but the bucket is on cpu"),
        (lambda p: p.__setitem__("second", [0.0] * 6), "destination 'second' is a list"),
    ]
    for mutate, message in cases:
        params = fresh()
        mutate(params)
        with pytest.raises(ValueError, match=message):
            bucket.load_into(params)
        assert torch.equal(params["first"], torch.zeros(4)), "load_into wrote before validating"
    with pytest.raises(TypeError, match="params must be a mapping"):
        bucket.load_into([("first", torch.zeros(4))])
    # extra destinations are fine
    params = fresh()
    params["unrelated"] = torch.zeros(1)
    bucket.load_into(params)
    assert torch.equal(params["second"], named["second"])


# ---------------------------------------------------------------------------------------------
# the ops themselves


def op_errors(setup: str, calls: list[str]) -> list[str]:
    """First line of the RuntimeError each call raises, run in a fresh interpreter.

    In a subprocess because on the device's torch 2.11 build a TORCH_CHECK failing inside
    rlperf._C crashed the process (SIGSEGV, cause not established; torch 2.13 here raises
    RuntimeError): a crash must fail this test, not end the test session.
    """
    script = textwrap.dedent(
        """
        import json, sys, torch
        import rlperf._C
        ops = torch.ops.rlperf
        """
    ) + textwrap.dedent(setup) + textwrap.dedent(
        f"""
        out = []
        for call in {calls!r}:
            try:
                eval(call)
                out.append("no error")
            except RuntimeError as e:
                out.append(str(e).splitlines()[0])
        print(json.dumps(out))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, f"rlperf._C crashed raising argument errors (rc {run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_extension
def test_op_argument_checks():
    setup = """
        bucket = torch.zeros(64, dtype=torch.uint8)
        a, b = torch.ones(4), torch.ones(2, dtype=torch.float64)  # 16 B each
    """
    expected = {
        "ops.multi_tensor_pack([a, b], bucket, [0, 8])": r"srcs\[1\] \(bytes \[8, 24\)\) overlaps srcs\[0\]",
        "ops.multi_tensor_pack([a], bucket, [56])": r"srcs\[0\] needs bytes \[56, 72\) of a bucket of 64 bytes",
        "ops.multi_tensor_pack([a], bucket, [-16])": r"srcs\[0\] needs bytes \[-16",
        "ops.multi_tensor_pack([a, b], bucket, [0])": "got 2 srcs but 1 offsets",
        "ops.multi_tensor_pack([a], torch.zeros(16), [0])": "bucket must be uint8",
        "ops.multi_tensor_pack([a], torch.zeros(4, 16, dtype=torch.uint8), [0])": "bucket must be 1-D",
        "ops.multi_tensor_pack([a], torch.zeros(128, dtype=torch.uint8)[::2], [0])": "bucket must be contiguous",
        "ops.multi_tensor_pack([torch.ones(2, 3).t()], bucket, [0])": r"srcs\[0\] \(shape \[3, 2\], strides \[1, 3\]\) is not contiguous",
        "ops.multi_tensor_unpack(bucket, [a, torch.ones(2, 3).t()], [0, 16])": r"dsts\[1\] .* is not contiguous",
        "ops.multi_tensor_unpack(bucket, [a], [60])": r"dsts\[0\] needs bytes \[60, 76\)",
        "ops.multi_tensor_pack([a], bucket, [0], 24)": "chunk_bytes must be 0 .* or a positive multiple of 16",
        "ops.bucket_checksum(torch.zeros(4))": "bucket must be uint8",
        "ops.multi_tensor_pack([a], bucket, [16])": "no error",
    }
    messages = op_errors(setup, list(expected))
    for (call, pattern), message in zip(expected.items(), messages):
        assert re.search(pattern, message), f"{call}: {message!r} does not match {pattern!r}"


@needs_extension
@pytest.mark.parametrize("chunk_bytes", [16, 48, 4096])
def test_small_chunks_and_misaligned_sources(chunk_bytes):
    # sources at odd byte addresses (a uint8 slice starting at 1) and tensors spanning many chunks
    raw = torch.randint(0, 256, (1001,), dtype=torch.uint8)
    srcs = [raw[1:], torch.randn(77), torch.randint(-9, 9, (3,), dtype=torch.int16)]
    offsets = [0, 1008, 1328]
    bucket = torch.full((1334,), 0xFF, dtype=torch.uint8)
    torch.ops.rlperf.multi_tensor_pack(srcs, bucket, offsets, chunk_bytes)
    with B.use_torch_fallback():
        expected = torch.full((1334,), 0x11, dtype=torch.uint8)
        E.multi_tensor_pack(srcs, expected, offsets)
    assert torch.equal(bucket, expected)
    outs = [poisoned_like(s) for s in srcs]
    outs[0] = torch.empty(1001, dtype=torch.uint8)[1:]  # misaligned destination too
    torch.ops.rlperf.multi_tensor_unpack(bucket, outs, offsets, chunk_bytes)
    for o, s in zip(outs, srcs):
        assert same_bits(o, s)


# ---------------------------------------------------------------------------------------------
# checksum


@needs_extension
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 33, 1000, 4099])
def test_checksum_matches_the_documented_formula(n):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    expected = ref_checksum(bytes(data.tolist()))
    assert B.bucket_checksum(data) == expected
    with B.use_torch_fallback():
        assert B.bucket_checksum(data) == expected
    # a buffer that starts at an odd address (not 8-byte aligned)
    holder = torch.empty(n + 3, dtype=torch.uint8)
    holder[3:] = data
    assert B.bucket_checksum(holder[3:]) == expected
    with B.use_torch_fallback():
        assert B.bucket_checksum(holder[3:]) == expected


@needs_extension
def test_checksum_is_stable_and_changes_with_any_byte():
    named = mixed_tensors(n_repeat=3)
    (bucket,) = B.flatten_buckets(named)
    (again,) = B.flatten_buckets(named)
    assert bucket.checksum == again.checksum == again.compute_checksum()
    with B.use_torch_fallback():
        assert B.bucket_checksum(bucket.buffer) == bucket.checksum
    large = torch.randint(0, 256, (3 * 1024 * 1024 + 5,), dtype=torch.uint8)  # several CPU blocks
    sums = {B.bucket_checksum(large)}
    base = B.bucket_checksum(large)
    for pos in [0, 1, 7, 8, 4096, 1024 * 1024 + 3, large.numel() - 1]:
        flipped = large.clone()
        flipped[pos] ^= 0x01
        h = B.bucket_checksum(flipped)
        assert h != base, pos
        sums.add(h)
    assert len(sums) == 8
    swapped = large.clone()
    swapped[0:8], swapped[8:16] = large[8:16].clone(), large[0:8].clone()
    assert B.bucket_checksum(swapped) != base
    # a trailing zero byte is not invisible (the length is hashed)
    assert B.bucket_checksum(large[:-1]) != B.bucket_checksum(torch.cat([large[:-1], torch.zeros(1, dtype=torch.uint8)]))


# ---------------------------------------------------------------------------------------------
# the fallback


@needs_extension
def test_fallback_equals_extension():
    named = mixed_tensors(n_repeat=4, scale=3)
    ext = B.flatten_buckets(named, 2048)
    with B.use_torch_fallback():
        assert B.copy_backend("cpu") == "torch"
        ref = B.flatten_buckets(named, 2048)
    assert len(ext) == len(ref)
    for e, r in zip(ext, ref):
        assert e.metadata == r.metadata
        assert torch.equal(e.buffer, r.buffer)
        assert e.checksum == r.checksum
        d_ext = {n: poisoned_like(t) for n, t in named.items()}
        d_ref = {n: poisoned_like(t) for n, t in named.items()}
        e.load_into(d_ext)
        with B.use_torch_fallback():
            r.load_into(d_ref)
        for n in e.names:
            assert same_bits(d_ext[n], d_ref[n]) and same_bits(d_ext[n], named[n])


def test_missing_extension_warns_once_and_still_works(monkeypatch):
    monkeypatch.setattr(E, "_extension", None)
    monkeypatch.setattr(E, "_EXTENSION_ERROR", ImportError("no module named rlperf._C"))
    monkeypatch.setattr(E, "_warned_fallback", False)
    assert B.copy_backend("cpu") == "torch" and not B.extension_available("cpu")
    named = mixed_tensors()
    with pytest.warns(RuntimeWarning, match="falls back to pure torch"):
        buckets = B.flatten_buckets(named, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = {n: poisoned_like(t) for n, t in named.items()}
        for b in buckets:
            b.load_into(params)
            assert b.checksum == ref_checksum(bytes(b.buffer.tolist()))
    for n, t in named.items():
        assert same_bits(params[n], t)


# ---------------------------------------------------------------------------------------------
# JSON descriptions (what a rollout server receives next to the buffer)


@needs_extension
def test_description_round_trip_through_json():
    named = mixed_tensors()
    (bucket,) = B.flatten_buckets(named)
    text = json.dumps(bucket.to_dict())
    desc = json.loads(text)
    assert desc["format"] == B.DESCRIPTION_FORMAT and desc["nbytes"] == bucket.nbytes
    assert desc["checksum"] == f"{bucket.checksum:016x}"
    first = desc["tensors"][0]
    assert set(first) == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}
    received = bucket.buffer.clone()
    rebuilt = B.FlattenedBucket.from_dict(desc, received, verify_checksum=True)
    assert rebuilt.metadata == bucket.metadata
    for n, v in rebuilt.unflatten().items():
        assert same_bits(v, named[n]) and v.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
    corrupted = received.clone()
    corrupted[5] ^= 0xFF
    with pytest.raises(ValueError, match="checksum mismatch"):
        B.FlattenedBucket.from_dict(desc, corrupted, verify_checksum=True)
    assert B.FlattenedBucket.from_dict(desc, corrupted).checksum == bucket.checksum  # not verified: trusted


def test_description_rejects_bad_input():
    (bucket,) = B.flatten_buckets({"w": torch.ones(4), "n": torch.ones(2, dtype=torch.bfloat16)})
    buf = bucket.buffer

    def desc(**tensor_changes):
        d = bucket.to_dict(with_checksum=False)
        d["tensors"][0].update(tensor_changes)
        return d

    with pytest.raises(ValueError, match="not a flattened-bucket description"):
        B.FlattenedBucket.from_dict({"format": "pickle"}, buf)
    with pytest.raises(ValueError, match="bytes but the buffer has"):
        B.FlattenedBucket.from_dict(bucket.to_dict(), buf[:-1].clone())
    with pytest.raises(ValueError, match="unknown dtype name"):
        B.FlattenedBucket.from_dict(desc(dtype="__import__('os')"), buf)
    with pytest.raises(ValueError, match="unknown dtype name"):
        B.FlattenedBucket.from_dict(desc(dtype="float128"), buf)
    with pytest.raises(ValueError, match=r"tensor 'w': numel 16 != the bytes of shape \[5\] of float32 \(5 elements x 4 bytes = 20\)"):
        B.FlattenedBucket.from_dict(desc(shape=[5]), buf)
    with pytest.raises(ValueError, match=r"tensor 'w': bytes \[0, 20\) do not hold numel 16: end_idx - start_idx = 20"):
        B.FlattenedBucket.from_dict(desc(end_idx=20), buf)
    # numel as an element count (the meaning rlperf once wrote) is refused, naming tensor and field
    with pytest.raises(ValueError, match=r"tensor 'w': bytes \[0, 16\) do not hold numel 4: .*numel is the byte count"):
        B.FlattenedBucket.from_dict(desc(numel=4), buf)
    with pytest.raises(ValueError, match="tensor 'w': numel must be a non-negative int"):
        B.FlattenedBucket.from_dict(desc(numel="16"), buf)
    with pytest.raises(ValueError, match="start_idx must be a non-negative int"):
        B.FlattenedBucket.from_dict(desc(start_idx=-4, end_idx=12), buf)
    with pytest.raises(ValueError, match="overlaps"):
        B.FlattenedBucket.from_dict(desc(start_idx=4, end_idx=20), buf)
    with pytest.raises(ValueError, match="exceed the 20-byte buffer"):
        B.FlattenedBucket.from_dict(desc(start_idx=16, end_idx=32), buf)
    with pytest.raises(ValueError, match="lacks fields"):
        d = bucket.to_dict()
        del d["tensors"][1]["numel"]
        B.FlattenedBucket.from_dict(d, buf)
    with pytest.raises(ValueError, match="1-D torch.uint8"):
        B.FlattenedBucket.from_dict(bucket.to_dict(), buf.view(torch.int8))
    assert B.dtype_from_name("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="not supported in a flattened bucket"):
        B.dtype_name(torch.quint8)


@needs_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_unflatten_copies_where_a_view_is_impossible(backend):
    """A buffer whose start is misaligned (storage offset 1, odd address): values still come out
    right, as copies; load_into copies bytes and does not care."""
    named = {"f32": torch.randn(3, 5), "i64": torch.arange(7), "u8": torch.arange(5, dtype=torch.uint8)}
    (bucket,) = B.flatten_buckets(named)
    holder = torch.zeros(bucket.nbytes + 1, dtype=torch.uint8)
    holder[1:] = bucket.buffer
    shifted = B.FlattenedBucket(holder[1:], bucket.metadata)
    with backend_context(backend):
        views = shifted.unflatten()
        dsts = {n: poisoned_like(t) for n, t in named.items()}
        shifted.load_into(dsts)
    for n, t in named.items():
        assert same_bits(views[n], t) and same_bits(dsts[n], t), n
    assert views["f32"].untyped_storage().data_ptr() != holder.untyped_storage().data_ptr()  # a copy
    assert views["u8"].data_ptr() == holder.data_ptr() + 1 + bucket.metadata[2].start_idx  # bytes always view


# ---------------------------------------------------------------------------------------------
# SGLang's own FlattenedTensorBucket (sglang.srt.weight_sync.tensor_bucket), both directions


def _load_sglang_tensor_bucket():
    """SGLang's ``sglang.srt.weight_sync.tensor_bucket`` module, from the installed sglang package.

    Executed from its file instead of ``import sglang.srt...``: importing runs ``sglang/__init__.py``,
    which needs about ten packages beyond torch (psutil, pybase64, requests, pillow, msgspec, pyzmq,
    ipython, ...) and, once run, sets TRITON_CACHE_DIR and other cache variables in os.environ and
    patches transformers for the rest of the test session. The module itself imports only the
    standard library and torch, so this is SGLang's class exactly as SGLang runs it. CI installs
    sglang with ``pip install --no-deps sglang==0.5.9``; a missing sglang fails these tests (never a silent skip).
    """
    spec = importlib.util.find_spec("sglang")  # finds the top-level package without running it
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("sglang is not installed (`pip install --no-deps sglang==0.5.9`, part of the README's test "
                    "install): the SGLang interop tests need its FlattenedTensorBucket", pytrace=False)
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "srt" / "weight_sync" / "tensor_bucket.py"
    assert path.is_file(), f"sglang at {root} has no srt/weight_sync/tensor_bucket.py: did SGLang move it?"
    module_spec = importlib.util.spec_from_file_location("_sglang_tensor_bucket", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sgl():
    return _load_sglang_tensor_bucket()


# Back to back in SGLang's unpadded layout, most of these start at byte offsets that are not a
# multiple of their item size (a float32 at byte 27, an int64 at byte 228, ...).
SGLANG_SPECS = [
    ("a.fp32", (2, 3), torch.float32),
    ("b.int8", (3,), torch.int8),
    ("c.fp32", (1, 13, 3), torch.float32),
    ("d.bf16", (7,), torch.bfloat16),
    ("e.int8", (1,), torch.int8),
    ("f.fp16", (5, 3), torch.float16),
    ("g.int64", (11,), torch.int64),
    ("h.fp32", (), torch.float32),
    ("i.bf16", (0, 4), torch.bfloat16),
    ("j.int8", (2, 3), torch.int8),
    ("k.int64", (1, 13), torch.int64),
    ("l.fp16", (33,), torch.float16),
    ("m.bf16", (2, 2, 2), torch.bfloat16),
    ("n.int8", (5,), torch.int8),
    ("o.fp32", (4, 4), torch.float32),
    ("p.int64", (2,), torch.int64),
    ("q.bf16", (1, 127), torch.bfloat16),
]


def sglang_named(device="cpu"):
    gen = torch.Generator().manual_seed(99)
    return {name: random_tensor(shape, dtype, device, gen) for name, shape, dtype in SGLANG_SPECS}


def backend_context(backend):
    return contextlib.nullcontext() if backend == "extension" else B.use_torch_fallback()


def _sglang_fields(m) -> tuple:
    return (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel)


@needs_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_bucket_unflattens_and_loads_in_rlperf(sgl, backend):
    named = sglang_named()
    sb = sgl.FlattenedTensorBucket(named_tensors=list(named.items()))
    metas = sb.get_metadata()
    for m in metas:  # SGLang's numel is the byte count
        t = named[m.name]
        assert m.numel == m.end_idx - m.start_idx == t.numel() * t.element_size(), m
    misaligned = {m.name for m in metas if m.start_idx % m.dtype.itemsize}
    assert {named[n].dtype for n in misaligned} == {torch.float32, torch.bfloat16, torch.int64}, misaligned
    assert {named[n].dtype for n in set(named) - misaligned} >= {torch.float32, torch.float16, torch.bfloat16, torch.int8}

    bucket = B.FlattenedBucket(sb.get_flattened_tensor(), metas)  # SGLang's metadata objects, as they are
    assert [_sglang_fields(m) for m in bucket.metadata] == [_sglang_fields(m) for m in metas]
    assert all(isinstance(m, B.FlattenedTensorMetadata) for m in bucket.metadata)
    with backend_context(backend):
        views = bucket.unflatten()
    assert list(views) == list(named)
    base = bucket.buffer.data_ptr()
    for m in bucket.metadata:
        v = views[m.name]
        assert same_bits(v, named[m.name]), m.name
        if m.nbytes and m.name in misaligned:  # a copy: no view of a misaligned float32 exists
            assert v.untyped_storage().data_ptr() != bucket.buffer.untyped_storage().data_ptr(), m.name
        elif m.nbytes:  # zero-copy
            assert v.data_ptr() == base + m.start_idx, m.name

    dsts = {n: poisoned_like(t) for n, t in named.items()}
    with backend_context(backend):
        bucket.load_into(dsts)
    for n, t in named.items():
        assert same_bits(dsts[n], t), n

    # rlperf's own description of the SGLang bucket survives JSON and a fresh buffer
    desc = json.loads(json.dumps(bucket.to_dict()))
    assert [d["numel"] for d in desc["tensors"]] == [m.numel for m in metas]
    received = B.FlattenedBucket.from_dict(desc, sb.get_flattened_tensor().clone(), verify_checksum=True)
    dsts = {n: poisoned_like(t) for n, t in named.items()}
    with backend_context(backend):
        received.load_into(dsts)
        got = received.unflatten()
    for n, t in named.items():
        assert same_bits(dsts[n], t) and same_bits(got[n], t), n


def test_sglang_metadata_round_trips_through_dicts(sgl):
    named = sglang_named()
    metas = sgl.FlattenedTensorBucket(named_tensors=list(named.items())).get_metadata()
    for m in metas:
        # SGLang's dataclass as JSON data (it has no to_dict of its own): torch.Size -> list, dtype -> name
        d = {**dataclasses.asdict(m), "shape": list(m.shape), "dtype": str(m.dtype)}
        ours = B.FlattenedTensorMetadata.from_dict(json.loads(json.dumps(d)))
        assert ours == B.FlattenedTensorMetadata.of(m)
        assert ours.nelements == named[m.name].numel() and ours.numel == m.numel
        back = ours.to_dict()
        assert back == {**d, "dtype": B.dtype_name(m.dtype)}
        again = sgl.FlattenedTensorMetadata(
            name=back["name"], shape=torch.Size(back["shape"]), dtype=B.dtype_from_name(back["dtype"]),
            start_idx=back["start_idx"], end_idx=back["end_idx"], numel=back["numel"],
        )
        assert again == m


def test_foreign_metadata_is_checked_by_name(sgl):
    meta = sgl.FlattenedTensorMetadata
    buf = torch.zeros(400, dtype=torch.uint8)
    # numel as an element count: what the issue saw the other way round, now a clear error
    with pytest.raises(ValueError, match=r"tensor 'w': bytes \[0, 312\) do not hold numel 39: .*numel is the byte count"):
        B.FlattenedBucket(buf, [meta("w", torch.Size([1, 13, 3]), torch.float64, 0, 312, 39)])
    with pytest.raises(ValueError, match=r"tensor 'w': numel 312 != the bytes of shape \[1, 13, 3\] of float32 \(39 elements x 4 bytes = 156\)"):
        B.FlattenedBucket(buf, [meta("w", torch.Size([1, 13, 3]), torch.float32, 0, 312, 312)])
    with pytest.raises(ValueError, match=r"tensor 'q': dtype: dtype torch.quint8 is not supported"):
        B.FlattenedBucket(buf, [meta("q", torch.Size([4]), torch.quint8, 0, 4, 4)])
    with pytest.raises(ValueError, match=r"tensor 'v' overlaps tensor 'u'"):
        B.FlattenedBucket(buf, [meta("u", torch.Size([3]), torch.int8, 0, 3, 3), meta("v", torch.Size([1]), torch.float32, 2, 6, 4)])
    with pytest.raises(ValueError, match=r"tensor 'x': bytes \[397, 401\) exceed the 400-byte buffer"):
        B.FlattenedBucket(buf, [meta("x", torch.Size([]), torch.float32, 397, 401, 4)])
    with pytest.raises(ValueError, match="lacks attributes"):
        B.FlattenedBucket(buf, [object()])
    ok = B.FlattenedBucket(buf, [meta("w", torch.Size([1, 13, 3]), torch.float32, 3, 159, 156)])  # misaligned: fine
    assert ok.unflatten()["w"].shape == (1, 13, 3)


@needs_extension
@pytest.mark.parametrize("bucket_bytes", [64, 1000, B.SYNC_BUCKET_BYTES])
def test_rlperf_buckets_reconstruct_in_sglang(sgl, bucket_bytes):
    named = {**mixed_tensors(), **sglang_named()}
    buckets = B.flatten_buckets(named, bucket_bytes)
    assert sorted(n for b in buckets for n in b.names) == sorted(named)
    for bucket in buckets:
        # rlperf's metadata objects handed to SGLang's class as they are
        rebuilt = sgl.FlattenedTensorBucket(flattened_tensor=bucket.buffer, metadata=list(bucket.metadata)).reconstruct_tensors()
        assert [n for n, _ in rebuilt] == bucket.names
        for n, t in rebuilt:
            assert same_bits(t, named[n]), n
        # and through rlperf's JSON description, rebuilt as SGLang's own metadata objects
        desc = json.loads(json.dumps(bucket.to_dict()))
        sgl_metas = [
            sgl.FlattenedTensorMetadata(
                name=d["name"], shape=torch.Size(d["shape"]), dtype=B.dtype_from_name(d["dtype"]),
                start_idx=d["start_idx"], end_idx=d["end_idx"], numel=d["numel"],
            )
            for d in desc["tensors"]
        ]
        received = bucket.buffer.clone()
        for n, t in sgl.FlattenedTensorBucket(flattened_tensor=received, metadata=sgl_metas).reconstruct_tensors():
            assert same_bits(t, named[n]), n
            assert t.numel() == 0 or t.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
        # numel means what SGLang's own flattening writes for the same tensor
        for m in bucket.metadata:
            (theirs,) = sgl.FlattenedTensorBucket(named_tensors=[(m.name, named[m.name])]).get_metadata()
            assert m.numel == theirs.numel == m.end_idx - m.start_idx, m.name


@needs_extension
@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_sglang_bucket_through_the_weight_transports(sgl, transport):
    from rlperf.sync import bucket_payload, receive_bucket, release

    named = sglang_named()
    sb = sgl.FlattenedTensorBucket(named_tensors=list(named.items()))
    payload, handle = bucket_payload(B.FlattenedBucket(sb.get_flattened_tensor(), sb.get_metadata()), transport)
    try:
        bucket = receive_bucket(json.dumps(payload), "cpu")
    finally:
        release(handle)
    dsts = {n: poisoned_like(t) for n, t in named.items()}
    bucket.load_into(dsts)
    for n, t in named.items():
        assert same_bits(dsts[n], t), n


@pytest.mark.gpu
def test_gpu_sglang_bucket_unflattens_and_loads(sgl):
    assert B.extension_available("cuda"), "rlperf._C has no CUDA kernels: was it built with nvcc?"
    named = sglang_named("cuda")
    gen = torch.Generator().manual_seed(5)
    named["z.big.bf16"] = random_tensor((1001, 777), torch.bfloat16, "cuda", gen)  # after an odd end: many chunks, misaligned
    named["z.tail.int8"] = random_tensor((3,), torch.int8, "cuda", gen)
    named["z.big.fp32"] = random_tensor((513, 129), torch.float32, "cuda", gen)
    sb = sgl.FlattenedTensorBucket(named_tensors=list(named.items()))
    bucket = B.FlattenedBucket(sb.get_flattened_tensor(), sb.get_metadata())
    assert bucket.device.type == "cuda"
    assert any(m.start_idx % m.dtype.itemsize for m in bucket.metadata if m.name.startswith("z.big"))
    views = bucket.unflatten()
    dsts = {n: poisoned_like(t) for n, t in named.items()}
    bucket.load_into(dsts)
    torch.cuda.synchronize()
    for n, t in named.items():
        assert same_bits(views[n], t) and same_bits(dsts[n], t), n


# ---------------------------------------------------------------------------------------------
# CMake builds the same sources standalone


@pytest.mark.slow
def test_cmake_builds_the_extension(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    build = tmp_path / "build"
    configure = subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}", "-DRLPERF_WITH_CUDA=OFF"],
        capture_output=True, text=True,
    )
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    compile_ = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
    assert compile_.returncode == 0, compile_.stdout[-3000:] + compile_.stderr[-3000:]
    (library,) = build.glob("_C*.so")
    data = list(range(1, 23))
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(build)!r})
        import torch, _C
        srcs = [torch.tensor({data[:11]!r}, dtype=torch.int16), torch.tensor({data[11:]!r}, dtype=torch.uint8)]
        bucket = torch.full((48,), 255, dtype=torch.uint8)
        torch.ops.rlperf.multi_tensor_pack(srcs, bucket, [0, 32])
        out = [torch.empty(11, dtype=torch.int16), torch.empty(11, dtype=torch.uint8)]
        torch.ops.rlperf.multi_tensor_unpack(bucket, out, [0, 32])
        assert out[0].tolist() == {data[:11]!r} and out[1].tolist() == {data[11:]!r}
        print(bytes(bucket.tolist()).hex(), torch.ops.rlperf.bucket_checksum(bucket) & (2**64 - 1))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    hex_bytes, checksum = run.stdout.split()
    expected = bytearray(48)
    for i, v in enumerate(data[:11]):
        expected[2 * i : 2 * i + 2] = v.to_bytes(2, "little")
    expected[32:43] = bytes(data[11:])
    assert bytes.fromhex(hex_bytes) == bytes(expected)
    assert int(checksum) == ref_checksum(bytes(expected))
    assert library.stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_round_trip_and_load(backend):
    assert B.extension_available("cuda"), "rlperf._C has no CUDA kernels: was it built with nvcc?"
    named = mixed_tensors(device="cuda", n_repeat=5, scale=37)
    gen = torch.Generator().manual_seed(3)
    for i in range(4):  # Qwen3-like bf16 blocks, several 64 KiB chunks each
        named[f"proj{i}"] = random_tensor((1024 + i, 777), torch.bfloat16, "cuda", gen)
    if backend == "torch":
        with B.use_torch_fallback():
            buckets = B.flatten_buckets(named, 4 * 1024 * 1024)
    else:
        buckets = B.flatten_buckets(named, 4 * 1024 * 1024)
    assert all(b.device.type == "cuda" for b in buckets)
    params = {n: poisoned_like(t) for n, t in named.items()}
    for b in buckets:
        for n, v in b.unflatten().items():
            assert same_bits(v, named[n]), n
        if backend == "torch":
            with B.use_torch_fallback():
                b.load_into(params)
        else:
            b.load_into(params)
    torch.cuda.synchronize()
    for n, t in named.items():
        assert same_bits(params[n], t), n


@pytest.mark.gpu
def test_gpu_matches_cpu_bytes_and_checksum():
    named_cpu = mixed_tensors(n_repeat=20, scale=5)  # 260 tensors: > 96 tasks, the device-table path
    named_gpu = {n: t.cuda() for n, t in named_cpu.items()}
    (cpu_bucket,) = B.flatten_buckets(named_cpu)
    (gpu_bucket,) = B.flatten_buckets(named_gpu)
    assert len(gpu_bucket) == 260
    assert torch.equal(gpu_bucket.buffer.cpu(), cpu_bucket.buffer)
    assert gpu_bucket.checksum == cpu_bucket.checksum == ref_checksum(bytes(cpu_bucket.buffer.tolist()))
    with B.use_torch_fallback():
        assert B.bucket_checksum(gpu_bucket.buffer) == cpu_bucket.checksum
    for n in [0, 1, 7, 9, 16, 4099, 10_000_019]:
        data = torch.randint(0, 256, (n + 3,), dtype=torch.uint8)
        for view in (data[:n], data[3:]):  # aligned start and a start 3 bytes off
            assert B.bucket_checksum(view.cuda()) == B.bucket_checksum(view), n
            holder = torch.empty(n + 3, dtype=torch.uint8, device="cuda")
            holder[3:] = data[3:].cuda()
            assert B.bucket_checksum(holder[3:]) == B.bucket_checksum(data[3:]), n


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_bytes", [0, 16, 4096, 1 << 20])
def test_gpu_ops_misaligned_and_chunk_sizes(chunk_bytes):
    gen = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (3_000_001,), dtype=torch.uint8, generator=gen).cuda()
    srcs = [
        raw[1:],  # odd address: byte path
        raw[4:1_000_004],  # 4-byte aligned: 32-bit path
        random_tensor((513, 1000), torch.bfloat16, "cuda", gen),
        random_tensor((7,), torch.float32, "cuda", gen)[1:],  # 4-byte aligned fp32
        torch.empty(0, device="cuda"),
    ]
    offsets, end = [], 0
    for s in srcs:
        offsets.append(align_up(end))
        end = offsets[-1] + s.numel() * s.element_size()
    bucket = torch.full((end + 5,), 0xFF, dtype=torch.uint8, device="cuda")
    torch.ops.rlperf.multi_tensor_pack(srcs, bucket, offsets, chunk_bytes)
    expected = torch.zeros(end + 5, dtype=torch.uint8)
    for s, o in zip(srcs, offsets):
        expected[o : o + s.numel() * s.element_size()] = s.reshape(-1).view(torch.uint8).cpu()
    assert torch.equal(bucket.cpu(), expected)
    outs = [poisoned_like(s) for s in srcs]
    outs[0] = torch.empty(3_000_001, dtype=torch.uint8, device="cuda")[1:]
    torch.ops.rlperf.multi_tensor_unpack(bucket, outs, offsets, chunk_bytes)
    for o, s in zip(outs, srcs):
        assert same_bits(o, s)


@pytest.mark.gpu
def test_gpu_rejects_mixed_devices():
    """What a user calls: the Python layer names the tensor and both devices before any launch."""
    with pytest.raises(ValueError, match="'b' is on cpu but 'a' is on cuda"):
        B.flatten_buckets({"a": torch.ones(2, device="cuda"), "b": torch.ones(2)})
    (gb,) = B.flatten_buckets({"a": torch.ones(2, device="cuda")})
    with pytest.raises(ValueError, match="'a' is on cpu but the bucket is on cuda"):
        gb.load_into({"a": torch.zeros(2)})


# torch 2.11.0+cu130 (the device's build): ANY C++ exception leaving a custom operator kills the
# process with SIGSEGV. A three-line TORCH_LIBRARY op that only raises TORCH_CHECK, built by
# torch.utils.cpp_extension.load with torch's own flags (with and without OpenMP, with and without
# a Python module), crashes the same way there, and raises RuntimeError under torch 2.13; so the
# raw operator's own checks are proven on the CPU build and the Python layer above guards users.
@pytest.mark.gpu
@pytest.mark.skipif(torch.__version__.startswith("2.11."), reason="torch 2.11 build: custom-op exceptions crash")
def test_gpu_op_rejects_mixed_devices():
    (message,) = op_errors(
        'bucket = torch.zeros(64, dtype=torch.uint8, device="cuda")',
        ['ops.multi_tensor_pack([torch.ones(2, device="cuda"), torch.ones(2)], bucket, [0, 16])'],
    )
    assert re.search(r"srcs\[1\] is on cpu but the bucket is on cuda", message), message


# ---------------------------------------------------------------------------------------------
# the benchmark's workload and bookkeeping (CPU smoke run; timings come from the device)


def test_flatten_bench_workload_and_rows_on_cpu():
    import time

    from rlperf.bench import flatten as bench
    from rlperf.bench.harness import Timing

    shapes = bench.qwen3_4b_shapes()
    assert len(shapes) == 398 and len({n for n, _ in shapes}) == 398
    assert sum(2 * torch.Size(s).numel() for _, s in shapes) == 8_044_936_192  # bf16 bytes: 8.04 GB

    def timer(fn):
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return Timing(median_ms=ms, p20_ms=ms, p80_ms=ms, reps=1)

    tiny = [(n, tuple(d // 16 for d in s)) for n, s in bench.qwen3_4b_shapes(2)]  # sizes stay multiples of 16 B
    rows = bench.measure(tiny, torch.device("cpu"), timer, bucket_bytes=1024 * 1024)
    assert {(r.kernel, r.anchor) for r in rows} >= {("flatten_buckets", "d2d copy"), ("load_into", "foreach_copy_")}
    assert all(r.unit == "GB/s" and r.kernel_ms > 0 and r.anchor_ms > 0 for r in rows)
    summary = bench.summarize(rows)
    assert summary["target_flatten_0.90"] in ("met", "missed") and summary["flatten_vs_copy"] > 0
