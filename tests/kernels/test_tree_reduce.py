"""Fixed-tree reductions (kernels/tree_reduce.py): the order is the tree's, a rank's leaves form one
node of it, and each op matches a float64 reference. The multi-rank bit-equality (gloo processes)
is tested with the megatron backend, tests/train/test_megatron_parallel.py."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels import tree_reduce as T


@pytest.fixture(autouse=True)
def _reference():
    with K.use_backend("reference"):
        yield


def test_tree_sum_is_the_balanced_tree_not_the_running_sum():
    p = [torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    assert T.tree_sum(p).item() == ((p[0] + p[1]) + (p[2] + p[3])).item() == 0.0
    assert (((p[0] + p[1]) + p[2]) + p[3]).item() == 1.0  # the running sum differs: the order is visible


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_stack_matches_tree_sum(n):
    g = torch.Generator().manual_seed(n)
    parts = [torch.randn(5, generator=g) * 10 ** torch.randint(-3, 4, (5,), generator=g) for _ in range(n)]
    acc = T._TreeStack()
    for x in parts:
        acc.push(x)
    assert torch.equal(acc.result(), T.tree_sum(parts))
    assert torch.equal(acc.result(), T.tree_sum(torch.stack(parts)))  # a level at a time: the same pairs


@pytest.mark.parametrize("n", [2, 4, 8])
def test_combine_levels_pairs_the_leaves_as_the_stack_does(n):
    # a combine that is neither commutative nor associative (exact small integers in float64): the value
    # names the tree's shape, so the level-at-a-time form must pair the leaves as the binary counter does
    def combine(left, right):
        return tuple(3 * a + b for a, b in zip(left, right))

    leaves = [(torch.tensor([float(i), 10.0 + i], dtype=torch.float64),) for i in range(n)]
    acc = T._TreeStack(combine)
    for leaf in leaves:
        acc.push(leaf)
    assert torch.equal(T._combine_levels(leaves, combine)[0], acc.result()[0])


def _leaf_stats_with_empty_leaves(g, leaves: int, n: int, device: str):
    """(m, s, e, tz) per leaf with some rows' maxima -inf (a leaf with no vocabulary for them)."""
    out = []
    for _ in range(leaves):
        m = torch.randn(n, generator=g, device=device) * 8
        m[torch.rand(n, generator=g, device=device) < 0.2] = -torch.inf
        s = torch.rand(n, generator=g, device=device) * 100 + 1
        e = torch.randn(n, generator=g, device=device) * 5
        tz = torch.randn(n, generator=g, device=device)
        out.append((m, s, e, tz))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("leaves", [2, 4, 8])
def test_gpu_tree_logprob_combine_levels_equal_the_pairwise_tree(leaves):
    # on CUDA tree_logprob combines the leaves' statistics a level at a time (stacked); its bits must be
    # the pairwise tree's, -inf maxima included
    import functools

    g = torch.Generator(device="cuda").manual_seed(leaves)
    stats = _leaf_stats_with_empty_leaves(g, leaves, 4099, "cuda")
    combine = functools.partial(T._combine_stats, inv_t=1 / 0.7)
    acc = T._TreeStack(combine)
    for leaf in stats:
        acc.push(leaf)
    for a, b in zip(T._combine_levels(stats, combine), acc.result()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_norm_gradient_partials_split_and_pad_without_moving_a_bit(interpreter, dtype):
    # what token_parallel_rmsnorm relies on: the kernel's partial sums of d weight over fixed row blocks,
    # computed on two ranks' shares (each a whole number of blocks) and concatenated, are the whole range's,
    # and rows appended with dy = 0 (padding) add zero partials; one sum_partials then gives one rank's bits
    from rlperf.kernels import norm

    H, rows = 48, norm.rmsnorm_grad_rows(48)
    x, dy = _rand(3 * rows, 1, H, seed=20).to(dtype), _rand(3 * rows, 1, H, seed=21).to(dtype)
    w = (1 + 0.1 * _rand(H, seed=22)).to(dtype)
    with K.use_backend("interpreter"):
        dx, dw = norm.rmsnorm_backward(dy, x, w, 1e-6)
        cut = rows  # rank 0 holds one block, rank 1 two: any whole number of blocks
        dx0, p0 = norm.rmsnorm_backward(dy[:cut], x[:cut], w, 1e-6, return_partials=True)
        dx1, p1 = norm.rmsnorm_backward(dy[cut:], x[cut:], w, 1e-6, return_partials=True)
        assert torch.equal(torch.cat([dx0, dx1]), dx)
        assert torch.equal(norm.sum_partials(torch.cat([p0, p1]), w.dtype), dw)
        pad = 2 * rows + 5
        xp = torch.cat([x, _rand(pad, 1, H, seed=23).to(dtype)])
        dyp = torch.cat([dy, torch.zeros(pad, 1, H, dtype=dtype)])
        dxp, dwp = norm.rmsnorm_backward(dyp, xp, w, 1e-6)
        assert torch.equal(dwp, dw) and torch.equal(dxp[:3 * rows], dx)
        # one rank: token_parallel_rmsnorm is rmsnorm itself, forward and backward
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        T.token_parallel_rmsnorm(xa, wa).backward(dy)
        K.rmsnorm(xb, wb).backward(dy)
        assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad) and torch.equal(wa.grad, dw)


def test_leaf_count_checked():
    with pytest.raises(ValueError, match="power of two"):
        T.tree_sum([torch.zeros(1)] * 3)
    with pytest.raises(ValueError, match="does not split into 8 equal leaves"):
        T.tree_matmul(torch.zeros(2, 12), torch.zeros(3, 12), leaves=8)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("split", [2, 4, 8])
def test_rank_leaves_are_one_node_of_the_tree(split):
    # what t ranks compute (each its K/t columns, then the nodes in the top of the tree) is the one-rank tree
    x, w = _rand(7, 40, seed=1), _rand(13, 40, seed=2)
    full = T.tree_matmul(x, w, leaves=8)
    width = 40 // split
    nodes = [T.tree_matmul(x[:, r * width:(r + 1) * width], w[:, r * width:(r + 1) * width], leaves=8 // split)
             for r in range(split)]
    assert torch.equal(T.tree_sum(nodes), full)
    assert torch.allclose(full.double(), x.double() @ w.double().T, rtol=1e-6, atol=1e-5)


def test_row_and_column_parallel_gradients():
    x = _rand(9, 24, seed=3).requires_grad_()
    w1 = (_rand(16, 24, seed=4) * 0.3).requires_grad_()
    w2 = (_rand(5, 16, seed=5) * 0.3).requires_grad_()
    y = T.row_parallel_linear(T.column_parallel_linear(x, w1, leaves=8), w2, leaves=8)
    g = _rand(9, 5, seed=6)
    (y * g).sum().backward()
    xr, w1r, w2r = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    yr = (xr @ w1r.T) @ w2r.T
    (yr * g.double()).sum().backward()
    assert torch.allclose(y.double(), yr, rtol=1e-5, atol=1e-5)
    for got, want in ((x.grad, xr.grad), (w1.grad, w1r.grad), (w2.grad, w2r.grad)):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_tree_logprob_matches_log_softmax_and_its_gradient():
    n, h, v, temp = 11, 16, 64, 0.7
    hid = _rand(n, h, seed=7).requires_grad_()
    w = _rand(v, h, seed=8).requires_grad_()
    tgt = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(9))
    lp, ent = T.tree_logprob(hid, w, tgt, temp, return_entropy=True, leaves=8)
    ga, gb = _rand(n, seed=10), _rand(n, seed=11)
    (lp * ga + ent * gb).sum().backward()
    hr, wr = hid.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp_all = torch.log_softmax((hr @ wr.T) / temp, -1)
    lpr = logp_all.gather(1, tgt[:, None]).squeeze(1)
    entr = -(logp_all.exp() * logp_all).sum(-1)
    (lpr * ga.double() + entr * gb.double()).sum().backward()
    assert torch.allclose(lp.double(), lpr, atol=1e-5) and torch.allclose(ent.double(), entr, atol=1e-5)
    assert torch.allclose(hid.grad.double(), hr.grad, atol=1e-5)
    assert torch.allclose(w.grad.double(), wr.grad, atol=1e-5)


def test_tree_logprob_out_of_range_target_is_nan():
    lp = T.tree_logprob(_rand(2, 8), _rand(16, 8, seed=1), torch.tensor([3, 16]), leaves=4)
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1])


def test_triton_path_under_the_interpreter(interpreter):
    # the GPU path (Triton leaf products with pinned tile configs, the fused log-prob kernel's leaf
    # statistics and backward) agrees with the float64 reference
    with K.use_backend("interpreter"):
        x = _rand(5, 32, seed=12).requires_grad_()
        w = (_rand(6, 32, seed=13) * 0.3).requires_grad_()
        y = T.row_parallel_linear(x, w, leaves=4)
        hid = _rand(3, 16, seed=14).requires_grad_()
        head = _rand(64, 16, seed=15).requires_grad_()
        tgt = torch.tensor([0, 17, 63])
        lp, ent = T.tree_logprob(hid, head, tgt, 1.3, return_entropy=True, leaves=4)
        (lp.sum() + ent.sum()).backward()
    with K.use_backend("reference"):
        hr, wr = hid.detach().clone().requires_grad_(), head.detach().clone().requires_grad_()
        lpr, entr = T.tree_logprob(hr, wr, tgt, 1.3, return_entropy=True, leaves=4)
        (lpr.sum() + entr.sum()).backward()
        yr = T.row_parallel_linear(x.detach(), w.detach(), leaves=4)
    assert torch.allclose(y, yr, atol=1e-5)
    assert torch.allclose(lp, lpr, atol=1e-5) and torch.allclose(ent, entr, atol=1e-5)
    assert torch.allclose(hid.grad, hr.grad, atol=1e-5) and torch.allclose(head.grad, wr.grad, atol=1e-5)


@pytest.mark.parametrize("tile", ["m64n64w4s3", "m64n128w8s3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("leaves,m,n,k", [(8, 37, 70, 8 * 48), (4, 1, 33, 4 * 136), (2, 65, 64, 2 * 40), (1, 3, 5, 24)])
def test_one_launch_tree_node_has_the_per_leaf_bits_under_the_interpreter(interpreter, poison, monkeypatch, dtype,
                                                                         leaves, m, n, k, tile):
    """The fused tree node (one launch: every leaf's BLOCK_K chain and the tree's adds in registers, in two
    tile shapes) gives the bits of a launch per leaf plus tree_sum: odd M and N, leaf widths that are not a multiple of BLOCK_K (the zero-masked tail), a
    row-parallel forward and a column-parallel input gradient."""
    from rlperf.kernels import gemm

    monkeypatch.setattr(T, "TREE_NODE_TILE", tile)

    g = torch.Generator().manual_seed(leaves * 1000 + m)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    launches = []
    real_launch = gemm.launch
    monkeypatch.setattr(gemm, "launch", lambda *a, **kw: launches.append(1) or real_launch(*a, **kw))
    with K.use_backend("interpreter"):
        fused = T._tree_node(x, w, leaves, config_n=n)
        assert launches == []  # one Triton launch, not one per leaf
        monkeypatch.setattr(T, "FUSED_LEAF_PRODUCTS", False)
        per_leaf = T._tree_node(x, w, leaves, config_n=n)
        assert len(launches) == leaves
        assert torch.equal(fused, per_leaf)
        # the layers: a row-parallel forward and a column-parallel layer's dx, fused against per-leaf
        xg = x.clone().requires_grad_()
        w_col = (torch.randn(leaves * 6, k, generator=g) / k**0.5).to(dtype)
        results = {}
        for fused_on in (True, False):
            monkeypatch.setattr(T, "FUSED_LEAF_PRODUCTS", fused_on)
            xg.grad = None
            y = T.row_parallel_linear(xg, w, leaves=leaves)
            z = T.column_parallel_linear(xg, w_col, leaves=leaves)
            (y.float().sum() + z.float().square().sum()).backward()
            results[fused_on] = (y.detach(), xg.grad.clone())
    assert torch.equal(results[True][0], results[False][0]) and torch.equal(results[True][1], results[False][1])


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 4])
def test_gpu_bits_do_not_depend_on_the_split(split):
    # bf16 on the GPU (Triton kernels): a column-parallel shard's columns, a row-parallel rank's tree
    # node and a vocabulary leaf range give the bits of the unsplit computation
    with K.use_backend("triton"):
        g = torch.Generator(device="cuda").manual_seed(split)
        x = torch.randn(37, 1024, device="cuda", generator=g).bfloat16()
        w = (torch.randn(3072, 1024, device="cuda", generator=g) * 0.05).bfloat16()
        full = T.column_parallel_linear(x, w)
        n = w.shape[0] // split
        shards = [T._matmul_out(x, w[r * n:(r + 1) * n], x.dtype, config_n=w.shape[0]) for r in range(split)]
        assert torch.equal(torch.cat(shards, dim=1), full)
        assert torch.equal(full, K.linear(x, w))  # the engine's projection
        x2 = torch.randn(37, 3072, device="cuda", generator=g).bfloat16()
        w2 = (torch.randn(1024, 3072, device="cuda", generator=g) * 0.05).bfloat16()
        k = 3072 // split
        nodes = [T.tree_matmul(x2[:, r * k:(r + 1) * k], w2[:, r * k:(r + 1) * k], leaves=8 // split)
                 for r in range(split)]
        assert torch.equal(T.tree_sum(nodes), T.tree_matmul(x2, w2, leaves=8))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(T.TREE_NODE_TILES))
@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
def test_gpu_one_launch_tree_node_has_the_per_leaf_bits(monkeypatch, leaves, tile):
    # bf16 on the GPU: the fused tree node (every launch choice of TREE_NODE_TILES) against a launch per
    # leaf (gemm's configs, both M buckets) plus tree_sum, for o_proj / down_proj shapes, decode-sized and
    # training-sized M
    monkeypatch.setattr(T, "TREE_NODE_TILE", tile)
    with K.use_backend("triton"):
        g = torch.Generator(device="cuda").manual_seed(leaves)
        for m, n, k in ((1, 1024, 2048), (37, 1024, 3072), (64, 2048, 6144), (65, 1024, 3072), (4096, 1024, 3072)):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
            monkeypatch.setattr(T, "FUSED_LEAF_PRODUCTS", True)
            fused = T._tree_node(x, w, leaves, config_n=n)
            monkeypatch.setattr(T, "FUSED_LEAF_PRODUCTS", False)
            per_leaf = T._tree_node(x, w, leaves, config_n=n)
            assert torch.equal(fused, per_leaf), (m, n, k, (fused - per_leaf).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("leaves,shape", [(8, (37, 70)), (4, (1,)), (2, (1029,)), (1, (3, 5))])
def test_tree_sum_to_is_one_launch_with_the_levels_bits_under_the_interpreter(interpreter, dtype, leaves, shape):
    """tree_sum_to: the float32 tree of tree_sum over the leading dim and one rounding, as one launch, from
    a strided (sliced) input; the row-parallel forward and column-parallel dx on one rank round their node
    in the kernel's store, with the bits of the float32 node rounded by torch."""
    g = torch.Generator().manual_seed(leaves)
    parts = (torch.randn(leaves, *shape, generator=g) * 100).to(dtype)
    wide = torch.randn(leaves, *shape[:-1], shape[-1] + 3, generator=g).to(dtype)[..., 1:-2]  # not contiguous
    with K.use_backend("interpreter"):
        for p in (parts, wide):
            for out_dtype in (torch.float32, dtype):
                got = T.tree_sum_to(p, out_dtype)
                assert got.dtype == out_dtype and got.shape == p.shape[1:]
                assert torch.equal(got, T.tree_sum(p.float()).to(out_dtype))
        x = torch.randn(37, leaves * 24, generator=g).to(dtype)
        w = (torch.randn(19, leaves * 24, generator=g) / 8).to(dtype)
        assert torch.equal(T._tree_node(x, w, leaves, out_dtype=dtype), T._tree_node(x, w, leaves).to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
def test_gpu_one_launch_roundings_equal_torch(leaves):
    # bf16 on the GPU: tree_sum_to and the tree node stored in bf16 round as torch rounds the float32 result
    with K.use_backend("triton"):
        g = torch.Generator(device="cuda").manual_seed(leaves)
        parts = torch.randn(leaves, 8, 1024, device="cuda", generator=g).bfloat16()
        assert torch.equal(T.tree_sum_to(parts, torch.bfloat16), T.tree_sum(parts.float()).bfloat16())
        x = torch.randn(4099, 3072, device="cuda", generator=g).bfloat16()
        w = (torch.randn(1024, 3072, device="cuda", generator=g) / 55).bfloat16()
        assert torch.equal(T._tree_node(x, w, leaves, out_dtype=torch.bfloat16), T._tree_node(x, w, leaves).bfloat16())


AOT_SCRIPT = r"""
import json
from rlperf.bench.aot_preflight import compile_specs
from rlperf.kernels import tree_reduce as T

names = T._tree_node_kernel.arg_names
lines = []
for dtype, block_k, precision, sizes in (("bf16", 128, "tf32", (1, 2, 4, 8)), ("fp32", 32, "tf32x3", (8,))):
    for leaves in sizes:
        const = {"LEAVES": leaves, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": block_k, "PRECISION": precision}
        sig = {n: {"x": "*" + dtype, "w": "*" + dtype, "out": "*fp32"}.get(n, "i32") for n in names}
        sig.update({c: "constexpr" for c in const})
        lines.append(json.dumps({"module": T.__name__, "file": T.__file__, "name": "_tree_node_kernel",
                                 "signature": sig, "constexprs": const,
                                 "options": {"num_warps": 4, "num_stages": 3}}))
failures, compiled = compile_specs(lines, 90)
assert not failures, failures
for spec, kernel in compiled:
    assert "wgmma" in kernel.asm["ptx"], spec["constexprs"]
    print(spec["signature"]["x"], spec["constexprs"]["LEAVES"], "cubin", len(kernel.asm["cubin"]))
"""


def test_tree_node_kernel_compiles_for_the_h100_h200_on_this_cpu(tmp_path):
    """The interpreter accepts Python a GPU compile may refuse: compile the fused tree node ahead of time for
    SM 90 (Triton's own compiler and ptxas, no GPU) at every tree size in bf16 and at 8 leaves in float32, and check its dots
    became wgmma instructions (the instruction family the bits rest on)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a fresh compile, not a cache hit
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("cubin") == 5, proc.stdout
