"""The FlashInfer anchors (rlperf.bench.flashinfer_anchors): a missing package is named; the paged-decode
plan describes rlperf's page table as FlashInfer reads it (CPU, with a recording stand-in for the library);
on a GPU with FlashInfer, its outputs match rlperf's kernels on the bench's shapes."""
import types

import pytest
import torch

from rlperf.bench import flashinfer_anchors as FI


def test_a_missing_flashinfer_is_named(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_flashinfer(name, *args, **kwargs):
        if name == "flashinfer":
            raise ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flashinfer)
    assert FI.flashinfer_or_reason() == (None, FI.NOT_INSTALLED)


def test_a_row_without_its_flashinfer_anchor_says_why():
    from rlperf.bench.harness import BenchRow
    from rlperf.bench.run import _markdown_section

    row = BenchRow("attention", "decode paged B=64 KV=4096", "rlperf.paged", 0.2, "flashinfer-paged", float("nan"),
                   1e9, "GB/s", {"phase": "decode", "anchor_unavailable": FI.NOT_INSTALLED})
    md = _markdown_section("attention", [row], {}, {})
    assert "| flashinfer-paged (did not run: flashinfer not installed) | nan |" in md


class _Recorder:
    def __init__(self, *args, **kwargs):
        self.init = (args, kwargs)

    def plan(self, *args, **kwargs):
        self.planned = (args, kwargs)

    def run(self, *args, **kwargs):
        return self


def test_paged_decode_plan_walks_each_sequences_pages_in_order():
    fi = types.SimpleNamespace(decode=types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Recorder))
    page, hkv, d = 4, 2, 8
    table = torch.tensor([[7, 2, 5], [1, 6, 0], [3, 4, 8]], dtype=torch.int32)  # 3 sequences, 3 pages each
    kv_lens = torch.tensor([9, 4, 1])  # 3 pages (last holds 1), 1 full page, 1 page (last holds 1)
    kc = torch.zeros(9, page, hkv, d)
    q = torch.zeros(3, 8, d)
    wrapper = FI.paged_decode(fi, q, kc, kc, table, kv_lens)()
    (indptr, indices, last, hq, hkv_, d_, page_), kw = wrapper.planned
    assert indptr.tolist() == [0, 3, 4, 5] and indices.tolist() == [7, 2, 5, 1, 3] and last.tolist() == [1, 4, 1]
    assert (hq, hkv_, d_, page_) == (8, hkv, d, page) and kw["q_data_type"] == q.dtype
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert wrapper.init[1]["use_tensor_cores"] is True  # 8 / 2 query heads per KV head
    with pytest.raises(ValueError, match="kv_len 13 needs 4 page"):
        FI.paged_decode(fi, q, kc, kc, table, torch.tensor([13, 1, 1]))


@pytest.mark.gpu
def test_flashinfer_anchors_match_rlperfs_kernels_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fi, why = FI.flashinfer_or_reason()
    if fi is None:
        pytest.skip(why)
    import rlperf.kernels as K

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, L, hq, hkv, d = 3, 300, 32, 8, 128  # odd lengths: partial last pages
    q, k, v = (torch.randn(B * L, h, d, device="cuda", generator=gen).bfloat16() for h in (hq, hkv, hkv))
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device="cuda")
    ref = K.varlen_attention(q, k, v, cu)
    got = FI.ragged_prefill(fi, q, k, v, cu)()
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    page = K.PAGE_SIZE
    pages = -(-L // page)
    table = torch.randperm(B * pages, generator=gen, device="cuda").view(B, pages).to(torch.int32)
    kc = torch.zeros(B * pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.arange(L, device="cuda")
    slots = (table.long()[:, pos // page] * page + pos % page).reshape(-1)
    K.write_kv_cache(k, v, kc, vc, slots)
    qd = torch.randn(B, hq, d, device="cuda", generator=gen).bfloat16()
    kv_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    ref = K.paged_attention(qd, kc, vc, table, torch.arange(B + 1, dtype=torch.int32, device="cuda"), kv_lens)
    got = FI.paged_decode(fi, qd, kc, vc, table, kv_lens)()
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    logits = torch.randn(64, 1000, device="cuda", generator=gen)
    ids = FI.top_k_top_p_sampling(fi, logits, 0.8, 0.9, 20)()
    top20 = logits.topk(20, -1).indices
    assert ids.shape == (64,) and bool((top20 == ids.long()[:, None]).any(-1).all())


# The FlashInfer kernels the anchors run on an H100 (sm_90a), as FlashInfer's JIT builds them:
# (name, the JIT spec's generator call, the object files of those kernels in its build.ninja).
JIT_KERNELS = {
    # BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) plans FlashInfer's FA2 prefill module
    # and runs its paged kernel without a mask (the decode anchor: Hq / Hkv = 4)
    "paged-decode-fa2": ("J.gen_batch_prefill_module('fa2', *BF16, torch.int32, 128, 128, 0, False, False, False)",
                         r"paged_kernel_mask_0|_batch_prefill\.cuda|jit_binding"),
    # BatchPrefillWithRaggedKVCacheWrapper's "auto" backend on sm_90a for bf16: FA3, causal (mask mode 1)
    "ragged-prefill-fa3": ("J.gen_batch_prefill_module('fa3', *BF16, torch.int32, 128, 128, 0, False, False, False)",
                           r"ragged_sm90_kernel_mask_1|_batch_prefill_sm90\.cuda|jit_binding"),
    # top_k_top_p_sampling_from_probs and friends (the sampling anchor)
    "sampling": ("gen_sampling_module()", r"\.o$"),
}

_COMPILE_ONLY = r'''
import importlib.util, json, os, re, subprocess, sys, types
# flashinfer/__init__.py queries the CUDA device at import; its JIT package needs none: a bare package
# object stands in for flashinfer so that only flashinfer.jit is imported
spec = importlib.util.find_spec("flashinfer")
pkg = types.ModuleType("flashinfer")
pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["flashinfer"] = pkg
import torch
import flashinfer.jit as J
from flashinfer.jit.sampling import gen_sampling_module
BF16 = (torch.bfloat16,) * 3
jit = eval(sys.argv[1])
jit.write_ninja()
ninja = jit.ninja_path.read_text()
builds = [(m.group(1), m.group(2)) for m in re.finditer(r"^build (\S+\.o): \S+ (\S+)", ninja, re.M)
          if re.search(sys.argv[2], m.group(1))]
objects = [obj for obj, _ in builds]

# the include path: the ninja file's -I/-isystem dirs and nvcc's own (from its dry run)
home = re.search(r"^cuda_home = (.*)$", ninja, re.M).group(1)
flags = ninja.replace("$cuda_home", home)
dry = subprocess.run(["nvcc", "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"], capture_output=True,
                     text=True)
dirs = re.findall(r"(?:-I|-isystem\s+)(\S+)", flags) + re.findall(r'INCLUDES="-I([^"]+)"', dry.stderr + dry.stdout)

def unresolved_includes(sources):
    """The names the sources #include, directly or through the headers they reach, that are on no
    directory of the include path (standard and system headers among them)."""
    seen, missing, todo = set(), set(), [os.path.abspath(s) for s in sources]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            text = open(path, errors="replace").read()
        except OSError:
            continue
        for name in re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', text, re.M):
            hits = [os.path.join(d, name) for d in [os.path.dirname(path), *dirs]]
            found = next((h for h in hits if os.path.isfile(h)), None)
            if found:
                todo.append(os.path.abspath(found))
            else:
                missing.add(name)
    return missing

# a CUDA toolkit without cuRAND's headers cannot build sources that include them: say so without compiling
absent = sorted(unresolved_includes([src for _, src in builds]) & {"curand.h", "curand_kernel.h"})
if absent:
    print(json.dumps({"objects": len(objects), "rc": 1, "tail": f"{absent[0]}: No such file (not on the include path)"}))
    sys.exit(0)
r = subprocess.run(["ninja", "-C", str(jit.build_dir), *objects], capture_output=True, text=True)
print(json.dumps({"objects": len(objects), "rc": r.returncode, "tail": (r.stdout + r.stderr)[-3000:]}))
'''


@pytest.mark.parametrize("kernel", sorted(JIT_KERNELS))
def test_flashinfer_jit_sources_compile_for_sm90a(kernel, tmp_path):
    """FlashInfer's JIT sources of each kernel the anchors use compile for sm_90a with this machine's nvcc
    (compile only: object files, no GPU, no link against the CUDA driver). Skips name why: no FlashInfer,
    no nvcc, or a CUDA toolkit without cuRAND's headers, which the FA3 and sampling sources include
    (seen before any compile, by following the sources' includes along the build's include path)."""
    import importlib.util
    import json
    import os
    import shutil
    import subprocess
    import sys

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer-python is not installed (the README's test install adds it)")
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on PATH: FlashInfer's JIT sources cannot be compiled here")
    call, objects = JIT_KERNELS[kernel]
    env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ONLY, call, objects], capture_output=True, text=True,
                          env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["rc"] != 0 and ("curand_kernel.h: No such file" in out["tail"] or "curand.h: No such file" in out["tail"]):
        pytest.skip(f"{kernel}: this CUDA toolkit has no cuRAND headers (curand_kernel.h), which its sources include")
    assert out["objects"] >= 1 and out["rc"] == 0, out["tail"]
