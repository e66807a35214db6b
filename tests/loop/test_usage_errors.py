"""Bad flags and inputs of ``rlperf train``: exit 2 and one line naming the flag, before any step,
never a traceback or four failed gates (issue #12, item 9)."""
import shutil

import pytest
import torch

from rlperf.cli import main
from rlperf.loop import METRICS_FILE, train
from rlperf.loop import checkpoint as ckpt
from rlperf.rollout.engine import BadRequest, SamplingParams
from rlperf.rollout.sampling_params import TOP_K_MAX, check_sampling_values

CHEAP = ("--no-progress", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--num-rollout", "2")


def _usage_error(tmp_path, capsys, *flags) -> str:
    """``rlperf train FLAGS`` (gates on) exits 2 before any step; returns its stderr."""
    try:
        code = main(["train", "--output-dir", str(tmp_path / "out"), *CHEAP, *map(str, flags)])
    except SystemExit as exc:  # a value the flag's parser type refuses (rlperf.flags): argparse exits 2
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "FAIL" not in err
    assert not (tmp_path / "out" / METRICS_FILE).exists()
    return err


@pytest.mark.parametrize("flags", [
    ("--rollout-top-p", "0"), ("--rollout-top-p", "1.5"), ("--rollout-top-p", "1e-50"), ("--rollout-top-p", "nan"),
    ("--rollout-temperature", "1e300"), ("--rollout-temperature", "0"), ("--rollout-temperature", "-1"),
    ("--rollout-temperature", "1e-50"), ("--rollout-top-k", "-5"), ("--rollout-top-k", str(TOP_K_MAX + 1)),
    ("--lr", "-1"), ("--lr", "nan"), ("--lr", "inf"), ("--eps-clip", "nan"), ("--adam-beta1", "1"),
    ("--weight-decay", "-0.1"), ("--model", "bogus"), ("--precompile-kernels", "no-such-manifest.jsonl"),
])
def test_bad_flag_value(tmp_path, capsys, flags):
    err = _usage_error(tmp_path, capsys, *flags)
    assert err.startswith(f"rlperf train: {flags[0]}"), err


def test_a_value_its_parser_refuses(tmp_path, capsys):
    err = _usage_error(tmp_path, capsys, "--num-threads", "-1")
    assert "rlperf train: error: argument --num-threads: must be an integer >= 0, got -1" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu(tmp_path, capsys):
    err = _usage_error(tmp_path, capsys, "--device", "cuda")
    assert err.startswith("rlperf train: --device cuda: no CUDA device"), err


def test_sampling_values_the_server_takes_train_takes(tmp_path):
    """One check for both sides: what the server refuses, train refuses (and the reverse)."""
    for bad in ({"temperature": 1e300}, {"top_p": 1e-50}, {"top_p": 1.5}, {"top_k": -5}, {"top_k": 2 ** 40}):
        with pytest.raises(BadRequest, match=f"sampling_params.{next(iter(bad))}"):
            SamplingParams.from_dict(bad)
    for good in ({"top_k": -1}, {"top_k": 0}, {"top_k": TOP_K_MAX}, {"top_p": 1.0}, {"temperature": 3.4e38}):
        SamplingParams.from_dict(good)
        check_sampling_values(**good)
    with pytest.raises(ValueError, match="--rollout-temperature"):  # train divides by it: 0 is refused there only
        check_sampling_values(temperature=0.0, positive_temperature=True,
                              names={"temperature": "--rollout-temperature"})
    train(["--output-dir", str(tmp_path), *CHEAP, "--num-rollout", "1", "--rollout-top-k", "0",
           "--rollout-top-p", "0.9"])


@pytest.fixture(scope="module")
def save(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    train(["--output-dir", str(root / "out"), *CHEAP, "--num-rollout", "1", "--save", str(root / "save")])
    return root / "save"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


BREAK = {
    "pointer names a missing iteration": (lambda d: (d / ckpt.LATEST).write_text("7"), "names iteration 7"),
    "pointer is not a number": (lambda d: (d / ckpt.LATEST).write_text("abc"), "expected an iteration number"),
    "no pointer": (lambda d: (d / ckpt.LATEST).unlink(), ckpt.LATEST),
    "truncated weights": (lambda d: _truncate(d / "iter_0000001" / "model" / "model.safetensors"), "model.safetensors"),
    "truncated trainer state": (lambda d: _truncate(d / "iter_0000001" / "trainer.pt"), "trainer.pt"),
    "no trainer state": (lambda d: (d / "iter_0000001" / "trainer.pt").unlink(), "trainer.pt"),
    "truncated config": (lambda d: _truncate(d / "iter_0000001" / "model" / "config.json"), "config.json"),
}


def _broken(save, tmp_path, how):
    d = tmp_path / "broken"
    shutil.copytree(save, d)
    BREAK[how][0](d)
    return d


@pytest.mark.parametrize("how", BREAK)
def test_load_of_a_broken_checkpoint(tmp_path, capsys, save, how):
    d = _broken(save, tmp_path, how)
    err = _usage_error(tmp_path, capsys, "--load", d)
    assert err.startswith(f"rlperf train: --load {d}") and BREAK[how][1] in err, err


@pytest.mark.parametrize("how", ["empty", *(h for h in BREAK if "trainer" not in h)])  # a reference is weights only
def test_ref_load_of_an_empty_or_broken_directory(tmp_path, capsys, save, how):
    if how == "empty":
        d = tmp_path / "empty"
        d.mkdir()
    else:
        d = _broken(save, tmp_path, how)
    err = _usage_error(tmp_path, capsys, "--ref-load", d, "--use-kl-loss")
    assert err.startswith(f"rlperf train: --ref-load {d}") and " --load " not in err, err


def test_load_error_found_while_loading_is_a_usage_error(tmp_path, capsys, save):
    """A trainer state that passes the cheap check but cannot be restored (here: not a trainer's dict)
    fails while the run is built: exit 2 naming --load, in train and in the gates."""
    d = tmp_path / "odd"
    shutil.copytree(save, d)
    torch.save({"something": "else"}, d / "iter_0000001" / "trainer.pt")
    err = _usage_error(tmp_path, capsys, "--load", d)
    assert f"--load {d}" in err and "trainer.pt" in err, err
