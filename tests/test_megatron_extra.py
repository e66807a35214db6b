"""setup.py pins megatron-core by Python version: 0.16.x on 3.11, 0.19.x from 3.12 (its minimum)."""
import ast
from pathlib import Path

from packaging.requirements import Requirement

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


def _megatron_requirements() -> list[Requirement]:
    tree = ast.parse(SETUP.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MEGATRON_CORE" for t in node.targets):
            return [Requirement(s) for s in ast.literal_eval(node.value)]
    raise AssertionError("setup.py defines no MEGATRON_CORE")


def _pick(python_version: str) -> list[str]:
    env = {"python_version": python_version, "python_full_version": python_version + ".0"}
    return [str(r.specifier) for r in _megatron_requirements() if r.marker.evaluate(env)]


def test_one_megatron_core_line_per_python():
    assert _pick("3.11") == ["~=0.16.1"]
    assert _pick("3.12") == ["~=0.19.0"]
    assert _pick("3.13") == ["~=0.19.0"]


def test_test_and_megatron_extras_bring_it():
    text = SETUP.read_text()
    assert '"megatron": MEGATRON_CORE' in text
    assert "*MEGATRON_CORE]" in text.split('"test":')[1].split("\n")[1]
