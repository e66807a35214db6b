"""Expert parallel over 2 gloo ranks (CPU, Triton kernels under the interpreter): each rank's MoE
output, input and routing-weight gradients, and its experts' weight gradients equal the one-process
expert block over both ranks' tokens, bit for bit."""
import torch
import torch.distributed as dist

import rlperf.kernels as K
from rlperf.loop.placement import leave_process
from spawned_ranks import run_ranks

WORLD, E, TOP_K, H, I = 2, 6, 2, 24, 20
TOKENS = (7, 12)  # uneven: the ranks send and receive different counts


def _data():
    g = torch.Generator().manual_seed(0)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w_down = torch.randn(E, H, I, generator=g) / I ** 0.5
    t = sum(TOKENS)
    x = torch.randn(t, H, generator=g)
    experts = torch.sort(torch.rand(t, E, generator=g).argsort(-1)[:, :TOP_K], -1).values.to(torch.int32)
    experts[:3] = torch.tensor([4, 5], dtype=torch.int32)  # rank 0's first tokens all go to rank 1
    weights = torch.rand(t, TOP_K, generator=g)
    grad = torch.randn(t, H, generator=g)
    return w_gate_up, w_down, x, experts, weights, grad


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _rank(rank: int, tmp: str) -> None:
    from rlperf.model.expert_parallel import expert_parallel_experts, expert_range

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=WORLD)
    try:
        w_gate_up, w_down, x, experts, weights, grad = _data()
        first, last = expert_range(E)
        lo = sum(TOKENS[:rank])
        mine = slice(lo, lo + TOKENS[rank])
        xs, ws, wg, wd = _leaves(x[mine], weights[mine], w_gate_up[first:last], w_down[first:last])
        out = expert_parallel_experts(xs, experts[mine], ws, wg, wd, E)
        out.backward(grad[mine])
        torch.save((out.detach(), xs.grad, ws.grad, wg.grad, wd.grad), f"{tmp}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_process(0)


def test_two_ranks_equal_one_process_bit_for_bit(tmp_path, interpreter):
    run_ranks(_rank, WORLD, str(tmp_path), timeout=600, what="an expert-parallel rank")

    w_gate_up, w_down, x, experts, weights, grad = _data()
    xs, ws, wg, wd = _leaves(x, weights, w_gate_up, w_down)
    out = K.moe_experts(xs, experts, ws, wg, wd)
    out.backward(grad)
    per = E // WORLD
    lo = 0
    for rank in range(WORLD):
        r_out, r_dx, r_dw, r_dgu, r_dd = torch.load(tmp_path / f"rank{rank}.pt")
        mine = slice(lo, lo + TOKENS[rank])
        lo += TOKENS[rank]
        assert torch.equal(r_out, out.detach()[mine]), f"rank {rank}: output"
        assert torch.equal(r_dx, xs.grad[mine]), f"rank {rank}: d x"
        assert torch.equal(r_dw, ws.grad[mine]), f"rank {rank}: d routing weights"
        assert torch.equal(r_dgu, wg.grad[rank * per:(rank + 1) * per]), f"rank {rank}: d w_gate_up"
        assert torch.equal(r_dd, wd.grad[rank * per:(rank + 1) * per]), f"rank {rank}: d w_down"
