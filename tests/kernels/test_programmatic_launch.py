"""Programmatic dependent launch (``kernels/pipeline.py``): the switch, the instructions the kernels
compile to for SM 90 (CPU, Triton's compiler and ptxas, no GPU), and on the GPU the same bits with the
switch on as off, eager and from CUDA graphs."""
import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlperf.kernels as K
from rlperf.kernels import pipeline

KERNELS_DIR = Path(pipeline.__file__).parent


def pdl_launches() -> dict[str, str]:
    """``module:kernel`` -> the first statement of each kernel that some launch in ``kernels/`` marks with
    ``**launch_options(...)``, read from the source."""
    found = {}
    for path in sorted(KERNELS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        jitted = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name)
                    and any(k.arg is None and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "")
                            == "launch_options" for k in node.keywords)):
                fn = jitted[node.func.value.id]
                body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                    else fn.body
                found[f"{path.stem}:{fn.name}"] = ast.unparse(body[0])
    return found


def test_every_kernel_launched_with_launch_options_waits_first():
    """A launch marked for PDL lets its kernel start before the previous one ends: the kernel's first
    statement must be ``grid_dependency_sync()``, or its loads could read what is still being written."""
    found = pdl_launches()
    assert len(found) >= 20, sorted(found)  # the decode step's and the dense train step's kernels
    assert {k for k, first in found.items() if first != "grid_dependency_sync()"} == set()


@pytest.fixture
def fresh_setting(monkeypatch):
    """The switch as a process starts: not read yet; restored after the test."""
    monkeypatch.setattr(pipeline, "_pdl_on", None)
    monkeypatch.delenv(pipeline.PDL_ENV, raising=False)


def test_the_switch_reads_rlperf_pdl_once_and_names_a_bad_value(fresh_setting, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(pipeline.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="RLPERF_PDL='yes'"):
        K.programmatic_launch(cpu)
    monkeypatch.setenv(pipeline.PDL_ENV, "1")
    assert not K.programmatic_launch(cpu)  # on, but a CPU tensor has no launch to mark
    assert pipeline._pdl_on is True and pipeline.launch_options(cpu) == {}
    monkeypatch.setenv(pipeline.PDL_ENV, "0")
    assert pipeline._pdl_on is True  # read once: a later change of the variable does nothing
    K.set_programmatic_launch(None)  # until the setting is cleared
    assert not K.programmatic_launch(cpu) and pipeline._pdl_on is False


def test_programmatic_launch_is_on_unless_rlperf_pdl_is_0(fresh_setting, monkeypatch):
    assert pipeline._pdl_from_environment() is True  # unset: on (SM 90+ GPUs only: _pdl_capable)
    monkeypatch.setenv(pipeline.PDL_ENV, "")
    assert pipeline._pdl_from_environment() is True
    monkeypatch.setenv(pipeline.PDL_ENV, "0")
    assert pipeline._pdl_from_environment() is False


def test_use_programmatic_launch_nests_and_restores(fresh_setting):
    with K.use_programmatic_launch(True):
        assert pipeline._pdl_on is True
        with K.use_programmatic_launch(False):
            assert pipeline._pdl_on is False
        assert pipeline._pdl_on is True
    assert pipeline._pdl_on is None
    with pytest.raises(RuntimeError):
        with K.use_programmatic_launch(True):
            raise RuntimeError("the block failed")
    assert pipeline._pdl_on is None


def test_the_interpreter_runs_no_grid_dependency_instruction():
    """Under TRITON_INTERPRET the kernels are Python: the grid-dependency calls are compiled out (the
    interpreter has no inline assembly), and the CPU kernel tests run the same kernels as before."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the kernels are compiled here, not interpreted")
    assert not pipeline._GRID_DEPENDENCY


COMPILE_SCRIPT = r"""
import json, re, subprocess, sys, tempfile
from triton import knobs
from rlperf.kernels import precompile as P

wanted = json.loads(sys.argv[1])
entries = P.read_manifest(P.MANIFEST_DIR / "cuda-90-triton3.6.0.jsonl")
picked = {}
for e in entries:  # one specialization of each kernel the manifest holds
    picked.setdefault(e["kernel"].removeprefix("rlperf.kernels."), e)


def spec(kernel, pointers, const, warps):  # an entry of our own: pointers {name: type}, the rest i32
    names = P._kernel("rlperf.kernels." + kernel).arg_names
    return {"kernel": "rlperf.kernels." + kernel, "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
            "spec": {"signature": {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names},
                     "constant_keys": [[names.index(n)] for n in const], "constant_vals": list(const.values()),
                     "attrs_keys": [], "attrs_vals": [], "options": {"num_warps": warps, "num_stages": 3}}}


# the engine fuses the K/V write and the gate samples without top-p: bf16 K/V, 8 heads of 128, 128-row pages;
# float32 sorted probabilities over a 151936-token vocabulary
picked.setdefault("attention:_write_kv_kernel", spec(
    "attention:_write_kv_kernel", {"K": "*bf16", "V": "*bf16", "KC": "*bf16", "VC": "*bf16", "SLOTS": "*i64"},
    {"H": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "PAGE": 128}, 4))
picked.setdefault("sampling:_top_p_threshold_kernel", spec(
    "sampling:_top_p_threshold_kernel", {n: "*fp32" for n in ("srt_ptr", "temp_ptr", "top_p_ptr", "thr_ptr")},
    {"BLOCK": 4096}, 8))
# the megatron tree step's node (8 leaves of a bf16 product, float32 out) and its tree sum
picked.setdefault("tree_reduce:_tree_node_kernel", spec(
    "tree_reduce:_tree_node_kernel", {"x": "*bf16", "w": "*bf16", "out": "*fp32"},
    {"LEAVES": 8, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "PRECISION": "tf32"}, 4))
picked.setdefault("tree_reduce:_tree_sum_kernel", spec(
    "tree_reduce:_tree_sum_kernel", {"parts": "*fp32", "out": "*bf16"}, {"LEAVES": 8, "BLOCK": 1024}, 4))
# the engine's one-pass draw and log-prob (fused_sample_logprob) at the 0.6b head: bf16 TMA tiles, 5-tile splits
picked.setdefault("fused_lm_head:_sample_partials_kernel", spec(
    "fused_lm_head:_sample_partials_kernel",
    {"h_src": "tensordesc<bf16[128, 64]>", "w_src": "tensordesc<bf16[256, 64]>", "temp_ptr": "*fp32",
     "seed_ptr": "*i64", "pos_ptr": "*i64", "pm_ptr": "*fp32", "ps_ptr": "*fp32", "pk_ptr": "*fp32", "pi_ptr": "*i32",
     "px_ptr": "*fp32", "c": "fp32"},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "SPLIT_TILES": 5, "EVEN_K": True, "PRECISION": "tf32",
     "USE_TMA": True, "FLATTEN": True}, 8))
picked.setdefault("fused_lm_head:_sample_combine_kernel", spec(
    "fused_lm_head:_sample_combine_kernel",
    {"pm_ptr": "*fp32", "ps_ptr": "*fp32", "pk_ptr": "*fp32", "pi_ptr": "*i32", "px_ptr": "*fp32", "tok_ptr": "*i64",
     "lp_ptr": "*fp32", "inv_t": "fp32", "c": "fp32"}, {"BLOCK": 128}, 4))
missing = [n for n in wanted if n not in picked]
assert not missing, f"no specialization to compile for {missing}: add a spec() line for each"
for name in wanted:
    entry = picked[name]
    entry["spec"]["options"]["launch_pdl"] = True
    kernel = P.compile_entry(entry, launcher=False)
    lines = [re.sub(r"^@!?%p\d+\s+", "", l.strip()) for l in kernel.asm["ptx"].splitlines()]  # predicates off
    wait = next(i for i, l in enumerate(lines) if l.startswith("griddepcontrol.wait"))
    go = next(i for i, l in enumerate(lines) if l.startswith("griddepcontrol.launch_dependents"))
    first_memory = next(i for i, l in enumerate(lines)
                        if l.startswith(("ld.global", "st.global", "cp.async", "cp.reduce", "atom.", "red.",
                                         "ld.shared", "st.shared")))
    # and in the machine code ptxas made of it: ACQBULK (the wait) before any load, store or TMA copy
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    acquire = ops.index("ACQBULK")
    memory = [i for i, op in enumerate(ops) if re.match(r"(LDG|STG|LDGSTS|UTMA|UBLKCP|ATOM|RED|LDS|STS|LD\b|ST\b)", op)]
    print(json.dumps({"kernel": name, "launch_pdl": bool(kernel.metadata.launch_pdl),
                      "wait_first": wait < go < first_memory and bool(memory) and acquire < memory[0]}))
"""


def test_every_pdl_kernel_compiles_for_the_h100_h200_with_the_wait_before_its_first_memory_access(tmp_path):
    """Each kernel that may be launched with PDL, compiled for SM 90 with ``launch_pdl`` (a specialization
    the shipped manifest recorded, or one of our own where it has none): ``griddepcontrol.wait`` comes
    before the kernel's first global or shared memory instruction, in the PTX and in ptxas's machine code
    (``ACQBULK``), so no load can read, and no store overwrite, what the previous kernel is still using;
    ``launch_dependents`` follows the wait."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    kernels = sorted(pdl_launches())
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(kernels)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [g["kernel"] for g in got] == kernels
    assert all(g["launch_pdl"] and g["wait_first"] for g in got), got


# ---- GPU: the bits with the switch on equal the bits with it off --------------------------------


@pytest.mark.gpu
def test_gpu_decode_with_programmatic_launch_gives_the_plain_bits():
    """The engine's tokens and log-probs with PDL on (eager steps, and decode steps captured into CUDA
    graphs with PDL launches) equal those with it off, 2 layers of the qwen3-0.6b shape in bf16, 12
    requests of mixed lengths (several graph buckets)."""
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.rollout.engine import Engine, EngineConfig, SamplingParams
    from rlperf.rollout.tokenizer import ByteTokenizer

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs SM 90 or later")
    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    model = Qwen3ForCausalLM.random(cfg, seed=4, dtype=torch.bfloat16, device="cuda")
    tok = ByteTokenizer(cfg.vocab_size)
    gen = torch.Generator().manual_seed(18)
    prompts = [torch.randint(0, 250, (int(n),), generator=gen).tolist()
               for n in torch.randint(10, 300, (12,), generator=gen)]
    params = [SamplingParams(max_new_tokens=16 + 4 * i, temperature=1.0, seed=40 + i, ignore_eos=True)
              for i in range(12)]

    def run(pdl: bool, graphs: int):
        with K.use_backend(None), K.use_mode("invariant"), K.use_programmatic_launch(pdl):
            engine = Engine(model, tok, EngineConfig(max_total_tokens=1 << 15, cuda_graph_max_bs=graphs))
            out = engine.generate(prompts, params)
            if graphs:
                assert len(engine.graphs.graphs) >= 3
        return [(r.output_ids, r.output_logprobs) for r in out]

    plain = run(False, 16)
    assert run(True, 16) == plain
    assert run(True, 0) == plain


@pytest.mark.gpu
def test_gpu_packed_forward_and_backward_with_programmatic_launch_give_the_plain_bits():
    """The trainer's packed forward (varlen attention with its LSE, norms, matmuls, SwiGLU) and its
    gradients with PDL on equal those with it off, bit for bit."""
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs SM 90 or later")
    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    model = Qwen3ForCausalLM.random(cfg, seed=5, dtype=torch.bfloat16, device="cuda")
    lens = [37, 300, 1, 129]
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(6)).cuda()
    positions = torch.cat([torch.arange(n) for n in lens]).cuda()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def run(pdl: bool):
        model.zero_grad(set_to_none=True)
        with K.use_backend(None), K.use_mode("invariant"), K.use_programmatic_launch(pdl):
            h = model.forward_packed(ids, positions, cu)
            lp = K.fused_logprob(h[:-1], model.head_weight, ids[1:], 1.0)
            lp.sum().backward()
        return [lp.detach().clone()] + [p.grad.clone() for p in model.parameters()]

    plain, marked = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, marked))
