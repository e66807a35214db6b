"""Train flags of issue #24 that crashed or hung: exit 2 with one line naming the flag, before any step."""
import socket

import pytest

from rlperf.cli import main
from rlperf.loop import METRICS_FILE

CHEAP = ("--no-progress", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--num-rollout", "1")


def _exit_2(tmp_path, capsys, *flags) -> str:
    """``rlperf train FLAGS`` exits 2 (from the parser or from the checks after it) without a traceback;
    its stderr."""
    try:
        code = main(["train", "--output-dir", str(tmp_path / "out"), *CHEAP, *map(str, flags)])
    except SystemExit as exc:  # argparse's own exit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / METRICS_FILE).exists()
    return err


def test_a_seed_of_23_digits(tmp_path, capsys):
    err = _exit_2(tmp_path, capsys, "--seed", "1" * 23)
    assert "argument --seed: must be an integer in [0, 2**63 - 1]" in err


def test_a_response_longer_than_the_context(tmp_path, capsys):
    err = _exit_2(tmp_path, capsys, "--rollout-max-response-len", "99999999")
    assert err.startswith("rlperf train: --rollout-max-response-len 99999999: longer than the model's context length, "
                          "1024 tokens")


@pytest.mark.parametrize("flags", [("--rollout-health-check-timeout", "0"), ("--rollout-health-check-interval", "nan"),
                                   ("--rollout-health-check-first-wait", "-1"), ("--rollout-health-check-timeout", "x")])
def test_health_check_seconds(tmp_path, capsys, flags):
    assert f"argument {flags[0]}: " in _exit_2(tmp_path, capsys, *flags)


def test_fault_tolerance_needs_engines_of_the_run(tmp_path, capsys):
    err = _exit_2(tmp_path, capsys, "--use-fault-tolerance")
    assert err.startswith("rlperf train: --use-fault-tolerance restarts the engines the run starts: it needs "
                          "--rollout-num-gpus N")


@pytest.mark.parametrize("bad", ["0", "-3"])
def test_a_response_length_below_one(tmp_path, capsys, bad):
    assert "argument --rollout-max-response-len: must be a positive integer" in _exit_2(
        tmp_path, capsys, "--rollout-max-response-len", bad)


def test_a_router_port_nothing_listens_on(tmp_path, capsys):
    with socket.socket() as s:  # a port bound but not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        err = _exit_2(tmp_path, capsys, "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", port)
    assert err.startswith(f"rlperf train: --sglang-router-port {port}: nothing accepts connections at 127.0.0.1:{port}")


@pytest.mark.parametrize("port", ["70000", "-1", "x"])
def test_a_router_port_out_of_range(tmp_path, capsys, port):
    assert "argument --sglang-router-port:" in _exit_2(tmp_path, capsys, "--sglang-router-ip", "127.0.0.1",
                                                       "--sglang-router-port", port)


def test_saving_rollout_data_where_nothing_can_be_written(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _exit_2(tmp_path, capsys, "--save-debug-rollout-data", f"{blocker}/sub/{{rollout_id}}.pt")
    assert err.startswith(f"rlperf train: --save-debug-rollout-data {blocker}/sub: not writable"), err


def test_loading_rollout_data_that_is_not_there(tmp_path, capsys):
    err = _exit_2(tmp_path, capsys, "--load-debug-rollout-data", f"{tmp_path}/missing_{{rollout_id}}.pt")
    assert err.startswith(f"rlperf train: --load-debug-rollout-data {tmp_path}/missing_{{rollout_id}}.pt: "
                          f"{tmp_path}/missing_0.pt: no such file"), err


def test_a_template_that_does_not_format(tmp_path, capsys):
    err = _exit_2(tmp_path, capsys, "--save-debug-rollout-data", f"{tmp_path}/{{step}}.pt")
    assert "--save-debug-rollout-data" in err and "{rollout_id}" in err
