"""``rlperf train --rollout-num-gpus N`` (issue #14): the loop starts N ``rlperf serve`` engines behind the
real sglang-router and syncs weights to them by broadcast (gloo on CPU); bad layouts exit 2 before
anything starts; an engine that fails to start is quoted; no engine outlives the run or its trainer."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from rlperf.cli import main
from rlperf.loop import UsageError, parse_train_args, train
from rlperf.loop import engines as E
from rlperf.loop.device import resolve_engine_layout
from rlperf.rollout.args import ServerArgs

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")

VOLATILE = ("perf/", "memory/")
# the runs compare bits, not learning: 4 prompts x 4 samples a rollout instead of the embedded 8 x 16
SMALL = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16"]


@pytest.fixture
def no_interpreter(monkeypatch):
    """Engine subprocesses on the reference backend need no Triton interpreter (and start faster without it)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_two_cpu_engines_train_like_the_in_process_engine(tmp_path, monkeypatch, no_interpreter):
    fleets = []
    start = E.EngineFleet.start.__func__

    def recording_start(cls, *args, **kwargs):
        fleets.append(start(cls, *args, **kwargs))
        return fleets[-1]

    monkeypatch.setattr(E.EngineFleet, "start", classmethod(recording_start))
    flags = ["--no-progress", "--num-rollout", "2", "--true-on-policy-mode", *SMALL]
    disaggregated = train(["--output-dir", str(tmp_path / "d"), "--rollout-num-gpus", "2", "--device", "cpu", *flags])
    local = train(["--output-dir", str(tmp_path / "l"), *flags])
    stable = lambda h: [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in h]  # noqa: E731
    assert stable(disaggregated) == stable(local)  # sync/weights_checksum included: the engines checked it each step
    assert [m["train/train_rollout_logprob_abs_diff"] for m in disaggregated] == [0.0, 0.0]
    (fleet,) = fleets
    assert len(fleet.worker_urls) == 2 and fleet.gpus is None
    procs = fleet.cluster.servers + [fleet.cluster.router]
    assert all(p.poll() is not None for p in procs), "the run left engine processes behind"
    logs = sorted(p.name for p in (tmp_path / "d" / E.LOG_DIR).iterdir())
    assert logs == ["router.log", "server-0.log", "server-1.log"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_gates_check_every_rank_and_every_engine(ranks, tmp_path, capfd, no_interpreter):
    """``rlperf gate --rollout-num-gpus 2 --device cpu`` (and on 2 ranks): oom_headroom holds each engine's
    own peak, as the engine reports it after the first rollout and weight sync, to the trainer's rule;
    the report lists both engines and the console line names the worst of ranks and engines; the JUnit
    still has one testcase per gate."""
    j, x = tmp_path / "gate.json", tmp_path / "gate.xml"
    flags = ["--device", "cpu", "--rollout-num-gpus", "2", "--true-on-policy-mode", "--no-progress",
             "--output-dir", str(tmp_path), "--report-json", str(j), "--junit-xml", str(x), *SMALL]
    if ranks == 2:
        flags += ["--actor-num-gpus-per-node", "2"]
    assert main(["gate", *flags]) == 0
    out = capfd.readouterr().out  # the ranks' own processes print through the file descriptors
    gate = {g["name"]: g for g in json.loads(j.read_text())["gates"]}
    assert list(gate) == ["kl_zero", "logprob_abs_diff", "oom_headroom", "sanity"]
    oom = gate["oom_headroom"]
    engines = oom["measured"]["engines"]
    assert len({e["url"] for e in engines}) == 2 and all(e["url"].startswith("http://127.0.0.1:") for e in engines)
    for e in engines:  # each engine's own numbers: its KV pool inside its resident set, which peaked above it
        assert (e["kind"], e["device"]) == ("cpu_rss", "cpu")
        assert 0 < e["kv_pool_bytes"] < e["current_bytes"] <= e["peak_bytes"] <= e["limit_bytes"]
        assert e["limit_bytes"] == int(0.9 * e["capacity_bytes"])
    worst = oom["measured"]["worst"]
    assert worst["fraction"] == max([e["fraction"] for e in engines] + [p / oom["measured"]["capacity_bytes"]
                                                                       for p in oom["measured"]["peaks_bytes"].values()])
    trainer = "the trainer (2 ranks)" if ranks == 2 else "the trainer"
    assert oom["message"].endswith(f", the worst of {trainer} and 2 engines") and oom["message"] in out
    assert out.count("all gates passed") == 1  # rank 0 alone prints
    assert [c.get("name") for c in ET.parse(x).getroot().iter("testcase")] == list(gate)
    assert sorted(p.name for p in (tmp_path / E.LOG_DIR).iterdir()) == ["router.log", "server-0.log", "server-1.log"]


def _procs_holding(directory: Path) -> list[int]:
    """Pids of the live processes with a file under ``directory`` open (an engine or router writes its
    log there for as long as it runs; the router renames itself, so its command line would not tell)."""
    prefix, found = str(directory.resolve()) + os.sep, []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd).startswith(prefix) for fd in (d / "fd").iterdir()) and _alive(int(d.name)):
                found.append(int(d.name))
        except OSError:
            pass  # gone, or not ours
    return found


def test_two_ranks_and_two_engines_train_exactly_as_two_colocated_ranks(tmp_path, no_interpreter):
    """DP=2 + 2 engines (real rank processes, gloo, rlperf serve engines behind the real router): rank 0
    drives the engines, the other rank gets the rollout by broadcast and takes part in the gathers of
    each weight broadcast. Every metric but times and memory equals the 2-rank colocated run's (each rank
    its own in-process engine); against the 1-rank run the first rollout is bit-identical, and later the
    ranks' gradient sums round differently (module tests/loop/test_data_parallel.py)."""
    flags = ["--device", "cpu", "--num-rollout", "2", "--true-on-policy-mode", "--no-progress", *SMALL]
    two = ["--skip-gates", "--actor-num-gpus-per-node", "2"]
    assert main(["train", *flags, *two, "--rollout-num-gpus", "2", "--output-dir", str(tmp_path / "d")]) == 0
    assert main(["train", *flags, *two, "--output-dir", str(tmp_path / "c")]) == 0
    one = train([*flags, "--output-dir", str(tmp_path / "one")])
    lines = {run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
             for run in ("d", "c")}
    stable = lambda h: [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in h]  # noqa: E731
    assert stable(lines["d"]) == stable(lines["c"]) and len(lines["d"]) == 2  # checksums and log-probs included
    assert [m["train/train_rollout_logprob_abs_diff"] for m in lines["d"]] == [0.0, 0.0]
    for key in ("rollout/raw_reward", "rollout/response_length", "rollout/rollout_log_probs", "rollout/log_probs"):
        assert lines["d"][0][key] == one[0][key]  # rollout 1: the 1-rank run's samples, bit for bit
    assert sorted(p.name for p in (tmp_path / "d" / E.LOG_DIR).iterdir()) == ["router.log", "server-0.log",
                                                                              "server-1.log"]
    deadline = time.time() + 10  # the engines and the router stop with rank 0's run (else PDEATHSIG)
    while _procs_holding(tmp_path / "d") and time.time() < deadline:
        time.sleep(0.1)
    assert not _procs_holding(tmp_path / "d"), "the run left engine or router processes behind"


@pytest.mark.parametrize("flags, message", [
    (["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus-per-engine 2: only 1"),
    (["--rollout-num-gpus", "-1"], "--rollout-num-gpus must be >= 0"),
    (["--rollout-num-gpus", "2", "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "1"],
     "--rollout-num-gpus 2 starts rlperf's own engines"),
    (["--rollout-num-gpus", "2", "--engine-weights", "shared"], "--engine-weights applies to the in-process engine"),
])
@pytest.mark.parametrize("command", ["train", "gate"])
def test_bad_layouts_exit_2_before_anything_starts(command, flags, message, tmp_path, capsys):
    assert main([command, "--device", "cpu", "--output-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def _layout(visible: int, device: str = "cuda", n: int = 2, **kw):
    ns = argparse.Namespace(**{"rollout_num_gpus": n, "rollout_num_gpus_per_engine": 1, "colocate": False,
                               "sglang_router_ip": None, "device": device, "placement": "local",
                               "actor_num_gpus_per_node": 1, **kw})
    resolve_engine_layout(ns, torch.device(device), visible_gpus=visible)
    return ns


def test_engines_take_the_gpus_after_the_actors(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert (_layout(3).disaggregated, _layout(3).engine_gpus) == (True, ["1", "2"])
    assert _layout(5, actor_num_gpus_per_node=2).engine_gpus == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert _layout(4).engine_gpus == ["5", "6"]  # the physical ids of the visible GPUs
    assert _layout(1, n=2, colocate=True).disaggregated is False  # colocated: the in-process path
    assert _layout(0, device="cpu").engine_gpus is None


def test_a_ray_driver_without_gpus_leaves_the_gpu_count_to_the_cluster(monkeypatch, tmp_path):
    """--placement ray: the driver computes nothing, so --device cuda on a host without GPUs is the
    cluster's GPUs (RayPlacement.check counts them), bf16 by default, and the engines' GPUs are their
    bundles'; --placement local still refuses it."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    flags = ["--device", "cuda", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
             "--output-dir", str(tmp_path)]
    ns = parse_train_args([*flags, "--placement", "ray"])
    assert (ns.precision, ns.disaggregated, ns.engine_gpus) == ("bf16", True, None)
    with pytest.raises(UsageError, match="--device cuda: no CUDA device is available"):
        parse_train_args(flags)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of that run is checked against its own GPUs
    with pytest.raises(UsageError, match="--device cuda: no CUDA device is available"):
        parse_train_args([*flags, "--placement", "ray"])


def test_engines_that_do_not_fit_are_a_usage_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UsageError) as info:
        _layout(2)
    assert str(info.value) == ("--rollout-num-gpus 2: the actor takes 1 GPU(s) and the engines 2 more, 3 in all, "
                               "but 2 are visible (CUDA_VISIBLE_DEVICES=0,1)")
    with pytest.raises(UsageError, match="--device cuda:1: with --rollout-num-gpus the actor runs on the first 1"):
        _layout(4, device="cuda:1")


def test_an_engine_that_fails_to_start_is_quoted_and_nothing_is_left(tmp_path, no_interpreter):
    args = ServerArgs(model_path=str(tmp_path / "no-such-model"), kernel_backend="reference", device="cpu", num_threads=1)
    with pytest.raises(E.EngineFleetError) as info:
        E.EngineFleet.start(args, 2, log_dir=tmp_path / "logs", timeout=120)
    msg = str(info.value)
    assert msg.startswith("the 2 rollout engine(s) on CPU did not start: server http://127.0.0.1:") and "exited with" in msg
    assert "neither a preset" in msg, msg  # the engine's own words, quoted from its log
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["server-0.log", "server-1.log"]


def test_children_die_with_the_process_that_started_them(tmp_path):
    # a parent that starts a long-lived child through spawn(die_with_parent=True), then is killed with SIGKILL
    script = ("import sys, time; from rlperf.rollout.router import spawn\n"
              "p = spawn([sys.executable, '-c', 'import time; time.sleep(120)'], die_with_parent=True)\n"
              "print(p.pid, flush=True); time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    if _alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its killed parent")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---- GPU (marker gpu, 2+ GPUs): NCCL to an engine on the second GPU --------------------------------------


def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: trainer rank 0 on the first, an engine on the second")


@pytest.mark.gpu
def test_nccl_broadcast_to_an_engine_on_the_second_gpu(tmp_path):
    from rlperf import kernels as K
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
    from rlperf.rollout.router import http_json
    from rlperf.rollout.tokenizer import ByteTokenizer
    from rlperf.sync import weights_checksum
    from rlperf.sync.distributed import WeightBroadcaster

    _two_gpus()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    second = listed.split(",")[1].strip() if listed else "1"
    args = ServerArgs(model_path="qwen3-0.6b", dtype="bfloat16", device="cuda", max_total_tokens=4096,
                      cuda_graph_max_bs=0, skip_warmup=True, random_seed=5)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s) for s in (1, 2)]
    with E.EngineFleet.start(args, 1, gpus=[second], log_dir=tmp_path) as fleet:
        url = fleet.worker_urls[0]
        with WeightBroadcaster(fleet.worker_urls, device="cuda:0") as b:
            for seed in (1, 2):
                model = Qwen3ForCausalLM.random(preset("qwen3-0.6b"), seed=seed, dtype=torch.bfloat16, device="cuda:0")
                named = model.hf_state_dict()
                stats = b.update_weights(named, str(seed))
                expected = weights_checksum(named, b.bucket_bytes)  # the checksum's definition includes the bucket size
                assert stats.weights_checksum == expected
                reply = http_json(url + f"/weights_checksum?bucket_bytes={b.bucket_bytes}")[1]
                assert (reply["weights_checksum"], reply["weight_version"]) == (expected, str(seed))
            # the engine on the other GPU generates the bits an in-process engine on this GPU does
            body = {"input_ids": prompts, "return_logprob": True,
                    "sampling_params": [{"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": s} for s in (1, 2)]}
            status, remote = http_json(url + "/generate", body, timeout=600)
            assert status == 200, remote
            with K.use_mode("invariant"):
                local = Engine(model, ByteTokenizer(model.cfg.vocab_size), EngineConfig(max_total_tokens=4096)).generate(
                    prompts, params)
            assert [r["output_ids"] for r in remote] == [r.output_ids for r in local]
            assert [[t[0] for t in r["meta_info"]["output_token_logprobs"]] for r in remote] == \
                [r.output_logprobs for r in local]


@pytest.mark.gpu
def test_train_with_an_engine_on_the_second_gpu_is_true_on_policy(tmp_path):
    _two_gpus()
    history = train(["--output-dir", str(tmp_path), "--rollout-num-gpus", "1", "--device", "cuda", "--no-progress",
                     "--num-rollout", "2", "--true-on-policy-mode"])
    assert [m["train/train_rollout_logprob_abs_diff"] for m in history] == [0.0, 0.0]
    assert all(m["sync/weights_checksum"] for m in history)


@pytest.mark.gpu
def test_two_gpu_ranks_and_two_engines_on_four_gpus_are_true_on_policy(tmp_path):
    """DP=2 (FSDP2 over NCCL on GPUs 0 and 1) + 2 engines (GPUs 2 and 3), the 0.6b shape in bf16: rank 0
    broadcasts the gathered weights to both engines over NCCL, every engine's checksum checked, and every
    sample's training log-probs are its rollout log-probs bit for bit at every step; the gates pass."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs: 2 actor ranks, then 2 engines")
    flags = ["--device", "cuda", "--model", "qwen3-0.6b", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
             "--global-batch-size", "32", "--rollout-max-response-len", "16", "--lr", "1e-5", "--true-on-policy-mode",
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--no-progress"]
    code = main(["train", *flags, "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--num-rollout", "3",
                 "--output-dir", str(tmp_path), "--report-json", str(tmp_path / "gate.json")])
    assert code == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/train_rollout_logprob_abs_diff"] for m in lines] == [0.0, 0.0, 0.0]
    assert all(m["sync/weights_checksum"] for m in lines)  # checked on both engines at every sync
    assert all(m["memory/kind"] == "cuda" for m in lines)
    assert json.loads((tmp_path / "gate.json").read_text())["passed"] is True
    assert sorted(p.name for p in (tmp_path / E.LOG_DIR).iterdir()) == ["router.log", "server-0.log", "server-1.log"]
