"""config.json as transformers 4 and 5 write it (issue #10).

transformers 5 moved ``rope_theta`` into ``rope_parameters`` (top level absent or ``null``) and
``torch_dtype`` to ``dtype``; transformers 4 wrote the top-level ``rope_theta`` and ``rope_scaling``.
Checkpoints saved by the installed transformers, in both layouts, must load with the base they were
saved with (logits equal to transformers' at length 64), and RoPE variants rlperf does not implement
must be refused with the field and value named, never read as plain RoPE.
"""
import dataclasses
import json
import re

import pytest
import torch

import rlperf.kernels as K
from rlperf.cli import main
from rlperf.loop import METRICS_FILE
from rlperf.model import preset
from rlperf.model.config import read_hf_config
from rlperf.model.qwen3 import Qwen3ForCausalLM

transformers = pytest.importorskip("transformers")
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, max_position_embeddings=1024)
SEQ_LEN = 64
ATOL, RTOL = 2e-5, 1e-4  # as test_qwen3: our float64-per-op reference vs transformers' float32


def _hf_checkpoint(path, seed=0, **config_kw):
    """A random transformers Qwen3ForCausalLM saved by the installed transformers; weights large
    enough and norms non-trivial, so that RoPE's base changes the logits at SEQ_LEN."""
    config = transformers.Qwen3Config(**SHAPE, initializer_range=0.1, **config_kw)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def _edit_config(path, edit):
    f = path / "config.json"
    raw = json.loads(f.read_text())
    edit(raw)
    f.write_text(json.dumps(raw, indent=2))
    return raw


def _saved_theta(raw):
    return raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta")


def _transformers4_layout(raw):
    """Top-level rope_theta, rope_scaling null, torch_dtype; no rope_parameters, no dtype."""
    theta = _saved_theta(raw)
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=theta, rope_scaling=None, torch_dtype=raw.pop("dtype", None) or raw.get("torch_dtype"))


def _transformers5_layout(raw):
    """rope_theta null at the top level, the base in rope_parameters; dtype, no torch_dtype."""
    theta = _saved_theta(raw)
    raw.pop("rope_scaling", None)
    raw.update(rope_theta=None, rope_parameters={"rope_theta": theta, "rope_type": "default"},
               dtype=raw.pop("torch_dtype", None) or raw.get("dtype"))


LAYOUTS = {"as_saved": None, "transformers4": _transformers4_layout, "transformers5": _transformers5_layout}


def _hf_theta(config):
    params = getattr(config, "rope_parameters", None)
    return params["rope_theta"] if params and "rope_theta" in params else config.rope_theta


def _logits(model, ids):
    cu = torch.tensor([0, len(ids)], dtype=torch.int32)
    return model.logits(model.forward_packed(ids, torch.arange(len(ids)), cu)).double()


def _compare_with_transformers(ours, hf):
    ids = torch.randint(0, SHAPE["vocab_size"], (SEQ_LEN,), generator=torch.Generator().manual_seed(7))
    with K.use_backend("reference"), torch.no_grad():
        ref = hf(ids[None]).logits[0].double()
        torch.testing.assert_close(_logits(ours, ids), ref, atol=ATOL, rtol=RTOL)
        # the base matters at this length: rlperf's old fallback (1e6) lands far outside the tolerance
        wrong = Qwen3ForCausalLM(dataclasses.replace(ours.cfg, rope_theta=1e6))
        wrong.load_hf_state_dict(ours.hf_state_dict())
        assert (_logits(wrong, ids) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("given, theta", [("rope_theta", 10000.0), ("rope_parameters", 500.0)])
def test_transformers_checkpoint_logits_in_both_layouts(tmp_path, given, theta, layout):
    if given == "rope_parameters" and TRANSFORMERS_MAJOR < 5:
        pytest.skip("Qwen3Config(rope_parameters=...) is transformers 5")
    kw = {"rope_theta": theta} if given == "rope_theta" else {"rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": theta}}
    path = _hf_checkpoint(tmp_path, **kw)
    if LAYOUTS[layout]:
        raw = _edit_config(path, LAYOUTS[layout])
        assert ("rope_parameters" in raw) == (layout == "transformers5")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert _hf_theta(hf.config) == theta  # transformers reads the edited layout as the same model

    ours = Qwen3ForCausalLM.from_pretrained(path)  # dtype from config.json ("dtype" or "torch_dtype")
    assert ours.cfg.rope_theta == theta
    assert ours.embed_tokens.dtype == torch.float32 and ours.lm_head is not None
    _compare_with_transformers(ours, hf)


def test_tie_word_embeddings_absent_or_null_follows_the_weights(tmp_path):
    untied = _hf_checkpoint(tmp_path / "untied", rope_theta=10000.0, tie_word_embeddings=False)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(untied, dtype=torch.float32).eval()
    _edit_config(untied, lambda raw: raw.pop("tie_word_embeddings"))
    ours = Qwen3ForCausalLM.from_pretrained(untied)
    assert ours.lm_head is not None  # lm_head.weight is in the checkpoint: not silently dropped
    _compare_with_transformers(ours, hf)

    tied = _hf_checkpoint(tmp_path / "tied", rope_theta=10000.0, tie_word_embeddings=True)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
    _edit_config(tied, lambda raw: raw.update(tie_word_embeddings=None))
    ours = Qwen3ForCausalLM.from_pretrained(tied)
    assert ours.lm_head is None
    _compare_with_transformers(ours, hf)


# ---- refused: never read as plain RoPE ----------------------------------------------------------------
SUPPORTED = "rlperf implements only rope_type 'default' (plain RoPE with one rope_theta"


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "linear", "factor": 2.0},
])
def test_scaled_rope_saved_by_transformers_is_refused(tmp_path, scaling):
    # rope_scaling= is accepted by transformers 4 and 5; 5 saves it as rope_parameters, 4 as rope_scaling
    transformers.Qwen3Config(**SHAPE, rope_theta=10000.0, rope_scaling=dict(scaling)).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    expected = (f"{tmp_path / 'config.json'}: {field} with rope_type {scaling['rope_type']!r} is not supported "
                f"({field} = {json.dumps(raw[field])}); {SUPPORTED}")
    with pytest.raises(ValueError, match=re.escape(expected)):
        read_hf_config(tmp_path)
    # from_pretrained refuses before it reads any weight (there are none here)
    with pytest.raises(ValueError, match=re.escape(expected)):
        Qwen3ForCausalLM.from_pretrained(tmp_path)


def _write_config(path, **fields):
    raw = dict(SHAPE, model_type="qwen3", torch_dtype="float32", tie_word_embeddings=True)
    raw.update(fields)
    (path / "config.json").write_text(json.dumps(raw))
    return path / "config.json"


@pytest.mark.parametrize("scaling", [{"type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
                                     {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}])
def test_legacy_rope_scaling_is_refused(tmp_path, scaling):
    f = _write_config(tmp_path, rope_theta=10000.0, rope_scaling=scaling)  # transformers 4 layout
    rope_type = scaling.get("rope_type") or scaling["type"]
    with pytest.raises(ValueError) as exc:
        read_hf_config(f)
    assert str(exc.value) == (f"{f}: rope_scaling with rope_type {rope_type!r} is not supported "
                              f"(rope_scaling = {json.dumps(scaling)}); rlperf implements only rope_type 'default' "
                              f"(plain RoPE with one rope_theta; rope_scaling null or {{'rope_type': 'default'}})")


@pytest.mark.parametrize("fields, message", [
    (dict(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
     "conflicting RoPE bases: rope_theta = 10000.0, rope_parameters.rope_theta = 500.0"),
    (dict(rope_theta=None, rope_parameters=None), "no rope_theta (neither at the top level nor in rope_parameters"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}),
     "rope_parameters.full_attention with rope_type 'yarn' is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor = 0.5 is not supported"),
    (dict(rope_theta=1e4, rope_scaling="linear"), "rope_scaling 'linear' is not supported: expected an object or null"),
    (dict(rope_theta=1e4, use_sliding_window=True, sliding_window=128,
          layer_types=["full_attention", "sliding_attention"]),
     "use_sliding_window true with sliding_window 128 is not supported"),
    (dict(rope_theta=1e4, use_sliding_window=True, sliding_window=128, max_window_layers=1),
     "use_sliding_window true with sliding_window 128 is not supported"),
    (dict(rope_theta=1e4, layer_types=["full_attention", "linear_attention"]),
     "layer_types ['linear_attention'] are not supported"),
    (dict(rope_theta=1e4, torch_dtype=None, dtype="float8_e4m3fn"),
     "dtype 'float8_e4m3fn' is not supported; choose one of ['float32', 'bfloat16', 'float16']"),
    (dict(rope_theta=1e4, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(rope_theta=1e4, hidden_size=None), "missing (or null) fields ['hidden_size']"),
])
def test_unsupported_or_ambiguous_configs_are_refused(tmp_path, fields, message):
    f = _write_config(tmp_path, **fields)
    with pytest.raises(ValueError, match=re.escape(f"{f}: ") + ".*" + re.escape(message)):
        read_hf_config(f)


def test_accepted_variants(tmp_path):
    # rope_scaling naming the default type; transformers 5 nulls; num_key_value_heads null = no GQA
    cfg, dtype = read_hf_config(_write_config(tmp_path, rope_theta=5e5, rope_scaling={"type": "default"},
                                              rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                              torch_dtype=None, dtype="bfloat16", num_key_value_heads=None,
                                              rms_norm_eps=None, partial_rotary_factor=1.0,
                                              # windows are off unless use_sliding_window (as in transformers)
                                              use_sliding_window=False, sliding_window=128,
                                              layer_types=["full_attention", "sliding_attention"]))
    assert (cfg.rope_theta, dtype, cfg.num_key_value_heads, cfg.rms_norm_eps) == (5e5, "bfloat16", 4, 1e-6)
    # rlperf's own checkpoints (transformers 4 layout) keep their base
    model = Qwen3ForCausalLM.random(dataclasses.replace(preset("tiny"), rope_theta=1e4))
    model.save_pretrained(tmp_path / "ours")
    assert Qwen3ForCausalLM.from_pretrained(tmp_path / "ours").cfg == model.cfg


# ---- the commands: exit 2 with the message ---------------------------------------------------------------
@pytest.fixture
def yarn_checkpoint(tmp_path):
    path = tmp_path / "yarn"
    path.mkdir()
    f = _write_config(path, rope_theta=None, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    return path, f"{f}: rope_parameters with rope_type 'yarn' is not supported"


def test_train_with_unsupported_checkpoint_exits_2(tmp_path, yarn_checkpoint, capsys):
    path, message = yarn_checkpoint
    code = main(["train", "--hf-checkpoint", str(path), "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    assert f"rlperf train: --hf-checkpoint {path}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out" / METRICS_FILE).exists()


def test_serve_with_unsupported_checkpoint_exits_2(tmp_path, yarn_checkpoint, capsys):
    path, message = yarn_checkpoint
    assert main(["serve", "--model-path", str(path)]) == 2
    assert f"rlperf serve: --model-path {path}: {message}" in capsys.readouterr().err
    assert main(["serve", "--model-path", str(tmp_path / "nope")]) == 2
    assert f"--model-path {tmp_path / 'nope'}: neither a preset" in capsys.readouterr().err


def test_train_with_checkpoint_without_weights_exits_2(tmp_path, capsys):
    # config.json passes the early check; the missing weights surface while the run is built
    _write_config(tmp_path, rope_theta=1e4)
    code = main(["train", "--hf-checkpoint", str(tmp_path), "--output-dir", str(tmp_path / "out"), "--no-progress",
                 "--skip-gates"])
    assert code == 2
    assert f"rlperf train: --hf-checkpoint {tmp_path}: {tmp_path}: no model.safetensors" in capsys.readouterr().err


def test_transformers5_moe_expert_count_alias():
    """transformers 5's Qwen3MoeConfig writes the expert count as num_local_experts (to_dict, save_pretrained):
    the same config as num_experts; an explicit num_experts wins."""
    from rlperf.model.config import config_from_hf_dict

    base = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=301, num_experts_per_tok=2,
                moe_intermediate_size=32, rope_theta=1e6)
    alias, _ = config_from_hf_dict({**base, "num_local_experts": 6, "num_experts": None})
    plain, _ = config_from_hf_dict({**base, "num_experts": 6})
    assert alias == plain and alias.num_experts == 6
    both, _ = config_from_hf_dict({**base, "num_experts": 4, "num_local_experts": 6})
    assert both.num_experts == 4
