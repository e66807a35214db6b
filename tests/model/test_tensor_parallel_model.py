"""rlperf's model split over 2 gloo tensor-parallel ranks (``tp_group``, tree mode) against the one-process
model with the same ``reduction_leaves`` (CPU, the kernels' torch references): the paged engine steps
(a prefill, then decode steps against the cache), the logits, the log-probs and the training forward give
every rank the one-process bits; the shards are the megatron backend's split (``hf_shard``), and a layout
that does not split is one ValueError line."""
import os

import pytest
import torch
import torch.distributed as dist

import rlperf.kernels as K
from rlperf.kernels.attention import PAGE_SIZE
from rlperf.loop.placement import leave_process
from rlperf.model import ModelConfig
from rlperf.model.config import check_tensor_parallel
from rlperf.model.qwen3 import Qwen3ForCausalLM, hf_shard
from spawned_ranks import run_ranks

WORLD, LEAVES = 2, 8
CFG = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=304, max_position_embeddings=512,
                  tie_word_embeddings=False)
PROMPTS = ((5, 9, 100, 303, 7, 44, 12), (1, 2, 250))
DECODE = ((17, 3), (299, 0), (42, 8))  # the next token of each sequence, three steps
MOE_CFG = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=304, max_position_embeddings=512,
                      tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=2)  # layer 0 dense, layer 1 sparse


def _run(model: Qwen3ForCausalLM, kv_heads: int, cfg=CFG):
    """Prefill both prompts, then three decode steps: each step's (logits, log-probs of the next tokens,
    final hidden states); and the training forward of the first prompt."""
    pages = 4
    caches = [(torch.zeros(pages, PAGE_SIZE, kv_heads, cfg.head_dim), torch.zeros(pages, PAGE_SIZE, kv_heads,
                                                                                   cfg.head_dim))
              for _ in range(cfg.num_hidden_layers)]
    page_table = torch.tensor([[1], [2]], dtype=torch.int32)
    lens = [len(p) for p in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([torch.arange(n) + (r + 1) * PAGE_SIZE for r, n in enumerate(lens)])
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    out = []
    with torch.no_grad():
        hidden = model.forward_paged(ids, pos, caches, slots, page_table, cu, torch.tensor(lens, dtype=torch.int32))
        last = hidden[cu[1:].long() - 1]
        for step in DECODE:
            nxt = torch.tensor(step)
            out.append((model.logits(last), model.token_logprobs(last, nxt, 0.7), last))
            lens = [n + 1 for n in lens]
            pos = torch.tensor(lens) - 1
            slots = torch.tensor([(r + 1) * PAGE_SIZE + n - 1 for r, n in enumerate(lens)])
            last = model.forward_paged(nxt, pos, caches, slots, page_table, torch.arange(3, dtype=torch.int32),
                                       torch.tensor(lens, dtype=torch.int32))
        packed = model.forward_packed(torch.tensor(PROMPTS[0]), torch.arange(len(PROMPTS[0])),
                                      torch.tensor([0, len(PROMPTS[0])], dtype=torch.int32))
    return out, packed


def _whole(leaves=LEAVES, cfg=CFG) -> Qwen3ForCausalLM:
    # seed 3: the dense model's tree and plain log-probs differ at every step (with other seeds some
    # steps' log-probs round to the same bits, though the logits differ)
    return Qwen3ForCausalLM.random(cfg, seed=3, reduction_leaves=leaves)


def _rank(rank: int, tmp: str, leaves=LEAVES, cfg=CFG, backend="reference") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=WORLD)
    try:
        with K.use_backend(backend):
            whole = _whole(leaves, cfg)
            model = Qwen3ForCausalLM(cfg, torch.float32, "cpu", reduction_leaves=leaves, tp_group=dist.group.WORLD)
            targets = model.hf_state_dict()
            with torch.no_grad():
                for name, full in whole.hf_state_dict().items():
                    targets[name].copy_(hf_shard(name, full, WORLD, rank, plain=leaves is None))
            torch.save(_run(model, cfg.num_key_value_heads // WORLD, cfg), f"{tmp}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_process(0)


def _plain_rank(rank: int, tmp: str, cfg_name: str, backend: str) -> None:
    _rank(rank, tmp, None, {"dense": CFG, "moe": MOE_CFG}[cfg_name], backend)


def _assert_every_rank_has(tmp_path, want_steps, want_packed) -> None:
    """Every rank's saved steps (hidden states, logits, log-probs) and training forward equal the wanted ones."""
    for rank in range(WORLD):
        steps, packed = torch.load(tmp_path / f"rank{rank}.pt")
        for n, ((logits, lp, hidden), (w_logits, w_lp, w_hidden)) in enumerate(zip(steps, want_steps)):
            assert torch.equal(hidden, w_hidden), f"rank {rank} step {n}: hidden states"
            assert torch.equal(logits, w_logits), f"rank {rank} step {n}: logits"
            assert torch.equal(lp, w_lp), f"rank {rank} step {n}: log-probs"
        assert torch.equal(packed, want_packed), f"rank {rank}: training forward"


def test_two_ranks_give_the_one_process_tree_bits(tmp_path):
    run_ranks(_rank, WORLD, str(tmp_path), what="a tensor-parallel rank")
    with K.use_backend("reference"):
        want_steps, want_packed = _run(_whole(), CFG.num_key_value_heads)
        plain_steps, _ = _run(_whole(None), CFG.num_key_value_heads)
    for n, (plain, tree) in enumerate(zip(plain_steps, want_steps)):
        assert not torch.equal(plain[1], tree[1]), f"step {n}: the tree and the plain log-probs should differ here"
    _assert_every_rank_has(tmp_path, want_steps, want_packed)


@pytest.mark.parametrize("cfg_name, backend", [("dense", "reference"), ("moe", "reference"), ("dense", "interpreter")])
def test_two_ranks_in_plain_numerics_give_the_one_process_bits(tmp_path, cfg_name, backend):
    """Plain tensor parallelism (no reduction_leaves: an SGLang engine at --tp-size 2 beside the fsdp trainer):
    each rank multiplies its q/k/v and gate/up rows in the whole product's tile config, gathers the heads
    and the SwiGLU output and runs o_proj / down_proj (and a sparse layer) whole, so every rank holds the
    one-process plain model's hidden states, logits and log-probs, prefill, decode and training forward."""
    if backend == "interpreter" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is not on")
    import functools

    cfg = {"dense": CFG, "moe": MOE_CFG}[cfg_name]
    run_ranks(functools.partial(_plain_rank, cfg_name=cfg_name, backend=backend), WORLD, str(tmp_path),
              what="a tensor-parallel rank")
    with K.use_backend(backend):
        want_steps, want_packed = _run(_whole(None, cfg), cfg.num_key_value_heads, cfg)
    _assert_every_rank_has(tmp_path, want_steps, want_packed)


def test_shards_follow_the_megatron_split():
    full = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(hf_shard("model.layers.0.self_attn.q_proj.weight", full, 2, 1), full[2:])
    assert torch.equal(hf_shard("model.layers.0.mlp.down_proj.weight", full.T, 2, 0), full.T[:, :2])
    assert torch.equal(hf_shard("lm_head.weight", full, 4, 3), full[3:])
    norm = full[0]
    assert hf_shard("model.layers.0.input_layernorm.weight", norm, 2, 1) is norm
    with pytest.raises(ValueError, match="does not split over 3"):
        hf_shard("model.embed_tokens.weight", full, 3, 0)


@pytest.mark.parametrize("cfg, leaves, tp, message", [
    (CFG, None, 3, "3 tensor-parallel ranks do not divide the 4 query heads"),
    (CFG, 8, 3, "3 tensor-parallel ranks do not divide"),
    (CFG, 6, 2, "power of two"),
    (ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=6,
                 num_key_value_heads=3, head_dim=16, vocab_size=304), 8, 2, "do not split into"),
    (ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=301), 8, 2, "vocab_size 301"),
    (ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=304, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32), 8, 2, "MoE"),
])
def test_layouts_that_do_not_split_are_one_line(cfg, leaves, tp, message):
    with pytest.raises(ValueError, match=message) as info:
        check_tensor_parallel(cfg, leaves, tp)
    assert "\n" not in str(info.value)
    check_tensor_parallel(CFG, LEAVES, 2)
