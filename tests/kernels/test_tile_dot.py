"""The kernels' tile product is row-position invariant under the CPU interpreter on any x86 BLAS.

The experiment: a [64, 32] x [32, 64] product; each row alone at row 0 of an otherwise-zero tile
must give the same bits as at its own position. numpy's float32 matmul (what the interpreter's
plain ``tl.dot`` uses) changes 34 of 64 rows on AVX2 and AVX-512 OpenBLAS kernels; the kernels'
:func:`rlperf.kernels.tile_dot.dot_acc` must change none. Each BLAS kernel family is tried in its
own process (``OPENBLAS_CORETYPE`` picks OpenBLAS's micro-kernel when the process starts), so an
AVX-512 CI machine also proves the AVX2 path.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

EXPERIMENT = textwrap.dedent(
    """
    import json, sys
    import torch, triton, triton.language as tl
    from rlperf.kernels.tile_dot import INTERPRETED, dot_acc

    assert INTERPRETED, "TRITON_INTERPRET=1 did not reach the kernels"

    @triton.jit
    def tile_product(a_ptr, b_ptr, acc_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        offs_m = tl.arange(0, M)
        offs_k = tl.arange(0, K)
        offs_n = tl.arange(0, N)
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :])
        b = tl.load(b_ptr + offs_k[:, None] * N + offs_n[None, :])
        acc = tl.load(acc_ptr + offs_m[:, None] * N + offs_n[None, :])
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], dot_acc(a, b, acc))

    def product(a, b, acc):
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32)
        tile_product[(1,)](a, b, acc, out, M=a.shape[0], K=a.shape[1], N=b.shape[1])
        return out

    M, K, N = 64, 32, 64
    result = {}
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(0)
        a = torch.randn(M, K, generator=g).to(dtype)
        b = torch.randn(K, N, generator=g).to(dtype)
        acc = torch.randn(M, N, generator=g)
        full = product(a, b, acc)
        # float32(acc + a @ b) from exact float64 math: the one rounding the helper promises
        want = (acc.double() + a.double() @ b.double()).float()
        changed = 0
        for i in range(M):
            alone_a = torch.zeros_like(a)
            alone_a[0] = a[i]
            alone_acc = torch.zeros_like(acc)
            alone_acc[0] = acc[i]
            if not torch.equal(product(alone_a, b, alone_acc)[0], full[i]):
                changed += 1
        result[str(dtype)] = {"rows_changed": changed, "matches_float64": bool(torch.equal(full, want))}
    json.dump(result, sys.stdout)
    """
)


@pytest.mark.parametrize("coretype", [None, "Haswell"], ids=["native-blas", "avx2-blas"])
def test_row_position_experiment_through_dot_acc(coretype):
    import json

    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("OPENBLAS_CORETYPE", None)
    if coretype is not None:
        if "avx2" not in open("/proc/cpuinfo").read():
            pytest.skip("this CPU has no AVX2: OpenBLAS cannot run its Haswell kernels here")
        env["OPENBLAS_CORETYPE"] = coretype
    proc = subprocess.run([sys.executable, "-c", EXPERIMENT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for dtype, r in result.items():
        assert r["rows_changed"] == 0, f"{dtype}: {r['rows_changed']} of 64 rows changed bits with their position"
        assert r["matches_float64"], f"{dtype}: dot_acc is not float32(acc + a @ b) computed exactly"
