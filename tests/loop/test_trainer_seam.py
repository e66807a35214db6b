"""The trainer seam: the loop builds its trainer through one registry (``--train-backend`` and the layout
flags -> :mod:`rlperf.train.backend`) and talks to it through one protocol.

* No module of the loop imports a concrete trainer (checked on the syntax tree, as tests/test_layering.py
  reads imports), and the runner never branches on a trainer kind or a world size.
* Every registered backend offers every verb of :class:`rlperf.train.backend.TrainerBackend`.
* The metrics of four layouts — the embedded default, FSDP on 2 ranks, expert parallel EP=2 and megatron
  TP=2 — are the bits the loop wrote before the seam existed (``data/trainer_seam_metrics.json``,
  recorded at ``f97aae1``). Re-recorded once, at ``1dd5654``, where the megatron backend's grad norm
  became the tree of its leaves' squared norms (``leaf_square_sums``): the megatron layout's grad norm
  moved by one float32 ulp and with it the clipped update; the other three layouts' bits were the
  recording's, unchanged. Re-recorded after ``adf7d0b`` for the seeded init
  (``rlperf.model.seeded_normal``), which gives the random model other weights: with the ``torch.randn``
  init patched into every process, that tree still wrote the ``1dd5654`` recording bit for bit, so the
  init is the only change. Re-recorded at ``3411e7c``, where the megatron tree mode's RMSNorm weight
  gradients became the norm kernel's fixed-row partials gathered across the sequence-parallel ranks
  (``token_parallel_rmsnorm``) instead of a tree over equal token blocks: recorded on one machine at
  ``e113736`` and at ``3411e7c``, the embedded, FSDP and EP layouts wrote the same bits and the megatron
  layout's metrics too; only its weights after the update (checksums, model digest) moved.

Why that last comparison is guarded. float32 CPU math is not the same bits on every x86 CPU: torch's and
numpy's vectorised kernels (matmul blocking, exp, log) differ between AVX2 and AVX-512 builds, and
between torch versions. The recorded file therefore carries the fingerprints of the machines whose numerics
are known to write the recorded bits (:func:`numerics_fingerprint`: the bits of the ops the reference kernels
are made of, and torch's version): the recording machine's, and each machine added since by
``--add-machine``, which runs the four layouts there and adds its fingerprint only when they wrote the
recording bit for bit. Where this machine's fingerprint is in that list the metrics must be equal bit for
bit; elsewhere that comparison is skipped, naming the difference, because it could only test the CPU. The
fingerprint is stricter than the runs need (an AMD AVX-512 machine whose fingerprint differs from the
recording machine's wrote the recording bit for bit): a skip names the command that checks and adds the
machine. What holds on every CPU is tested by the layout tests beside this file: each layout equals the
one-process run bit for bit, in the same process, on whatever CPU runs them.

Recording (once, at the commit before a refactor, with that commit's ``rlperf`` importable; COMMIT
defaults to the checkout ``rlperf`` is imported from)::

    python tests/loop/test_trainer_seam.py --record tests/loop/data/trainer_seam_metrics.json [COMMIT]

Adding this machine (at a commit whose bits are the recording's, e.g. the head while this test passes on
a listed machine; exit 0 when the machine was added or already listed, 1 naming the first difference)::

    python tests/loop/test_trainer_seam.py --add-machine tests/loop/data/trainer_seam_metrics.json
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).with_name("data") / "trainer_seam_metrics.json"

CONCRETE_MODULES = ("rlperf.train.trainer", "rlperf.train.fsdp", "rlperf.train.expert_parallel",
                    "rlperf.train.megatron")
"""Modules that define trainers: only :mod:`rlperf.train.backend`'s registry imports them."""
CONCRETE_NAMES = {"Trainer", "FSDPTrainer", "ExpertParallelTrainer", "MegatronTrainer", "MegatronBackend"}
"""Trainer classes, wherever a module would import them from (``rlperf.train`` exports ``Trainer``)."""
LAYOUT_WORDS = {"world_size", "backend", "expert_model_parallel_size", "megatron", "tensor_model_parallel_size"}
"""Names a branch on a trainer kind or a world size would read."""


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def concrete_trainer_imports(relpath: str, source: str) -> list[str]:
    """``file:line: what`` for every import of a trainer module or class in ``source`` (anywhere in the tree:
    functions and ``TYPE_CHECKING`` blocks too)."""
    importer = ".".join(Path(relpath).with_suffix("").parts)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, node)
            targets = [(f"{base}.{a.name}", a.name) for a in node.names] + [(base, None)]
        else:
            continue
        for target, name in targets:
            if any(target == m or target.startswith(m + ".") for m in CONCRETE_MODULES) or name in CONCRETE_NAMES:
                found.append(f"{relpath}:{node.lineno}: imports {target}")
    return sorted(set(found))


def layout_branches(source: str) -> list[str]:
    """``line: names`` of every condition (``if``, conditional expression, ``while``, boolean operand) that
    reads a trainer kind or the world size (:data:`LAYOUT_WORDS`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else []
        tests += node.values if isinstance(node, ast.BoolOp) else []
        for t in tests:
            names = {n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)}
            names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            if names & LAYOUT_WORDS:
                out.append(f"{t.lineno}: {sorted(names & LAYOUT_WORDS)}")
    return out


def test_the_loop_imports_no_concrete_trainer():
    hits = []
    for path in sorted((ROOT / "rlperf" / "loop").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        hits += concrete_trainer_imports(rel, path.read_text())
    assert not hits, "the loop reaches trainers only through rlperf.train.backend:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", ["from rlperf.train.fsdp import FSDPTrainer", "from rlperf.train import Trainer",
                                  "import rlperf.train.megatron.trainer",
                                  "def f():\n    from ..train.expert_parallel import ExpertParallelTrainer"])
def test_a_planted_concrete_trainer_import_is_found(line):
    assert concrete_trainer_imports("rlperf/loop/runner.py", line + "\n")


def test_the_runner_never_branches_on_a_trainer_kind_or_the_world_size():
    source = (ROOT / "rlperf" / "loop" / "runner.py").read_text()
    assert layout_branches(source) == []
    assert layout_branches("if self.world_size > 1:\n    pass\n") == ["1: ['world_size']"]  # the check bites


def test_backend_names_follow_the_flags_and_the_layout():
    from rlperf.train.args import TrainArgs
    from rlperf.train.backend import backend_name
    from rlperf.train.config import MoEConfig, TrainConfig

    def config(backend="fsdp", ep=1):
        return TrainConfig(TrainArgs(), "fp32", 1, backend, None, MoEConfig(expert_model_parallel_size=ep))

    assert backend_name(config(), 1) == "one-process"
    assert backend_name(config(), 2) == "fsdp"
    assert backend_name(config(ep=2), 2) == "expert-parallel"
    assert backend_name(config("megatron"), 1) == backend_name(config("megatron"), 2) == "megatron"


PROTOCOL = ("engine_model", "describe", "prepare", "train_step", "train", "train_routed_experts", "compute_weights",
            "checkpoint_state", "load_state_dict", "probe_step", "close", "device")


@pytest.mark.parametrize("name", ["one-process", "fsdp", "expert-parallel", "megatron"])
def test_every_registered_backend_offers_the_protocol(name):
    import typing

    from rlperf.train.backend import TrainerBackend, trainer_backend

    if name == "megatron":
        pytest.importorskip("megatron.core")
    factory = trainer_backend(name)
    cls = typing.get_type_hints(factory)["return"]
    assert all(hasattr(cls, verb) for verb in PROTOCOL), [v for v in PROTOCOL if not hasattr(cls, v)]
    assert {m for m in dir(TrainerBackend) if not m.startswith("_")} <= set(PROTOCOL) | {"args", "model"}


def test_an_unknown_backend_names_the_registered_ones():
    from rlperf.train.backend import trainer_backend

    with pytest.raises(KeyError, match="one-process"):
        trainer_backend("deepspeed")


def test_the_architecture_page_examples_of_adding_a_backend_run(capsys):
    """docs/ARCHITECTURE.md's two examples ("Adding a backend"), run as the page shows them, in order."""
    import re

    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = page[page.index("### Adding a backend"):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    scope: dict = {"__name__": "architecture_example"}
    for block in blocks:
        exec(compile(block, "docs/ARCHITECTURE.md", "exec"), scope)
    assert "step 1: loss" in capsys.readouterr().out


# ---- the four layouts' metrics, bit for bit --------------------------------------------------------
FAST = ["--device", "cpu", "--num-threads", "1", "--no-progress", "--skip-gates"]
PROMPTS = [{"input": "q0?", "label": "A"}, {"input": "q1?", "label": "B"}, {"input": "q2?", "label": "A"}]
LAYOUTS = {
    "embedded": ["--num-rollout", "2"],
    "fsdp2": ["--actor-num-gpus-per-node", "2", "--num-rollout", "2", "--true-on-policy-mode",
              "--use-dynamic-batch-size", "--max-tokens-per-gpu", "128"],
    "ep2": ["--model", "qwen3-moe-tiny", "--prompt-data", "{prompts}", "--rollout-batch-size", "3",
            "--n-samples-per-prompt", "2", "--global-batch-size", "6", "--micro-batch-size", "2",
            "--rollout-max-response-len", "2", "--num-rollout", "2", "--use-kl-loss", "--kl-loss-coef", "0.1",
            "--lr", "1e-2", "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"],
    "megatron_tp2": ["--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node",
                     "2", "--num-rollout", "2", "--true-on-policy-mode", "--rollout-batch-size", "2",
                     "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--micro-batch-size", "4"],
}
"""Small runs of the four layouts (each saves a checkpoint at its end: the seam's checkpoint verb)."""


def numerics_fingerprint() -> dict:
    """The bits of the float ops the CPU reference kernels are made of (float32 / float64 products of a few
    shapes, exp, log, tanh, sigmoid, rsqrt, softmax, numpy's float32 product), hashed, with torch's version:
    equal fingerprints, equal numerics for these runs (module docstring)."""
    import numpy as np
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        h = hashlib.sha256()
        for m, k, n in ((1, 96, 80), (37, 96, 80), (64, 256, 512), (128, 64, 1000)):
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            h.update((a @ b).numpy().tobytes())
            h.update((a.double() @ b.double()).numpy().tobytes())
            h.update(np.matmul(a.numpy(), b.numpy()).tobytes())
        x = torch.randn(4099, generator=g)
        for y in (x.exp(), x.abs().log(), x.tanh(), x.sigmoid(), x.abs().rsqrt(), x.view(1, -1).softmax(-1),
                  torch.nn.functional.silu(x)):
            h.update(y.numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
    return {"torch": torch.__version__.split("+")[0], "ops": h.hexdigest()[:16]}


def _kept(line: dict) -> dict:
    """A metrics line without what depends on time or processes (``perf/*``, ``memory/*``)."""
    return {k: v for k, v in line.items() if not k.startswith(("perf/", "memory/"))}


def run_layouts(work: Path) -> dict:
    """Each layout's metrics lines (:func:`_kept`) and the hash of the model file its checkpoint wrote."""
    from rlperf.cli import main

    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = {}
    for name, flags in LAYOUTS.items():
        run = work / name
        argv = ["train", *FAST, "--output-dir", str(run), "--save", str(run / "ckpt"),
                *[f.format(prompts=prompts) for f in flags]]
        assert main(argv) == 0, name
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        (model_file,) = (run / "ckpt").glob("iter_*/model/model.safetensors")
        out[name] = {"metrics": [_kept(m) for m in lines],
                     "model_sha256": hashlib.sha256(model_file.read_bytes()).hexdigest()}
    return out


@pytest.fixture(scope="module")
def recorded():
    data = json.loads(RECORDED.read_text())
    here = numerics_fingerprint()
    if here not in data["fingerprints"]:
        pytest.skip(f"this CPU's float numerics are not a listed machine's ({here} vs {data['fingerprints']}): "
                    f"bits recorded there cannot be compared here (python {Path(__file__).relative_to(ROOT)} "
                    f"--add-machine {RECORDED.relative_to(ROOT)} checks this machine and adds it)")
    return data


def test_first_difference_names_the_layout_line_and_metric():
    """The comparison behind the recorded-bits test and ``--add-machine``: equal layouts give None; a moved
    metric, a missing layout and another checkpoint are named (layout, metrics line, key, both values)."""
    layouts = json.loads(RECORDED.read_text())["layouts"]
    assert first_difference(json.loads(json.dumps(layouts)), layouts) is None
    moved = json.loads(json.dumps(layouts))
    moved["fsdp2"]["metrics"][1]["train/grad_norm"] += 1e-9
    want = layouts["fsdp2"]["metrics"][1]["train/grad_norm"]
    assert first_difference(moved, layouts) == (f"fsdp2: metrics line 1: train/grad_norm = "
                                                 f"{want + 1e-9!r}, recorded {want!r}")
    moved = json.loads(json.dumps(layouts))
    moved["ep2"]["model_sha256"] = "0" * 64
    assert first_difference(moved, layouts) == "ep2: the checkpoint's model file differs"
    del moved["ep2"]
    assert first_difference(moved, layouts) == "ep2: not run"


def test_four_layouts_write_the_recorded_bits(recorded, tmp_path):
    """Metrics (rewards, log-probs, losses, grad norms, weight checksums) and the checkpoint's weights of
    the embedded default, FSDP 2 ranks, EP=2 and megatron TP=2, equal to the recording bit for bit."""
    pytest.importorskip("megatron.core")
    diff = first_difference(run_layouts(tmp_path), recorded["layouts"])
    assert diff is None, f"not the recorded bits (commit {recorded['commit']}): {diff}"


def first_difference(got: dict, recorded: dict) -> str | None:
    """Where the layouts' bits ``got`` (:func:`run_layouts`) first differ from ``recorded``'s, in words;
    None when they are equal."""
    for name, want in recorded.items():
        have = got.get(name)
        if have is None:
            return f"{name}: not run"
        if have["model_sha256"] != want["model_sha256"]:
            return f"{name}: the checkpoint's model file differs"
        for i, (a, b) in enumerate(zip(have["metrics"], want["metrics"])):
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            if keys:
                return f"{name}: metrics line {i}: {keys[0]} = {a.get(keys[0])!r}, recorded {b.get(keys[0])!r}"
        if len(have["metrics"]) != len(want["metrics"]):
            return f"{name}: {len(have['metrics'])} metrics lines, recorded {len(want['metrics'])}"
    return None


def _record_or_add_machine(argv: list[str]) -> int:
    """``--record FILE [COMMIT]`` or ``--add-machine FILE`` (module docstring)."""
    import subprocess
    import tempfile

    if len(argv) < 2 or argv[0] not in ("--record", "--add-machine"):
        print("Recording" + __doc__.split("Recording", 1)[1], file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py sets it on a machine without CUDA
    path = Path(argv[1])
    here = numerics_fingerprint()
    if argv[0] == "--add-machine":
        data = json.loads(path.read_text())
        if here in data["fingerprints"]:
            print(f"{here} is already listed in {path}")
            return 0
    with tempfile.TemporaryDirectory() as tmp:
        layouts = run_layouts(Path(tmp))
    if argv[0] == "--add-machine":
        diff = first_difference(layouts, data["layouts"])
        if diff is not None:
            print(f"not added: this machine ({here}) did not write the recording (commit {data['commit']}): {diff}",
                  file=sys.stderr)
            return 1
        data["fingerprints"].append(here)
        print(f"added {here}: the four layouts wrote the recording of {data['commit']} bit for bit")
    else:
        import rlperf

        commit = argv[2] if len(argv) > 2 else subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(rlperf.__file__).parents[1]).stdout.strip()
        data = {"commit": commit, "fingerprints": [here], "layouts": layouts}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_record_or_add_machine(sys.argv[1:]))
