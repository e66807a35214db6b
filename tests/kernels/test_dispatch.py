"""Backend and mode selection is explicit and testable."""
import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels import dispatch


@pytest.fixture(autouse=True)
def _reread_environment():
    yield
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


def test_mode_switch_restores():
    assert K.mode() == "invariant"
    with K.use_mode("fast"):
        assert K.mode() == "fast"
    assert K.mode() == "invariant"
    with pytest.raises(ValueError, match="mode"):
        K.set_mode("quick")


def test_fast_mode_uses_stock_ops_only_where_they_win():
    assert not dispatch.use_stock_op("cpu", stock_wins_on_cuda=False)  # invariant mode: never
    with K.use_mode("fast"):
        assert dispatch.use_stock_op("cpu", stock_wins_on_cuda=False)  # CPU: stock torch
        assert dispatch.use_stock_op(torch.device("cuda"), stock_wins_on_cuda=True)  # cuBLAS, SDPA
        assert not dispatch.use_stock_op("cuda:0", stock_wins_on_cuda=False)  # row ops keep the kernel
