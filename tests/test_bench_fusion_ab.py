"""``python -m rlperf.bench.fusion_ab``: its variants reach the engine's layers and every variant decodes
the same tokens (tiny model, CPU, reference kernels for speed: that the fused launches keep the bits of
their unfused calls is the kernel tests' proof, tests/kernels/test_rope.py and test_matmul.py)."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.bench import fusion_ab
from rlperf.kernels import attention, fused_lm_head, gemm
from rlperf.bench.rollout import decoding_engine
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.engine import EngineConfig


def _decoded(model, fused_sampling=False, logprob_rows=None, beside=False):
    engine = decoding_engine(model, batch=2, prompt_len=5, new_tokens=4, warmup=1, fused_sampling=fused_sampling,
                             logprob_from_logits_max_rows=logprob_rows, logprob_beside_sampler=beside)
    assert engine.config.fused_sampling is fused_sampling and engine.config.logprob_beside_sampler is beside
    default = EngineConfig().logprob_from_logits_max_rows
    assert engine.config.logprob_from_logits_max_rows == (default if logprob_rows is None else logprob_rows)
    engine.step()
    return sorted((list(r.prompt_ids), list(r.output_ids)) for r in engine.requests.values())


def test_every_variant_reaches_the_layers_and_decodes_the_same_tokens(one_thread, monkeypatch):
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    calls = {"swiglu": 0, "kv": 0}
    unfused_mlp, unfused_kv = fusion_ab._unfused_linear_silu_mul, fusion_ab._unfused_store_kv

    def mlp(*a):
        calls["swiglu"] += 1
        return unfused_mlp(*a)

    def kv(*a):
        calls["kv"] += 1
        return unfused_kv(*a)

    monkeypatch.setattr(fusion_ab, "_unfused_linear_silu_mul", mlp)
    monkeypatch.setattr(fusion_ab, "_unfused_store_kv", kv)
    fused_calls = K.linear_silu_mul, K.rmsnorm_rope_store_kv
    limit = gemm.SWIGLU_EPILOGUE_MAX_ROWS
    with fusion_ab.variant(True, True):  # the epilogue at every size
        assert gemm.SWIGLU_EPILOGUE_MAX_ROWS > 1 << 40
    tokens = {}
    from rlperf.kernels import pipeline

    setting = pipeline._pdl_on
    variants = fusion_ab.chosen_variants("all, logprob split 3")
    assert variants["logprob split 3"] == fusion_ab.Variant(None, True, True, 3)
    assert variants["fused sampling"].fused_sampling and not variants[fusion_ab.ENGINE_DEFAULT].fused_sampling
    assert not variants["no decode guess"].decode_guess and variants[fusion_ab.ENGINE_DEFAULT].decode_guess
    decode_configs = (attention._DECODE_CONFIG, attention._DECODE_FEW_PROGRAMS, attention._DECODE_MANY_PROGRAMS)
    assert all(c["GUESS_ONE_QUERY"] for c in decode_configs)
    assert variants["logprob from the lm head"].logprob_from_logits_max_rows == 0
    assert not variants["two matmul buckets"].matmul_buckets and variants[fusion_ab.ENGINE_DEFAULT].matmul_buckets
    buckets = gemm.TINY_M, dict(gemm._SMALL_M_UP_TO), dict(gemm._TINY_M_UP_TO)
    assert variants["logprob beside the sampler"].logprob_beside_sampler
    assert not variants[fusion_ab.ENGINE_DEFAULT].logprob_beside_sampler
    assert variants["decode keys on m"].decode_keys_on_m and variants["decode row tiles"].decode_keys_on_m is False
    orientations = [c.get("KEYS_ON_M", False) for c in decode_configs]
    stages = attention._DECODE_MANY_PROGRAMS["num_stages"]
    for name, (swiglu, kv_fused, pdl, split, fused_sampling, decode_guess, logprob_rows, matmul_buckets,
               beside, keys_on_m, many_stages) in variants.items():
        before = dict(calls)
        configs = dict(fused_lm_head._CONFIGS)
        with fusion_ab.variant(swiglu, kv_fused, pdl, split, decode_guess, matmul_buckets, keys_on_m, many_stages), \
                K.use_backend("reference"):
            # the two buckets of before: a decode batch of one row takes the 64-row small-M tiles
            assert (K.matmul_config(torch.bfloat16, 1024, 2048, 1).BLOCK_M == 64) == (not matmul_buckets), name
            assert (K.matmul_config(torch.bfloat16, 1024, 2048, 64).BLOCK_M == 64) == (not matmul_buckets), name
            assert all(c["GUESS_ONE_QUERY"] is decode_guess for c in decode_configs), name
            assert keys_on_m is None or all(c["KEYS_ON_M"] is keys_on_m for c in decode_configs), name
            assert attention._DECODE_MANY_PROGRAMS["num_stages"] == (many_stages or stages), name
            assert all(fused_lm_head.fused_config(d).SPLIT_TILES == (split or c.SPLIT_TILES)
                       for d, c in configs.items()), name
            assert pipeline._pdl_on is pdl, name  # the launches' setting (a no-op on the CPU)
            tokens[name] = _decoded(model, fused_sampling, logprob_rows, beside)
        assert pipeline._pdl_on is setting, name  # restored
        assert fused_lm_head._CONFIGS == configs, name
        assert all(c["GUESS_ONE_QUERY"] for c in decode_configs), name  # restored
        assert [c.get("KEYS_ON_M", False) for c in decode_configs] == orientations, name  # restored
        assert attention._DECODE_MANY_PROGRAMS["num_stages"] == stages, name  # restored
        assert (calls["swiglu"] > before["swiglu"]) == (swiglu is False), name
        assert (calls["kv"] > before["kv"]) == (not kv_fused), name
        assert (K.linear_silu_mul, K.rmsnorm_rope_store_kv) == fused_calls  # restored
        assert gemm.SWIGLU_EPILOGUE_MAX_ROWS == limit
        assert (gemm.TINY_M, gemm._SMALL_M_UP_TO, gemm._TINY_M_UP_TO) == buckets, name  # restored
    first = tokens[fusion_ab.ENGINE_DEFAULT]
    assert all(len(out) >= 3 for _, out in first)
    assert all(t == first for t in tokens.values())


def test_variants_flag_picks_the_default_and_the_named_ones():
    assert list(fusion_ab.chosen_variants("all")) == list(fusion_ab.VARIANTS)
    assert list(fusion_ab.chosen_variants("no pdl")) == [fusion_ab.ENGINE_DEFAULT, "no pdl"]
    assert list(fusion_ab.chosen_variants(" neither , no pdl")) == [fusion_ab.ENGINE_DEFAULT, "neither", "no pdl"]
    assert fusion_ab.chosen_variants("no pdl,fast") is None and fusion_ab.chosen_variants(",") is None
    assert list(fusion_ab.chosen_variants("logprob  split 5, no pdl, logprob split 2")) == [
        fusion_ab.ENGINE_DEFAULT, "no pdl", "logprob split 5", "logprob split 2"]
    assert fusion_ab.chosen_variants("logprob split 5")["logprob split 5"].logprob_split_tiles == 5
    assert fusion_ab.chosen_variants("logprob split 0") is None
    assert fusion_ab.chosen_variants("logprob split x") is None


def test_rounds_rotate_the_variants_so_each_is_timed_first_once():
    names = [fusion_ab.ENGINE_DEFAULT, "no pdl", "fused sampling"]
    orders = fusion_ab.timing_orders(names, 3)
    assert orders == [names, names[1:] + names[:1], names[2:] + names[:2]]
    assert sorted(o[0] for o in orders) == sorted(names) and all(sorted(o) == sorted(names) for o in orders)
    assert fusion_ab.timing_orders(names, 4)[3] == names and fusion_ab.timing_orders(names[:2], 1) == [names[:2]]


def test_bad_flags_exit_2_naming_them(capsys):
    with pytest.raises(SystemExit) as e:
        fusion_ab.main(["--batches", "1,x"])
    assert e.value.code == 2 and "--batches" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        fusion_ab.main(["--steps", "0"])
    assert e.value.code == 2 and "--steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        fusion_ab.main(["--prefill", "-1"])
    assert e.value.code == 2 and "--prefill" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        fusion_ab.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        fusion_ab.main(["--variants", "no pdl,turbo"])
    assert e.value.code == 2 and "--variants" in capsys.readouterr().err
