"""``--rollout-backend sglang`` (issue #23) on the CPU, with real HTTP against a stand-in SGLang server
(``tests/loop/fake_sglang``: ``python -m sglang.launch_server`` resolves to it through ``PYTHONPATH``) and the
real sglang-router: the launch command and its flags, the generate request, the weight-push sequence and
bodies (broadcast bytes checked by sha256), the gate's measured distance, and exit 2 naming what is missing
when SGLang cannot start."""
import argparse
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from rlperf.cli import main
from rlperf.loop import UsageError
from rlperf.loop import sglang_engines as S
from rlperf.loop.clients import SGLangClient
from rlperf.loop.args import add_loop_arguments, check_sglang_backend_flags
from rlperf.loop.config import SGLangConfig
from rlperf.rollout.engine import SamplingParams
from rlperf.rollout.router import start_router
from rlperf.sync.distributed import WeightSyncError

pytest.importorskip("sglang_router")

FAKE = Path(__file__).parent / "fake_sglang"
FAKE_LOGPROB = -1.25  # tests/loop/fake_sglang/sglang/launch_server.py
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--rollout-max-response-len", "4", "--rm-type", "exact"]  # with --prompt-data: no format warm-up


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """``python -m sglang.launch_server`` runs the stand-in; returns a function reading its records."""
    rec = tmp_path / "sglang-record.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(rec))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def records(kind=None):
        lines = [json.loads(x) for x in rec.read_text().splitlines()] if rec.exists() else []
        return [r for r in lines if kind is None or r["kind"] == kind]
    return records


def test_launch_argv_names_every_flag():
    cfg = SGLangConfig(tp_size=2, attention_backend="triton", deterministic=True, load_format="dummy", numerics="sglang")
    argv = S.sglang_launch_argv("/m", 31001, cfg, dtype="bfloat16", mem_fraction_static=0.7, seed=5)
    pairs = dict(zip(argv[::1], argv[1:]))
    assert pairs["--model-path"] == "/m" and pairs["--port"] == "31001" and pairs["--tp-size"] == "2"
    assert pairs["--attention-backend"] == "triton" and pairs["--mem-fraction-static"] == "0.7"
    assert pairs["--load-format"] == "dummy" and pairs["--dtype"] == "bfloat16" and pairs["--random-seed"] == "5"
    assert "--enable-deterministic-inference" in argv and "--skip-tokenizer-init" in argv and "--device" not in argv
    fast = S.sglang_launch_argv("/m", 1, SGLangConfig(deterministic=False, numerics="sglang"), dtype="float32",
                                mem_fraction_static=0.8,
                                seed=0, device="cpu")
    assert "--enable-deterministic-inference" not in fast and fast[-2:] == ["--device", "cpu"]
    assert fast[fast.index("--attention-backend") + 1] == "flashinfer"


def _flags(*argv):
    p = argparse.ArgumentParser()
    add_loop_arguments(p)
    ns = p.parse_args(list(argv))
    return ns


@pytest.mark.parametrize("argv, message", [
    (["--rollout-backend", "sglang"], "needs --rollout-num-gpus N"),
    (["--rollout-backend", "sglang", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "multiple of"),
    (["--rollout-backend", "sglang", "--colocate"], "--sglang-mem-fraction-static"),
    (["--rollout-backend", "sglang", "--rollout-num-gpus", "1", "--use-fault-tolerance"], "--use-fault-tolerance"),
    (["--rollout-backend", "sglang", "--rollout-num-gpus", "1", "--sglang-router-ip", "1.2.3.4",
      "--sglang-router-port", "1"], "--sglang-router-ip"),
    (["--sglang-load-format", "dummy"], "needs --rollout-backend sglang"),
])
def test_layouts_sglang_cannot_run_are_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message.replace("-", r"\-")):
        check_sglang_backend_flags(_flags(*argv))
    check_sglang_backend_flags(_flags("--rollout-backend", "sglang", "--rollout-num-gpus", "4",
                                      "--rollout-num-gpus-per-engine", "2"))


def test_missing_packages_are_named():
    with pytest.raises(S.SGLangUnavailable, match="sglang-router not installed"):
        S.check_sglang_installed(lambda m: None if m == "sglang_router" else object())
    assert issubclass(S.SGLangUnavailable, UsageError)  # the commands exit 2


def _engines(tmp_path, n, extra_env=None, timeout=60.0):
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 101}))
    cfg = SGLangConfig()
    argvs = [S.sglang_launch_argv(tmp_path / "model", S.free_port(), cfg, dtype="float32", mem_fraction_static=0.5,
                                  seed=1, device="cpu") for _ in range(n)]
    return S.start_sglang_servers(argvs, [dict(extra_env or {}) for _ in range(n)], tmp_path, timeout)


def test_engines_sharing_a_gpu_start_one_after_another(tmp_path, monkeypatch):
    """An engine whose GPUs overlap an earlier engine's is spawned only once that one answers /health (SGLang
    sizes its pools from the memory its weights' load took); engines on GPUs of their own start together."""
    order = []
    monkeypatch.setattr(S, "spawn", lambda argv, env, **kw: order.append(("spawn", env.get("CUDA_VISIBLE_DEVICES")))
                        or object())
    monkeypatch.setattr(S, "wait_until", lambda ok, timeout, what, procs: order.append(("ready", what.split()[2])))
    argvs = [["--host", "127.0.0.1", "--port", str(9000 + i)] for i in range(5)]
    envs = [{"CUDA_VISIBLE_DEVICES": g} for g in ("0", "0", "1", "1,2", "3")]
    procs, urls = S.start_sglang_servers(argvs, envs, None, 1.0, env={})
    assert len(procs) == 5 and urls == [f"http://127.0.0.1:{9000 + i}" for i in range(5)]
    assert order == [("spawn", "0"), ("ready", "0"), ("spawn", "0"), ("spawn", "1"), ("ready", "2"), ("spawn", "1,2"),
                     ("spawn", "3"), ("ready", "1"), ("ready", "3"), ("ready", "4")]
    order.clear()
    S.start_sglang_servers(argvs[:2], [{}, {}], None, 1.0, env={})  # unset: every GPU, so shared
    assert order == [("spawn", None), ("ready", "0"), ("spawn", None), ("ready", "1")]
    assert S._share_gpus("0,1", " 1") and not S._share_gpus("0", "1") and S._share_gpus(None, "3")


def test_client_generates_and_pushes_weights_with_sglangs_endpoints(tmp_path, fake_sglang):
    procs, urls = _engines(tmp_path, 2, {"CUDA_VISIBLE_DEVICES": "5"})
    router = None
    client = None
    try:
        port = S.free_port()
        router = start_router(urls, "127.0.0.1", port, log_dir=str(tmp_path))
        launches = fake_sglang("launch")
        assert len(launches) == 2 and {r["cuda_visible_devices"] for r in launches} == {"5"}
        assert all(r["argv"][r["argv"].index("--model-path") + 1] == str(tmp_path / "model") for r in launches)

        client = SGLangClient("127.0.0.1", port, None, colocate=False)
        prompts = [[3, 4, 5], [9, 10]]
        params = [SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, seed=11),
                  SamplingParams(max_new_tokens=2, temperature=1.0, seed=12)]
        out = client.generate(prompts, params)
        assert [o.output_ids for o in out] == [[(12 + 7 * i) % 101 for i in range(4)], [19, 26]]
        assert all(lp == FAKE_LOGPROB for o in out for lp in o.output_logprobs)
        bodies = sorted((r["body"] for r in fake_sglang("generate")), key=lambda b: b["input_ids"])
        assert bodies[0]["input_ids"] == [3, 4, 5] and bodies[0]["return_logprob"] is True
        sp = bodies[0]["sampling_params"]
        assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["top_k"], sp["sampling_seed"]) == (4, 0.7, 0.9, 20, 11)

        g = torch.Generator().manual_seed(0)
        weights = {"model.embed_tokens.weight": torch.randn(13, 8, generator=g),  # 416 bytes: gap-free buckets
                   "model.norm.weight": torch.randn(12, generator=g),
                   "lm_head.weight": torch.randn(13, 8, generator=g).to(torch.bfloat16)}
        stats = client.load_weights(weights, "1")
        assert stats.weights_checksum and client.weights_checksum() == stats.weights_checksum
        inits = sorted((r["body"] for r in fake_sglang("init_weights_update_group")), key=lambda b: b["rank_offset"])
        assert [b["rank_offset"] for b in inits] == [1, 2] and {b["world_size"] for b in inits} == {3}
        assert {b["backend"] for b in inits} == {"gloo"} and {b["group_name"] for b in inits} == {"weight_update_group"}
        for port_ in {r["port"] for r in launches}:
            seq = [r["kind"] for r in fake_sglang() if r["port"] == port_ and r["kind"] not in ("launch", "generate")]
            assert seq == ["init_weights_update_group", "pause_generation", "update_weights_from_distributed",
                           "continue_generation"]
        for r in fake_sglang("update_weights_from_distributed"):
            b = r["body"]
            assert b["names"] == list(weights) and b["dtypes"] == ["float32", "float32", "bfloat16"]
            assert b["shapes"] == [[13, 8], [12], [13, 8]] and b["load_format"] == "flattened_bucket"
            assert b["flush_cache"] is True and b["weight_version"] == "1" and "description" not in b
            assert r["sha256"] == [hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                                   for t in weights.values()]
        with pytest.raises(WeightSyncError, match="gap-free"):  # 7 floats = 28 bytes: the next would not be back to back
            client.load_weights({"a": torch.ones(7), "b": torch.ones(4)}, "2")
    finally:
        if client is not None:
            client.close()
        S._kill(procs + ([router] if router else []))
    assert all(p.poll() is not None for p in procs)


def test_colocated_push_carries_pickled_handles_per_tp_rank(tmp_path, fake_sglang):
    procs, urls = _engines(tmp_path, 1)
    try:
        named = [("a.weight", torch.ones(4, 4)), ("b.weight", torch.zeros(8)), ("c.weight", torch.ones(2))]
        n = S.push_tensors_to_sglang(urls[0], named, "3", tp_size=2, group_bytes=64)
        assert n == 2  # 64 bytes, then 40
        kinds = [r["kind"] for r in fake_sglang() if r["kind"] != "launch"]
        assert kinds == ["pause_generation", "update_weights_from_tensor", "update_weights_from_tensor",
                         "continue_generation"]
        pushes = fake_sglang("update_weights_from_tensor")
        assert [p["flush_cache"] for p in pushes] == [False, True] and {p["weight_version"] for p in pushes} == {"3"}
        assert all(p["entries"] == 2 and p["same_entries"] and p["load_format"] is None for p in pushes)
        assert all(any(g.startswith("torch.") for g in p["globals"]) for p in pushes)
        assert not any(g.startswith("rlperf") for p in pushes for g in p["globals"])  # SGLang's unpickler allows torch.*
    finally:
        S._kill(procs)


def test_an_engine_that_cannot_import_fails_at_once_naming_the_module(tmp_path, fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "import")
    with pytest.raises(S.SGLangUnavailable, match="sgl_kernel cannot be imported"):
        _engines(tmp_path, 1, timeout=120.0)  # would hang 120 s if the exit were not seen


def test_an_engine_that_never_answers_times_out(tmp_path, fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "hang")
    with pytest.raises(S.EngineFleetError, match="sglang-launch-timeout"):
        _engines(tmp_path, 1, timeout=3.0)


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "2+3=", "label": "5"}\n{"input": "4+4=", "label": "8"}\n')
    return ["--prompt-data", str(path)]


def test_the_trainer_and_its_engines_share_one_nccl_cumem_setting():
    """Ranks of the weight-update group that differ in NCCL's cuMem setting fail the first broadcast, and
    with it on SGLang's side failed too: the trainer's process takes 0 where it has no value, the
    engines get the trainer's value, and a value the user set is kept on both sides."""
    off = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    env: dict[str, str] = {}
    assert S.engine_nccl_env(env) == off
    assert S.use_weight_sync_nccl_settings(env) == off and env == off
    mine = {"NCCL_CUMEM_ENABLE": "1", "PATH": "/bin"}
    assert S.use_weight_sync_nccl_settings(mine) == {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    assert S.engine_nccl_env(mine) == {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}


def test_gate_with_sglang_engines_reports_the_measured_distance(tmp_path, fake_sglang, monkeypatch, capsys):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    report = tmp_path / "gate.json"
    code = main(["gate", "--device", "cpu", "--rollout-backend", "sglang", "--rollout-num-gpus", "2",
                 "--sglang-attention-backend", "triton", "--sglang-load-format", "dummy", *SMALL,
                 *_prompts(tmp_path),
                 "--output-dir", str(tmp_path / "g"), "--report-json", str(report)])
    out = capsys.readouterr()
    assert code == 1, out.err
    results = {r["name"]: r for r in json.loads(report.read_text())["gates"]}
    diff = results["logprob_abs_diff"]
    assert not diff["passed"] and diff["measured"]["mean_abs_diff"] > 0 and diff["measured"]["kl_rollout_train"] > 0
    assert f"{diff['measured']['mean_abs_diff']:.4g}" in diff["message"]
    assert f"{diff['measured']['kl_rollout_train']:.4g}" in diff["message"]
    oom = results["oom_headroom"]  # SGLang's static budget is listed, not checked
    assert oom["passed"] and "2 SGLang engine(s) hold a static 768 MiB, 768 MiB" in oom["message"], oom["message"]
    assert [e["kind"] for e in oom["measured"]["engines"]] == ["sglang_static"] * 2
    launches = fake_sglang("launch")
    assert len(launches) == 2 and {r["nccl_cumem_enable"] for r in launches} == {"0"}
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"  # the trainer's own NCCL too (monkeypatch restores it)
    for r in launches:
        a = r["argv"]
        assert a[a.index("--attention-backend") + 1] == "triton" and a[a.index("--load-format") + 1] == "dummy"
        assert a[a.index("--device") + 1] == "cpu" and "--enable-deterministic-inference" in a
    model_dir = tmp_path / "g" / S.MODEL_DIR
    assert (model_dir / "config.json").exists() and not list(model_dir.glob("*.safetensors"))  # dummy: config only
    kinds = [r["kind"] if r["kind"] != "update_weights_from_distributed" else r["body"]["weight_version"]
             for r in fake_sglang() if r["port"] == launches[0]["port"]]
    # the dummy weights are replaced (version 0) before rollout 0; the gate's weight-sync phase sends version 1
    assert kinds.index("0") < kinds.index("generate") < kinds.index("1")


def test_gate_exits_2_naming_the_module_sglang_lacks(tmp_path, fake_sglang, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "import")
    code = main(["gate", "--device", "cpu", "--rollout-backend", "sglang", "--rollout-num-gpus", "1", *SMALL,
                 *_prompts(tmp_path), "--output-dir", str(tmp_path / "g")])
    assert code == 2
    assert "sgl_kernel" in capsys.readouterr().err


# ---- --sglang-numerics (issue #36): rlperf's kernels in the engines through rlperf's SGLang plugin ----------------


def test_launch_argv_of_each_numerics():
    from rlperf.kernels.attention import PAGE_SIZE

    exact = S.sglang_launch_argv("/m", 1, SGLangConfig(numerics="rlperf"), dtype="bfloat16", mem_fraction_static=0.5,
                                 seed=3)
    i = exact.index("--attention-backend")
    assert exact[i:i + 4] == ["--attention-backend", "rlperf", "--page-size", str(PAGE_SIZE)]
    assert exact.count("--attention-backend") == 1 and "--enable-deterministic-inference" in exact
    loose = S.sglang_launch_argv("/m", 1, SGLangConfig(numerics="rlperf", deterministic=False), dtype="bfloat16",
                                 mem_fraction_static=0.5, seed=3)
    assert "--enable-deterministic-inference" not in loose and "--page-size" in loose
    own = S.sglang_launch_argv("/m", 1, SGLangConfig(attention_backend="triton", numerics="sglang"), dtype="bfloat16",
                               mem_fraction_static=0.5, seed=3)
    assert own[own.index("--attention-backend") + 1] == "triton" and "--page-size" not in own
    assert "rlperf's SGLang plugin" in S.describe_numerics(SGLangConfig(numerics="rlperf"))
    assert "--sglang-numerics sglang" in S.describe_numerics(SGLangConfig(numerics="sglang"))


def test_numerics_default_is_one_constant_and_fills_the_attention_backend():
    from rlperf.loop.args import DEFAULT_SGLANG_ATTENTION_BACKEND, DEFAULT_SGLANG_NUMERICS

    base = ["--rollout-backend", "sglang", "--rollout-num-gpus", "1"]
    ns = _flags(*base)
    check_sglang_backend_flags(ns)
    assert ns.sglang_numerics == DEFAULT_SGLANG_NUMERICS == "rlperf" and SGLangConfig().numerics == "rlperf"
    # where the plugin cannot run, the default is SGLang's own kernels: an attention backend named
    ns = _flags(*base, "--sglang-attention-backend", "triton")
    check_sglang_backend_flags(ns)
    assert ns.sglang_numerics == "sglang" and ns.sglang_attention_backend == "triton"
    # TP engines run the plugin too: the tree beside the megatron trainer, plain tensor parallelism beside fsdp
    for trainer in ("fsdp", "megatron"):
        ns = _flags("--rollout-backend", "sglang", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
                    "--train-backend", trainer)
        check_sglang_backend_flags(ns)
        assert ns.sglang_numerics == "rlperf"
    ns = _flags(*base, "--sglang-numerics", "sglang")
    check_sglang_backend_flags(ns)
    assert ns.sglang_attention_backend == DEFAULT_SGLANG_ATTENTION_BACKEND
    ns = _flags(*base, "--sglang-numerics", "rlperf")
    check_sglang_backend_flags(ns)
    assert ns.sglang_attention_backend is None  # the engines run rlperf's attention
    check_sglang_backend_flags(ns)  # twice: still fine


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_an_attention_backend_with_rlperf_numerics_is_a_usage_error_naming_both(backend):
    with pytest.raises(UsageError, match=r"--sglang-attention-backend .*--sglang-numerics rlperf"):
        check_sglang_backend_flags(_flags("--rollout-backend", "sglang", "--rollout-num-gpus", "1",
                                          "--sglang-numerics", "rlperf", "--sglang-attention-backend", backend))


def test_numerics_other_than_the_default_need_the_sglang_backend():
    from rlperf.loop.args import DEFAULT_SGLANG_NUMERICS, SGLANG_NUMERICS

    other = next(x for x in SGLANG_NUMERICS if x != DEFAULT_SGLANG_NUMERICS)
    with pytest.raises(UsageError, match=r"--sglang-numerics needs --rollout-backend sglang"):
        check_sglang_backend_flags(_flags("--sglang-numerics", other))
    with pytest.raises(UsageError, match=r"--sglang-attention-backend needs --rollout-backend sglang"):
        check_sglang_backend_flags(_flags("--sglang-attention-backend", "flashinfer"))


def test_gate_exits_2_naming_both_flags(tmp_path, fake_sglang, capsys):
    code = main(["gate", "--device", "cpu", "--rollout-backend", "sglang", "--rollout-num-gpus", "1",
                 "--sglang-numerics", "rlperf", "--sglang-attention-backend", "triton", *SMALL, *_prompts(tmp_path),
                 "--output-dir", str(tmp_path / "g")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--sglang-attention-backend triton" in err and "--sglang-numerics rlperf" in err
    assert not fake_sglang("launch")  # refused before anything starts


@pytest.mark.parametrize("environ, expected", [
    ({}, {}),  # unset: SGLang loads every installed plugin
    ({"SGLANG_PLUGINS": ""}, {}),  # empty: no whitelist either
    ({"SGLANG_PLUGINS": "rlperf"}, {}),
    ({"SGLANG_PLUGINS": "other, rlperf"}, {}),
    ({"SGLANG_PLUGINS": "other"}, {"SGLANG_PLUGINS": "other,rlperf"}),
    ({"SGLANG_PLUGINS": "a, b,"}, {"SGLANG_PLUGINS": "a, b,rlperf"}),
    ({"SGLANG_PLUGINS": "rlperf_extra"}, {"SGLANG_PLUGINS": "rlperf_extra,rlperf"}),
])
def test_a_plugin_whitelist_without_rlperf_gets_it(environ, expected):
    assert S.engine_plugin_env(SGLangConfig(numerics="rlperf"), environ) == expected
    assert S.engine_plugin_env(SGLangConfig(numerics="sglang"), environ) == {}  # SGLang's kernels: left alone


def _gate(tmp_path, *extra):
    report = tmp_path / "gate.json"
    code = main(["gate", "--device", "cpu", "--rollout-backend", "sglang", "--rollout-num-gpus", "1",
                 "--sglang-load-format", "dummy", *SMALL, *_prompts(tmp_path), *extra,
                 "--output-dir", str(tmp_path / "g"), "--report-json", str(report)])
    return code, {r["name"]: r for r in json.loads(report.read_text())["gates"]}


def test_gate_with_rlperf_numerics_starts_the_plugins_engines_and_holds_them_to_0(tmp_path, fake_sglang, monkeypatch,
                                                                                 capsys):
    from rlperf.kernels.attention import PAGE_SIZE

    monkeypatch.setenv("SGLANG_PLUGINS", "someone_elses")
    code, results = _gate(tmp_path, "--sglang-numerics", "rlperf", "--true-on-policy-mode")
    err = capsys.readouterr().err
    assert code == 1, err  # the stand-in answers FAKE_LOGPROB, not rlperf's log-probs
    (launch,) = fake_sglang("launch")
    a = launch["argv"]
    assert a[a.index("--attention-backend") + 1] == "rlperf" and a[a.index("--page-size") + 1] == str(PAGE_SIZE)
    assert "--enable-deterministic-inference" in a
    assert launch["sglang_plugins"] == "someone_elses,rlperf"
    line = next(x for x in err.splitlines() if "starting 1 SGLang engine(s)" in x)
    assert "--sglang-numerics rlperf" in line and f"--attention-backend rlperf --page-size {PAGE_SIZE}" in line
    diff = results["logprob_abs_diff"]
    assert not diff["passed"] and diff["threshold"] == "exactly 0 (true-on-policy mode, --sglang-numerics rlperf)"
    assert "not exactly 0" in diff["message"] and "--sglang-numerics rlperf" in diff["message"]
    assert "rlperf's SGLang plugin" in diff["hint"]


def test_gate_with_sglang_numerics_in_true_on_policy_mode_fails_naming_them(tmp_path, fake_sglang, monkeypatch):
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    code, results = _gate(tmp_path, "--sglang-numerics", "sglang", "--true-on-policy-mode")
    assert code == 1
    (launch,) = fake_sglang("launch")
    assert launch["argv"][launch["argv"].index("--attention-backend") + 1] == "flashinfer"
    assert "--page-size" not in launch["argv"] and launch["sglang_plugins"] is None
    diff = results["logprob_abs_diff"]  # today's rule kept: exactly 0, which SGLang's own kernels do not give
    assert not diff["passed"] and diff["threshold"] == "exactly 0 (true-on-policy mode, --sglang-numerics sglang)"
    assert "--sglang-numerics sglang" in diff["message"] and "--sglang-numerics rlperf" in diff["hint"]


def test_every_sample_sent_to_sglang_carries_its_own_seed(tmp_path, fake_sglang):
    """SGLang's deterministic inference samples every request without a ``sampling_seed`` from one default
    seed: the n samples of a prompt would come out alike. Each request carries its sample's seed, distinct
    within a prompt's group, within a rollout and across rollouts."""
    n_rollouts, n = 3, 2
    code = main(["train", "--device", "cpu", "--rollout-backend", "sglang", "--rollout-num-gpus", "1",
                 "--sglang-load-format", "dummy", *SMALL, *_prompts(tmp_path), "--num-rollout", str(n_rollouts),
                 "--output-dir", str(tmp_path / "t"), "--no-progress", "--skip-gates"])
    assert code == 0
    seeds = [r["body"]["sampling_params"]["sampling_seed"] for r in fake_sglang("generate")]
    per_rollout = 2 * n  # --rollout-batch-size 2 x --n-samples-per-prompt 2
    assert len(seeds) >= n_rollouts * per_rollout and all(isinstance(s, int) for s in seeds)
    assert len(set(seeds)) == len(seeds), seeds
    by_prompt: dict[tuple, list] = {}
    for r in fake_sglang("generate"):
        by_prompt.setdefault(tuple(r["body"]["input_ids"]), []).append(r["body"]["sampling_params"]["sampling_seed"])
    assert all(len(v) >= n and len(set(v)) == len(v) for v in by_prompt.values()), by_prompt


def test_two_actor_ranks_drive_sglang_engines_from_rank_0(tmp_path, fake_sglang):
    """``--actor-num-gpus-per-node 2`` with SGLang engines (two gloo ranks on the CPU): rank 0 starts the
    engine on a config.json alone (its model is not the trainer's sharded weights) and every sync, the
    first included, sends the bytes the one-rank run sends (the same SHA-256 per tensor, version by
    version); the samples come through rank 0 and the two runs' metrics agree."""
    def run(name, *extra):
        code = main(["train", "--device", "cpu", "--rollout-backend", "sglang", "--rollout-num-gpus", "1", *SMALL,
                     *_prompts(tmp_path), "--num-rollout", "2", "--output-dir", str(tmp_path / name), "--no-progress",
                     "--skip-gates", *extra])
        assert code == 0, name
        port = fake_sglang("launch")[-1]["port"]
        syncs = [(r["body"]["weight_version"], r["sha256"]) for r in fake_sglang("update_weights_from_distributed")
                 if r["port"] == port]
        metrics = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return fake_sglang("launch")[-1]["argv"], syncs, metrics

    argv1, syncs1, m1 = run("one")
    argv2, syncs2, m2 = run("two", "--actor-num-gpus-per-node", "2")
    assert argv2[argv2.index("--load-format") + 1] == "dummy" and argv1[argv1.index("--load-format") + 1] == "auto"
    assert not list((tmp_path / "two" / S.MODEL_DIR).glob("*.safetensors"))
    assert [v for v, _ in syncs2] == ["0", "1", "2"] and syncs2 == syncs1  # one full copy per sync, the same bytes
    for a, b in zip(m1, m2):
        assert a["rollout/raw_reward"] == b["rollout/raw_reward"]
        assert a["train/train_rollout_logprob_abs_diff"] == b["train/train_rollout_logprob_abs_diff"]
    with pytest.raises(UsageError, match="--colocate puts one engine on the trainer's GPU"):
        check_sglang_backend_flags(_flags("--rollout-backend", "sglang", "--colocate", "--sglang-mem-fraction-static",
                                          "0.4", "--actor-num-gpus-per-node", "2"))


def test_sample_seeds_are_distinct_over_rollouts_and_samples():
    from rlperf.loop.generation import sample_seed

    seeds = [sample_seed(1234, k, i) for k in range(50) for i in range(2048)]
    assert len(set(seeds)) == len(seeds)


def test_moe_engines_return_routed_experts():
    """MoE models: the engines start with --enable-return-routed-experts (the routing-agreement gate and routing
    replay read meta_info['routed_experts']); dense models without it."""
    moe = S.sglang_launch_argv("/m", 1, SGLangConfig(numerics="rlperf"), dtype="bfloat16", mem_fraction_static=0.5,
                               seed=0, routed_experts=True)
    dense = S.sglang_launch_argv("/m", 1, SGLangConfig(numerics="rlperf"), dtype="bfloat16", mem_fraction_static=0.5,
                                 seed=0)
    assert moe.count("--enable-return-routed-experts") == 1 and "--enable-return-routed-experts" not in dense


# ---- --rollout-num-gpus-per-engine N with rlperf's numerics: the plugin's tree over SGLang's TP group ------------
def test_tp_engines_with_rlperf_numerics_beside_either_trainer(tmp_path):
    """Engines of 2 GPUs with rlperf's numerics start at --tp-size 2 beside the megatron trainer (the saved
    model names its tree) and beside the fsdp trainer (no leaf count: the plugin's plain tensor parallelism)."""
    for trainer in ("fsdp", "megatron"):
        ns = _flags("--rollout-backend", "sglang", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
                    "--train-backend", trainer, "--sglang-numerics", "rlperf")
        check_sglang_backend_flags(ns)
    argv = S.sglang_launch_argv("/m", 1, SGLangConfig(tp_size=2, numerics="rlperf"), dtype="bfloat16",
                                mem_fraction_static=0.5, seed=0)
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--attention-backend") + 1] == "rlperf"


def test_a_colocated_tp_engine_spans_the_trainers_gpu_and_the_ones_after_it(monkeypatch):
    """``--colocate --rollout-num-gpus-per-engine K``: the flags pass, rank 0 shares the trainer's GPU and ranks
    1..K-1 take the next visible GPUs; too few visible GPUs is a usage error naming the flags and the GPUs."""
    from rlperf.loop.device import resolve_engine_layout

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ns = _flags("--rollout-backend", "sglang", "--colocate", "--rollout-num-gpus-per-engine", "2",
                "--sglang-mem-fraction-static", "0.4", "--train-backend", "megatron")
    check_sglang_backend_flags(ns)
    assert ns.sglang_numerics == "rlperf"  # beside the tree trainer, the plugin's tree
    resolve_engine_layout(ns, torch.device("cuda"), visible_gpus=2)
    assert not ns.disaggregated
    with pytest.raises(UsageError, match=r"--colocate --rollout-num-gpus-per-engine 2: .*cuda:0\.\.cuda:1, but 1 are"):
        resolve_engine_layout(ns, torch.device("cuda"), visible_gpus=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(UsageError, match=r"cuda:1\.\.cuda:2, but 2 are visible \(CUDA_VISIBLE_DEVICES=3,5\)"):
        resolve_engine_layout(ns, torch.device("cuda:1"), visible_gpus=2)
    resolve_engine_layout(ns, torch.device("cpu"))  # on the CPU the fleet refuses --colocate itself


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
                    reason="needs CUDA and SGLang (its reductions rebuild the handles)")
def test_gpu_colocated_handles_name_the_gpu_by_uuid_for_every_rank(tmp_path):
    """A pushed tensor's IPC handle names its GPU by UUID, so a rank that numbers the GPUs differently (here a
    process with CUDA_VISIBLE_DEVICES reversed, as rank 1 of a colocated engine of 2 GPUs sees them on a
    2-GPU machine) rebuilds it on the trainer's GPU with SGLang's own reductions and reads the same bytes."""
    t = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64) * 0.5
    entry = S.serialize_named_tensors([("w", t)])
    n = torch.cuda.device_count()
    # the GPUs this process sees, reversed: a process already limited by CUDA_VISIBLE_DEVICES (a device lane)
    # names the same physical GPUs, not the machine's first n
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    order = ",".join(reversed(visible[:n] if len(visible) >= n else [str(i) for i in range(n)]))
    code = ("import base64, sys, torch\n"
            "from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions\n"
            "from sglang.srt.utils import MultiprocessingSerializer\n"
            "monkey_patch_torch_reductions()\n"
            "(name, w), = MultiprocessingSerializer.deserialize(sys.stdin.read())\n"
            "print(name, w.device.index, torch.cuda.get_device_properties(w.device).uuid, float(w.double().sum()))\n")
    import subprocess
    import sys as _sys
    out = subprocess.run([_sys.executable, "-c", code], input=entry, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": order})
    assert out.returncode == 0, out.stderr[-3000:]
    name, index, uuid, total = out.stdout.split()
    assert name == "w" and uuid == str(torch.cuda.get_device_properties(t.device).uuid)
    assert int(index) == n - 1 - (t.device.index or 0) and float(total) == float(t.double().sum())
    torch.cuda.synchronize()


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_the_saved_model_names_the_trainers_tree(tmp_path, load_format):
    from rlperf.model import ModelConfig
    from rlperf.model.config import REDUCTION_LEAVES_KEY, reduction_leaves_from_hf_dict
    from rlperf.model.qwen3 import Qwen3ForCausalLM

    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, vocab_size=64)
    tree = S.save_engine_model(Qwen3ForCausalLM.random(cfg, reduction_leaves=8), tmp_path / "tree", load_format)
    plain = S.save_engine_model(Qwen3ForCausalLM.random(cfg), tmp_path / "plain", load_format)
    assert reduction_leaves_from_hf_dict(json.loads((tree / "config.json").read_text())) == 8
    assert REDUCTION_LEAVES_KEY not in json.loads((plain / "config.json").read_text())
    assert (tree / "model.safetensors").exists() == (load_format == "auto")


def test_gate_with_the_megatron_trainer_starts_tree_engines(tmp_path, fake_sglang, monkeypatch):
    pytest.importorskip("megatron.core")
    from rlperf.model.config import REDUCTION_LEAVES_KEY

    code, results = _gate(tmp_path, "--train-backend", "megatron", "--sglang-numerics", "rlperf")
    (launch,) = fake_sglang("launch")
    a = launch["argv"]
    assert a[a.index("--attention-backend") + 1] == "rlperf"
    saved = json.loads((Path(a[a.index("--model-path") + 1]) / "config.json").read_text())
    assert saved[REDUCTION_LEAVES_KEY] == 8
    assert fake_sglang("update_weights_from_distributed"), "the megatron trainer's weights reached the engine"
    assert results["logprob_abs_diff"]["passed"] is not None

