"""SGLang's own benchmark client against ``rlperf serve``: ``python -m sglang.bench_serving --backend sglang``
(random-ids prompts, streaming on) through the real sglang-router to two workers serving a tiny
checkpoint with a local Hugging Face tokenizer.

The client finds the model through ``GET /v1/models`` (no ``--model``), loads the tokenizer from
that path, streams ``/generate`` and counts tokens from each chunk's ``meta_info.completion_tokens``.

Needs the ``sglang`` package, not a dependency of rlperf; with torch installed, on a CPU machine:
``pip install --no-deps sglang==0.5.9 && pip install pybase64 requests ipython datasets pillow``.
Which releases work: 0.5.3.post3 to 0.5.9 (0.5.3.post3 needs only pybase64, requests and ipython;
0.5.4 on import ``datasets`` and ``PIL`` at the top of ``bench_serving``); 0.5.2 and older fail
after the run, reading ``internal_states`` from ``/get_server_info``, which sglang-router answers
itself; 0.5.10 and newer import ``torchvision`` under ``import sglang``, and PyPI's torchvision
(a CUDA build) does not load next to a CPU-only torch.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")
pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
INSTALL = "pip install --no-deps sglang==0.5.9 && pip install pybase64 requests ipython datasets pillow"
if importlib.util.find_spec("sglang") is None:
    # part of the README's test install: a missing client fails, never skips silently
    pytest.fail(f"needs SGLang's client: {INSTALL}", pytrace=False)

from rlperf.model import preset  # noqa: E402
from rlperf.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlperf.rollout.args import ServerArgs  # noqa: E402
from rlperf.rollout.router import http_json  # noqa: E402

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 24, 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model saved as an HF checkpoint with a word-level tokenizer covering its whole vocabulary."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-hf")
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0)
    model.save_pretrained(path)
    words = ["<|endoftext|>", "<unk>", "<|im_end|>"]
    words += [f"w{i}" for i in range(model.cfg.vocab_size - len(words))]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<unk>",
                                         additional_special_tokens=["<|im_end|>"]).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def cluster(launch_router_cluster, checkpoint):
    args = ServerArgs(model_path=str(checkpoint), kernel_backend="reference", max_total_tokens=4096,
                      num_threads=1, device="cpu")
    with launch_router_cluster(args) as c:
        yield c


def test_sglang_bench_serving_streams_through_the_router(cluster, checkpoint, tmp_path):
    status, models = http_json(cluster.router_url + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == str(checkpoint), models
    out = tmp_path / "bench.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", cluster.router_url,
           "--dataset-name", "random-ids", "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
           "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1.0", "--request-rate", "inf",
           "--seed", "1", "--output-file", str(out), "--output-details", "--disable-tqdm"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode != 0 and "_get_module_details" in proc.stderr:  # python -m failed to import the module
        pytest.fail(f"sglang.bench_serving does not import here ({proc.stderr.strip().splitlines()[-1]}); {INSTALL}")
    assert proc.returncode == 0, log
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["completed"] == NUM_PROMPTS and not any(result["errors"]), log
    # completion_tokens of the streamed chunks: every request ran to max_new_tokens (ignore_eos)
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS and result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert all(t > 0 for t in result["ttfts"]) and all(result["generated_texts"])
    # inter-token latencies exist only when the reply came in several chunks: it streamed
    assert sum(len(itl) for itl in result["itls"]) > 0, result["itls"]
    assert "Successful requests:" in proc.stdout and "Serving Benchmark Result" in proc.stdout
