"""``rlperf train --model qwen3-moe-tiny`` on the CPU: true on-policy (abs diff exactly 0 at every
step) on the reference kernels and on the Triton MoE kernels under the interpreter, and the run learns."""
import json

from rlperf.loop import train

MOE = ("--no-progress", "--model", "qwen3-moe-tiny", "--device", "cpu")
CHEAP = ("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4")


def _abs_diffs(hist):
    return [m["train/train_rollout_logprob_abs_diff"] for m in hist]


def test_moe_true_on_policy_and_the_reward_rises(tmp_path):
    # the embedded task's 128 samples packed into one micro-batch per step (not 128 of one sample):
    # the same learning, a fraction of the time (lr 1.5e-3 for 25 rollouts barely moved, 3e-3 collapsed)
    hist = train(["--output-dir", str(tmp_path), *MOE, "--true-on-policy-mode", "--num-rollout", "40", "--lr", "1e-3",
                  "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--num-threads", "1"])
    assert _abs_diffs(hist) == [0.0] * 40
    rewards = [m["rollout/raw_reward"] for m in hist]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert end >= start + 0.15, f"the MoE run did not learn: {rewards}"


def test_moe_true_on_policy_on_the_triton_kernels(tmp_path, interpreter):
    """The MoE kernels themselves (routing, permutation, grouped GEMM, combine and their backward)
    under the interpreter, engine and trainer alike. A prompt file instead of the embedded task: its
    format warm-up (60 supervised steps) would take most of an hour under the interpreter."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input": "question?", "label": "A"}) + "\n")
    # one rollout of one prompt x 2 samples, both in one micro-batch: every interpreted launch costs
    hist = train(["--output-dir", str(tmp_path / "out"), *MOE, "--rollout-batch-size", "1", "--n-samples-per-prompt",
                  "2", "--global-batch-size", "2", "--micro-batch-size", "2", "--prompt-data", str(data),
                  "--rollout-max-response-len", "2", "--true-on-policy-mode", "--num-rollout", "1",
                  "--kernel-backend", "interpreter", "--num-threads", "1"])
    assert _abs_diffs(hist) == [0.0]


def _prompts(tmp_path, n=2):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"question {i}?", "label": "A"}) + "\n" for i in range(n)))
    return ["--prompt-data", str(data), "--rollout-max-response-len", "3", "--num-threads", "1"]


def test_routing_replay_through_the_cli_with_the_moe_gates(tmp_path):
    """``rlperf train --use-rollout-routing-replay``: the gates run first, routing_agreement among them
    (table, JSON and JUnit), then the replayed run stays exactly on-policy."""
    from rlperf.cli import main

    out = tmp_path / "out"
    code = main(["train", *MOE, *CHEAP, *_prompts(tmp_path), "--true-on-policy-mode", "--num-rollout", "2",
                 "--use-rollout-routing-replay", "--output-dir", str(out), "--report-json", str(tmp_path / "gate.json"),
                 "--junit-xml", str(tmp_path / "gate.xml")])
    assert code == 0
    report = json.loads((tmp_path / "gate.json").read_text())
    gates = {g["name"]: g for g in report["gates"]}
    assert list(gates)[-1] == "routing_agreement" and gates["routing_agreement"]["passed"]
    assert gates["routing_agreement"]["measured"]["agreement"] == 1.0
    assert 'name="routing_agreement"' in (tmp_path / "gate.xml").read_text()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/train_rollout_logprob_abs_diff"] for m in lines] == [0.0, 0.0]


def test_a_dense_model_has_no_routing_gate(tmp_path):
    from rlperf.gates.runner import FirstStepGate
    from rlperf.loop.first_step import first_step

    rec = first_step(["--device", "cpu", "--model", "tiny", *CHEAP, *_prompts(tmp_path), "--num-rollout", "1",
                      "--output-dir", str(tmp_path / "out")])
    assert rec.train_routed_experts is None
    assert "routing_agreement" not in [r.name for r in FirstStepGate().check(rec).results]


ROLLOUT_WITHOUT_ROUTING = '''
from rlperf.loop.generation import generate_rollout


def rollout(args, rollout_id, data_source, evaluation=False):
    samples = generate_rollout(args, rollout_id, data_source, evaluation)
    samples[1].rollout_routed_experts = None  # an engine that sent no routed experts for this one
    return samples
'''


def test_a_sample_without_routed_experts_stops_the_run_naming_it(tmp_path, monkeypatch, capsys):
    from rlperf.cli import main

    (tmp_path / "no_routing.py").write_text(ROLLOUT_WITHOUT_ROUTING)
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = ["train", *MOE, *CHEAP, *_prompts(tmp_path), "--num-rollout", "1", "--use-rollout-routing-replay",
             "--rollout-function-path", "no_routing.rollout", "--output-dir", str(tmp_path / "out")]
    assert main([*flags, "--skip-gates"]) == 1
    err = capsys.readouterr().err
    assert "--use-rollout-routing-replay: sample 1: rollout routing replay needs the rollout's routed experts" in err
    assert "Traceback" not in err
    assert main([*flags, "--report-json", str(tmp_path / "gate.json")]) == 1  # the gates name it too
    gates = {g["name"]: g for g in json.loads((tmp_path / "gate.json").read_text())["gates"]}
    assert "sample 1" in gates["kl_zero"]["message"]


def test_routing_replay_round_trip_through_rlperf_serve(tmp_path, launch_router_cluster):
    """R3 through the real sglang-router and an ``rlperf serve`` worker: the worker returns
    ``meta_info["routed_experts"]``, the client decodes them, the trainer replays them; the run is the
    in-process run's, bit for bit (the same routing, log-probs and rewards)."""
    import pytest

    pytest.importorskip("aiohttp")
    pytest.importorskip("sglang_router")
    from rlperf.rollout.args import ServerArgs

    args = ServerArgs(model_path="qwen3-moe-tiny", kernel_backend="reference", num_threads=1, device="cpu",
                      random_seed=5)
    flags = [*MOE, *CHEAP, *_prompts(tmp_path), "--true-on-policy-mode", "--num-rollout", "2",
             "--use-rollout-routing-replay"]
    with launch_router_cluster(args, n=1) as cluster:
        port = cluster.router_url.rsplit(":", 1)[1]
        routed = train(["--output-dir", str(tmp_path / "r"), "--sglang-router-ip", "127.0.0.1",
                        "--sglang-router-port", str(port), *flags])
    local = train(["--output-dir", str(tmp_path / "l"), *flags])
    stable = lambda h: [{k: v for k, v in m.items() if not k.startswith(("perf/", "memory/"))} for m in h]  # noqa: E731
    assert stable(routed) == stable(local)
    assert _abs_diffs(routed) == [0.0, 0.0]
