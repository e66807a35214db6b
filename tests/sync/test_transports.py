"""rlperf.sync.transports: JSON descriptions + inline / shared-memory / CUDA IPC buffers, exact round trips;
sync_weights, the whole path in one process."""
import json
import multiprocessing as mp

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
