"""Bad flag values exit 2 with one line naming the flag (issue #24), never a traceback or silence.

``rlperf serve`` and ``rlperf profile`` check their values with :mod:`rlperf.flags` at parse time, so
nothing starts; each case below is one flag and one value that used to exit 1 with a traceback or be
accepted.
"""
import subprocess
import sys

import pytest
import torch

from rlperf import flags
from rlperf.cli import main

SERVE_CASES = [
    ("--port", "70000"), ("--port", "-1"), ("--port", "0"), ("--port", "x"),
    ("--max-total-tokens", "-5"), ("--max-running-requests", "0"), ("--num-threads", "-1"),
    ("--host", "999.1.1.1"), ("--host", "a b"), ("--host", "1.2.3"),
    ("--router", "-1"), ("--context-length", "0"), ("--max-generate-body-bytes", "0"),
    ("--max-weights-body-bytes", "-3"), ("--profile-root", "/proc/x"), ("--router-port", "65536"),
    ("--random-seed", "1" * 23), ("--random-seed", "-1"), ("--mem-fraction-static", "1.5"),
    ("--cuda-graph-max-bs", "-1"), ("--device", "tpu"), ("--device", "cpu:1"),
]


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("flag,value", SERVE_CASES, ids=[f"{f}={v[:12]}" for f, v in SERVE_CASES])
def test_serve_refuses_a_bad_value_naming_the_flag(flag, value, capsys):
    line = _usage_error(["serve", flag, value], capsys)
    assert f"argument {flag}" in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("value", ["cuda", "cuda:0", "cuda:3"])
def test_serve_device_cuda_without_cuda_exits_2(value, capsys):
    line = _usage_error(["serve", "--device", value], capsys)
    assert "argument --device" in line and "no CUDA device" in line, line


def test_good_values_pass_through():
    assert flags.port("1") == 1 and flags.port("65535") == 65535
    assert flags.positive_int("7") == 7 and flags.nonnegative_int("0") == 0
    for h in ("127.0.0.1", "0.0.0.0", "::1", "::", "localhost", "engine-3.cluster.local", "[::1]"):
        assert flags.host(h)
    assert flags.device("auto") == "auto" and flags.device("cpu") == "cpu"
    assert flags.seed(str((1 << 63) - 1)) == (1 << 63) - 1
    assert flags.fraction("1") == 1.0
    assert flags.http_url("http://127.0.0.1:30000") and flags.http_url("https://router.example")


def test_serve_refuses_a_bad_port_as_a_process_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlperf", "serve", "--port", "70000"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["rlperf serve: error: argument --port: must be a TCP port in [1, 65535], got "
                                        "70000 (see rlperf serve --help)"], proc.stderr  # one line, no usage block


PROFILE_CASES = [
    ["profile", "--router-url", "notaurl", "--action", "start"],
    ["profile", "run", "--router-url", "notaurl"],
    ["profile", "run", "--router-url", "http://127.0.0.1:99999"],
    ["profile", "run", "--router-url", "http://127.0.0.1:1", "--num-prompts", "0"],
    ["profile", "run", "--router-url", "http://127.0.0.1:1", "--concurrency", "-2"],
    ["profile", "--router-url", "http://127.0.0.1:1", "--action", "start", "--num-steps", "0"],
]


@pytest.mark.parametrize("argv", PROFILE_CASES, ids=lambda a: " ".join(a[1:])[:50])
def test_profile_usage_errors_exit_2_naming_the_flag(argv, capsys):
    line = _usage_error(argv, capsys)
    flag = next(a for a in reversed(argv) if a.startswith("--") and a != "--action")
    assert f"argument {flag}" in line, line


def test_profile_run_with_a_bad_dataset_exits_2_before_touching_a_worker(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    for dataset, says in ((tmp_path / "missing.jsonl", "no such file"), (bad, "not valid JSON")):
        # the router URL answers nothing: reaching it would be exit 1
        assert main(["profile", "run", "--router-url", "http://127.0.0.1:1", "--dataset", str(dataset)]) == 2
        err = capsys.readouterr().err
        assert "--dataset" in err and says in err, err


def test_token_buckets_parse_sort_and_refuse():
    import argparse

    from rlperf.flags import token_buckets

    assert token_buckets("4096,1024,2048,1024") == (1024, 2048, 4096)
    assert token_buckets(" 513 ") == (513,)
    assert token_buckets("auto") == token_buckets(" AUTO ") == "auto"  # the loop resolves it for its host
    assert token_buckets("none") == ()  # eager
    for bad, why in (("", "expected auto, none or token counts"), ("1024,x", "not an integer"),
                     ("foo", "'foo' is not an integer: expected auto, none or token counts"),
                     ("1,64", "--cuda-graph-buckets takes token counts >= 2"), ("1", "token counts >= 2")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            token_buckets(bad)


@pytest.mark.parametrize("command", ["train", "gate"])
@pytest.mark.parametrize("value", ["foo", "1", "auto,1024", ""])
def test_bad_cuda_graph_buckets_exit_2_naming_the_flag(command, value, capsys):
    from rlperf.cli import main

    with pytest.raises(SystemExit) as info:
        main([command, "--cuda-graph-buckets", value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "argument --cuda-graph-buckets" in err and "Traceback" not in err, err
