"""The kernel policy and the routing every op calls: explicit, testable, scoped to a context."""
import asyncio
import importlib.util
import threading
import types

import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels import dispatch
from rlperf.kernels.dispatch import FAST_MODE_KERNEL_ROWS, FAST_MODE_STOCK, KernelPolicy, route

OPS = ["matmul", "linear", "rmsnorm", "add_rmsnorm", "silu_mul", "log_softmax", "token_logprobs", "fused_logprob",
       "varlen_attention", "paged_attention", "write_kv_cache", "sample", "rmsnorm_rope", "moe_route", "moe_experts"]
# (the MoE building blocks moe_plan, grouped_matmul, moe_combine, moe_slot_rows and moe_route_weights
# run under moe_experts' and moe_route's routing)


@pytest.fixture(autouse=True)
def _restore_process_default():
    mode = dispatch.default_policy().mode
    yield
    dispatch.set_mode(mode)
    dispatch.refresh_environment()  # undo whatever a test set


def test_cpu_backend_follows_triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.refresh_environment()
    assert K.backend("cpu") == "interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert K.backend("cpu") == "interpreter", "read once: kernels imported under the interpreter stay there"
    dispatch.refresh_environment()
    assert K.backend("cpu") == "reference"
    assert K.backend(torch.device("cpu")) == "reference"


def test_cuda_backend_is_triton():
    assert K.backend("cuda") == "triton"


def test_forced_backend_and_bad_names(monkeypatch):
    with K.use_backend("reference"):
        assert K.backend("cpu") == "reference"
    with pytest.raises(ValueError, match="expected one of"):
        with K.use_backend("cublas"):
            pass
    monkeypatch.setenv("RLPERF_BACKEND", "triton")
    dispatch.refresh_environment()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        K.backend("cpu")
    monkeypatch.setenv("RLPERF_BACKEND", "interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.refresh_environment()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.backend("cpu")
    monkeypatch.setenv("RLPERF_BACKEND", "cublas")
    with pytest.raises(ValueError, match="RLPERF_BACKEND"):
        dispatch.refresh_environment()


def test_use_backend_none_restores_the_process_default(monkeypatch):
    monkeypatch.setenv("RLPERF_BACKEND", "reference")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.refresh_environment()
    with K.use_backend("interpreter"):
        assert K.backend("cpu") == "interpreter"
        with K.use_backend(None):
            assert K.backend("cpu") == "reference"  # RLPERF_BACKEND, not the automatic choice
    monkeypatch.delenv("RLPERF_BACKEND")
    dispatch.refresh_environment()
    with K.use_backend("reference"), K.use_backend(None):
        assert K.backend("cpu") == "interpreter"


def test_mode_switch_restores():
    assert K.mode() == "invariant"
    with K.use_mode("fast"):
        assert K.mode() == "fast"
    assert K.mode() == "invariant"
    with pytest.raises(ValueError, match="mode"):
        K.set_mode("quick")
    with pytest.raises(ValueError, match="mode"):
        K.use_mode("quick")


def test_use_mode_and_use_backend_compose_into_one_policy():
    with K.use_backend("reference"), K.use_mode("fast"):
        assert K.current_policy() == KernelPolicy("fast", "reference")
        with K.use_backend(None):
            assert K.current_policy() == KernelPolicy("fast", None)
    with K.use_policy(KernelPolicy("fast", "reference")) as p:
        assert K.current_policy() is p and K.mode() == "fast" and K.backend("cpu") == "reference"
        with K.use_policy(None):
            assert K.current_policy() == K.default_policy()
    assert K.current_policy() == K.default_policy()
    with pytest.raises(TypeError, match="KernelPolicy"):
        with K.use_policy("fast"):
            pass


def test_impossible_policies_are_errors():
    with pytest.raises(ValueError, match="mode 'quick'"):
        KernelPolicy(mode="quick")
    with pytest.raises(ValueError, match="backend 'cublas'"):
        KernelPolicy(backend="cublas")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        KernelPolicy(backend="triton").backend_for(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        KernelPolicy(backend="interpreter").backend_for("cuda:0")
    # the op's route raises the same error, never falls back
    with K.use_backend("triton"), pytest.raises(RuntimeError, match="needs CUDA"):
        route("rmsnorm", torch.device("cpu"))
    with K.use_backend("triton"), pytest.raises(RuntimeError, match="needs CUDA"):
        K.rmsnorm(torch.ones(2, 4), torch.ones(4))


def test_route_fast_mode_takes_stock_ops_only_where_they_win():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with K.use_backend("reference"):
        assert route("rmsnorm", cpu) == "reference"  # invariant mode: never stock
    with K.use_mode("fast"):
        assert route("rmsnorm", cpu) == "stock"  # CPU: stock torch
        assert route("matmul", cuda) == "stock" and route("varlen_attention", "cuda:1") == "stock"  # cuBLAS, SDPA
        # the matmul: the kernel for decode-sized calls on CUDA (faster there), cuBLAS above; stock on the CPU
        limit = FAST_MODE_KERNEL_ROWS
        assert route("matmul", cuda, rows=1) == route("matmul", cuda, rows=limit) == "triton"
        assert route("matmul", cuda, rows=limit + 1) == "stock" and route("matmul", cpu, rows=1) == "stock"
        assert route("varlen_attention", cuda, rows=1) == "stock"  # rows decide only the "large" ops
        assert route("rmsnorm", "cuda:0") == "triton"  # row ops keep the kernel
        assert route("sample", cuda) == "triton"  # sampling never changes with the mode
        assert route("fused_logprob", cuda, stock_ok=False) == "triton"  # e.g. with a tp_group
        with K.use_backend("triton"):
            # a stock op does not resolve the backend, so it cannot fail on it
            assert route("matmul", cpu) == "stock"


def test_route_autograd_only_when_a_kernel_runs_with_grad():
    x = torch.ones(2, 3, requires_grad=True)
    with K.use_backend("reference"):
        assert route("matmul", x.device, (x, None)) == "reference"  # torch differentiates the reference
        with K.use_mode("fast"):
            assert route("matmul", x.device, (x, None)) == "stock"
    with K.use_policy(KernelPolicy("fast", None)):
        assert route("matmul", "cuda", (None, x)) == "autograd"  # the grad check comes first
        with torch.no_grad():
            assert route("matmul", "cuda", (x,)) == "stock"
    assert route("rmsnorm", "cuda", (x.detach(),)) == "triton"


def test_every_public_op_is_routed():
    # linear is matmul over flattened leading dims; every other op names its row in the table
    assert sorted(FAST_MODE_STOCK) == sorted(op for op in OPS if op != "linear")
    assert all(where in ("everywhere", "large", "cpu", None) for where in FAST_MODE_STOCK.values())
    with pytest.raises(KeyError):
        route("no_such_op", "cpu")


def test_no_submodule_shares_a_name_with_an_op():
    for name in OPS:
        assert callable(getattr(K, name)) and not isinstance(getattr(K, name), types.ModuleType), name
        assert importlib.util.find_spec(f"rlperf.kernels.{name}") is None, name


def test_policy_is_per_thread():
    """A block's policy holds in its own thread; a new thread starts from the process default."""
    ready, go = threading.Barrier(2), threading.Barrier(2)
    seen = {}

    def worker():
        with K.use_policy(KernelPolicy("fast", "reference")):
            ready.wait()
            go.wait()
            seen["worker"] = K.current_policy()
        seen["worker_after"] = K.current_policy()

    t = threading.Thread(target=worker)
    with K.use_mode("fast"):
        inner = threading.Thread(target=lambda: seen.setdefault("started_inside", K.current_policy()))
        inner.start()
        inner.join()
    t.start()
    ready.wait()  # the worker is inside its block now
    seen["main"] = K.current_policy()
    go.wait()
    t.join()
    assert seen["main"] == K.default_policy() != KernelPolicy("fast", "reference")
    assert seen["worker"] == KernelPolicy("fast", "reference")
    assert seen["worker_after"] == K.default_policy()
    assert seen["started_inside"] == K.default_policy()  # threading.Thread does not copy the context


def test_set_mode_is_the_process_default_for_every_thread():
    K.set_mode("fast")
    seen = []
    t = threading.Thread(target=lambda: seen.append(K.mode()))
    t.start()
    t.join()
    assert seen == ["fast"] and K.mode() == "fast"
    with K.use_mode("invariant"):
        K.set_mode("fast")
        assert K.mode() == "invariant"  # a block keeps its own policy
    K.set_mode("invariant")
    assert K.mode() == "invariant"


def test_policy_is_per_asyncio_task():
    async def task(name, policy, step):
        with K.use_policy(policy):
            await step.wait()  # both tasks are inside their blocks at once
            return name, K.current_policy(), await asyncio.to_thread(K.current_policy)

    async def main():
        step = asyncio.Event()
        a = asyncio.create_task(task("a", KernelPolicy("fast", "reference"), step))
        b = asyncio.create_task(task("b", KernelPolicy("invariant", "reference"), step))
        await asyncio.sleep(0)
        step.set()
        results = await asyncio.gather(a, b)

        async def read():
            return K.current_policy()

        with K.use_mode("fast"):
            child = asyncio.create_task(read())
        return results, await child, K.current_policy()  # the child runs after the block has closed

    (a, b), child, after = asyncio.run(main())
    assert a == ("a", KernelPolicy("fast", "reference"), KernelPolicy("fast", "reference"))
    assert b == ("b", KernelPolicy("invariant", "reference"), KernelPolicy("invariant", "reference"))
    assert child.mode == "fast"  # a task copies the context it is created in
    assert after == K.default_policy()
