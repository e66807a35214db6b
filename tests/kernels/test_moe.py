"""rlperf.kernels MoE ops: routing, permutation, grouped GEMM, combine and the expert block against
float64 references; batch invariance bit for bit (shuffled tokens, added and removed tokens, an
expert's load from 0 to every token); deterministic gradients against a float64 reference.

CPU tests run the Triton kernels under the interpreter in float32 and float16 (its bf16 dot is
wrong), with odd sizes (H, I, T not multiples of the tiles); tile products run in float64 there
(``kernels/tile_dot.py``), so the bit-for-bit checks hold on any x86 CPU. GPU tests (marker
``gpu``) repeat the invariance in bf16 on the 30B-A3B expert shape.
"""
import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels.moe import grouped_matmul_config
from rlperf.kernels.reference.moe import grouped_matmul_ref, moe_experts_ref, moe_route_ref

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _weights(e, h, i, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype=dtype, device=device)
    w_down = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype=dtype, device=device)
    return w_gate_up, w_down


def _tokens(t, h, e, k, dtype, device="cpu", seed=1):
    """Tokens, their experts (distinct, increasing per row) and weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype=dtype, device=device)
    experts = torch.sort(torch.rand(t, e, generator=g).argsort(-1)[:, :k], -1).values.to(torch.int32)
    weights = torch.rand(t, k, generator=g)
    return x, experts.to(device), weights.to(device)


# ---- routing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("e,k", [(7, 1), (8, 2), (33, 5)])
def test_route_matches_reference(interpreter, e, k, normalize):
    logits = torch.randn(19, e) * 3
    w, experts = K.moe_route(logits, k, normalize)
    w_ref, experts_ref = moe_route_ref(logits, k, normalize)
    assert experts.dtype == torch.int32 and torch.equal(experts.long(), experts_ref)
    torch.testing.assert_close(w.double(), w_ref, atol=1e-6, rtol=1e-6)
    assert bool((experts[:, 1:] > experts[:, :-1]).all())  # increasing expert index


def test_route_ties_go_to_the_lower_index(interpreter):
    logits = torch.zeros(4, 8)
    logits[1, [6, 2, 5]] = 1.0         # a three-way tie for two places: 2 and 5 win
    logits[2] = torch.tensor([0., 1, 1, 0, 0, 1, 1, 0])
    logits[3, 7] = 5.0                 # one clear winner, then a tie among the rest: 0 wins
    _, experts = K.moe_route(logits, 2, True)
    assert experts.tolist() == [[0, 1], [2, 5], [1, 2], [0, 7]]
    with K.use_backend("reference"):
        assert K.moe_route(logits, 2, True)[1].tolist() == experts.tolist()


def test_route_weights_replay_given_experts(interpreter):
    logits = torch.randn(11, 9)
    w, experts = K.moe_route(logits, 3, True)
    shuffled = experts.flip(-1)        # replayed rows may come in any order
    w_replay, experts_replay = K.moe_route_weights(logits, shuffled, True)
    assert torch.equal(experts_replay, experts) and torch.equal(w_replay, w)
    with pytest.raises(ValueError, match="out of range"):
        K.moe_route_weights(logits, torch.full((11, 3), 9), True)
    with pytest.raises(ValueError, match="same expert twice"):
        K.moe_route_weights(logits, torch.zeros(11, 3, dtype=torch.int32), True)


def test_route_gradient_matches_float64(interpreter):
    logits = torch.randn(6, 8, requires_grad=True)
    w, experts = K.moe_route(logits, 3, True)
    g = torch.randn_like(w)
    w.backward(g)
    ref_logits = logits.detach().double().requires_grad_()
    w_ref, _ = moe_route_ref(ref_logits, 3, True)
    w_ref.backward(g.double())
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-6, rtol=1e-5)


# ---- permutation -----------------------------------------------------------------------------

def test_plan_is_a_stable_sort_by_expert(interpreter):
    _, experts, _ = _tokens(37, 4, 9, 3, torch.float32)
    experts[5:9] = torch.tensor([0, 1, 2], dtype=torch.int32)  # a crowded expert; expert 8 may stay empty
    plan = K.moe_plan(experts, 10)                             # expert 9: never routed
    flat = experts.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    assert torch.equal(plan.pair_of_slot.long(), order)
    assert torch.equal(plan.slot_of_pair.long()[order], torch.arange(flat.numel()))
    counts = torch.bincount(flat, minlength=10)
    assert plan.expert_offsets.tolist() == [0] + counts.cumsum(0).tolist()
    assert torch.equal(plan.token_of_slot.long(), order // 3)


# ---- grouped GEMM ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gather", [True, False])
def test_grouped_matmul_matches_reference(interpreter, poison, dtype, gather):
    e, k, h, n = 5, 2, 40, 70
    x, experts, _ = _tokens(23, h, e, k, dtype)
    experts[:4] = torch.tensor([1, 3], dtype=torch.int32)
    w = (torch.randn(e, n, h) / h ** 0.5).to(dtype)
    plan = K.moe_plan(experts, e)
    a = x if gather else x[plan.token_of_slot.long()]
    out = K.grouped_matmul(a, w, plan, gather=gather)
    expert_of_slot = torch.sort(experts.reshape(-1).long(), stable=True).values
    ref = grouped_matmul_ref(x[plan.token_of_slot.long()], w, expert_of_slot)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def _rows_by_pair(out, plan):
    return out[plan.slot_of_pair.long()]  # [S, N] in pair order (t k + j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_matmul_bits_do_not_depend_on_expert_load(interpreter, dtype):
    """A probe token's rows keep their bits while the other tokens pile onto its expert (0 to 130
    of them, across tile boundaries, so the probe's row moves through its tile) or leave it."""
    e, h, n = 4, 36, 50
    w = (torch.randn(e, n, h) / h ** 0.5).to(dtype)
    probe = torch.randn(1, h).to(dtype)
    probe_experts = torch.tensor([[1, 2]], dtype=torch.int32)
    rows = None
    for load in (0, 1, 62, 63, 64, 130):
        others = torch.randn(load, h).to(dtype)
        other_experts = torch.tensor([[1, 3]] * load, dtype=torch.int32).reshape(load, 2)
        for first in (True, False):  # the probe first or last in the batch
            x = torch.cat([probe, others] if first else [others, probe])
            experts = torch.cat([probe_experts, other_experts] if first else [other_experts, probe_experts])
            plan = K.moe_plan(experts, e)
            got = _rows_by_pair(K.grouped_matmul(x, w, plan, gather=True), plan)
            got = got[:2] if first else got[-2:]
            if rows is None:
                rows = got
            assert torch.equal(got, rows), f"probe rows changed with load {load}, first={first}"


# ---- the expert block ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_experts_match_reference(interpreter, poison, dtype):
    e, k, h, i = 6, 3, 40, 24
    w_gate_up, w_down = _weights(e, h, i, dtype)
    x, experts, weights = _tokens(29, h, e, k, dtype)
    out = K.moe_experts(x, experts, weights, w_gate_up, w_down)
    ref = moe_experts_ref(x, experts, weights, w_gate_up, w_down)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_experts_bits_do_not_depend_on_the_batch(interpreter, dtype):
    """Shuffle the tokens, drop some, add others (all onto one expert, then onto unused experts):
    every remaining token's output keeps its bits."""
    e, k, h, i = 8, 2, 40, 24
    w_gate_up, w_down = _weights(e, h, i, dtype)
    x, experts, weights = _tokens(21, h, e, k, dtype)
    experts[experts == 7] = 6          # expert 7 starts empty
    experts = torch.sort(experts, -1).values
    experts[:, 0] = torch.where(experts[:, 0] == experts[:, 1], 0, experts[:, 0])
    experts = torch.sort(experts, -1).values
    base = K.moe_experts(x, experts, weights, w_gate_up, w_down)

    perm = torch.randperm(21)
    assert torch.equal(K.moe_experts(x[perm], experts[perm], weights[perm], w_gate_up, w_down), base[perm])

    keep = torch.tensor([3, 4, 17])    # remove most tokens
    assert torch.equal(K.moe_experts(x[keep], experts[keep], weights[keep], w_gate_up, w_down), base[keep])

    for extra_experts in ([0, 1], [6, 7]):  # a crowded expert; a previously empty one
        xe, _, we = _tokens(70, h, e, k, dtype, seed=5)
        ee = torch.tensor([extra_experts] * 70, dtype=torch.int32)
        xs = torch.cat([xe[:30], x, xe[30:]])
        es = torch.cat([ee[:30], experts, ee[30:]])
        ws = torch.cat([we[:30], weights, we[30:]])
        got = K.moe_experts(xs, es, ws, w_gate_up, w_down)
        assert torch.equal(got[30:51], base), f"outputs changed when 70 tokens joined experts {extra_experts}"


def test_experts_gradients_match_float64_and_repeat_bit_for_bit(interpreter):
    e, k, h, i = 5, 2, 24, 20
    w_gate_up, w_down = _weights(e, h, i, torch.float32)
    x, experts, weights = _tokens(17, h, e, k, torch.float32)
    experts[experts == 4] = 3          # expert 4 gets no token: its gradient is exactly 0
    experts[:, 0] = torch.where(experts[:, 0] == experts[:, 1], 0, experts[:, 0])
    experts = torch.sort(experts, -1).values
    g = torch.randn(17, h)

    def grads(ref: bool):
        dt = torch.float64 if ref else torch.float32
        leaves = [t.detach().to(dt).requires_grad_() for t in (x, weights, w_gate_up, w_down)]
        fn = moe_experts_ref if ref else K.moe_experts
        fn(leaves[0], experts, *leaves[1:]).backward(g.to(dt))
        return [t.grad for t in leaves]

    got, again, ref = grads(False), grads(False), grads(True)
    for name, a, b, r in zip(("x", "weights", "w_gate_up", "w_down"), got, again, ref):
        assert torch.equal(a, b), f"d {name} is not deterministic"
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-4, msg=f"d {name}")
    assert not got[2][4].any() and not got[3][4].any()


def test_fast_mode_and_reference_backend_agree_with_the_kernel(interpreter):
    e, k, h, i = 6, 2, 32, 16
    w_gate_up, w_down = _weights(e, h, i, torch.float32)
    x, experts, weights = _tokens(15, h, e, k, torch.float32)
    ref = moe_experts_ref(x, experts, weights, w_gate_up, w_down)
    with K.use_mode("fast"):
        fast = K.moe_experts(x, experts, weights, w_gate_up, w_down)
    with K.use_backend("reference"):
        plain = K.moe_experts(x, experts, weights, w_gate_up, w_down)
    for out in (fast, plain):
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_fast_mode_runs_the_kernels_where_the_stock_block_would_read_counts_on_the_host():
    # CUDA stand-ins (routing reads only the device, dtype and requires_grad): on CUDA fast mode's stock block
    # must stay on the device (torch._grouped_mm, bf16) so a CUDA graph can hold the step; fp16 takes the kernels
    from types import SimpleNamespace

    from rlperf.kernels.moe import _experts_route

    def cuda(dtype, grad=False):
        return SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda"), requires_grad=grad)

    grouped = "stock" if hasattr(torch, "_grouped_mm") else "triton"
    with K.use_mode("fast"):
        assert _experts_route(cuda(torch.bfloat16), ()) == grouped
        assert _experts_route(cuda(torch.bfloat16, grad=True), (cuda(torch.bfloat16, grad=True),)) == grouped
        assert _experts_route(cuda(torch.float16), ()) == "triton"
        assert _experts_route(cuda(torch.float16, grad=True), (cuda(torch.float16, grad=True),)) == "autograd"
        cpu = torch.zeros(2, 4, dtype=torch.float16, requires_grad=True)
        assert _experts_route(cpu, (cpu,)) == "stock"  # the loop is fine on the CPU; torch differentiates it
    with K.use_mode("invariant"):
        assert _experts_route(cuda(torch.bfloat16), ()) == "triton"


def test_bad_shapes_are_named():
    w_gate_up, w_down = _weights(4, 8, 6, torch.float32)
    x, experts, weights = _tokens(3, 8, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="w_down"):
        K.moe_experts(x, experts, weights, w_gate_up, w_down[:, :, :5])
    with pytest.raises(ValueError, match="top_k"):
        K.moe_route(torch.zeros(3, 4), 5, True)


def test_one_config_per_dtype_and_shape():
    a = grouped_matmul_config(torch.bfloat16, 1536, 2048)
    assert a == grouped_matmul_config(torch.bfloat16, 1536, 2048) and a.BLOCK_M in (64, 128)


# ---- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_experts_bits_do_not_depend_on_the_batch(dtype):
    """Qwen3-30B-A3B's expert shape (H 2048, I 768, 128 experts, top-8): a batch of 64 tokens keeps
    its bits inside batches of 8192 tokens, shuffled, and with every other token on one expert."""
    e, k, h, i = 128, 8, 2048, 768
    w_gate_up, w_down = _weights(e, h, i, dtype, "cuda")
    x, experts, weights = _tokens(64, h, e, k, dtype, "cuda")
    base = K.moe_experts(x, experts, weights, w_gate_up, w_down)
    torch.testing.assert_close(base.double(), moe_experts_ref(x, experts, weights, w_gate_up, w_down),
                               atol=TOL[dtype], rtol=TOL[dtype])
    xo, eo, wo = _tokens(8192 - 64, h, e, k, dtype, "cuda", seed=7)
    for others in (eo, torch.arange(k, dtype=torch.int32, device="cuda").expand(8192 - 64, k).contiguous()):
        xs, es, ws = torch.cat([xo, x]), torch.cat([others, experts]), torch.cat([wo, weights])
        perm = torch.randperm(8192, device="cuda")
        got = K.moe_experts(xs[perm], es[perm], ws[perm], w_gate_up, w_down)
        back = torch.empty_like(got)
        back[perm] = got
        assert torch.equal(back[-64:], base)


@pytest.mark.gpu
def test_gpu_expert_weight_gradients_are_deterministic():
    e, k, h, i = 128, 8, 2048, 768
    w_gate_up, w_down = _weights(e, h, i, torch.bfloat16, "cuda")
    x, experts, weights = _tokens(4096, h, e, k, torch.bfloat16, "cuda")
    g = torch.randn(4096, h, device="cuda", dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate_up, w_down)]
        K.moe_experts(leaves[0], experts, weights, leaves[1], leaves[2]).backward(g)
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_matmul_tma_loads_give_the_pointer_loads_bits(interpreter, dtype):
    """The TMA path (slot rows through a descriptor, the weights as one [E N, K] tensor, or [E K, N] for
    the backward's w^T read in place) gives the pointer path's bits: rows past an expert's end and a
    block's columns past N read other experts' data that is never stored."""
    from rlperf.kernels.moe import GroupedMatmulConfig, _grouped_tma_operands, _launch_grouped

    e, k, h, n = 5, 2, 64, 40
    cfg = GroupedMatmulConfig(64, 32, 32, 4, 2)  # N = 40: the second column block spills into the next expert
    x, experts, _ = _tokens(37, h, e, k, dtype)
    plan = K.moe_plan(experts, e)
    xs = x[plan.token_of_slot.long()].contiguous()
    w = (torch.randn(e, n, h) / h ** 0.5).to(dtype)
    w_t = (torch.randn(e, h, n) / n ** 0.5).to(dtype).transpose(1, 2)  # [E, N, K] over [E, K, N] storage
    for a, weights, gather, flags in ((xs, w, False, (True, True, False)), (x, w, True, (False, True, False)),
                                      (xs, w_t, False, (True, True, True))):
        assert _grouped_tma_operands(a, weights, cfg, gather)[2:] == flags
        tma = _launch_grouped(a, weights, plan, gather, config=cfg)
        ptr = _launch_grouped(a, weights, plan, gather, config=cfg, tma=False)
        assert torch.equal(tma, ptr)
        expert_of_slot = torch.sort(experts.reshape(-1).long(), stable=True).values
        ref = grouped_matmul_ref(xs, weights.contiguous(), expert_of_slot)
        torch.testing.assert_close(tma.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # the backward's K (= N of the stored weights) not a multiple of BLOCK_K: pointer loads for w
    w_odd = (torch.randn(e, 36, n) / 6).to(dtype).transpose(1, 2)  # [E, N = 40, K = 36]
    assert _grouped_tma_operands(xs[:, :36].contiguous(), w_odd, cfg, False)[3:] == (False, False)


@pytest.mark.gpu
def test_gpu_grouped_matmul_tma_loads_give_the_pointer_loads_bits():
    """bf16 on the 30B-A3B expert shape: the default config with TMA loads equals pointer loads bit for
    bit on the forward's slot rows, its gathered token rows and the backward's w^T read in place."""
    from rlperf.kernels.moe import _grouped_tma_operands, _launch_grouped, grouped_matmul_config

    e, k, h, i = 128, 8, 2048, 768
    w_gate_up, w_down = _weights(e, h, i, torch.bfloat16, "cuda")
    x, experts, _ = _tokens(2048, h, e, k, torch.bfloat16, "cuda")
    plan = K.moe_plan(experts, e)
    xs = x[plan.token_of_slot.long()].contiguous()
    dy = torch.randn(xs.shape[0], h, device="cuda", dtype=torch.bfloat16)
    for a, w, gather in ((xs, w_gate_up, False), (x, w_gate_up, True), (dy, w_down.transpose(1, 2), False)):
        cfg = grouped_matmul_config(w.dtype, w.shape[1], w.shape[2])
        assert _grouped_tma_operands(a, w, cfg, gather)[3]  # the weights through TMA
        assert torch.equal(_launch_grouped(a, w, plan, gather), _launch_grouped(a, w, plan, gather, tma=False))
