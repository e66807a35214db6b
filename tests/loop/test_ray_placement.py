"""``--placement ray`` (issue #14): actor ranks and engines as Ray actors on the bundles of one placement group.

One Ray cluster of two nodes on this host (``ray.cluster_utils.Cluster``: a head and a second raylet,
2 declared GPUs and 4 CPUs each) serves the whole module; this test process is its driver. The work
runs on the CPU; the declared GPUs are what Ray schedules by and hands out (``CUDA_VISIBLE_DEVICES``).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rlperf.cli import main  # noqa: E402
from rlperf.loop import UsageError  # noqa: E402
from rlperf.loop import ray_placement as R  # noqa: E402
from rlperf.loop.placement import RANK_ENV, ActorLayout, actor_process_group  # noqa: E402
from rlperf.rollout.args import ServerArgs  # noqa: E402
from rlperf.rollout.router import free_port, http_json  # noqa: E402

GPUS_PER_NODE, CPUS_PER_NODE = 2, 4
VOLATILE = ("perf/", "memory/")


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this host; yields the cluster (``.address``: the head's HOST:PORT). While it runs,
    ``TRITON_INTERPRET`` is unset: the actors, engines and local runs compute on the torch reference
    backend (the CPU default) and start faster without the interpreter."""
    from ray.cluster_utils import Cluster

    saved = os.environ.pop("TRITON_INTERPRET", None)
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE))
    try:
        c.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE)
        ray.init(address=c.address, logging_level="WARNING")
        c.wait_for_nodes()
        yield c
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
        ray.shutdown()
        c.shutdown()


def _table() -> dict:
    """Every placement group of the cluster, by id."""
    from ray.util.placement_group import placement_group_table

    return placement_group_table()


def _given_back(timeout: float = 30.0) -> bool:
    """Whether every GPU is free again (Ray removes a placement group asynchronously)."""
    deadline = time.time() + timeout
    while ray.available_resources().get("GPU", 0) != 2 * GPUS_PER_NODE and time.time() < deadline:
        time.sleep(0.1)
    return ray.available_resources().get("GPU", 0) == 2 * GPUS_PER_NODE


def probe_rank(ns) -> int:
    """A rank entry: join the ranks' group as the loop does (:func:`actor_process_group`), all-reduce the
    ranks, and record what this process sees (its environment, Ray's node, GPU ids and placement group)."""
    import torch
    import torch.distributed as dist
    from ray.util.placement_group import placement_group_table

    with actor_process_group(ns) as place:
        total = torch.tensor([float(place.rank)])
        dist.all_reduce(total)
        pg = ray.util.get_current_placement_group()
        record = {"env": {k: os.environ.get(k) for k in (*RANK_ENV, "CUDA_VISIBLE_DEVICES")},
                  "node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": ray.get_gpu_ids(),
                  "sum": total.item(), "cwd": os.getcwd(),
                  "bundles_to_node_id": {str(b): n for b, n in placement_group_table(pg)["bundles_to_node_id"].items()}}
        Path(ns.output_dir, f"rank-{place.rank}.json").write_text(json.dumps(record))
    return 0


def fail_on_rank_1(ns) -> int:
    """Rank 1 raises while rank 0 waits for it in a collective: the placement must stop rank 0."""
    import torch.distributed as dist

    with actor_process_group(ns) as place:
        if place.rank == 1:
            raise RuntimeError("rank 1 broke on purpose")
        dist.barrier()
    return 0


def _ns(tmp_path, **kw):
    import argparse

    return argparse.Namespace(device="cpu", output_dir=str(tmp_path), **kw)


def test_ranks_land_on_their_bundles_and_meet_across_nodes(cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the ranks run in the driver's directory when their node has it
    layout = ActorLayout(num_nodes=2, gpus_per_node=2)
    placement = R.RayPlacement(device="cpu")
    t = time.perf_counter()
    assert placement.launch_actors(probe_rank, _ns(tmp_path), layout) == 0
    took = time.perf_counter() - t
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    slots = {s.index: s for s in placement.slots}
    assert sorted(slots) == [0, 1, 2, 3] and all(s.role == "actor" for s in slots.values())
    driver_node = ray.get_runtime_context().get_node_id()
    for r, rec in enumerate(ranks):
        s = slots[r]
        assert rec["env"] == {"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                              "MASTER_ADDR": slots[0].node_ip, "MASTER_PORT": ranks[0]["env"]["MASTER_PORT"],
                              "CUDA_VISIBLE_DEVICES": s.cuda_visible_devices}
        assert rec["node_id"] == s.node_id == rec["bundles_to_node_id"][str(s.bundle)]  # the group's own record
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] == str(rec["gpu_ids"][0])  # Ray gave the rank its bundle's GPU
        assert rec["sum"] == 0 + 1 + 2 + 3  # torch.distributed rendezvous at rank 0's node IP, across the nodes
        assert rec["cwd"] == str(tmp_path)
    assert len({s.bundle for s in slots.values()}) == 4
    # slime's order: the driver's node first, ranks of one node consecutive, one GPU each
    assert slots[0].node_id == slots[1].node_id == driver_node != slots[2].node_id == slots[3].node_id
    for node in (driver_node, slots[2].node_id):
        assert sorted(s.cuda_visible_devices for s in slots.values() if s.node_id == node) == ["0", "1"]
    assert _given_back()  # the group was removed
    print(f"4 ranks on 2 nodes: {took:.1f} s")


def test_a_failing_rank_stops_the_others(cluster, tmp_path, capsys):
    t = time.perf_counter()
    code = R.RayPlacement(device="cpu").launch_actors(fail_on_rank_1, _ns(tmp_path), ActorLayout(gpus_per_node=2))
    assert code == 1 and time.perf_counter() - t < 60
    err = capsys.readouterr().err
    assert "actor rank 1 of 2 failed" in err and "rank 1 broke on purpose" in err, err
    assert _given_back()


def test_engines_land_on_their_own_bundles(cluster, tmp_path):
    placement = R.RayPlacement(engines=2, device="cpu")
    layout = ActorLayout(gpus_per_node=2)
    placement.check(layout)
    order = placement.place_group(layout)
    try:
        args = ServerArgs(model_path="tiny", device="cpu", kernel_backend="reference", num_threads=1)
        router = placement.launch_engines(args, order[2:], str(tmp_path / "engines"))
        status, body = http_json(router + "/workers", timeout=5)
        urls = sorted(w["url"] for w in body["workers"])
        engines = sorted(placement.slots, key=lambda s: s.index)
        assert status == 200 and len(urls) == 2 and [s.role for s in engines] == ["engine", "engine"]
        assert sorted(s.bundle for s in engines) == sorted(order[2:])  # not the ranks' bundles
        nodes = _table()[placement._pg.id.hex()]["bundles_to_node_id"]
        for s, actor in zip(engines, placement._engines):
            assert nodes[s.bundle] == s.node_id
            pid = ray.get(actor.server_pid.remote())
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            assert env["CUDA_VISIBLE_DEVICES"] == s.cuda_visible_devices != ""  # the server has its bundle's GPU
        assert sorted((tmp_path / "engines").iterdir()) == sorted(
            tmp_path / "engines" / n for n in ("router.log", "server-0.log", "server-1.log"))
        pids = [ray.get(a.server_pid.remote()) for a in placement._engines]
    finally:
        placement.close()
    assert not any(_alive(p) for p in pids), "an engine outlived the placement"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_layout_larger_than_the_cluster_exits_2_before_anything_starts(cluster, tmp_path):
    before = set(_table())
    with pytest.raises(UsageError) as info:
        R.RayPlacement(engines=2, device="cpu").launch_actors(probe_rank, _ns(tmp_path), ActorLayout(2, 2))
    assert str(info.value).startswith(
        "--placement ray: --actor-num-nodes 2 x --actor-num-gpus-per-node 2 = 4 actor rank(s) + --rollout-num-gpus "
        "2 engine(s) need 6 GPUs, one each, but the Ray cluster (2 node(s), 4 GPU(s), 8 CPU(s)) has 4")
    assert set(_table()) == before  # no placement group was made
    assert not list(tmp_path.iterdir())


def test_a_group_the_busy_cluster_cannot_place_exits_2_instead_of_waiting(cluster, tmp_path):
    from ray.util.placement_group import placement_group, remove_placement_group

    other = placement_group([{"GPU": 1}] * 3)  # another job holds 3 of the 4 GPUs
    ray.get(other.ready(), timeout=30)
    try:
        with pytest.raises(UsageError, match=r"did not place 2 bundles of \{'GPU': 1, 'CPU': 1\} within 1 s: other "
                                             r"work holds its resources \(available now: 1 GPU\(s\)"):
            R.RayPlacement(device="cpu", placement_timeout=1).launch_actors(probe_rank, _ns(tmp_path),
                                                                            ActorLayout(gpus_per_node=2))
    finally:
        remove_placement_group(other)
    assert _given_back()


def test_two_ranks_through_ray_train_exactly_as_two_local_ranks(cluster, tmp_path):
    flags = ["train", "--device", "cpu", "--actor-num-gpus-per-node", "2", "--num-rollout", "2", "--no-progress",
             "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16"]
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlperf", *flags, "--output-dir", str(tmp_path / "ray"),
                           "--placement", "ray", "--ray-address", cluster.address],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_COLOR_PREFIX": "0"})
    took_ray = time.perf_counter() - t
    assert proc.returncode == 0, proc.stderr[-4000:]
    t = time.perf_counter()
    assert main([*flags, "--output-dir", str(tmp_path / "local")]) == 0
    took_local = time.perf_counter() - t

    def metrics(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(VOLATILE)} for x in lines]

    assert metrics("ray") == metrics("local") and len(metrics("ray")) == 2  # checksums and log-probs included
    assert "actor rank 0" in proc.stderr and "actor rank 1" in proc.stderr  # the placement table
    print(f"2 ranks, 2 rollouts, gates first: ray {took_ray:.1f} s, local {took_local:.1f} s")


def test_two_ranks_and_two_engines_through_ray_train_exactly_as_two_local_ranks(cluster, tmp_path):
    """DP=2 + 2 engines through Ray (4 bundles: 2 ranks, 2 engines): rank 0 drives the placement's engines
    through their router; the metrics are the 2 local colocated ranks' bit for bit."""
    flags = ["--device", "cpu", "--num-rollout", "2", "--true-on-policy-mode", "--no-progress", "--skip-gates",
             "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
             "--global-batch-size", "16"]
    t = time.perf_counter()
    assert main(["train", "--placement", "ray", "--rollout-num-gpus", "2", "--output-dir", str(tmp_path / "ray"),
                 *flags]) == 0
    took = time.perf_counter() - t
    assert main(["train", *flags, "--output-dir", str(tmp_path / "local")]) == 0

    def metrics(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(VOLATILE)} for x in lines]

    assert metrics("ray") == metrics("local") and len(metrics("ray")) == 2  # the engines checked every checksum
    assert [m["train/train_rollout_logprob_abs_diff"] for m in metrics("ray")] == [0.0, 0.0]
    assert sorted(p.name for p in (tmp_path / "ray" / "engines").iterdir()) == ["router.log", "server-0.log",
                                                                                 "server-1.log"]
    assert _given_back()
    print(f"2 ranks + 2 engines through ray, 2 rollouts: {took:.1f} s")


def test_gate_runs_on_one_rank_actor(cluster, tmp_path):
    junit = tmp_path / "gates.xml"
    t = time.perf_counter()
    assert main(["gate", "--placement", "ray", "--device", "cpu", "--output-dir", str(tmp_path / "out"),
                 "--junit-xml", str(junit)]) == 0  # one rank: still an actor on its bundle
    assert junit.read_text().count("<testcase") == 4
    print(f"rlperf gate, 1 rank actor: {time.perf_counter() - t:.1f} s")


def test_a_dead_ray_address_exits_2_fast(tmp_path):
    port = free_port()
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlperf", "train", "--placement", "ray", "--device", "cpu",
                           "--ray-address", f"127.0.0.1:{port}", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert time.perf_counter() - t < 60
    assert f"--ray-address 127.0.0.1:{port}: no Ray cluster answers there" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_ray_address_resolution(monkeypatch, capsys):
    live = free_port()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", live))
        s.listen()
        monkeypatch.setattr(R, "_recorded_address", lambda: None)
        assert R.resolve_ray_address(None, environ={}) == "local"  # nothing running here: a new instance
        assert R.resolve_ray_address(f"127.0.0.1:{live}", environ={}) == f"127.0.0.1:{live}"
        assert R.resolve_ray_address(None, environ={"RAY_ADDRESS": f"127.0.0.1:{live}"}) == f"127.0.0.1:{live}"
        assert R.resolve_ray_address("local", environ={"RAY_ADDRESS": "10.0.0.1:1"}) == "local"
        with pytest.raises(UsageError, match="--ray-address auto: no Ray cluster was started on this host"):
            R.resolve_ray_address("auto", environ={})
        monkeypatch.setattr(R, "_recorded_address", lambda: f"127.0.0.1:{live}")
        assert R.resolve_ray_address(None, environ={}) == "auto"  # the cluster ray start started: Ray joins it
    dead = free_port()
    monkeypatch.setattr(R, "_recorded_address", lambda: f"127.0.0.1:{dead}")
    assert R.resolve_ray_address(None, environ={}) == "local"  # a stale record: a new instance, said so
    assert "does not answer" in capsys.readouterr().err
    with pytest.raises(UsageError, match=rf"RAY_ADDRESS 127.0.0.1:{dead}: no Ray cluster answers there"):
        R.resolve_ray_address(None, environ={"RAY_ADDRESS": f"127.0.0.1:{dead}"})
    for bad, message in (("ray://h:10001", "Ray Client addresses are not supported"), ("nohost", "not HOST:PORT")):
        with pytest.raises(UsageError, match=message):
            R.resolve_ray_address(bad, environ={})


def test_without_ray_the_flag_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(UsageError, match=r"--placement ray needs Ray, which is not installed .*'ray\[default\]'"):
        R.import_ray()


def test_bundle_order_puts_the_driver_node_first_then_nodes_by_ip():
    nodes = {0: "b", 1: "a", 2: "c", 3: "a", 4: "b"}
    ips = {"a": "10.0.0.2", "b": "10.0.0.10", "c": "10.0.0.1"}
    assert R.order_bundles(nodes, ips, first_node="b") == [0, 4, 2, 1, 3]
    assert R.order_bundles(nodes, ips, first_node=None) == [2, 1, 3, 0, 4]  # 10.0.0.2 < 10.0.0.10 as numbers


RAY_ENGINE_SIGNALLER = '''
import json, os, signal, time
from rlperf.data.rewards import BUILTIN_REWARDS

def reward(args, sample):
    """The boxed-math reward; at the 4th sample of rollout 1, engine 1's server (an EngineActor's child)
    gets RLPERF_TEST_SIGNAL, once; its pid, every engine's and the time go to RLPERF_TEST_DIR/signalled."""
    d = os.environ["RLPERF_TEST_DIR"]
    with open(os.path.join(d, "rewards"), "a") as f:
        f.write("x")
    if os.path.getsize(os.path.join(d, "rewards")) == 16 + 4:
        import ray
        from rlperf.loop.ray_placement import ENGINE_ACTOR_PREFIX

        pids = {n.rsplit("-", 1)[1]: ray.get(ray.get_actor(n).server_pid.remote())
                for n in ray.util.list_named_actors() if n.startswith(ENGINE_ACTOR_PREFIX)}
        os.kill(pids["1"], getattr(signal, os.environ["RLPERF_TEST_SIGNAL"]))
        with open(os.path.join(d, "signalled"), "w") as f:
            json.dump({"pids": pids, "at": time.time()}, f)
    return BUILTIN_REWARDS["boxed_math"](args, sample)
'''


@pytest.mark.parametrize("sig,tolerant", [("SIGKILL", True), ("SIGSTOP", False)])
def test_fault_tolerance_watches_the_engines_ray_placed(cluster, tmp_path, capfd, monkeypatch, sig, tolerant):
    """Issue #39 item 9: engines under --placement ray are watched as the run's own. Engine 1's server
    killed (-9) in rollout 1 with --use-fault-tolerance: a new engine actor takes its bundle and port, is
    given the weights (checksum checked) and put back, and the run equals the run without the fault bit
    for bit. Stopped (SIGSTOP) without it: one line naming the engine and the resume command, exit 1,
    within the health check's bound. No receive file of a dead engine is left."""
    from rlperf.sync import receiver as Rcv

    (tmp_path / "ray_engine_signaller.py").write_text(RAY_ENGINE_SIGNALLER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RLPERF_TEST_DIR", str(tmp_path))
    monkeypatch.setenv("RLPERF_TEST_SIGNAL", sig)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    flags = ["--device", "cpu", "--num-rollout", "3", "--true-on-policy-mode", "--no-progress", "--skip-gates",
             "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
             "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "4"]
    save = tmp_path / "save"
    code = main(["train", "--placement", "ray", "--rollout-num-gpus", "2", "--custom-rm-path",
                 "ray_engine_signaller.reward", *(["--use-fault-tolerance"] if tolerant else []), "--save", str(save),
                 "--save-interval", "1",
                 "--output-dir", str(tmp_path / "ray"), *flags])
    ended = time.time()
    err = capfd.readouterr().err
    signalled = json.loads((tmp_path / "signalled").read_text())
    assert "Traceback" not in err, err
    pids = {int(p) for p in signalled["pids"].values()}
    assert not any(_alive(p) for p in pids)
    assert [n for d in (Rcv.SHM_DIR, "/tmp") if os.path.isdir(d) for n in os.listdir(d)
            if Rcv.segment_owner(n) in pids] == []
    assert _given_back()
    if not tolerant:
        assert code == 1, err
        lines = [x for x in err.splitlines() if "the run stops" in x]
        assert len(lines) == 1, err
        assert "rlperf train: rollout engine 1 (http://" in lines[0] and "did not answer /health within 4 s" in lines[0]
        assert f"--load {save}" in lines[0], lines[0]
        # docs/scale-out.md: interval + timeout + 5 s under Ray (its 1.5 s log drain, the actors' stop) on an
        # idle machine; the drain and the stop take up to 8 s on a 2-core CI machine running another test file
        # beside this one (10.1 s measured there). Finding the stop is bounded tightly in test_health_monitor.py.
        assert ended - signalled["at"] <= 1 + 4 + 8, ended - signalled["at"]
        return
    assert code == 0, err
    # the same reward, on the in-process engine (the rewards counted past rollout 1: nothing is signalled)
    assert main(["train", "--output-dir", str(tmp_path / "local"), "--custom-rm-path", "ray_engine_signaller.reward",
                 *flags]) == 0

    def metrics(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]

    ray_run, local = metrics("ray"), metrics("local")
    assert [m.get("rollout/engines_restarted") for m in ray_run] == [None, "1", None]
    stable = ("perf/", "memory/", "rollout/engine")
    assert [{k: v for k, v in m.items() if not k.startswith(stable)} for m in ray_run] == \
        [{k: v for k, v in m.items() if not k.startswith(stable)} for m in local]
    assert "was killed by SIGKILL" in err and "taken out of the router" in err and "back in the router" in err, err
    assert sorted(p.name for p in (tmp_path / "ray" / "engines").iterdir()) == [
        "router.log", "server-0.log", "server-1.log", "server-1.restart-1.log"]
