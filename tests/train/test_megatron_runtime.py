"""megatron-core's CPU paths and layout checks (rlperf/train/megatron/runtime.py), in one process."""
import pytest
import torch

pytest.importorskip("megatron.core")

from rlperf.train.megatron.model import RecomputeConfig  # noqa: E402
from rlperf.train.megatron.runtime import CPURNGStatesTracker, ParallelLayout, cpu_device_queries  # noqa: E402


def test_rng_tracker_forks_named_cpu_states():
    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)  # the outer state is untouched
    with tracker.fork("model-parallel-rng"):
        b = torch.rand(3)  # the named state advanced: a new draw
    torch.manual_seed(123)
    assert torch.equal(torch.cat([a, b]), torch.rand(6))
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("other", 123)
    with pytest.raises(ValueError, match="not added"):
        with tracker.fork("missing"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_cpu_device_queries_only_inside_the_block():
    t = torch.ones(2)
    with cpu_device_queries():
        assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
        assert t.cuda() is t
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


@pytest.mark.parametrize("layout, world, message", [
    (ParallelLayout(context_parallel_size=2), 2, "--context-parallel-size 2"),
    (ParallelLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 6, "do not split"),
    (ParallelLayout(tensor_model_parallel_size=0), 1, "--tensor-model-parallel-size must be"),
])
def test_layout_refused_with_the_flag(layout, world, message):
    with pytest.raises(ValueError, match=message):
        layout.check(world)


def test_layout_data_parallel_is_what_is_left():
    layout = ParallelLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    layout.check(8)
    assert layout.data_parallel_size(8) == 2


@pytest.mark.parametrize("recompute, message", [
    (RecomputeConfig("sometimes"), "--recompute-granularity 'sometimes'"),
    (RecomputeConfig("selective"), "--recompute-granularity selective"),
    (RecomputeConfig(None, "block", 1), "need --recompute-granularity full"),
])
def test_recompute_flags_checked(recompute, message):
    with pytest.raises(ValueError, match=message):
        recompute.check()
    RecomputeConfig().check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_full_recompute_refused_on_cpu():
    with pytest.raises(ValueError, match="--recompute-granularity full needs CUDA"):
        RecomputeConfig("full", "uniform", 1).check()


@pytest.mark.gpu
@pytest.mark.parametrize("recompute, message", [
    (RecomputeConfig("full"), "--recompute-method"),
    (RecomputeConfig("full", "uniform"), "--recompute-num-layers"),
])
def test_full_recompute_flags_checked_on_gpu(recompute, message):
    with pytest.raises(ValueError, match=message):
        recompute.check()


@pytest.mark.gpu
def test_full_recompute_gives_the_same_gradients(tmp_path):
    """Full recompute re-runs each layer's forward in the backward: the same kernels, the same bits."""
    import torch.distributed as dist

    import rlperf.kernels as K
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.runtime import destroy_model_parallel, initialize_model_parallel

    cfg = preset("tiny")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        initialize_model_parallel(ParallelLayout())
        weights = Qwen3ForCausalLM.random(cfg, seed=0, std=0.05).hf_state_dict()
        ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).cuda()
        cu = torch.tensor([0, 15, 40], dtype=torch.int32, device="cuda")
        rows = torch.arange(10, 39, device="cuda")
        grads = []
        for rc in (RecomputeConfig(), RecomputeConfig("full", "uniform", 1)):
            model = build_gpt_model(cfg, torch.bfloat16, recompute=rc, device="cuda")
            model.load_hf_tensors(weights)
            model.train()
            with K.use_mode("invariant"):
                model.log_probs(model.forward_hidden(ids, cu), rows, ids[rows + 1], 1.0).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def test_module_casts_keep_the_rope_tables_float32(tmp_path):
    """The trainer casts its compute copy with ``model.to(bf16)``; the RoPE tables must stay the same
    float32 tables (rmsnorm_rope's contract), on every layer."""
    import torch.distributed as dist

    from rlperf.model.config import preset
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.runtime import destroy_model_parallel, initialize_model_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        initialize_model_parallel(ParallelLayout())
        model = build_gpt_model(preset("tiny"), torch.float32)
        tables = {n: b.clone() for n, b in model.named_buffers() if "rope" in n}
        assert tables and all(t.dtype == torch.float32 for t in tables.values())
        model.to(torch.bfloat16)
        after = dict(model.named_buffers())
        assert next(model.parameters()).dtype == torch.bfloat16
        for name, table in tables.items():
            assert after[name].dtype == torch.float32 and torch.equal(after[name], table), name
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


def test_padding_moves_no_bit_of_the_tree_step(tmp_path, interpreter):
    """A packed micro-batch with more padding (a sequence of its own, as a CUDA-graph bucket pads it) gives
    the tree step the same log-probs and every gradient bit for bit (the kernels' sums over tokens run in
    fixed blocks of rows, the RMSNorm weights' included): what graphed micro-steps of the megatron backend
    need. Interpreter, float16, one layer."""
    import dataclasses

    import torch.distributed as dist

    import rlperf.kernels as K
    from rlperf.model.config import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.train.megatron.model import build_gpt_model
    from rlperf.train.megatron.runtime import destroy_model_parallel, initialize_model_parallel

    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        initialize_model_parallel(ParallelLayout())
        weights = Qwen3ForCausalLM.random(cfg, seed=0, std=0.05).hf_state_dict()
        ids = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(1))
        rows = torch.arange(6, 20)
        model = build_gpt_model(cfg, torch.float32)
        model.load_hf_tensors(weights)
        model.to(torch.float16)
        model.train()
        runs = []
        for pad in (0, 43):
            for p in model.parameters():
                p.grad = None
            model.head_grad = None
            padded = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
            cu = torch.tensor([0, 8, 21] + ([21 + pad] if pad else []), dtype=torch.int32)
            with K.use_backend("interpreter"), K.use_mode("invariant"):
                lp = model.log_probs(model.forward_hidden(padded, cu), rows, ids[rows + 1], 1.0)
                lp.sum().backward()
            runs.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (lp0, g0), (lp1, g1) = runs
        assert torch.equal(lp0, lp1)
        assert g0.keys() == g1.keys() and len(g0) > 0
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
