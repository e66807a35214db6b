"""``--precompile-kernels`` / ``--record-kernels`` as the run starts them (rlperf.loop.device.start_kernel_precompile).

The compiles themselves are tests/kernels/test_precompile.py's; here: what starts where. CPU runs start
nothing (the interpreter and the torch reference compile nothing); a CUDA run starts the background
precompile of the named manifest on one process per host and installs the recorder on rank 0.
"""
import json

import pytest
import torch
from triton import knobs

from rlperf import kernels as K
from rlperf.loop.device import start_kernel_precompile

SILU = "rlperf.kernels.activation:_silu_mul_kernel"


def test_cpu_runs_start_nothing(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("")
    for flag in ("auto", "off", str(manifest)):
        background, recorder = start_kernel_precompile(flag, str(tmp_path / "rec.jsonl"), torch.device("cpu"),
                                                       K.KernelPolicy(mode="invariant", backend="reference"), True)
        assert background is None and recorder is None
    assert not (tmp_path / "rec.jsonl").exists()


def test_cuda_run_starts_the_named_manifest_and_the_recorder(tmp_path, monkeypatch):
    """The wiring of a CUDA run, on this CPU: the manifest names a kernel with parameters that no longer
    fit (so the child process reports it stale instead of compiling for minutes), the recorder's hook is
    Triton's post-compile hook until the run closes it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"kernel": SILU, "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
                                    "spec": {"signature": {}, "constant_keys": [], "constant_vals": [],
                                             "attrs_keys": [], "attrs_vals": [], "options": {}}}) + "\n")
    cuda = torch.device("cuda")
    policy = K.KernelPolicy(mode="invariant", backend="triton")
    before = knobs.runtime.jit_post_compile_hook
    background, recorder = start_kernel_precompile(str(manifest), str(tmp_path / "rec.jsonl"), cuda, policy, True)
    try:
        assert knobs.runtime.jit_post_compile_hook == recorder._hook
        assert background.finish(timeout=300).startswith("0 of 1 kernel specialization(s) compiled or found in the "
                                                        "cache, 1 stale")
    finally:
        recorder.__exit__(None, None, None)
    assert knobs.runtime.jit_post_compile_hook == before
    # another process of the same host (not the local leader), no recorder asked: nothing starts
    assert start_kernel_precompile(str(manifest), None, cuda, policy, False) == (None, None)
    assert start_kernel_precompile("off", None, cuda, policy, True) == (None, None)


def test_auto_without_a_manifest_for_this_gpu_says_so_and_starts_nothing(tmp_path, monkeypatch, capsys):
    from rlperf.kernels import precompile

    monkeypatch.setattr(precompile, "shipped_manifest_path", lambda: tmp_path / "cuda-80-triton9.9.9.jsonl")
    policy = K.KernelPolicy(mode="invariant", backend="triton")
    assert start_kernel_precompile("auto", None, torch.device("cuda"), policy, True) == (None, None)
    err = capsys.readouterr().err
    assert "no kernel manifest ships for this GPU and Triton (cuda-80-triton9.9.9.jsonl)" in err, err
    assert "--record-kernels FILE" in err


@pytest.mark.parametrize("flag", ["auto", "off"])
def test_flag_values_parse(flag, tmp_path):
    from rlperf.loop import parse_train_args

    ns = parse_train_args(["--precompile-kernels", flag, "--record-kernels", str(tmp_path / "r.jsonl"),
                           "--output-dir", str(tmp_path / "out")])
    assert ns.precompile_kernels == flag and ns.record_kernels == str(tmp_path / "r.jsonl")
