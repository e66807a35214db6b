"""One direction of imports across rlperf, checked on the syntax tree of every module.

    kernels (+ _C, plots) -> model (+ telemetry) -> {rollout, train, sync, data} -> loop -> gates -> cli

``bench`` and ``profiles`` are tools on top: they import the product, and nothing in the product
imports them except the CLI (``rlperf.cli``). Every ``import`` / ``from`` statement counts, including
those inside functions and under ``if TYPE_CHECKING:`` (a lazy import is still a dependency), and so
does ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name. Relative imports
are resolved, and so is the package_dir mapping of setup.py (``kernels/x.py`` is ``rlperf.kernels.x``).

A module's unit is its top-level subpackage under ``rlperf`` (``rlperf.kernels.reference.norm`` is in
``kernels``). An import is allowed when the target's layer is lower, or when both are in the same
unit; between two units of the same layer only the pairs of :data:`PEER_EDGES` are allowed, each
with its reason. A unit missing from :data:`LAYERS` fails, so the table stays complete.
See docs/ARCHITECTURE.md for what each unit holds.

Within and across units, modules form no circle: the graph of module-to-module imports (the same
edges, lazy ones included) has no cycle (:func:`import_cycles`). A circle means neither module can be
read, tested or imported without the other; break it by moving what both need into a lower module.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "rlperf"

TOP_LEVEL_SUBPACKAGES = ("kernels", "gates", "profiles", "bench")
"""Folders at the repository's top that import as ``rlperf.<name>`` (setup.py's package_dir)."""

LAYERS = {
    "": 0,  # rlperf/__init__.py: the version string, nothing else
    "kernels": 0,
    "lazy_exports": 0,  # the packages' exports loaded on first use (light --help); imports nothing of rlperf
    "flags": 0,  # argparse value checks every command's flags share; imports nothing of rlperf
    "graph_capture": 0,  # CUDA-graph captures that fall back to eager steps: the engine's and the trainer's graphs
    "_C": 0,  # the C++/CUDA extension, the kernels' peer
    "plots": 0,  # pictures of rlperf's files (metrics.jsonl, bench JSON) with matplotlib: imports nothing of rlperf,
                 # so the loop's --plot (through telemetry's loggers), the gates and the CLI can all draw
    "model": 1,
    "telemetry": 1,  # process memory, phase meter, timeline: imports nothing of rlperf; the loop and the
                     # rollout server (its /get_server_info memory) both measure with it
    "rollout": 2, "train": 2, "sync": 2, "data": 2,
    "sglang_plugin": 2,  # rlperf's numerics inside SGLang's engine (model, attention, sampler): the rollout
                         # side's peer, on the model and the kernels; SGLang loads it, nothing of rlperf does
    "loop": 3,
    "gates": 4,
    "cli": 5, "__main__": 5,
    "profiles": 6, "bench": 6,
}
"""Layer of each unit: an import must point to a lower layer (or stay inside its unit)."""

TOOLS = {"profiles", "bench"}
"""Tools on top of the product: they import it; only :data:`TOOL_USERS` import them."""
TOOL_USERS = {"cli"}
"""The product units that may import a tool: the CLI wires ``rlperf bench`` and ``rlperf profile``."""

PEER_EDGES = {
    ("rollout", "sync"): "the server receives and loads weight buckets through sync's transports",
    ("data", "train"): "the embedded task's format warm-up packs its samples with the trainer's micro-batching",
    ("__main__", "cli"): "python -m rlperf runs the CLI's main",
}
"""Allowed imports between different units of one layer: (importer, imported) -> why."""


@dataclasses.dataclass(frozen=True)
class Edge:
    """``importer`` (defined in ``path``) imports ``target`` at ``line``."""

    path: str
    line: int
    importer: str
    target: str


@dataclasses.dataclass(frozen=True)
class Violation:
    edge: Edge
    rule: str

    def __str__(self) -> str:
        e = self.edge
        return f"{e.path}:{e.line}: {e.importer} imports {e.target}: {self.rule}"


def module_name(relpath: str) -> str:
    """``kernels/reference/norm.py`` -> ``rlperf.kernels.reference.norm``; ``rlperf/loop/__init__.py`` -> ``rlperf.loop``."""
    parts = list(Path(relpath).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in TOP_LEVEL_SUBPACKAGES:
        parts.insert(0, PACKAGE)
    return ".".join(parts)


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _literal_import_call(node: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("x")`` or ``__import__("x")`` (a literal first argument)."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def import_edges(relpath: str, source: str, modules: set[str] = frozenset()) -> list[Edge]:
    """Every import of an ``rlperf`` module in ``source`` (the file ``relpath``), anywhere in the tree.

    ``from P import x`` is an import of ``P.x`` when that is a module (one of ``modules``, or a unit
    of :data:`LAYERS` directly under ``rlperf``: ``from rlperf import kernels as K``), else of ``P``.
    """
    importer = module_name(relpath)
    is_package = Path(relpath).name == "__init__.py"
    edges = []

    def add(node, target):
        edge = Edge(relpath, node.lineno, importer, target)
        if (target == PACKAGE or target.startswith(PACKAGE + ".")) and edge not in edges:
            edges.append(edge)  # `from P import a, b` is one edge

    for node in ast.walk(ast.parse(source, filename=relpath)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(importer, is_package, node.level, node.module) if node.level else node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = sub in modules or (base == PACKAGE and alias.name in LAYERS)
                add(node, sub if is_module else base)
        elif isinstance(node, ast.Call):
            target = _literal_import_call(node)
            if target:
                add(node, target)
    return edges


def unit(module: str) -> str:
    """``rlperf.loop.runner`` -> ``loop``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def check_edge(edge: Edge) -> str | None:
    """The rule ``edge`` breaks, or None."""
    src, dst = unit(edge.importer), unit(edge.target)
    for u, who in ((src, "importing module"), (dst, "imported module")):
        if u not in LAYERS:
            return (f"unknown unit {PACKAGE}.{u} ({who}): add it to LAYERS in tests/test_layering.py "
                    f"with its layer, and to docs/ARCHITECTURE.md")
    if src == dst:
        return None
    if dst in TOOLS and src not in TOOLS:
        if src in TOOL_USERS:
            return None
        return (f"{PACKAGE}.{dst} is a tool: nothing in the product imports it except "
                f"{', '.join(PACKAGE + '.' + u for u in sorted(TOOL_USERS))}")
    ls, ld = LAYERS[src], LAYERS[dst]
    if ld > ls:
        return (f"upward import: {src or PACKAGE} (layer {ls}) may not import {dst or PACKAGE} (layer {ld}); "
                f"imports point down: kernels -> model/telemetry -> rollout/train/sync/data -> loop -> gates -> cli")
    if ld == ls and (src, dst) not in PEER_EDGES:
        return (f"{src or PACKAGE} and {dst or PACKAGE} are peers (layer {ls}): a peer import must be listed in "
                f"PEER_EDGES with its reason")
    return None


def check_sources(sources: dict[str, str]) -> list[Violation]:
    """Violations of every import in ``sources`` (relative path -> source text)."""
    modules = {module_name(p) for p in sources}
    out = []
    for path in sorted(sources):
        for edge in import_edges(path, sources[path], modules):
            rule = check_edge(edge)
            if rule is not None:
                out.append(Violation(edge, rule))
    return out


def _known_module(target: str, modules: set[str]) -> str | None:
    """The module of ``modules`` that ``target`` names: itself, or its longest dotted prefix that is one
    (``importlib.import_module("rlperf.x.y")`` of a name that is not a file); None for the extension ``_C``."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in modules:
            return name
        parts.pop()
    return None


def import_graph(sources: dict[str, str]) -> dict[str, dict[str, Edge]]:
    """importer module -> {imported module: the first edge that imports it}, over ``sources``' modules.

    Only the imports written in a module count: ``import rlperf.loop.runner`` is an edge to
    ``rlperf.loop.runner``, not to ``rlperf.loop`` (whose ``__init__`` Python also runs first): a package
    that re-exports its submodules would otherwise be a circle with each of them.
    """
    modules = {module_name(p) for p in sources}
    graph: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    for path in sorted(sources):
        for edge in import_edges(path, sources[path], modules):
            target = _known_module(edge.target, modules)
            if target is not None and target != edge.importer:
                graph[edge.importer].setdefault(target, dataclasses.replace(edge, target=target))
    return graph


def import_tangles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan): each module of a group reaches
    every other through imports. Sorted; empty when the graph has no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # recursive Tarjan; the module graph is a few hundred nodes deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(groups)


def import_cycles(sources: dict[str, str]) -> list[list[Edge]]:
    """One shortest circle of imports per tangle (:func:`import_tangles`), through its first module, as
    the edges ``m0 -> m1 -> ... -> m0``; empty when the module graph has no cycle."""
    graph = import_graph(sources)
    cycles = []
    for group in import_tangles(graph):
        members, start = set(group), group[0]
        parent: dict[str, str] = {start: start}
        frontier, closing = [start], None
        while frontier and closing is None:  # breadth first from start, inside the group, back to start
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        closing = v
                        break
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if closing is not None:
                    break
            frontier = nxt
        path = [closing]
        while path[-1] != start:
            path.append(parent[path[-1]])
        path.reverse()
        cycles.append([graph[a][b] for a, b in zip(path, path[1:] + [start])])
    return cycles


def format_cycle(cycle: list[Edge]) -> str:
    """``a -> b (a.py:3) -> a (b.py:7)``: each step with the file and line of its import."""
    return cycle[0].importer + "".join(f" -> {e.target} ({e.path}:{e.line})" for e in cycle)


def repository_sources(root: Path = ROOT) -> dict[str, str]:
    sources = {}
    for top in (PACKAGE, *TOP_LEVEL_SUBPACKAGES):
        for f in sorted((root / top).rglob("*.py")):
            sources[f.relative_to(root).as_posix()] = f.read_text()
    return sources


# ---- the repository --------------------------------------------------------------------------------


def test_imports_point_one_way():
    violations = check_sources(repository_sources())
    assert not violations, "imports against the layering:\n" + "\n".join(map(str, violations))


def test_every_module_is_in_a_known_unit():
    unknown = sorted({unit(module_name(p)) for p in repository_sources()} - set(LAYERS))
    assert not unknown, (f"units without a layer: {unknown}; add them to LAYERS in tests/test_layering.py "
                         f"and to docs/ARCHITECTURE.md")


def test_top_level_subpackages_match_setup_py():
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TOP_LEVEL_SUBPACKAGES" for t in node.targets):
            assert tuple(ast.literal_eval(node.value)) == TOP_LEVEL_SUBPACKAGES
            return
    pytest.fail("setup.py no longer defines TOP_LEVEL_SUBPACKAGES")


def test_no_import_cycles_between_modules():
    sources = repository_sources()
    cycles = import_cycles(sources)
    tangles = import_tangles(import_graph(sources))
    report = [f"{len(t)} modules ({', '.join(t)}), e.g. {format_cycle(c)}" for t, c in zip(tangles, cycles)]
    assert not cycles, ("modules that import each other (directly or around a circle); move what they share "
                        "into a module both import:\n" + "\n".join(report))


def test_peer_edges_are_used():
    """A listed peer import that nothing makes any more is stale: drop it from PEER_EDGES."""
    sources = repository_sources()
    modules = {module_name(p) for p in sources}
    used = {(unit(e.importer), unit(e.target)) for p, s in sources.items() for e in import_edges(p, s, modules)}
    assert not set(PEER_EDGES) - used, f"unused PEER_EDGES: {sorted(set(PEER_EDGES) - used)}"


# ---- the checker itself: it must be able to fail ----------------------------------------------------


def _one(sources: dict[str, str]) -> Violation:
    violations = check_sources(sources)
    assert len(violations) == 1, violations
    return violations[0]


def test_an_upward_import_inside_a_function_is_reported_with_file_and_line():
    v = _one({"rlperf/loop/runner.py": "import torch\n\n\ndef first_step():\n    from rlperf.gates.record import R\n"})
    assert str(v).startswith("rlperf/loop/runner.py:5: rlperf.loop.runner imports rlperf.gates.record: upward import")
    assert "loop (layer 3) may not import gates (layer 4)" in v.rule


def test_type_checking_and_relative_imports_count():
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..loop import Run\n"
    v = _one({"rlperf/train/trainer.py": src})
    assert (v.edge.line, v.edge.target) == (3, "rlperf.loop") and "upward import" in v.rule
    v = _one({"kernels/reference/norm.py": "from ... import model\n", "rlperf/model/__init__.py": ""})
    assert (v.edge.importer, v.edge.target) == ("rlperf.kernels.reference.norm", "rlperf.model")


def test_from_package_import_unit_is_an_edge_to_that_unit():
    v = _one({"kernels/matmul.py": "from rlperf import gates as G\n"})
    assert v.edge.target == "rlperf.gates" and str(v).startswith("kernels/matmul.py:1:")
    assert check_sources({"rlperf/model/qwen3.py": "from rlperf import kernels as K\nfrom rlperf import __version__\n"}) == []


def test_tools_are_imported_only_by_the_cli():
    v = _one({"rlperf/rollout/benchmark.py": "def f():\n    from rlperf.bench.harness import cuda_time\n"})
    assert str(v).startswith("rlperf/rollout/benchmark.py:2:") and "rlperf.bench is a tool" in v.rule
    v = _one({"gates/runner.py": "import importlib\nimportlib.import_module('rlperf.profiles.timeline')\n"})
    assert v.edge.line == 2 and "rlperf.profiles is a tool" in v.rule
    assert check_sources({"rlperf/cli.py": "from rlperf.bench.run import add_bench_arguments\n",
                          "bench/rollout.py": "from rlperf.rollout.engine import Engine\n"}) == []


def test_peers_need_a_listed_reason():
    v = _one({"rlperf/train/trainer.py": "from rlperf.rollout.engine import Engine\n"})
    assert "peers (layer 2)" in v.rule and "PEER_EDGES" in v.rule
    v = _one({"rlperf/sync/buckets.py": "from rlperf.rollout.engine import Engine\n"})  # listed one way only
    assert "peers (layer 2)" in v.rule
    assert check_sources({"rlperf/rollout/server.py": "from rlperf.sync import receive_bucket\n"}) == []
    v = _one({"rlperf/telemetry/memory.py": "from rlperf.loop import Run\n"})  # telemetry sits below the loop
    assert "upward import" in v.rule
    assert check_sources({"rlperf/loop/runner.py": "from rlperf.telemetry import PhaseMeter\n",
                          "rlperf/rollout/server.py": "from rlperf.telemetry.memory import process_memory\n"}) == []


def test_an_unknown_unit_fails_with_a_clear_message():
    v = _one({"rlperf/metrics/store.py": "from rlperf.kernels import matmul\n"})
    assert "unknown unit rlperf.metrics (importing module)" in v.rule and "LAYERS" in v.rule
    v = _one({"rlperf/loop/runner.py": "import rlperf.plugins.x\n"})
    assert "unknown unit rlperf.plugins (imported module)" in v.rule


def test_a_planted_upward_import_in_a_copy_of_the_tree_fails(tmp_path):
    sources = repository_sources()
    path = "rlperf/model/qwen3.py"
    sources[path] += "\n\ndef _planted():\n    import rlperf.loop.runner  # noqa\n"
    line = sources[path].splitlines().index("    import rlperf.loop.runner  # noqa") + 1
    for rel, text in sources.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    violations = check_sources(repository_sources(tmp_path))
    assert [str(v).split(": upward")[0] for v in violations] == [f"{path}:{line}: rlperf.model.qwen3 imports rlperf.loop.runner"]


# ---- the cycle detector: it must be able to fail ----------------------------------------------------


def _write_tree(root: Path, sources: dict[str, str]) -> Path:
    for rel, text in sources.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture
def planted_cycle_tree(tmp_path):
    """A small package on disk whose modules form one circle of three, closed by a lazy import inside a
    function and a relative import, plus modules outside the circle that import into it."""
    return _write_tree(tmp_path, {
        "rlperf/__init__.py": "",
        "rlperf/loop/__init__.py": "from .runner import Run\n",  # re-exports: no circle with its submodules
        "rlperf/loop/args.py": "from rlperf.loop.placement import needs_launch\n",
        "rlperf/loop/placement.py": "import os\n\n\ndef launch():\n    from . import ray_placement\n",
        "rlperf/loop/ray_placement.py": "import rlperf.loop.args as A\n",
        "rlperf/loop/runner.py": "from rlperf.loop.args import resolve_args\nimport rlperf.loop.placement\n",
        "kernels/__init__.py": "from rlperf.kernels.matmul import matmul\n",
        "kernels/matmul.py": "import torch\n",
    })


def test_a_planted_cycle_is_reported_with_every_file_and_line(planted_cycle_tree):
    sources = repository_sources(planted_cycle_tree)
    assert import_tangles(import_graph(sources)) == [["rlperf.loop.args", "rlperf.loop.placement", "rlperf.loop.ray_placement"]]
    cycles = import_cycles(sources)
    assert [format_cycle(c) for c in cycles] == [
        "rlperf.loop.args -> rlperf.loop.placement (rlperf/loop/args.py:1)"
        " -> rlperf.loop.ray_placement (rlperf/loop/placement.py:5)"
        " -> rlperf.loop.args (rlperf/loop/ray_placement.py:1)"]


def test_breaking_the_planted_cycle_leaves_none(planted_cycle_tree):
    (planted_cycle_tree / "rlperf/loop/ray_placement.py").write_text("import os\n")
    assert import_cycles(repository_sources(planted_cycle_tree)) == []


def test_two_modules_importing_each_other_through_the_package_are_a_cycle():
    """``from rlperf.loop import X`` is an import of ``rlperf/loop/__init__.py``; a submodule that does it
    while ``__init__`` imports that submodule is a real circle (it sees a half-initialized package)."""
    sources = {"rlperf/__init__.py": "", "rlperf/loop/__init__.py": "from .runner import Run\nUsageError = ValueError\n",
               "rlperf/loop/runner.py": "def f():\n    from rlperf.loop import UsageError\n"}
    assert [format_cycle(c) for c in import_cycles(sources)] == [
        "rlperf.loop -> rlperf.loop.runner (rlperf/loop/__init__.py:1) -> rlperf.loop (rlperf/loop/runner.py:2)"]


def test_a_cycle_through_import_module_and_the_top_level_folders_is_found():
    sources = {"rlperf/__init__.py": "", "kernels/__init__.py": "",
               "kernels/dispatch.py": "import importlib\nimportlib.import_module('rlperf.kernels.matmul')\n",
               "kernels/matmul.py": "from .dispatch import route\n"}
    (cycle,) = import_cycles(sources)
    assert [(e.importer, e.target, e.line) for e in cycle] == [
        ("rlperf.kernels.dispatch", "rlperf.kernels.matmul", 2), ("rlperf.kernels.matmul", "rlperf.kernels.dispatch", 1)]


def test_a_planted_cycle_in_a_copy_of_the_tree_is_reported(tmp_path):
    """The real tree plus one lazy import that closes a circle (model.qwen3 -> model.config -> model.qwen3):
    the detector names it, whatever else it finds."""
    sources = repository_sources()
    before = {format_cycle(c) for c in import_cycles(sources)}
    assert "from rlperf.model.qwen3" not in sources["rlperf/model/config.py"]
    qwen3_imports_config = any(e.target == "rlperf.model.config" for e in import_graph(sources)["rlperf.model.qwen3"].values())
    assert qwen3_imports_config
    sources["rlperf/model/config.py"] += "\n\ndef _planted():\n    from rlperf.model.qwen3 import Qwen3ForCausalLM  # noqa\n"
    after = {format_cycle(c) for c in import_cycles(repository_sources(_write_tree(tmp_path, sources)))}
    new = after - before
    assert len(new) == 1 and "rlperf.model.qwen3" in new.pop()
