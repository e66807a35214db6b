"""Flags defined once with one default, read once into the typed RunConfig; the parsers light to import."""
import dataclasses
import json
import subprocess
import sys

import pytest

from rlperf.cli import build_parser
from rlperf.data.embedded import EMBEDDED_DEFAULTS
from rlperf.loop.args import TASK_DEFAULTS
from rlperf.loop.config import RunConfig
from rlperf.loop.resolve import parse_train_args
from rlperf.rollout.args import DEFAULT_NUM_THREADS, ServerArgs
from rlperf.train.args import TrainArgs


def test_device_and_threads_have_one_default_on_every_command():
    p = build_parser()
    got = {cmd: p.parse_args([cmd]) for cmd in ("serve", "train", "gate")}
    assert {(ns.device, ns.num_threads) for ns in got.values()} == {("auto", DEFAULT_NUM_THREADS)}
    assert (ServerArgs().device, ServerArgs().num_threads) == ("auto", DEFAULT_NUM_THREADS)


def test_task_defaults_fill_only_what_the_command_line_left(tmp_path):
    ns = parse_train_args(["--device", "cpu", "--output-dir", str(tmp_path)])
    config = RunConfig.from_args(ns)
    assert config.data.embedded and config.train.args.lr == EMBEDDED_DEFAULTS["lr"] != TrainArgs.lr
    assert config.rollout.n_samples_per_prompt == EMBEDDED_DEFAULTS["n_samples_per_prompt"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input": "1+1?", "label": "2"}) + "\n")
    ns = parse_train_args(["--device", "cpu", "--output-dir", str(tmp_path), "--prompt-data", str(prompts)])
    config = RunConfig.from_args(ns)
    assert config.train.args.lr == TASK_DEFAULTS["lr"] == TrainArgs.lr  # the training core's own default
    assert (config.rollout.batch_size, config.data.rm_type) == (TASK_DEFAULTS["rollout_batch_size"], "boxed_math")
    ns = parse_train_args(["--device", "cpu", "--output-dir", str(tmp_path), "--lr", "0.5"])
    assert RunConfig.from_args(ns).train.args.lr == 0.5


def test_the_embedded_task_packs_its_micro_batches_and_a_flag_turns_that_off(tmp_path):
    """The embedded task's short samples go into packed micro-batches (one of up to 4096 tokens holds a
    step); ``--prompt-data`` runs keep one sample per micro-batch; ``--no-use-dynamic-batch-size`` and
    ``--max-tokens-per-gpu`` override the task's values."""
    base = ["--device", "cpu", "--output-dir", str(tmp_path)]
    args = RunConfig.from_args(parse_train_args(base)).train.args
    assert (args.use_dynamic_batch_size, args.max_tokens_per_gpu) == (True, 4096)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input": "1+1?", "label": "2"}) + "\n")
    args = RunConfig.from_args(parse_train_args(base + ["--prompt-data", str(prompts)])).train.args
    assert (args.use_dynamic_batch_size, args.max_tokens_per_gpu, args.micro_batch_size) == (False, None, 1)
    args = RunConfig.from_args(parse_train_args(base + ["--no-use-dynamic-batch-size"])).train.args
    assert not args.use_dynamic_batch_size
    args = RunConfig.from_args(parse_train_args(base + ["--max-tokens-per-gpu", "512"])).train.args
    assert (args.use_dynamic_batch_size, args.max_tokens_per_gpu) == (True, 512)


def test_every_config_section_is_frozen_and_documented(tmp_path):
    config = RunConfig.from_args(parse_train_args(["--device", "cpu", "--output-dir", str(tmp_path)]))
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            assert type(value).__dataclass_params__.frozen and type(value).__doc__, section.name
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(value, dataclasses.fields(value)[0].name, None)
    assert (config.runtime.device, config.train.precision, config.rollout.engine) == ("cpu", "fp32", "in-process")


@pytest.mark.parametrize("module", ["rlperf.cli", "rlperf.loop.args", "rlperf.loop.config", "rlperf.train.args",
                                    "rlperf.rollout.args", "rlperf.gates.runner"])
def test_the_flag_modules_import_neither_torch_nor_the_kernels(module):
    """What `rlperf <command> --help` needs loads no torch (seconds of imports): build every parser."""
    code = (f"import sys, {module}; import rlperf.cli; rlperf.cli.build_parser(); "
            "heavy = [m for m in ('torch', 'triton', 'numpy', 'rlperf.kernels') if m in sys.modules]; "
            "assert not heavy, heavy")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
