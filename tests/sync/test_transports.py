"""rlperf.sync.transports: JSON descriptions + inline / shared-memory / CUDA IPC buffers, exact round trips;
sync_weights, the whole path in one process."""
import json
import multiprocessing as mp
import os
import re
import sys

import pytest
import torch

from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.sync import (INLINE_BUCKET_BYTES, SYNC_BUCKET_BYTES, PayloadError, SyncConfig, bucket_payload,
                         flatten_buckets, load_bucket, receive_bucket, release, sync_weights, weights_checksum)


def _named(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(7, 3, generator=g).to(device), "b": torch.randn(33, generator=g).to(torch.bfloat16).to(device),
            "c": torch.arange(5, dtype=torch.int64).to(device), "empty": torch.empty(0, 4).to(device)}


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_payload_round_trip_is_exact_and_pure_json(transport):
    named = _named()
    (bucket,) = flatten_buckets(named)
    payload, handle = bucket_payload(bucket, transport)
    try:
        wire = json.dumps(payload)  # nothing but JSON travels
        got = receive_bucket(wire, "cpu").unflatten()
    finally:
        release(handle)
    assert set(got) == set(named)
    for k, t in named.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_receive_rejects_non_objects_and_bad_json():
    with pytest.raises(PayloadError, match="not JSON"):
        receive_bucket("{oops", "cpu")
    with pytest.raises(PayloadError, match="must be an object"):
        receive_bucket([1, 2], "cpu")
    with pytest.raises(PayloadError, match="description"):
        receive_bucket({"transport": {"kind": "inline", "data": ""}}, "cpu")
    with pytest.raises(PayloadError, match="nbytes"):
        receive_bucket({"description": {"nbytes": -1}, "transport": {"kind": "inline", "data": ""}}, "cpu")


def test_load_bucket_writes_model_parameters_and_checks_dtypes():
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    new = Qwen3ForCausalLM.random(preset("tiny"), seed=1)
    for bucket in flatten_buckets(new.hf_state_dict(), bucket_bytes=32 * 1024):
        assert load_bucket(receive_bucket(bucket_payload(bucket)[0], "cpu"), model.hf_state_dict()) == bucket.names
    for (name, a), b in zip(model.hf_state_dict().items(), new.hf_state_dict().values()):
        assert torch.equal(a, b), name
    (bad,) = flatten_buckets({"model.norm.weight": torch.ones(64, dtype=torch.float16)})
    with pytest.raises(PayloadError, match="float16"):
        load_bucket(bad, model.hf_state_dict())


@pytest.mark.parametrize("transport", [None, "inline", "shm"])
def test_sync_weights_loads_every_tensor_exactly(transport):
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    new = Qwen3ForCausalLM.random(preset("tiny"), seed=1)
    config = SyncConfig(transport=transport, bucket_bytes=32 * 1024)
    stats = sync_weights(new.hf_state_dict(), model.hf_state_dict(), config=config)
    assert stats.buckets == len(flatten_buckets(new.hf_state_dict(), bucket_bytes=32 * 1024)) > 1
    assert weights_checksum(model.hf_state_dict()) == weights_checksum(new.hf_state_dict())
    for (name, a), b in zip(model.hf_state_dict().items(), new.hf_state_dict().values()):
        assert torch.equal(a, b), name


def test_sync_config_bucket_sizes_and_transports():
    assert SyncConfig().bucket_bytes == SyncConfig(transport="shm").bucket_bytes == SYNC_BUCKET_BYTES
    assert SyncConfig(transport="inline").bucket_bytes == INLINE_BUCKET_BYTES
    assert SyncConfig(transport="inline", bucket_bytes=4096).bucket_bytes == 4096
    with pytest.raises(ValueError, match="transport must be one of"):
        SyncConfig(transport="pickle")


def test_weights_checksum_sees_every_byte_and_the_order():
    named = _named()
    base = weights_checksum(named)
    assert weights_checksum({k: v.clone() for k, v in named.items()}) == base
    changed = dict(named, b=named["b"].clone())
    changed["b"].view(torch.int16)[3] ^= 1
    assert weights_checksum(changed) != base
    assert weights_checksum(dict(reversed(named.items()))) != base


def _share_from_child(queue, done):
    named = _named("cuda")
    (bucket,) = flatten_buckets(named)
    payload, handle = bucket_payload(bucket, "cuda_ipc")
    queue.put(json.dumps(payload))
    done.wait(60)  # the buffer must outlive the receiver's copy


@pytest.mark.gpu
def test_cuda_ipc_payload_from_another_process():
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_share_from_child, args=(queue, done))
    child.start()
    try:
        got = receive_bucket(queue.get(timeout=120), "cuda")
        got = {k: v.clone() for k, v in got.unflatten().items()}
        torch.cuda.synchronize()
    finally:
        done.set()
        child.join(60)
    for k, t in _named("cuda").items():
        assert torch.equal(got[k], t), k


# ---- shared memory: only rlperf's own per-transfer segments, read-only, never unlinked by the receiver


def _shm_payload(named=None):
    (bucket,) = flatten_buckets(named or _named())
    return bucket_payload(bucket, "shm")


def test_shm_segments_are_named_for_one_transfer_and_released():
    from rlperf.sync.transports import SHM_NAME

    (p1, h1), (p2, h2) = _shm_payload(), _shm_payload()
    try:
        n1, n2 = p1["transport"]["name"], p2["transport"]["name"]
        assert SHM_NAME.fullmatch(n1) and n1.startswith(f"rlperf_bucket_{os.getpid()}_") and n1 != n2
    finally:
        release(h1)
        release(h2)
    with pytest.raises(PayloadError, match="cannot be opened"):  # released: unlinked by its creator
        receive_bucket(p1, "cpu")


@pytest.mark.parametrize("name", ["psm_1234abcd", "rlperf-no-such-segment", "rlperf_bucket_1_xyz", "../rlperf_bucket_1_0123456789abcdef",
                                  "rlperf_bucket_1_0123456789abcdef/../../etc/passwd", "rlperf_bucket_1_0123456789ABCDEF", ""])
def test_shm_refuses_names_rlperf_did_not_create_for_a_transfer(name):
    payload, handle = _shm_payload()
    release(handle)
    payload["transport"]["name"] = name
    with pytest.raises(PayloadError, match="must name a segment rlperf created for this transfer"):
        receive_bucket(payload, "cpu")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="elsewhere segment sizes are rounded up to pages")
def test_shm_refuses_a_segment_of_another_size():
    payload, handle = _shm_payload()
    try:
        payload["description"]["nbytes"] -= 8  # a prefix of a bigger segment is not this bucket's segment
        with pytest.raises(PayloadError, match="not the segment of this bucket"):
            receive_bucket(payload, "cpu")
    finally:
        release(handle)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_the_checksum_is_required(transport):
    (bucket,) = flatten_buckets(_named())
    payload, handle = bucket_payload(bucket, transport)
    try:
        for missing in (None, "drop"):
            desc = dict(payload["description"])
            if missing is None:
                desc["checksum"] = None
            else:
                del desc["checksum"]
            with pytest.raises(PayloadError, match="no checksum"):
                receive_bucket({**payload, "description": desc}, "cpu")
        for bad in ("0x12", "1234", "g" * 16, 12345, " " + "0" * 15):
            with pytest.raises(PayloadError, match="16 hex digits"):
                receive_bucket({**payload, "description": {**payload["description"], "checksum": bad}}, "cpu")
    finally:
        release(handle)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_a_checksum_mismatch_reply_holds_no_hash_of_the_received_bytes(transport):
    from rlperf.sync import bucket_checksum

    (bucket,) = flatten_buckets(_named())
    payload, handle = bucket_payload(bucket, transport)
    try:
        actual = f"{bucket_checksum(bucket.buffer):016x}"
        for guess in ("0" * 16, "f" * 16):
            desc = {**payload["description"], "checksum": guess}
            with pytest.raises(PayloadError) as info:
                receive_bucket({**payload, "description": desc}, "cpu")
            msg = str(info.value)
            assert msg == "bucket rejected: checksum mismatch", msg
            assert actual not in msg.lower() and not re.search(r"[0-9a-f]{8}", msg)
    finally:
        release(handle)


def test_receiving_leaves_the_sender_segment_to_the_sender():
    payload, handle = _shm_payload()
    try:
        for _ in range(2):  # received twice: still there, and still this process's to unlink
            receive_bucket(payload, "cpu")
        assert os.path.exists(f"/dev/shm/{payload['transport']['name']}") or sys.platform != "linux"
    finally:
        release(handle)


def test_a_second_release_is_a_no_op():
    payload, handle = _shm_payload()
    release(handle)
    release(handle)  # the segment is gone: nothing to close or unlink twice
    release(None)


class _Stopped(BaseException):
    """Stands for ``cli.Terminated``: SIGTERM raised in the main thread, not an Exception."""


class _BucketStoppedWhileCopied:
    """A bucket whose bytes cannot be read: the stop arrives while its segment is being filled."""
    nbytes = 64

    def to_dict(self):
        return {}

    @property
    def buffer(self):
        raise _Stopped()


def test_a_stop_while_a_segment_is_filled_unlinks_it(monkeypatch):
    from rlperf.sync import transports

    made = []
    real = transports._new_segment
    monkeypatch.setattr(transports, "_new_segment", lambda n: made.append(real(n)) or made[-1])
    with pytest.raises(_Stopped):
        bucket_payload(_BucketStoppedWhileCopied(), "shm")
    (shm,) = made
    assert shm.name not in transports._created
    assert not os.path.exists(f"/dev/shm/{shm.name}") or sys.platform != "linux"


# Where a stop (SIGTERM's Terminated, KeyboardInterrupt) lands around a segment, as the code a subprocess runs
# before it exits 143: the bucket's segment is then left in one of the states _release_at_exit must finish.
_STOP_LANDS = {
    # between a transfer's start and its release (or a transfer in a thread): the segment is held
    "held": "payload, handle = bucket_payload(b, 'shm')\n",
    # inside release(), between SharedMemory.unlink's two steps: the name is gone, the tracker not told
    "inside unlink": ("payload, handle = bucket_payload(b, 'shm')\n"
                      "stop_at(resource_tracker, 'unregister')\n"
                      "try:\n    release(handle)\nexcept KeyboardInterrupt:\n    pass\n"),
    # inside the constructor, after the segment exists and before the tracker registers it
    "inside create": ("stop_at(resource_tracker, 'register')\n"
                      "try:\n    bucket_payload(b, 'shm')\nexcept KeyboardInterrupt:\n    pass\n"),
    # inside the constructor, before the segment exists
    "before create": ("stop_at(transports.shared_memory, 'SharedMemory')\n"
                      "try:\n    bucket_payload(b, 'shm')\nexcept KeyboardInterrupt:\n    pass\n"),
}


@pytest.mark.skipif(sys.platform != "linux", reason="reads /dev/shm")
@pytest.mark.parametrize("where", list(_STOP_LANDS))
def test_segments_left_at_exit_are_unlinked_without_a_resource_tracker_warning(where):
    # a run stopped by SIGTERM while it syncs weights: wherever the stop landed, the process must leave
    # nothing in /dev/shm and multiprocessing's resource tracker must print no leak warning (nor fail to
    # unlink a segment already gone) after the run's last line
    import subprocess

    script = ("import torch\n"
              "from multiprocessing import resource_tracker\n"
              "from rlperf.sync import bucket_payload, flatten_buckets, release, transports\n"
              "def stop_at(owner, attr):  # the next call of owner.attr raises KeyboardInterrupt, once\n"
              "    real = getattr(owner, attr)\n"
              "    def stopped(*a, **k):\n"
              "        setattr(owner, attr, real)\n"
              "        raise KeyboardInterrupt\n"
              "    setattr(owner, attr, stopped)\n"
              "(b,) = flatten_buckets({'w': torch.arange(10.0)})\n"
              + _STOP_LANDS[where] +
              "print(*transports._created, flush=True)\n"
              "raise SystemExit(143)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 143, out.stderr[-2000:]
    names = out.stdout.split()
    assert len(names) == 1 and names[0].startswith("rlperf_bucket_"), (out.stdout, out.stderr[-2000:])
    assert not os.path.exists(f"/dev/shm/{names[0]}")
    assert "resource_tracker" not in out.stderr and "leaked" not in out.stderr, out.stderr[-2000:]
