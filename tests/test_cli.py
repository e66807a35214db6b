"""The rlperf command and the package layout."""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlperf.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


SUBCOMMANDS = ("bench", "serve", "gate", "train", "profile", "plot")
"""The jobs ``rlperf`` runs, in the order ``rlperf --help`` lists them (README's table has one row each)."""


def _subcommand_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Subcommand name -> its one-line help, read from the parser's subparsers action."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {choice.dest: choice.help for choice in action._choices_actions}


def test_the_parser_has_exactly_the_documented_subcommands():
    helps = _subcommand_helps(build_parser())
    assert tuple(helps) == SUBCOMMANDS
    for name, text in helps.items():
        assert text and len(text) > 20, f"rlperf {name} has no one-line help"


def test_console_help_lists_every_subcommand_with_its_help():
    """``python -m rlperf --help`` in a fresh process: one line per subcommand, name then its help."""
    env = {**os.environ, "COLUMNS": "400"}  # one line per subcommand, whatever the terminal
    out = subprocess.run([sys.executable, "-m", "rlperf", "--help"], capture_output=True, text=True, check=True,
                         env=env).stdout
    listed = {}
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "COMMAND") + 1
    for line in lines[start:]:
        m = re.fullmatch(r"    (\S+)\s+(\S.*)", line)
        if not m:
            break
        listed[m.group(1)] = m.group(2)
    assert listed == _subcommand_helps(build_parser()), out


def test_console_script_is_installed_and_runs_the_same_parser():
    out = subprocess.run(["rlperf", "--help"], capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": "400"}).stdout
    assert out.startswith("usage: rlperf ") and all(f"\n    {name} " in out for name in SUBCOMMANDS), out


@pytest.mark.parametrize("command", ["train", "gate", "serve", "profile", "bench"])
def test_every_subcommand_help_renders_and_exits_0(command, capsys):
    with pytest.raises(SystemExit) as done:  # argparse expands every flag's help text (a bare % breaks it)
        main([command, "--help"])
    assert done.value.code == 0
    assert "usage: rlperf " + command in capsys.readouterr().out


def test_bench_without_cuda_refuses_with_exit_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    proc = subprocess.run([sys.executable, "-m", "rlperf", "bench", "matmul"], capture_output=True, text=True)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_bench_rejects_unknown_name():
    proc = subprocess.run([sys.executable, "-m", "rlperf", "bench", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown benchmark" in proc.stderr


@pytest.mark.parametrize("folder", ["kernels", "gates", "profiles", "bench"])
def test_top_level_folders_import_as_rlperf_subpackages_from_this_checkout(folder, tmp_path):
    """setup.py maps ``kernels/``, ``gates/``, ``profiles/`` and ``bench/`` to ``rlperf.<folder>``: from any
    directory, ``rlperf.<folder>`` must be this checkout's folder (not another install's copy)."""
    code = f"import rlperf.{folder} as m, rlperf; print(m.__file__); print(rlperf.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    sub_file, package_file = out.splitlines()
    assert Path(sub_file).resolve() == ROOT / folder / "__init__.py"
    assert Path(package_file).resolve() == ROOT / "rlperf" / "__init__.py"
