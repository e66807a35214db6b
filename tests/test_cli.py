"""The rlperf command and the package layout."""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
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


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_help_renders_and_exits_0(command, capsys):
    with pytest.raises(SystemExit) as done:  # argparse expands every flag's help text (a bare % breaks it)
        main([command, "--help"])
    assert done.value.code == 0
    assert "usage: rlperf " + command in capsys.readouterr().out


HIDDEN_FLAGS = {"--wandb-key"}
"""Flags left out of ``--help`` on purpose: accepted only to be refused with the safe way to do it."""


def _every_option(parser: argparse.ArgumentParser, prog: str = "rlperf"):
    """(command, parser, action) for every option and positional of every command and mode."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_option(sub, f"{prog} {name}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield prog, parser, action


def _shown(value) -> set[str]:
    """The ways a default may be written in a help text."""
    out = {str(value)}
    if isinstance(value, float):
        out.add(f"{value:g}")
    if isinstance(value, bool):
        out.add("default on" if value else "default off")
    if isinstance(value, (list, tuple)):
        out |= {", ".join(map(str, value)), " ".join(map(str, value))}
    return out


def test_every_option_of_every_command_has_help_and_shows_its_default():
    from rlperf.loop.args import TASK_DEFAULTS

    missing, no_default, no_task_default = [], [], []
    options = list(_every_option(build_parser()))
    assert len(options) > 250  # every command's parser was walked (train alone has > 100 options)
    for prog, parser, action in options:
        name = "/".join(action.option_strings) or action.dest
        if action.help == argparse.SUPPRESS:
            assert set(action.option_strings) <= HIDDEN_FLAGS, f"{prog} {name} is hidden from --help"
            continue
        if not (action.help or "").strip():
            missing.append(f"{prog} {name}")
            continue
        text = parser._get_formatter()._expand_help(action)  # what --help prints for it, %(default)s filled in
        default = action.default
        if default not in (None, False, ()) and not any(s in text for s in _shown(default)):
            no_default.append(f"{prog} {name} (default {default!r}): {text}")
        if action.dest in TASK_DEFAULTS and action.option_strings and not (
                "for the embedded task" in text and "with --prompt-data" in text):
            no_task_default.append(f"{prog} {name}: {text}")
    assert not missing, f"options without help text: {missing}"
    assert not no_default, "defaults --help does not show:\n" + "\n".join(no_default)
    assert not no_task_default, "task-dependent defaults not stated for both tasks:\n" + "\n".join(no_task_default)


def test_help_formatter_adds_the_default_once():
    from rlperf import flags

    p = flags.ArgumentParser(prog="x")
    p.add_argument("--a", type=int, default=7, help="seven")
    p.add_argument("--b", type=int, default=3, help="three (default 3, the usual)")
    p.add_argument("--c", default=None, help="none")
    p.add_argument("--d", action="store_true", help="off")
    text = " ".join(p.format_help().split())
    assert "seven (default: 7)" in text and "(default 3, the usual)" in text and text.count("default") == 2


@pytest.mark.parametrize("argv,flag", [
    (["train", "--lr", "abc"], "--lr"),
    (["gate", "--num-rollout"], "--num-rollout"),
    (["profile", "run"], "--router-url"),
    (["train", "--no-such-flag"], "--no-such-flag"),
    (["gate", "--overwrite-output-dir"], "--overwrite-output-dir"),  # train's flag: the gate has nothing to refuse
], ids=["train-lr", "gate-missing-value", "profile-run-missing-required", "train-unknown", "gate-train-only-flag"])
def test_a_bad_value_is_one_line_pointing_at_help_and_exit_2(argv, flag):
    """As a user types it: the console script in a fresh process; stderr is the one error line, not the
    usage block (88 lines for train) above it (serve: tests/test_flags.py)."""
    proc = subprocess.run(["rlperf", *argv], capture_output=True, text=True, timeout=120)
    command = " ".join(["rlperf", *argv[:1 + (argv[0] == "profile")]])
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{command}: error: ") and flag in lines[0], lines[0]
    assert lines[0].endswith(f"(see {command} --help)"), lines[0]


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


STOPPED_IN_A_FINALIZER = """
import os, signal, sys, time
from rlperf.cli import Terminated, _sigterm_raises

class Finalized:
    def __del__(self):  # the stop lands in here, where Python would print it as ignored and go on
        os.kill(os.getpid(), signal.{signal})

try:
    with _sigterm_raises():
        Finalized()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.001)
    print("the stop was lost")
except (Terminated, KeyboardInterrupt) as exc:
    print("stopped by", type(exc).__name__, flush=True)
    assert sys.unraisablehook is sys.__unraisablehook__  # the block's hook is gone with the block
    signal.raise_signal(signal.SIGTERM)  # and SIGTERM has its default action again
"""


@pytest.mark.parametrize("signame,raised", [("SIGTERM", "Terminated"), ("SIGINT", "KeyboardInterrupt")])
def test_a_stop_raised_inside_a_finalizer_still_stops_the_run(signame, raised):
    """A SIGTERM or SIGINT handled while the garbage collector runs a ``__del__`` (a dropped
    ``SharedMemory``, say) raises there, where Python swallows exceptions; the run must still stop,
    at once and without the "Exception ignored" traceback."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STOPPED_IN_A_FINALIZER.replace("{signal}", signame)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout == f"stopped by {raised}\n", proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == -signal.SIGTERM and proc.stderr == "", proc.stderr[-3000:]
    assert time.monotonic() - started < 25
