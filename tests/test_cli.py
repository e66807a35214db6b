"""The rlperf command and the package layout."""
import subprocess
import sys

import pytest

from rlperf.cli import main


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_console_script_help_lists_every_subcommand():
    out = subprocess.run(["rlperf", "--help"], capture_output=True, text=True, check=True).stdout
    for name in ("train", "gate", "serve", "profile", "bench"):
        assert name in out


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


def test_subpackages_import_as_rlperf_children():
    import rlperf.bench
    import rlperf.kernels

    assert rlperf.kernels.__name__ == "rlperf.kernels"
    assert rlperf.bench.__name__ == "rlperf.bench"
