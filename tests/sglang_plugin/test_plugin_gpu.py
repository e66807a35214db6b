"""rlperf's SGLang plugin in real SGLang engines (GPU; SGLang 0.5.17 importable: bench/device_sglang.sh).

Two ``python -m sglang.launch_server`` engines with ``--attention-backend rlperf --page-size 128
--enable-deterministic-inference`` (radix cache on, decode CUDA graphs on) behind the real sglang-router,
on the 0.6b shape in bf16 with random weights saved in HF format. rlperf's own engine on the same
weights gives the reference. One seeded request goes through the router in 50 batches, each mixed with
other requests of random lengths and seeds sent at the same time; every copy must come back with the
same output ids and log-probs, equal to rlperf's engine's bit for bit. Repeats of the request hit the
radix cache (its prompt's pages are cached after the first), so prefix reuse is covered too.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import random
import sys
import urllib.request

import pytest
import torch

pytestmark = pytest.mark.gpu

needs = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None
    or importlib.util.find_spec("sglang_router") is None,
    reason="needs CUDA, SGLang 0.5.17 and sglang-router (bench/device_sglang.sh puts the unpacked pack on the path)")

PROMPT_LEN, NEW_TOKENS, SEED, TEMPERATURE = 300, 24, 1234, 0.8


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _request(ids, seed, new_tokens, temperature=TEMPERATURE):
    return {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": temperature, "sampling_seed": seed,
                                "ignore_eos": True}}


def _output(reply: dict) -> tuple[tuple[int, ...], tuple[str, ...]]:
    triples = reply["meta_info"]["output_token_logprobs"]
    return tuple(t[1] for t in triples), tuple(float(t[0]).hex() for t in triples)


def _engine_reference(model, prompt_seed: int):
    """A random prompt of PROMPT_LEN ids (``random.Random(prompt_seed)``) and rlperf's own engine's output
    for it (ids, log-probs as hex) with the test's seed and temperature; ``model`` is freed after."""
    from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
    from rlperf.rollout.tokenizer import ByteTokenizer

    g = random.Random(prompt_seed)
    prompt = [g.randrange(1000, 50000) for _ in range(PROMPT_LEN)]
    engine = Engine(model, ByteTokenizer(model.cfg.vocab_size), EngineConfig(max_total_tokens=1 << 15))
    ref = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, seed=SEED,
                                                   ignore_eos=True))[0]
    del engine
    torch.cuda.empty_cache()
    return prompt, (tuple(ref.output_ids), tuple(float(x).hex() for x in ref.output_logprobs))


@needs
def test_seeded_request_in_50_mixed_batches_equals_rlperf_engine(tmp_path, free_ports):
    from rlperf.loop.sglang_engines import start_sglang_servers
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.rollout.router import start_router

    cfg = preset("qwen3-0.6b")
    model = Qwen3ForCausalLM.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    model.save_pretrained(tmp_path / "model")
    prompt, want = _engine_reference(model, 0)
    del model
    torch.cuda.empty_cache()

    ports = free_ports(3)
    gpus = torch.cuda.device_count()
    argvs = [["--model-path", str(tmp_path / "model"), "--host", "127.0.0.1", "--port", str(ports[i]),
              "--attention-backend", "rlperf", "--page-size", "128", "--enable-deterministic-inference",
              "--skip-tokenizer-init", "--mem-fraction-static", "0.3" if gpus == 1 else "0.6",
              "--cuda-graph-max-bs", "32", "--random-seed", "0", "--dtype", "bfloat16"] for i in range(2)]
    envs = [{"CUDA_VISIBLE_DEVICES": str(i % gpus)} for i in range(2)]
    procs, urls = start_sglang_servers(argvs, envs, tmp_path, timeout=600)
    router = None
    try:
        router = start_router(urls, "127.0.0.1", ports[2], log_dir=str(tmp_path))
        base = f"http://127.0.0.1:{ports[2]}"
        seen = []
        g = random.Random(100)  # the other requests of each mixed batch
        with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
            for batch in range(50):
                others = [_request([g.randrange(1000, 50000) for _ in range(g.randrange(1, 700))], g.randrange(1 << 30),
                                   g.randrange(1, 40), g.choice([0.6, 0.8, 1.0])) for _ in range(g.randrange(0, 20))]
                bodies = others + [_request(prompt, SEED, NEW_TOKENS)]
                g.shuffle(bodies)
                replies = list(pool.map(lambda b: _post(base + "/generate", b), bodies))
                seen.append(_output(replies[bodies.index(next(b for b in bodies if b["input_ids"] is prompt))]))
        distinct = set(seen)
        assert len(distinct) == 1, f"{len(distinct)} distinct outputs of one seeded request over 50 mixed batches"
        assert seen[0] == want, f"SGLang + plugin {seen[0]} != rlperf's engine {want}"
        print(f"50 mixed batches, 2 engines: 1 distinct output, equal to rlperf's engine (ids {list(want[0][:8])}...)",
              file=sys.stderr)
    finally:
        for p in procs + ([router] if router is not None else []):
            p.kill()
        for p in procs + ([router] if router is not None else []):
            p.wait(timeout=30)
        for f in sorted(tmp_path.glob("*.log")):
            out = os.environ.get("OUT")
            if out:
                (__import__("pathlib").Path(out) / f"plugin-gpu-{f.name}").write_text(f.read_text()[-200_000:])


needs_two = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or importlib.util.find_spec("sglang") is None,
    reason="needs 2 GPUs and SGLang 0.5.17 (issue #42: the --tp-size 2 engine)")


def _tp2_engine_against_rlperf_engine(tmp_path, free_ports, leaves, seed: int) -> None:
    """One ``--tp-size 2`` engine over both GPUs on a random 0.6b model (``leaves``: the tree numerics, its
    ``config.json`` naming them; None: plain tensor parallelism) against rlperf's engine on one GPU with the
    same model: a seeded request alone and inside a mixed batch of 8 gives the same ids and log-probs."""
    from rlperf.loop.sglang_engines import save_engine_model, start_sglang_servers
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM

    cfg = preset("qwen3-0.6b")
    model = Qwen3ForCausalLM.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda", reduction_leaves=leaves)
    save_engine_model(model, tmp_path / "model", "auto")
    prompt, want = _engine_reference(model, seed)
    del model
    torch.cuda.empty_cache()
    (port,) = free_ports(1)
    argv = ["--model-path", str(tmp_path / "model"), "--host", "127.0.0.1", "--port", str(port), "--tp-size", "2",
            "--attention-backend", "rlperf", "--page-size", "128", "--enable-deterministic-inference",
            "--skip-tokenizer-init", "--mem-fraction-static", "0.5", "--random-seed", "0", "--dtype", "bfloat16"]
    procs, urls = start_sglang_servers([argv], [{"CUDA_VISIBLE_DEVICES": "0,1"}], tmp_path, timeout=600)
    g = random.Random(100 + seed)  # the other requests of the mixed batch
    try:
        alone = _output(_post(urls[0] + "/generate", _request(prompt, SEED, NEW_TOKENS)))
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            bodies = [_request([g.randrange(1000, 50000) for _ in range(g.randrange(1, 500))], g.randrange(1 << 30),
                               g.randrange(1, 30)) for _ in range(7)] + [_request(prompt, SEED, NEW_TOKENS)]
            mixed = _output(list(pool.map(lambda b: _post(urls[0] + "/generate", b), bodies))[-1])
        what = "tree" if leaves else "plain"
        assert alone == mixed == want, f"--tp-size 2 ({what}) {alone} / {mixed} != rlperf's engine {want}"
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


@needs_two
def test_tp2_engine_equals_rlperf_tree_engine(tmp_path, free_ports):
    """One ``--tp-size 2`` engine (the tree numerics: ``rlperf_reduction_leaves`` in config.json) against
    rlperf's engine on one GPU with ``reduction_leaves`` 8."""
    from rlperf.kernels.tree_reduce import TREE_LEAVES

    _tp2_engine_against_rlperf_engine(tmp_path, free_ports, TREE_LEAVES, 1)


@needs_two
def test_tp2_plain_engine_equals_rlperf_engine(tmp_path, free_ports):
    """One ``--tp-size 2`` engine on a model folder without ``rlperf_reduction_leaves`` (plain tensor
    parallelism: the fsdp trainer's numerics) against rlperf's plain engine on one GPU."""
    _tp2_engine_against_rlperf_engine(tmp_path, free_ports, None, 2)
