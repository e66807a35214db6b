"""Checks of rlperf's SGLang plugin against the real SGLang 0.5.17 package, on the CPU.

Run as a script in a process whose path holds SGLang 0.5.17 (``tests/sglang_plugin/test_plugin.py``
starts it): it imports :mod:`sglang_boot` first, loads the plugins the way SGLang does
(``sglang.srt.plugins.load_plugins``: the entry point rlperf declares), runs every ``check_*`` function
and prints one JSON object ``{check: {"ok": bool, "detail": str}}`` as its last line.

The engine steps use SGLang's own classes: ``ServerArgs``, ``ReqToTokenPool``, ``MHATokenToKVPool``
(CPU tensors), ``ForwardBatch`` and ``ForwardMode``, ``SamplingBatchInfo``, the forward context, the
model registry; only the model runner is left out (it needs CUDA): the steps call what it calls, in its
order (``attn_backend.init_forward_metadata``, ``model.forward``, ``sampler``).
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
import tempfile
import traceback

import sglang_boot  # noqa: F401  (first: torchvision stand-in)
import torch

torch.set_default_dtype(torch.float32)

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt import server_args as sa  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.models.registry import ModelRegistry  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import TOP_K_ALL  # noqa: E402

import rlperf.sglang_plugin as plugin  # noqa: E402
from rlperf.kernels.attention import PAGE_SIZE as P  # noqa: E402
from rlperf.model import ModelConfig  # noqa: E402
from rlperf.model.qwen3 import Qwen3ForCausalLM as RlperfQwen3  # noqa: E402
from rlperf.model.qwen3 import config_to_hf  # noqa: E402
from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from rlperf.rollout.tokenizer import ByteTokenizer  # noqa: E402
from rlperf.sglang_plugin.attention import RlperfAttnBackend  # noqa: E402
from rlperf.sglang_plugin.models import ENTRY_CLASSES  # noqa: E402
from rlperf.sglang_plugin.sampler import RlperfSampler, apply_min_p, host_temperatures, request_temperature  # noqa: E402

DENSE = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=301, max_position_embeddings=1024)
MOE = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=301, max_position_embeddings=1024,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
TREE = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=304, max_position_embeddings=1024)
"""DENSE with a vocabulary that splits into the tree's leaves (tensor-parallel checks)."""
LEAVES = 8
MODELS = pathlib.Path(tempfile.mkdtemp(prefix="rlperf-sglang-checks-"))


def model_dir(cfg: ModelConfig, name: str, architectures=None, leaves=None) -> pathlib.Path:
    path = MODELS / name
    path.mkdir(exist_ok=True)
    hf = config_to_hf(cfg, torch.float32, leaves)
    if architectures is not None:
        hf["architectures"] = architectures
    (path / "config.json").write_text(json.dumps(hf))
    return path


def server_args(path, **kw):
    base = dict(model_path=str(path), attention_backend="rlperf", page_size=P, enable_deterministic_inference=True,
                skip_tokenizer_init=True, device="cpu")
    return sa.ServerArgs(**{**base, **kw})


def expect_error(fn, *needles) -> str:
    try:
        fn()
    except plugin.PluginError as exc:
        text = str(exc)
        assert "\n" not in text, f"not one line: {text!r}"
        for n in needles:
            assert n in text, f"{n!r} not in {text!r}"
        return text
    raise AssertionError(f"no PluginError (wanted one naming {needles})")


# ---- registration and start-up checks ---------------------------------------------------------
def check_registration():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert eps.get("rlperf") == "rlperf.sglang_plugin:register", eps
    for name, choices in (("attention", sa.ATTENTION_BACKEND_CHOICES),
                          ("deterministic", sa.DETERMINISTIC_ATTENTION_BACKEND_CHOICES),
                          ("radix deterministic", sa.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND)):
        assert choices.count("rlperf") == 1, (name, choices)
    plugin.register()  # idempotent: a second call adds nothing
    assert sa.ATTENTION_BACKEND_CHOICES.count("rlperf") == 1
    assert "rlperf" in ATTENTION_BACKENDS
    import argparse

    parser = argparse.ArgumentParser()
    sa.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--attention-backend", "rlperf", "--page-size", str(P)])
    return f"entry point {eps['rlperf']}; --attention-backend {ns.attention_backend} accepted"


def check_server_args():
    path = model_dir(DENSE, "dense")
    args = server_args(path)
    from sglang.srt.model_executor.cuda_graph_config import Backend

    assert args.attention_backend == "rlperf" and args.page_size == P
    assert not args.disable_radix_cache, "deterministic mode must keep the radix cache for rlperf"
    assert args.cuda_graph_config.prefill.backend == Backend.DISABLED
    other = sa.ServerArgs(model_path=str(path), attention_backend="triton", skip_tokenizer_init=True, device="cpu")
    assert other.attention_backend == "triton"  # another backend: the plugin does nothing
    errors = [
        expect_error(lambda: server_args(path, page_size=64), "--page-size 128", "64"),
        expect_error(lambda: server_args(path, page_size=1), "--page-size 128"),
        expect_error(lambda: server_args(model_dir(DENSE, "llama", ["LlamaForCausalLM"])),
                     "LlamaForCausalLM", "Qwen3ForCausalLM"),
        expect_error(lambda: plugin.check_sglang_version("0.5.9"), "0.5.17", "0.5.9"),
    ]
    moe = server_args(model_dir(MOE, "moe"))
    assert moe.attention_backend == "rlperf"
    return "; ".join(errors)


def check_model_registry():
    path = model_dir(DENSE, "dense")
    plain = sa.ServerArgs(model_path=str(path), attention_backend="triton", skip_tokenizer_init=True, device="cpu")
    sa.set_global_server_args_for_scheduler(plain)
    theirs, _ = ModelRegistry.resolve_model_cls(["Qwen3ForCausalLM"])
    assert theirs.__module__.startswith("sglang."), theirs
    sa.set_global_server_args_for_scheduler(server_args(path))
    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        cls, got = ModelRegistry.resolve_model_cls([arch])
        assert cls is ENTRY_CLASSES[arch] and got == arch, (cls, got)
    err = expect_error(lambda: ModelRegistry.resolve_model_cls(["LlamaForCausalLM"]), "LlamaForCausalLM")
    # the SGLANG_EXTERNAL_MODEL_PACKAGE route: every module's EntryClass, replacing SGLang's
    ModelRegistry.register("rlperf.sglang_plugin.models", overwrite=True, strict=True)
    assert ModelRegistry.models["Qwen3ForCausalLM"] is ENTRY_CLASSES["Qwen3ForCausalLM"]
    assert ModelRegistry.models["Qwen3MoeForCausalLM"] is ENTRY_CLASSES["Qwen3MoeForCausalLM"]
    from sglang.srt.layers.sampler import create_sampler

    assert isinstance(create_sampler(), RlperfSampler)
    sa.set_global_server_args_for_scheduler(plain)
    from transformers import AutoConfig

    expect_error(lambda: ENTRY_CLASSES["Qwen3ForCausalLM"](AutoConfig.from_pretrained(path)), "--attention-backend rlperf")
    return err


# ---- engine steps ---------------------------------------------------------------------------
class Runner:
    """What SGLang's model runner holds for a step: the pools, the attention backend, the model, the sampler."""

    def __init__(self, cfg: ModelConfig, path, reference: RlperfQwen3, num_pages: int = 12, max_reqs: int = 8,
                 context: int = 1024, tp_size: int = 1):
        from transformers import AutoConfig

        sa.set_global_server_args_for_scheduler(server_args(path, tp_size=tp_size))
        self.page_size, self.device = P, "cpu"
        self.req_to_token_pool = ReqToTokenPool(size=max_reqs, max_context_len=context, device="cpu",
                                                enable_memory_saver=False)
        # a TP worker's pool holds its share of the key-value heads (SGLang's get_num_kv_heads(tp_size))
        self.token_to_kv_pool = MHATokenToKVPool(size=num_pages * P - P, page_size=P, dtype=torch.float32,
                                                 head_num=cfg.num_key_value_heads // tp_size, head_dim=cfg.head_dim,
                                                 layer_num=cfg.num_hidden_layers, device="cpu",
                                                 enable_memory_saver=False)
        self.attn_backend = ATTENTION_BACKENDS["rlperf"](self)
        assert isinstance(self.attn_backend, RlperfAttnBackend)
        cls, _ = ModelRegistry.resolve_model_cls(AutoConfig.from_pretrained(path).architectures)
        self.model = cls(AutoConfig.from_pretrained(path))
        self.model.load_weights(reference.hf_state_dict().items())
        self.sampler = RlperfSampler()
        self.free_pages = list(range(1, num_pages))  # page 0: SGLang's padding slots
        self.pages: dict[int, list[int]] = {}

    def slot(self, req: int, pos: int) -> int:
        while len(self.pages[req]) <= pos // P:
            page = self.free_pages.pop(0)
            self.pages[req].append(page)
            self.req_to_token_pool.req_to_token[req, (len(self.pages[req]) - 1) * P:len(self.pages[req]) * P] = \
                torch.arange(page * P, page * P + P, dtype=torch.int32)
        return self.pages[req][pos // P] * P + pos % P

    def share_prefix(self, req: int, donor: int, pages: int) -> None:
        """Radix-cache reuse: ``req`` starts with ``donor``'s first ``pages`` pages (already computed)."""
        self.pages[req] = list(self.pages[donor][:pages])
        self.req_to_token_pool.req_to_token[req, :pages * P] = self.req_to_token_pool.req_to_token[donor, :pages * P]

    def step(self, reqs, new_tokens, cached, params, graph_bs: int | None = None):
        """One forward + sample: ``reqs`` pool rows, ``new_tokens[i]`` the ids to run after ``cached[i]``
        cached tokens; ``params[i]`` (temperature, top_p, top_k, seed). Returns (tokens, logprobs)."""
        decode = all(len(t) == 1 for t in new_tokens) and all(c > 0 for c in cached)
        for r in reqs:
            self.pages.setdefault(r, [])
        ids, pos, slots = [], [], []
        for r, toks, c in zip(reqs, new_tokens, cached):
            ids += toks
            pos += range(c, c + len(toks))
            slots += [self.slot(r, p) for p in range(c, c + len(toks))]
        seq_lens = [c + len(t) for c, t in zip(cached, new_tokens)]
        bs = len(reqs)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=bs,
            input_ids=torch.tensor(ids), req_pool_indices=torch.tensor(reqs), seq_lens=torch.tensor(seq_lens),
            out_cache_loc=torch.tensor(slots), seq_lens_sum=sum(seq_lens), seq_lens_cpu=torch.tensor(seq_lens),
            positions=torch.tensor(pos), return_logprob=True, top_logprobs_nums=[0] * bs,
            token_ids_logprobs=[None] * bs)
        if not decode:
            fb.extend_seq_lens = torch.tensor([len(t) for t in new_tokens], dtype=torch.int32)
            fb.extend_seq_lens_cpu = [len(t) for t in new_tokens]
            fb.extend_prefix_lens = torch.tensor(cached, dtype=torch.int32)
            fb.extend_prefix_lens_cpu = list(cached)
            fb.extend_logprob_start_lens_cpu = [len(t) for t in new_tokens]  # output log-probs only
        # SGLang's SamplingParams: temperature 0 is stored as temperature 1 with top_k 1; top_k -1 as TOP_K_ALL
        params = [(1.0, p[1], 1, p[3]) if p[0] == 0 else p for p in params]
        temps = [p[0] for p in params]
        top_ks = [p[2] if p[2] > 0 else TOP_K_ALL for p in params]
        fb.sampling_info = SamplingBatchInfo(
            temperatures=torch.tensor(temps, dtype=torch.float32).view(-1, 1),
            top_ps=torch.tensor([p[1] for p in params], dtype=torch.float32),
            top_ks=torch.tensor(top_ks, dtype=torch.int32),
            min_ps=torch.zeros(bs), is_all_greedy=all(k <= 1 for k in top_ks), is_any_greedy=any(k <= 1 for k in top_ks),
            need_top_p_sampling=any(p[1] < 1 for p in params), need_top_k_sampling=any(k != TOP_K_ALL for k in top_ks),
            need_min_p_sampling=False, vocab_size=self.model.cfg.vocab_size,
            sampling_seed=torch.tensor([p[3] for p in params], dtype=torch.int64))
        backend = self.attn_backend
        if graph_bs is not None:  # the decode-graph path: static buffers, rows padded to graph_bs
            assert decode and graph_bs >= bs
            backend.init_cuda_graph_state(max_bs=graph_bs, max_num_tokens=graph_bs)
            pad = graph_bs - bs
            fb.batch_size = graph_bs
            fb.req_pool_indices = torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=torch.int64)])
            fb.seq_lens = torch.cat([fb.seq_lens, torch.full((pad,), backend.get_cuda_graph_seq_len_fill_value())])
            fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=torch.int64)])
            fb.input_ids = torch.cat([fb.input_ids, torch.zeros(pad, dtype=torch.int64)])
            fb.positions = torch.cat([fb.positions, torch.zeros(pad, dtype=torch.int64)])
            backend.init_forward_metadata_out_graph(fb, in_capture=False)
        else:
            backend._graph = None
            backend.init_forward_metadata(fb)
        with forward_context(ForwardContext(attn_backend=backend)):
            out = self.model.forward(fb.input_ids, fb.positions, fb)
        if graph_bs is not None:  # the runner slices the replayed outputs to the real rows
            out.next_token_logits, out.hidden_states = out.next_token_logits[:bs], out.hidden_states[:bs]
            fb.positions = fb.positions[:bs]
        positions = fb.positions if decode else torch.tensor(seq_lens) - 1  # what ModelRunner.sample passes
        tokens = self.sampler(out, fb.sampling_info, True, fb.top_logprobs_nums, fb.token_ids_logprobs, positions)
        return tokens.tolist(), out.next_token_logprobs.tolist()


def engine_run(reference, prompts, params, new_tokens):
    engine = Engine(reference, ByteTokenizer(reference.cfg.vocab_size), EngineConfig(max_total_tokens=4096))
    sps = [SamplingParams(max_new_tokens=new_tokens, temperature=t, top_p=p, top_k=k if k > 0 else -1, seed=s,
                          ignore_eos=True) for t, p, k, s in params]
    return [(r.output_ids, r.output_logprobs) for r in engine.generate(prompts, sps)]


def plugin_run(runner, reqs, prompts, params, new_tokens, graph_bs=None, prefix=None):
    """Prefill every prompt (``prefix``: (req, donor, pages) shares a donor's cached pages first), then
    decode ``new_tokens - 1`` steps; each request's (output ids, log-probs)."""
    cached = [0] * len(reqs)
    if prefix is not None:
        req, donor, pages = prefix
        runner.share_prefix(req, donor, pages)
        cached[reqs.index(req)] = pages * P
    outs = [([], []) for _ in reqs]
    toks = [p[c:] for p, c in zip(prompts, cached)]
    for step in range(new_tokens):
        t, lp = runner.step(reqs, toks, cached, params, graph_bs=graph_bs if step > 0 else None)
        for i in range(len(reqs)):
            outs[i][0].append(t[i])
            outs[i][1].append(lp[i])
        cached = [c + len(x) for c, x in zip(cached, toks)]
        toks = [[x] for x in t]
    return outs


def _bits(outs):
    return [(ids, [float(x).hex() for x in lps]) for ids, lps in outs]


def _steps_match_engine(cfg, name):
    path = model_dir(cfg, name)
    reference = RlperfQwen3.random(cfg, seed=3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (150, 37, 129)]
    params = [(0.7, 1.0, 0, 11), (1.0, 0.9, 20, 12), (0.85, 0.95, 0, 13)]
    want = engine_run(reference, prompts, params, 4)
    runner = Runner(cfg, path, reference)
    got = plugin_run(runner, [1, 2, 3], prompts, params, 4)
    assert _bits(got) == _bits(want), f"plugin {got} != rlperf engine {want}"
    # the same requests in another batch (alone, other pool rows and pages) and through the decode-graph
    # metadata path with padded rows: the same tokens and log-probs
    alone = plugin_run(Runner(cfg, path, reference), [4], prompts[1:2], params[1:2], 4)
    assert _bits(alone) == _bits(want[1:2]), (alone, want[1:2])
    graphed = plugin_run(Runner(cfg, path, reference), [2, 5], prompts[:2], params[:2], 4, graph_bs=4)
    assert _bits(graphed) == _bits(want[:2]), (graphed, want[:2])
    # radix-cache reuse: request 6 finds request 1's first page cached and prefills only the rest
    shared = Runner(cfg, path, reference)
    plugin_run(shared, [1], prompts[:1], params[:1], 1)
    reused = plugin_run(shared, [6], prompts[:1], params[:1], 4, prefix=(6, 1, 1))
    assert _bits(reused) == _bits(want[:1]), (reused, want[:1])
    return f"{len(prompts)} requests x 4 tokens: tokens and log-probs equal rlperf's engine bit for bit (batched, " \
           f"alone, decode-graph metadata with padding, after a cached {P}-token prefix)"


def check_dense_steps_match_rlperf_engine():
    return _steps_match_engine(DENSE, "dense")


def check_moe_steps_match_rlperf_engine():
    return _steps_match_engine(MOE, "moe")


class _Recorder:
    """Stands where SGLang's RoutedExpertsCapturer stands (``--enable-return-routed-experts``): keeps what
    each MoE layer hands it."""

    def __init__(self):
        self.layers: dict[int, torch.Tensor] = {}

    def capture(self, layer_id: int, topk_indices: torch.Tensor) -> None:
        self.layers[layer_id] = topk_indices.clone()


def check_moe_routed_experts_reach_sglangs_capturer():
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

    from rlperf.model.moe import RoutingTrace

    path = model_dir(MOE, "moe")
    reference = RlperfQwen3.random(MOE, seed=3)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, MOE.vocab_size, (n,), generator=g).tolist() for n in (133, 21)]
    recorder = _Recorder()
    set_global_experts_capturer(recorder)
    try:
        Runner(MOE, path, reference).step([1, 2], prompts, [0, 0], [(1.0, 1.0, 0, 1), (1.0, 1.0, 0, 2)])
    finally:
        set_global_experts_capturer(None)
    assert sorted(recorder.layers) == MOE.moe_layers, sorted(recorder.layers)
    want = []
    for p in prompts:
        trace = RoutingTrace()
        reference.forward_packed(torch.tensor(p), torch.arange(len(p)), torch.tensor([0, len(p)], dtype=torch.int32),
                                 trace)
        want.append(trace.experts())
    got = torch.stack([recorder.layers[i] for i in MOE.moe_layers], dim=1)
    assert torch.equal(got, torch.cat(want)), "captured experts differ from the trainer's routing"
    return f"{len(MOE.moe_layers)} MoE layers x {got.shape[0]} tokens: the trainer's experts, through SGLang's capturer"


def check_load_weights_errors():
    path = model_dir(DENSE, "dense")
    reference = RlperfQwen3.random(DENSE, seed=1)
    runner = Runner(DENSE, path, reference)
    m = runner.model
    for name, t in reference.hf_state_dict().items():
        assert torch.equal(m.model.hf_state_dict()[name], t), name
    m.load_weights([("lm_head.weight", torch.zeros(DENSE.vocab_size, DENSE.hidden_size)),  # tied: skipped
                    ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])
    e1 = expect_error(lambda: m.load_weights([("model.layers.0.mlp.bogus.weight", torch.zeros(1))]), "bogus")
    e2 = expect_error(lambda: m.load_weights([("model.norm.weight", torch.zeros(3))]), "model.norm.weight", "(3,)")
    return f"{e1}; {e2}"


def check_greedy_rows_and_host_temperatures():
    path = model_dir(DENSE, "dense")
    reference = RlperfQwen3.random(DENSE, seed=3)
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, DENSE.vocab_size, (n,), generator=g).tolist() for n in (61, 140)]
    for params in ([(0.0, 1.0, 0, 21), (0.0, 1.0, 0, 22)],     # all greedy: SGLang's top_k 1, no filter, no sync
                   [(0.0, 1.0, 0, 21), (0.7, 0.9, 0, 11)]):    # a greedy row beside a filtered sampled one
        want = engine_run(reference, prompts, params, 4)
        got = plugin_run(Runner(DENSE, path, reference), [1, 2], prompts, params, 4)
        assert _bits(got) == _bits(want), f"{params}: plugin {got} != rlperf engine {want}"
    temps = torch.tensor([0.7, 1.0], dtype=torch.float32).view(-1, 1)
    first = host_temperatures(temps)
    assert first == [0.7, 1.0] and host_temperatures(temps) is first, "a steady batch reads its temperatures once"
    temps.mul_(2.0)  # changed in place: read again
    assert host_temperatures(temps) == [1.4, 2.0]
    assert host_temperatures(torch.tensor([[0.5]])) == [0.5]
    return "greedy requests (SGLang's top_k 1) give rlperf's greedy tokens and log-probs, alone and beside " \
           "sampled rows; a batch's temperatures are read to the host once per tensor"


def check_sampler_pieces():
    for t in (0.7, 0.6, 1.0, 0.85, 0.123456):
        stored = float(torch.tensor(t, dtype=torch.float32))
        assert request_temperature(stored) == t, (t, stored)
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0], [0.0, 0.0, 0.0, 0.0]])
    kept = apply_min_p(logits, torch.tensor([1.0, 1.0]), torch.tensor([0.3, 0.5]))
    # row 0: p_i / p_max = e^(l_i - 2): 1, 0.37, 0.14, ~0 -> keep the first two
    assert torch.isinf(kept[0, 2:]).all() and torch.isfinite(kept[0, :2]).all() and torch.isfinite(kept[1]).all()
    assert math.isinf(float(apply_min_p(logits[:1], torch.tensor([2.0]), torch.tensor([0.5]))[0, 3]))
    return "request_temperature round-trips 7-digit temperatures; min_p keeps p >= min_p * p_max"


# ---- tensor parallelism: the tree numerics (rlperf_reduction_leaves) at --tp-size 1 and 2 -------------------
def check_tree_and_tp_server_args():
    from rlperf.model.config import REDUCTION_LEAVES_KEY

    plain, tree = model_dir(TREE, "tree-plain"), model_dir(TREE, "tree", leaves=LEAVES)
    assert server_args(tree, tp_size=2).tp_size == 2 and server_args(tree).tp_size == 1
    assert plugin.contract.tensor_parallel_group() is None  # no SGLang groups in this process: TP 1
    bad = model_dir(TREE, "tree-6", leaves=6)
    wide = ModelConfig(**{**TREE.__dict__, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16})
    assert server_args(plain, tp_size=2).tp_size == 2  # no leaf count: plain tensor parallelism
    errors = [
        expect_error(lambda: server_args(plain, tp_size=3), "--tp-size 3 in plain numerics", "4 query heads"),
        expect_error(lambda: server_args(bad, tp_size=2), REDUCTION_LEAVES_KEY, "power of two"),
        expect_error(lambda: server_args(tree, tp_size=4), "--tp-size 4", "head"),
        expect_error(lambda: server_args(tree, tp_size=3), "3 tensor-parallel ranks"),
        expect_error(lambda: server_args(model_dir(wide, "wide", leaves=LEAVES), tp_size=2), "3 key-value heads"),
        expect_error(lambda: server_args(model_dir(MOE, "moe-tree", leaves=LEAVES), tp_size=2), "MoE"),
        expect_error(lambda: server_args(model_dir(DENSE, "dense-tree", leaves=LEAVES)), "vocab_size 301"),
    ]
    return "; ".join(errors)


def _tp_rank(rank: int, world: int, init: str, path, prompts, params, out: str, cfg=TREE, leaves=LEAVES) -> None:
    """One SGLang TP worker's part of :func:`check_tp2_steps_match_tree_engine` and
    :func:`check_tp2_plain_steps_match_plain_engine` (a forked process)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        plugin.contract.tensor_parallel_group = lambda: dist.group.WORLD  # SGLang's TP group, in a worker
        reference = RlperfQwen3.random(cfg, seed=3)  # whole tensors: every worker keeps its shard
        runner = Runner(cfg, path, reference, tp_size=world)
        assert runner.model.model.tp_size == world and runner.model.model.reduction_leaves == leaves
        assert runner.model.model.plain_tp == (leaves is None)
        # a worker takes whole tensors and keeps its shard; a wrong whole shape is named as a whole shape
        expect_error(lambda: runner.model.load_weights([("model.layers.0.self_attn.q_proj.weight",
                                                          torch.zeros(30, cfg.hidden_size))]),
                     f"(30, {cfg.hidden_size})", f"({cfg.q_size}, {cfg.hidden_size})")
        got = plugin_run(runner, [1, 2, 3], prompts, params, 4)
        pathlib.Path(out).write_text(json.dumps(_bits(got)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _tp_workers(world: int, path, prompts, params, cfg, leaves) -> list[list[tuple]]:
    """Run :func:`_tp_rank` in ``world`` forked workers on one gloo group; each worker's output bits."""
    import multiprocessing

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rlperf-tp-"))
    # fork: the workers start with SGLang imported (each import would take ~20 s of CPU)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_tp_rank, args=(r, world, f"file://{tmp}/init", path, prompts, params,
                                                 str(tmp / f"rank{r}.json"), cfg, leaves)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"TP worker exited with {p.exitcode}"
    return [[tuple(x) for x in json.loads((tmp / f"rank{r}.json").read_text())] for r in range(world)]


def check_tp2_steps_match_tree_engine():
    path = model_dir(TREE, "tree", leaves=LEAVES)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TREE.vocab_size, (n,), generator=g).tolist() for n in (150, 37, 129)]
    params = [(0.7, 1.0, 0, 11), (1.0, 0.9, 20, 12), (0.0, 1.0, 0, 13)]
    world = 2
    ranks = _tp_workers(world, path, prompts, params, TREE, LEAVES)
    tree_model = RlperfQwen3.random(TREE, seed=3, reduction_leaves=LEAVES)
    want = _bits(engine_run(tree_model, prompts, params, 4))
    one = _bits(plugin_run(Runner(TREE, path, RlperfQwen3.random(TREE, seed=3)), [1, 2, 3], prompts, params, 4))
    plain = _bits(engine_run(RlperfQwen3.random(TREE, seed=3), prompts, params, 4))
    assert one == want, f"plugin --tp-size 1 tree {one} != rlperf engine (reduction_leaves {LEAVES}) {want}"
    for r, got in enumerate(ranks):
        assert [(list(i), list(l)) for i, l in got] == [(list(i), list(l)) for i, l in want], \
            f"--tp-size {world} rank {r} {got} != rlperf engine (reduction_leaves {LEAVES}) {want}"
    assert plain != want, "the tree and the plain numerics should differ on this model"
    return f"{len(prompts)} requests x 4 tokens (prefill + 3 decode steps): --tp-size {world} (both ranks) and " \
           f"--tp-size 1 with {LEAVES} tree leaves give rlperf's engine's tree tokens and log-probs bit for bit"


def check_tp2_plain_steps_match_plain_engine():
    """Plain tensor parallelism: a model folder without a leaf count at --tp-size 2 (the dense model, and the
    MoE model whose sparse layers run whole on each rank) gives rlperf's plain engine's tokens and log-probs
    (the fsdp trainer's numerics) on both ranks, bit for bit."""
    details = []
    for cfg, name in ((TREE, "tree-plain"), (MOE, "moe")):
        path = model_dir(cfg, name)
        g = torch.Generator().manual_seed(8)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (150, 37, 129)]
        params = [(0.7, 1.0, 0, 21), (1.0, 0.9, 20, 22), (0.0, 1.0, 0, 23)]
        world = 2
        ranks = _tp_workers(world, path, prompts, params, cfg, None)
        want = _bits(engine_run(RlperfQwen3.random(cfg, seed=3), prompts, params, 4))
        for r, got in enumerate(ranks):
            assert [(list(i), list(l)) for i, l in got] == [(list(i), list(l)) for i, l in want], \
                f"{name}: --tp-size {world} rank {r} {got} != rlperf's plain engine {want}"
        details.append(f"{name} ({len(prompts)} requests x 4 tokens)")
    return f"--tp-size 2 without a leaf count, both ranks: rlperf's plain engine's bits for {', '.join(details)}"


def main() -> int:
    results = {}
    for name, fn in sorted(globals().items()):
        if name.startswith("check_") and callable(fn) and (len(sys.argv) < 2 or name in sys.argv[1:]):
            try:
                results[name] = {"ok": True, "detail": str(fn())}
            except Exception:
                results[name] = {"ok": False, "detail": traceback.format_exc(limit=-6)}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
