"""Disaggregated weight sync over gloo (issue #14): trainer rank 0 (this process) broadcasts to two
``rlperf serve`` engines behind the real sglang-router, through SGLang's endpoints.

* After each update both engines hold exactly the trainer's weights (``GET /weights_checksum`` equals
  ``rlperf.sync.weights_checksum``) and generate with them: through the router, the tokens and
  log-probs of an in-process engine on the same weights.
* SGLang's own formats load too: one broadcast per tensor (``load_format`` null), and a bucket
  whose layout is rlperf's ``description`` (gaps; its checksum verified).
* A request whose tensors the engine lacks still takes its broadcast (the group stays in step) and
  loads nothing; hostile bodies get 400 naming the field before any collective.
"""
import concurrent.futures

import pytest
import torch

from rlperf import kernels as K
from rlperf.loop.clients import RouterClient
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.args import ServerArgs
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
from rlperf.rollout.router import http_json
from rlperf.rollout.tokenizer import ByteTokenizer
from rlperf.sync import FlattenedBucket, FlattenedTensorMetadata, weights_checksum
from rlperf.sync.distributed import UPDATE_ENDPOINT, WeightBroadcaster, sglang_bucket_layout

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def cluster(launch_router_cluster):
    # a random init other than any trainer's below: only a sync gives the engines those weights
    args = ServerArgs(model_path="tiny", kernel_backend="reference", num_threads=1, device="cpu", random_seed=5,
                      max_total_tokens=1024)
    with launch_router_cluster(args) as c:
        yield c


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return Qwen3ForCausalLM.random(preset("tiny"), seed=seed).hf_state_dict()


def _checksums(cluster) -> list[tuple[str, str]]:
    replies = [http_json(u + "/weights_checksum")[1] for u in cluster.worker_urls]
    return [(r["weights_checksum"], r["weight_version"]) for r in replies]


def _post_then_broadcast(b: WeightBroadcaster, body: dict, tensors) -> list:
    """Post ``body`` to every engine (as the broadcaster does), broadcast ``tensors`` from rank 0; the replies."""
    with concurrent.futures.ThreadPoolExecutor(len(b.urls)) as pool:
        futures = [pool.submit(http_json, u + UPDATE_ENDPOINT, body) for u in b.urls]
        for t in tensors:
            b.group.wait(b.group.broadcast(t), host=True)
        return [f.result() for f in futures]


def test_sglang_layout_is_sglangs_own_flattened_tensor_bucket():
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [("a", torch.randn(3)), ("b", torch.arange(5, dtype=torch.int8)), ("c", torch.randn(2, 3).bfloat16())]
    theirs = FlattenedTensorBucket(named_tensors=named)
    ours = sglang_bucket_layout([n for n, _ in named], [t.dtype for _, t in named], [list(t.shape) for _, t in named])
    fields = lambda ms: [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in ms]  # noqa: E731
    assert fields(ours) == fields(theirs.get_metadata())
    got = FlattenedBucket(theirs.get_flattened_tensor(), ours).unflatten()  # b ends at byte 17: c is unaligned
    assert all(torch.equal(got[n], t) for n, t in named)


def test_a_broadcast_gives_both_engines_the_trainers_weights_and_they_generate_with_them(cluster):
    port = int(cluster.router_url.rsplit(":", 1)[1])
    client = RouterClient("127.0.0.1", port, ByteTokenizer(512), distributed=True)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s) for s in range(4)]
    try:
        for seed, version in ((1, "1"), (2, "2")):
            named = _weights(seed)
            expected = weights_checksum(named)
            assert all(c != expected for c, _ in _checksums(cluster))
            stats = client.load_weights(iter(named.items()), version)  # the seam: (name, tensor) pairs, once
            assert (stats.weights_checksum, stats.buckets) == (expected, 1)
            assert client.weights_checksum() == expected  # the engines' checksum, as the loop records it
            assert _checksums(cluster) == [(expected, version)] * 2
            routed = client.generate(prompts, params)  # one request per prompt: the router uses both engines
            with K.use_backend("reference"):
                model = Qwen3ForCausalLM.random(preset("tiny"), seed=seed)
                local = Engine(model, ByteTokenizer(512), EngineConfig(max_total_tokens=1024)).generate(prompts, params)
            assert [(r.output_ids, r.output_logprobs) for r in routed] == [(r.output_ids, r.output_logprobs) for r in local]
        group = client.broadcaster.group_name
        assert all(http_json(u + "/get_server_info")[1]["weight_update_groups"] == [group] for u in cluster.worker_urls)
    finally:
        client.close()
    assert all(http_json(u + "/get_server_info")[1]["weight_update_groups"] == [] for u in cluster.worker_urls)


def test_sglang_formats_a_mismatch_and_hostile_bodies_leave_the_group_in_step(cluster):
    base = _weights(3)
    with WeightBroadcaster(cluster.worker_urls, device="cpu", group_name="g2") as b:
        assert b.update_weights(base, "base").weights_checksum == weights_checksum(base)
        other = _weights(4)
        names = ["model.norm.weight", "model.layers.1.mlp.down_proj.weight"]

        # SGLang's default: one broadcast per tensor, each in its dtype and shape
        body = {"names": names, "dtypes": ["float32", "torch.float32"], "shapes": [list(other[n].shape) for n in names],
                "group_name": "g2", "weight_version": "per-tensor"}
        assert [r[0] for r in _post_then_broadcast(b, body, [other[n] for n in names])] == [200, 200]
        expected = {**base, **{n: other[n] for n in names}}
        assert _checksums(cluster) == [(weights_checksum(expected), "per-tensor")] * 2

        # rlperf's description: the same two tensors 48 bytes apart, checksum verified
        a, c = base[names[0]], base[names[1]]
        meta = [FlattenedTensorMetadata(names[0], tuple(a.shape), a.dtype, 0, a.nbytes, a.nbytes),
                FlattenedTensorMetadata(names[1], tuple(c.shape), c.dtype, a.nbytes + 48, a.nbytes + 48 + c.nbytes, c.nbytes)]
        buffer = torch.zeros(a.nbytes + 48 + c.nbytes, dtype=torch.uint8)
        bucket = FlattenedBucket(buffer, meta)
        views = bucket.unflatten()  # aligned starts: views of the buffer's bytes
        views[names[0]].copy_(a)
        views[names[1]].copy_(c)
        body = {"names": names, "dtypes": ["float32"] * 2, "shapes": [list(a.shape), list(c.shape)], "group_name": "g2",
                "load_format": "flattened_bucket", "description": bucket.to_dict()}
        assert [r[0] for r in _post_then_broadcast(b, body, [buffer])] == [200, 200]
        assert [c for c, _ in _checksums(cluster)] == [weights_checksum(base)] * 2
        wrong = {**body, "description": {**body["description"], "checksum": "0" * 16}}
        replies = _post_then_broadcast(b, wrong, [buffer])
        assert [(s, r["error"]["message"]) for s, r in replies] == [(400, "bucket rejected: checksum mismatch")] * 2

        # a tensor the engines lack: the broadcast is taken (the group stays in step), nothing is loaded
        body = {"names": ["model.no_such.weight"], "dtypes": ["float32"], "shapes": [[4]], "group_name": "g2",
                "load_format": "flattened_bucket"}
        replies = _post_then_broadcast(b, body, [torch.zeros(16, dtype=torch.uint8)])
        for status, reply in replies:
            assert status == 400 and "'model.no_such.weight' is not a parameter" in reply["error"]["message"], reply
            assert "received and dropped" in reply["error"]["message"]

        # hostile bodies: 400 naming the field, no collective joined (the update below still lines up)
        url = cluster.worker_urls[0]
        ok_update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "g2"}
        ok_init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                   "group_name": "g3", "backend": "gloo"}
        hostile = [
            (UPDATE_ENDPOINT, {**ok_update, "names": "model.norm.weight"}, "'names'"),
            (UPDATE_ENDPOINT, {**ok_update, "names": ["a", "a"], "dtypes": ["float32"] * 2, "shapes": [[1]] * 2}, "'names'"),
            (UPDATE_ENDPOINT, {**ok_update, "dtypes": ["float32", "float32"]}, "'dtypes'"),
            (UPDATE_ENDPOINT, {**ok_update, "dtypes": ["int128"]}, "'dtypes'"),
            (UPDATE_ENDPOINT, {**ok_update, "dtypes": [{"__class__": "x"}]}, "'dtypes'"),
            (UPDATE_ENDPOINT, {**ok_update, "shapes": [[-1]]}, "'shapes'"),
            (UPDATE_ENDPOINT, {**ok_update, "shapes": [[1 << 39]]}, "'shapes'"),
            (UPDATE_ENDPOINT, {**ok_update, "shapes": [["64"]]}, "'shapes'"),
            (UPDATE_ENDPOINT, {**ok_update, "group_name": "nope"}, "'group_name'"),
            (UPDATE_ENDPOINT, {**ok_update, "group_name": "../x y"}, "'group_name'"),
            (UPDATE_ENDPOINT, {**ok_update, "load_format": "pickle"}, "'load_format'"),
            (UPDATE_ENDPOINT, {**ok_update, "flush_cache": "yes"}, "'flush_cache'"),
            (UPDATE_ENDPOINT, {**ok_update, "abort_all_requests": 1}, "'abort_all_requests'"),
            (UPDATE_ENDPOINT, {**ok_update, "weight_version": 5}, "'weight_version'"),
            (UPDATE_ENDPOINT, {**ok_update, "description": {"nbytes": 256}}, "'description'"),
            (UPDATE_ENDPOINT, {**ok_update, "load_format": "flattened_bucket", "description": {"nbytes": 1 << 40}},
             "'description.nbytes'"),
            ("/init_weights_update_group", {**ok_init, "master_address": "a b"}, "'master_address'"),
            ("/init_weights_update_group", {**ok_init, "master_port": 70000}, "'master_port'"),
            ("/init_weights_update_group", {**ok_init, "master_port": True}, "'master_port'"),
            ("/init_weights_update_group", {**ok_init, "world_size": 1}, "'world_size'"),
            ("/init_weights_update_group", {**ok_init, "rank_offset": 0}, "'rank_offset'"),
            ("/init_weights_update_group", {**ok_init, "rank_offset": 2}, "'rank_offset'"),
            ("/init_weights_update_group", {**ok_init, "backend": "mpi"}, "'backend'"),
            ("/init_weights_update_group", {**ok_init, "backend": "nccl"}, "'backend': nccl needs a CUDA engine"),
            ("/init_weights_update_group", {**ok_init, "group_name": "g2"}, "already in a group named 'g2'"),
            ("/destroy_weights_update_group", {"group_name": 7}, "'group_name'"),
            ("/weights_checksum?bucket_bytes=-1", None, "'bucket_bytes'"),
            ("/weights_checksum?bucket_bytes=1e9", None, "'bucket_bytes'"),
        ]
        for path, body, field in hostile:
            status, reply = http_json(url + path, body)
            assert status == 400 and field in reply["error"]["message"], (path, body, status, reply)
        status, reply = http_json(url + "/destroy_weights_update_group", {"group_name": "never-joined"})
        assert (status, reply["success"]) == (400, False), reply
        assert http_json(url + "/weights_checksum")[0] == 200

        # the group is still in step: a whole update lands on both engines
        assert b.update_weights(other, "after").weights_checksum == weights_checksum(other)
        assert _checksums(cluster) == [(weights_checksum(other), "after")] * 2


def test_an_engine_that_refuses_a_bucket_fails_the_update_at_once_and_the_next_one_forms_a_new_group(cluster):
    """The sender does not wait for a broadcast an engine will never take: the refusal (here the engine
    left the group behind the sender's back) fails the update within a moment, the sender leaves the
    group (every engine's pending receive ends with it), and the next update forms a new one."""
    import time

    from rlperf.sync.distributed import WeightSyncError

    named = _weights(6)
    with WeightBroadcaster(cluster.worker_urls, device="cpu", group_name="g5", bucket_bytes=64 << 10, timeout=60) as b:
        b.update_weights(named, "ok")
        assert http_json(cluster.worker_urls[1] + "/destroy_weights_update_group", {"group_name": "g5"})[0] == 200
        t = time.perf_counter()
        with pytest.raises(WeightSyncError) as info:
            b.update_weights(named, "refused")
        assert time.perf_counter() - t < 10  # not the 60 s timeout of a broadcast nobody takes
        assert str(info.value).startswith(f"bucket 1 (1 tensors, 131072 bytes): {cluster.worker_urls[1]}"
                                          f"/update_weights_from_distributed answered 400: 'group_name'"), info.value
        assert b.group is None
        assert all(http_json(u + "/get_server_info")[1]["weight_update_groups"] == [] for u in cluster.worker_urls)
        b.update_weights(named, "again")  # a new group, both engines in it
        assert _checksums(cluster) == [(weights_checksum(named), "again")] * 2
