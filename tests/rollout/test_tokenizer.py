"""Tokenizers: the built-in byte tokenizer, and a checkpoint directory with its own HF tokenizer."""
import json

import pytest
import torch

from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.args import ServerArgs
from rlperf.rollout.tokenizer import BYTE_EOS_ID, BYTE_PAD_ID, ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer(512)
    text = "héllo ✓ world"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids[:2] + [BYTE_EOS_ID, BYTE_PAD_ID, 300, 511] + ids[2:]) == text  # specials/unused skipped
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte sequence decodes to a replacement char
    assert tok.eos_token_ids == (BYTE_EOS_ID,)
    with pytest.raises(ValueError, match="vocabulary of >= 258"):
        ByteTokenizer(256)
    assert isinstance(load_tokenizer(None, 512), ByteTokenizer)


def _hf_tokenizer_dir(path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<|endoftext|>", "<unk>", "<|im_end|>"] + [f"w{i}" for i in range(100)] + ["hello", "world"]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<unk>",
                                                additional_special_tokens=["<|im_end|>"])
    fast.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return words


def test_checkpoint_directory_with_hf_tokenizer_serves_text(tmp_path):
    from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
    from rlperf.rollout.server import load_model

    model = Qwen3ForCausalLM.random(preset("tiny"), seed=3)
    model.save_pretrained(tmp_path)
    words = _hf_tokenizer_dir(tmp_path)
    loaded, tok = load_model(ServerArgs(model_path=str(tmp_path), device="cpu"))
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (0, 2)
    for (name, a), b in zip(model.hf_state_dict().items(), loaded.hf_state_dict().values()):
        assert torch.equal(a, b), name
    ids = tok.encode("hello world w7")
    assert ids == [words.index("hello"), words.index("world"), words.index("w7")]
    assert tok.decode(ids + [0]) == "hello world w7"  # EOS is a special token: skipped
    import rlperf.kernels as K

    with K.use_backend("reference"):
        engine = Engine(loaded, tok, EngineConfig(max_total_tokens=1024))
        (r,) = engine.generate([ids], SamplingParams(max_new_tokens=5, seed=1, ignore_eos=True))
    assert len(r.output_ids) == 5 and r.text == tok.decode(r.output_ids)


def test_unknown_model_path_is_refused():
    from rlperf.rollout.server import load_model

    with pytest.raises(ValueError, match="neither a preset"):
        load_model(ServerArgs(model_path="/no/such/dir", device="cpu"))
