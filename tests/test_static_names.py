"""Every tracked Python file names only what exists: pyflakes' undefined-name checks over the whole
repository. GPU-only tests, device benchmarks and multi-GPU paths never run on CI's CPU, so a name left
undefined there (a helper folded away, a variable renamed) would otherwise first fail on the device,
costing a device call. This test reads the files; it runs nothing of them."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNDEFINED = ("UndefinedName", "UndefinedLocal", "UndefinedExport")


def _tracked_python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_no_undefined_names_in_any_tracked_python_file():
    from pyflakes import checker  # the test extra installs pyflakes: a missing one fails here, never skips

    files = _tracked_python_files()
    assert len(files) > 100, f"git ls-files found {len(files)} Python files under {ROOT}"
    found = []
    for path in files:
        source = path.read_text()
        tree = ast.parse(source, filename=str(path))
        for message in checker.Checker(tree, filename=str(path)).messages:
            if type(message).__name__ in UNDEFINED:
                found.append(f"{path.relative_to(ROOT)}:{message.lineno}: {message.message % message.message_args}")
    assert not found, "undefined names:\n" + "\n".join(found)
