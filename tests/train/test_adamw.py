"""The trainers' AdamW (:mod:`rlperf.train.adamw`): fused on CUDA, torch's default on the CPU; the fused
update element-wise (a parameter stepped whole or in shards gets the same bits); the implementation kept
across a checkpoint written by the other one; the ``step`` state where the fused kernel wants it."""
import pytest
import torch

from rlperf.train.adamw import adamw, fused_for, keep_implementation, step_state


def _params(seed=0, sizes=(1031, 37, 1)):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]


def test_cpu_parameters_take_torch_default_and_cuda_ones_the_fused_kernel():
    params = _params()
    assert not fused_for([{"params": params}]) and not fused_for([{"params": []}])
    opt = adamw([{"params": params, "weight_decay": 0.0}], 1e-3, (0.9, 0.999), 1e-8)
    assert not opt.defaults.get("fused")
    assert step_state(opt, 3.0, params[0]).device.type == "cpu"
    if torch.cuda.is_available():
        cuda = [torch.nn.Parameter(torch.zeros(3, device="cuda"))]
        assert fused_for([{"params": cuda}]) and adamw([{"params": cuda}], 1e-3, (0.9, 0.999), 1e-8).defaults["fused"]


def _step(params, fused, steps=3, seed=1):
    opt = adamw([{"params": params, "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, fused=fused)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        opt.step()
    return opt


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cuts", [(515,), (1, 1030), (512, 768)])
def test_fused_update_is_element_wise_whole_or_in_shards(cuts, device):
    """One 1031-element parameter stepped whole and as shards cut at ``cuts`` (odd sizes, a one-element
    shard): the same bits, as FSDP's and the distributed optimizer's shards need."""
    whole = [torch.nn.Parameter(p.detach().to(device)) for p in _params(sizes=(1031,))]
    bounds = [0, *cuts, 1031]
    shards = [torch.nn.Parameter(whole[0].detach()[a:b].clone()) for a, b in zip(bounds, bounds[1:])]
    _step(whole, fused=True)
    g = torch.Generator().manual_seed(1)
    opt = adamw([{"params": shards, "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, fused=True)
    for _ in range(3):
        grad = torch.randn(1031, generator=g).to(device)
        for s, a, b in zip(shards, bounds, bounds[1:]):
            s.grad = grad[a:b].clone()
        opt.step()
    assert torch.equal(torch.cat([s.detach() for s in shards]), whole[0].detach())


@pytest.mark.parametrize("saved_fused,own_fused", [(True, False), (False, True)])
def test_a_loaded_checkpoint_keeps_this_optimizer_implementation(saved_fused, own_fused):
    saved = _step(_params(), fused=saved_fused).state_dict()
    params = _params()
    opt = adamw([{"params": params, "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, fused=own_fused)
    opt.load_state_dict(saved)
    assert bool(opt.param_groups[0].get("fused")) == saved_fused  # torch restores the saving run's
    keep_implementation(opt)
    assert bool(opt.param_groups[0].get("fused")) == own_fused
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # the resumed step runs (the fused kernel wants its step counts on the parameters' device)
    assert all(float(st["step"]) == 4.0 for st in opt.state.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_state_follows_the_implementation(device):
    """The fused kernel keeps ``step`` on the parameter's device, the default form on the CPU."""
    p = torch.nn.Parameter(torch.zeros(3, device=device))
    for fused, where in ((True, device), (False, "cpu")):
        opt = adamw([{"params": [p]}], 1e-3, (0.9, 0.999), 1e-8, fused=fused)
        t = step_state(opt, 7.0, p)
        assert t.dtype == torch.float32 and t.dim() == 0 and float(t) == 7.0 and t.device.type == where
