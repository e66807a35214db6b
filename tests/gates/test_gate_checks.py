"""Each gate passes on a healthy first step and fails, naming the offender, when it should."""
import math

import pytest
import torch

from gate_records import ENGINE_URLS, GiB, healthy_record, layout_record, next_float
from rlperf.gates import (GATES, PHASES, EngineMemory, GateOptions, PhaseMemory, kl_zero, logprob_abs_diff,
                          oom_headroom, parse_memory_size, sanity)
from rlperf.gates.memory import format_bytes
from rlperf.telemetry import rss_bytes


@pytest.mark.parametrize("true_on_policy,noise", [(True, 0.0), (False, 0.0), (False, 0.01)])
def test_every_gate_passes_on_a_healthy_record(true_on_policy, noise):
    record = healthy_record(true_on_policy, noise)
    for name, gate in GATES.items():
        r = gate(record, GateOptions())
        assert r.passed, (name, r.message)
        assert r.name == name and r.hint == ""


# -- kl_zero -------------------------------------------------------------------------------------------

def test_kl_zero_fails_on_a_one_ulp_reference_difference_and_names_the_token():
    record = healthy_record()
    s = record.samples[1]
    before = float(s.ref_log_probs[2])
    s.ref_log_probs[2] = next_float(before)
    r = kl_zero(record)
    assert not r.passed
    pos = s.tokens.numel() - s.response_length + 2
    assert f"sample 1, response token 2 (position {pos}, token id {int(s.tokens[pos])})" in r.message
    assert f"{float(s.log_probs[2]):.9g}" in r.message and f"{float(s.ref_log_probs[2]):.9g}" in r.message
    assert r.measured["tokens_differing"] == 1
    assert r.measured["max_abs_diff"] == pytest.approx(abs(next_float(before) - before))
    assert "--ref-load" in r.hint


def test_kl_zero_names_the_first_differing_token_in_sample_order():
    record = healthy_record()
    record.samples[3].ref_log_probs[20] -= 0.5
    record.samples[2].ref_log_probs[0] -= 0.5
    r = kl_zero(record)
    assert not r.passed and "sample 2, response token 0" in r.message and r.measured["tokens_differing"] == 2


@pytest.mark.parametrize("key,value", [("train/ppo_kl", 1e-12), ("train/pg_clipfrac", 0.25),
                                       ("train/ppo_kl", math.nan), ("train/pg_clipfrac", -1e-30)])
def test_kl_zero_fails_on_a_nonzero_first_micro_step_metric(key, value):
    record = healthy_record()
    record.first_micro_step[key] = value
    r = kl_zero(record)
    assert not r.passed and key in r.message and "not exactly 0" in r.message


def test_kl_zero_fails_when_a_metric_is_missing():
    record = healthy_record()
    del record.first_micro_step["train/pg_clipfrac"]
    r = kl_zero(record)
    assert not r.passed and "train/pg_clipfrac missing" in r.message


def test_kl_zero_without_a_reference_checks_the_metrics_and_says_so():
    record = healthy_record()
    for s in record.samples:
        s.ref_log_probs = None
    r = kl_zero(record)
    assert r.passed and "without a reference" in r.message and r.measured["tokens_compared"] == 0
    record.first_micro_step["train/ppo_kl"] = 1e-7
    assert not kl_zero(record).passed


# -- logprob_abs_diff ----------------------------------------------------------------------------------

def test_logprob_abs_diff_true_on_policy_fails_on_one_ulp_and_names_the_worst_token():
    record = healthy_record(true_on_policy=True)
    s = record.samples[3]
    s.rollout_log_probs[7] = next_float(float(s.rollout_log_probs[7]))
    s.rollout_log_probs[9] -= 0.125  # the worst
    r = logprob_abs_diff(record)
    assert not r.passed and r.threshold == "exactly 0 (true-on-policy mode)"
    pos = s.tokens.numel() - s.response_length + 9
    assert f"sample 3, response token 9 (position {pos}, token id {int(s.tokens[pos])})" in r.message
    assert f"train {float(s.log_probs[9]):.9g} vs rollout {float(s.rollout_log_probs[9]):.9g}" in r.message
    assert r.measured["max_abs_diff"] == pytest.approx(0.125, rel=1e-5)


def test_logprob_abs_diff_ignores_tokens_outside_the_loss_mask():
    record = healthy_record(true_on_policy=True)
    record.samples[1].rollout_log_probs[1] -= 3.0  # loss_mask[1] == 0 there
    assert record.samples[1].loss_mask[1] == 0
    assert logprob_abs_diff(record).passed


def test_logprob_abs_diff_mean_is_over_loss_tokens_and_held_to_the_threshold():
    record = healthy_record(true_on_policy=False, noise=0.02, seed=3)
    diffs = torch.cat([(s.log_probs.double() - s.rollout_log_probs.double()).abs()[s.loss_mask > 0]
                       for s in record.samples])
    want = float(diffs.mean())
    r = logprob_abs_diff(record, GateOptions(logprob_abs_diff_threshold=0.05))
    assert r.passed and r.measured["mean_abs_diff"] == pytest.approx(want, rel=1e-12)
    assert r.measured["loss_tokens"] == diffs.numel() == 40
    r = logprob_abs_diff(record, GateOptions(logprob_abs_diff_threshold=want * 0.99))
    assert not r.passed and "sample" in r.message and "--true-on-policy-mode" in r.hint


def test_logprob_abs_diff_true_on_policy_also_holds_the_trainers_metric_to_zero():
    record = healthy_record(true_on_policy=True)
    record.step_metrics["train/train_rollout_logprob_abs_diff"] = 3e-8
    r = logprob_abs_diff(record)
    assert not r.passed and "train/train_rollout_logprob_abs_diff" in r.message


def test_logprob_abs_diff_fails_on_a_nan_rollout_log_prob():
    record = healthy_record(true_on_policy=False)
    record.samples[0].rollout_log_probs[1] = math.nan
    r = logprob_abs_diff(record, GateOptions(logprob_abs_diff_threshold=1e9))
    assert not r.passed and "sample 0, response token 1" in r.message


def test_logprob_abs_diff_fails_without_rollout_log_probs():
    record = healthy_record()
    record.samples[2].rollout_log_probs = None
    r = logprob_abs_diff(record)
    assert not r.passed and "sample 2 has no rollout_log_probs" in r.message


# -- oom_headroom --------------------------------------------------------------------------------------

def test_oom_headroom_fails_on_a_too_low_capacity_naming_the_first_phase_over():
    record = healthy_record()  # peaks: rollout 2, log_prob 3, train 4, weight_sync 5 GiB, probe 6 GiB
    record.capacity_bytes = 3 * GiB  # limit 2.7 GiB: log_prob is the first phase over it
    r = oom_headroom(record, GateOptions(oom_headroom=0.1))
    assert not r.passed and r.message.startswith("phase log_prob: peak 3 GiB")
    # slime's order of remedies, with the current --max-tokens-per-gpu, naming only what the layout takes
    i = [r.hint.index(x) for x in ("1. lower --max-tokens-per-gpu (now 4096)",
                                   "2. shard the trainer over more GPUs: --actor-num-gpus-per-node (now 1",
                                   "3. lower --sglang-mem-fraction-static")]
    assert i == sorted(i) and "context" not in r.hint


def test_oom_remedies_name_what_the_layout_takes():
    from rlperf.gates.checks import oom_remedies

    fsdp = oom_remedies({"train_backend": "fsdp", "actor_num_gpus_per_node": 2, "max_tokens_per_gpu": 512})
    assert fsdp[0] == "lower --max-tokens-per-gpu (now 512)" and "--actor-num-gpus-per-node (now 2" in fsdp[1]
    megatron = oom_remedies({"train_backend": "megatron", "tensor_model_parallel_size": 2,
                             "pipeline_model_parallel_size": 1})
    assert "--tensor-model-parallel-size (now 2)" in megatron[1] and "--pipeline-model-parallel-size (now 1)" in megatron[1]
    assert not any("context" in x for x in fsdp + megatron)


def test_oom_headroom_checks_the_probe_and_the_boundary():
    record = healthy_record()
    record.capacity_bytes = 8 * GiB
    assert not oom_headroom(record, GateOptions(oom_headroom=0.3)).passed  # limit 5.6 GiB < probe 6 GiB
    r = oom_headroom(record, GateOptions(oom_headroom=0.3))
    assert "phase probe:train" in r.message
    record.capacity_bytes = 12 * GiB
    assert oom_headroom(record, GateOptions(oom_headroom=0.5)).passed  # limit exactly 6 GiB: allowed
    record.probe = PhaseMemory("train", 6 * GiB + 1)
    assert not oom_headroom(record, GateOptions(oom_headroom=0.5)).passed


def test_oom_headroom_fails_without_a_capacity_or_with_an_unmeasured_phase():
    record = healthy_record()
    record.capacity_bytes = None
    r = oom_headroom(record)
    assert not r.passed and "--memory-limit" in r.hint
    record = healthy_record()
    record.phases = [p for p in record.phases if p.phase != "weight_sync"]
    r = oom_headroom(record)
    assert not r.passed and "weight_sync not measured" in r.message


def test_oom_headroom_on_cpu_rss_of_this_process():
    record = healthy_record()
    rss = rss_bytes()
    record.memory_kind = "cpu_rss"
    record.phases = [PhaseMemory(p, rss) for p in PHASES]
    record.probe = None
    record.capacity_bytes = parse_memory_size("1MiB")
    r = oom_headroom(record)
    assert not r.passed and r.message.startswith("phase rollout:") and "cpu_rss" in r.message
    record.capacity_bytes = parse_memory_size("1TiB")
    assert oom_headroom(record).passed


def test_oom_headroom_checks_each_engine_against_its_own_capacity_and_names_it():
    record = layout_record(engine_peaks_gib=(20, 73))  # 80 GiB GPUs, limit 72 GiB: the second engine is over
    r = oom_headroom(record)
    assert not r.passed and r.message == (f"engine {ENGINE_URLS[1]}: peak 73 GiB (91.2% of 80 GiB cuda) exceeds "
                                          f"72 GiB (headroom 0.1); its KV pool is 16 GiB")
    assert "1. lower --sglang-mem-fraction-static" in r.hint and "2. lower --sglang-cuda-graph-max-bs" in r.hint
    assert [e["url"] for e in r.measured["engines"]] == ENGINE_URLS and r.measured["ranks"] == 2
    assert r.measured["engines"][1]["limit_bytes"] == int(0.9 * 80 * GiB)
    assert r.measured["engines"][1]["peak_bytes"] == 73 * GiB
    assert oom_headroom(record, GateOptions(oom_headroom=0.05)).passed  # limit 76 GiB: the same rule as the trainer's
    # the trainer's 16 GiB would not hold it: each engine is held to its own capacity, not the trainer's
    assert record.capacity_bytes == 16 * GiB


def test_oom_headroom_names_the_worst_of_ranks_and_engines():
    r = oom_headroom(layout_record(engine_peaks_gib=(20, 30)))  # trainer 6/16 GiB = 37.5%, engines 25% and 37.5%+
    assert r.passed and r.message == ("highest peak trainer probe:train 6 GiB = 37.5% of 16 GiB, "
                                      "the worst of the trainer (2 ranks) and 2 engines")
    r = oom_headroom(layout_record(engine_peaks_gib=(20, 31)))  # 31/80 = 38.8% > 37.5%
    assert r.passed and r.message.startswith(f"highest peak engine {ENGINE_URLS[1]} 31 GiB = 38.8% of 80 GiB, the worst")
    assert r.measured["worst"]["name"] == f"engine {ENGINE_URLS[1]}"
    r = oom_headroom(layout_record(engine_peaks_gib=()))  # no engines of its own: the ranks alone
    assert r.passed and r.message == "highest peak probe:train 6 GiB = 37.5% of 16 GiB, the worst of 2 ranks"
    record = layout_record(engine_peaks_gib=())
    record.capacity_bytes = 5 * GiB
    r = oom_headroom(record)
    assert not r.passed and r.message == ("phase weight_sync: peak 5 GiB on the worst of 2 ranks (100.0% of 5 GiB cuda) "
                                          "exceeds 4.5 GiB (headroom 0.1)")


def test_oom_headroom_fails_on_an_engine_that_reports_no_memory():
    record = layout_record()
    record.engines[0] = EngineMemory.from_server_info(ENGINE_URLS[0], {"internal_states": [{}]})
    r = oom_headroom(record)
    assert not r.passed and r.message.startswith(f"engine {ENGINE_URLS[0]} did not report its memory")


def test_oom_headroom_lists_an_sglang_engines_static_budget_without_checking_it():
    record = layout_record()
    sglang_info = {"internal_states": [{"memory_usage": {"weight": 1.25, "kvcache": 60.0, "graph": 0.75,
                                                         "token_capacity": 10}}]}  # SGLang's own keys, in GiB
    record.engines[0] = EngineMemory.from_server_info(ENGINE_URLS[0], sglang_info)
    assert (record.engines[0].peak_bytes, record.engines[0].kv_pool_bytes) == (62 * GiB, 60 * GiB)
    r = oom_headroom(record)
    assert r.passed and "1 SGLang engine(s) hold a static 62 GiB" in r.message, r.message
    assert ENGINE_URLS[0] not in r.measured["worst"]["name"]
    info = {"internal_states": [{"memory": {"kind": "cpu_rss", "device": "cpu", "capacity_bytes": 8 * GiB,
                                            "current_bytes": GiB, "peak_bytes": 2 * GiB, "reserved_bytes": None,
                                            "kv_pool_bytes": 64 << 20}}]}
    assert EngineMemory.from_server_info("u", info) == EngineMemory("u", "cpu_rss", 8 * GiB, 2 * GiB, GiB, 64 << 20, "cpu")


# -- sanity --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["first_micro_step", "step_metrics"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_sanity_fails_on_a_non_finite_loss(where, value):
    record = healthy_record()
    getattr(record, where)["train/pg_loss"] = value
    r = sanity(record)
    assert not r.passed and "train/pg_loss" in r.message


def test_sanity_fails_on_a_non_finite_reward_or_grad_norm():
    record = healthy_record()
    record.samples[2].reward = math.nan
    r = sanity(record)
    assert not r.passed and "sample 2 reward" in r.message
    record = healthy_record()
    record.step_metrics["train/grad_norm"] = math.inf
    r = sanity(record)
    assert not r.passed and "train/grad_norm" in r.message and "--lr" in r.hint


@pytest.mark.parametrize("field", ["log_probs", "rollout_log_probs", "ref_log_probs"])
@pytest.mark.parametrize("value", [1e-6, math.nan, -math.inf])
def test_sanity_fails_on_a_positive_or_non_finite_log_prob(field, value):
    record = healthy_record()
    getattr(record.samples[3], field)[32] = value
    r = sanity(record)
    assert not r.passed and f"{field} at sample 3, response token 32" in r.message


def test_sanity_accepts_a_log_prob_of_exactly_zero():
    record = healthy_record()
    for field in ("log_probs", "rollout_log_probs", "ref_log_probs"):
        getattr(record.samples[2], field)[0] = 0.0  # a certain token
    assert sanity(record).passed


# -- options and memory sizes ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(oom_headroom=1.0), dict(oom_headroom=-0.1),
                                dict(logprob_abs_diff_threshold=-1e-3), dict(logprob_abs_diff_threshold=math.nan)])
def test_gate_options_reject_bad_values(kw):
    with pytest.raises(ValueError):
        GateOptions(**kw)


@pytest.mark.parametrize("text,want", [("8GiB", 8 * 2**30), ("8G", 8 * 2**30), ("1.5GB", 1_500_000_000),
                                       ("512 MiB", 512 * 2**20), ("1000000", 1_000_000), ("64kB", 64_000),
                                       ("2TiB", 2 * 2**40), (4096, 4096)])
def test_parse_memory_size(text, want):
    assert parse_memory_size(text) == want


@pytest.mark.parametrize("text", ["", "lots", "8 GiBs", "-1GiB", "0", "1e9", "GiB"])
def test_parse_memory_size_rejects(text):
    with pytest.raises(ValueError):
        parse_memory_size(text)


def test_format_bytes():
    assert format_bytes(3 * GiB) == "3 GiB" and format_bytes(512) == "512 B" and format_bytes(None) == "-"


def test_a_probe_over_the_limit_fails_the_gate_naming_its_tokens():
    record = healthy_record()
    record.probe = PhaseMemory("train", 15 * GiB, tokens=8192)
    r = oom_headroom(record)
    assert not r.passed and r.message.startswith("phase probe:train (worst-case micro-batch of 8192 tokens)")
    assert r.measured["probe_tokens"] == 8192


# -- oom_headroom: engines on the trainer's GPU (--colocate) -------------------------------------------------

SGLANG_COLOCATED_INFO = {"mem_fraction_static": 0.45,  # SGLang's server_args, and its memory_usage in GiB
                         "internal_states": [{"memory_usage": {"weight": 1.5, "kvcache": 33.0,
                                                               "graph": {"decode": 0.5, "prefill": 1.0}}}]}


def _colocated_record(trainer_peak_gib: float, info: dict, fraction_flag=None):
    """A one-GPU (80 GiB) run whose worst-case probe peaks at ``trainer_peak_gib``, with one engine on the same
    GPU recorded as the loop records it (:func:`rlperf.loop.first_step.engine_memory` on ``info``)."""
    from types import SimpleNamespace

    from rlperf.loop.first_step import engine_memory

    record = healthy_record()
    record.capacity_bytes = 80 * GiB
    record.probe = PhaseMemory("train", int(trainer_peak_gib * GiB))
    client = SimpleNamespace(engine_memory=lambda: [EngineMemory.from_server_info(ENGINE_URLS[0], info)])
    run = SimpleNamespace(client=client, config=SimpleNamespace(rollout=SimpleNamespace(
        disaggregated=False, colocate=True, mem_fraction_static=fraction_flag)))
    record.engines = engine_memory(run)
    return record


def test_oom_headroom_counts_a_colocated_sglang_engines_static_share():
    # the trainer alone (50 GiB) fits under 0.9 x 80 = 72 GiB; with SGLang's reported 36 GiB beside it, it does not
    record = _colocated_record(50, SGLANG_COLOCATED_INFO)
    assert record.engines[0].colocated and record.engines[0].peak_bytes == 36 * GiB
    r = oom_headroom(record)
    assert not r.passed, r.message
    assert r.message.startswith("phase probe:train: trainer peak"), r.message
    assert ("trainer peak 50 GiB (62.5% of 80 GiB cuda) exceeds 36 GiB = 72 GiB (headroom 0.1) - 36 GiB held by 1 "
            f"colocated engine on the same GPU: {ENGINE_URLS[0]} 36 GiB (reported); the trainer alone would fit under "
            "72 GiB") in r.message, r.message
    assert r.measured["limit_bytes"] == 36 * GiB and r.measured["colocated_share_bytes"] == 36 * GiB
    assert "engines" not in r.measured and r.measured["colocated_engines"][0]["fraction"] == 0.45
    r = oom_headroom(_colocated_record(30, SGLANG_COLOCATED_INFO))  # 30 GiB + 36 GiB fits: a pass naming both
    assert r.passed and "trainer limit 36 GiB = 72 GiB - 36 GiB held by 1 colocated engine" in r.message, r.message


def test_oom_headroom_counts_a_colocated_rlperf_serve_engine_and_falls_back_to_its_fraction():
    serve = {"mem_fraction_static": 0.3, "internal_states": [{"memory": {
        "kind": "cuda", "device": "cuda:0", "capacity_bytes": 80 * GiB, "current_bytes": 20 * GiB,
        "peak_bytes": 24 * GiB, "reserved_bytes": 30 * GiB, "kv_pool_bytes": 16 * GiB}}]}
    r = oom_headroom(_colocated_record(50, serve))  # its CUDA reservation (30 GiB, above its peak) counts
    assert not r.passed and "exceeds 42 GiB = 72 GiB (headroom 0.1) - 30 GiB held by 1 colocated engine" in r.message
    # an engine that reports no memory: its --mem-fraction-static x capacity (0.3 x 80 = 24 GiB), said so
    r = oom_headroom(_colocated_record(50, {"mem_fraction_static": 0.3, "internal_states": [{}]}))
    assert not r.passed and "- 24 GiB held by 1 colocated engine" in r.message and "(configured)" in r.message
    assert r.measured["colocated_engines"][0]["source"].startswith("configured: it reported no memory")
    r = oom_headroom(_colocated_record(40, {"internal_states": [{}]}, fraction_flag=0.25))  # the run's flag
    assert r.passed and "72 GiB - 20 GiB held by 1 colocated engine" in r.message, r.message
    r = oom_headroom(_colocated_record(10, {"internal_states": [{}]}))  # nothing to go by: cannot vouch
    assert not r.passed and "cannot vouch for the trainer's limit" in r.message


def test_oom_headroom_keeps_disaggregated_engines_on_their_own_gpus():
    record = layout_record()
    assert not any(e.colocated for e in record.engines)
    r = oom_headroom(record)
    assert r.passed and "colocated" not in r.message and r.measured["limit_bytes"] == int(0.9 * 16 * GiB)
