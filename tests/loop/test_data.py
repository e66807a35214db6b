"""rlperf.data (jsonl prompts, rule rewards) and the loop's Python-path hooks on a jsonl task."""
import json
import subprocess
import sys
import textwrap

import pytest

from rlperf.data import (DataError, PromptDataset, boxed_answer, boxed_math_reward, exact_match_reward,
                         load_prompt_data)
from rlperf.data.jsonl import PromptRecord
from rlperf.loop import train
from rlperf.train import Sample


def _sample(response, label):
    return Sample([1], 0, index=0, group_index=0, prompt="p", label=label, response=response)


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{42}", "42"), ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"), ("no box", None),
    ("\\boxed{unclosed", None), ("\\boxed{}", ""),
])
def test_boxed_answer(text, expected):
    assert boxed_answer(text) == expected


@pytest.mark.parametrize("response, label, reward", [
    ("\\boxed{42}", "42", 1.0), ("\\boxed{ 42 }", "42", 1.0), ("\\boxed{42.0}", "42", 1.0), ("\\boxed{$7$}", "7", 1.0),
    ("\\boxed{41}", "42", 0.0), ("42", "42", 0.0), ("\\boxed{42}", None, 0.0),
])
def test_boxed_math_reward(response, label, reward):
    assert boxed_math_reward(None, _sample(response, label)) == reward


def test_exact_match_reward():
    assert exact_match_reward(None, _sample(" B\n", "B")) == 1.0
    assert exact_match_reward(None, _sample("BB", "B")) == 0.0


def test_load_prompt_data_keys_metadata_and_chat_template(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"q": [{"role": "user", "content": "1+1?"}], "a": 2, "m": {"src": "x"}}) + "\n\n"
                 + json.dumps({"q": [{"role": "user", "content": "2+2?"}], "a": "4"}) + "\n")
    recs = load_prompt_data(f, "q", "a", "m", apply_template=True)
    assert [r.line for r in recs] == [1, 3]
    assert recs[0].prompt == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert recs[0].label == "2" and recs[0].metadata == {"src": "x"} and recs[1].metadata == {}
    with pytest.raises(DataError, match=r"d.jsonl:1: field 'q' must be a non-empty string"):
        load_prompt_data(f, "q", "a", "m")  # messages without --apply-chat-template


@pytest.mark.parametrize("line, message", [
    ("[1, 2]", "expected a JSON object"), ('{"input": ""}', "non-empty string"),
    ('{"input": "x", "label": [1]}', "must be a string or a number"), ('{"input": "x", "metadata": 3}', "must be an object"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    f = tmp_path / "d.jsonl"
    f.write_text('{"input": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"d.jsonl:2: .*{message}"):
        load_prompt_data(f)


def test_dataset_batches_wrap_and_depend_only_on_seed_and_rollout():
    recs = [PromptRecord(str(i)) for i in range(5)]
    a, b = PromptDataset(recs, seed=3), PromptDataset(recs, seed=3)
    assert [r.prompt for r in a.batch(0, 3)] == ["0", "1", "2"]
    epoch1 = [r.prompt for r in a.batch(1, 5)]  # prompts 5..9: the second epoch, shuffled
    assert sorted(epoch1) == ["0", "1", "2", "3", "4"] and epoch1 != ["0", "1", "2", "3", "4"]
    assert [r.prompt for r in a.batch(7, 3)] == [r.prompt for r in b.batch(7, 3)]


CUSTOM = textwrap.dedent('''
    from rlperf.loop.generation import generate_rollout
    from rlperf.train import Sample

    CALLS = []
    SEEDS = []

    def reward(args, sample):
        return float(sample.response.startswith(sample.metadata["want"]))

    def rollout(args, rollout_id, data_source, evaluation=False):
        CALLS.append(rollout_id)
        return generate_rollout(args, rollout_id, data_source)

    def generate(args, sample, sampling_params):
        # a deterministic "model": answer the label's first character, log-prob 0 (slime's fields)
        assert sample.status is Sample.Status.PENDING and sample.response_length == 0
        SEEDS.append(sampling_params.seed)
        sample.tokens = sample.tokens + [ord(sample.label[0])]
        sample.response_length = 1
        sample.rollout_log_probs = [0.0]
        sample.response = sample.label[0]
        sample.status = Sample.Status.COMPLETED
        return sample
''')


def test_jsonl_task_with_custom_rollout_generate_and_reward(tmp_path, monkeypatch):
    (tmp_path / "my_custom.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": l, "metadata": {"want": w}}) + "\n"
                            for i, (l, w) in enumerate([("A", "A"), ("B", "C")])))
    common = ["--output-dir", str(tmp_path / "o"), "--no-progress", "--prompt-data", str(data),
              "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
              "--rollout-max-response-len", "3"]
    hist = train(common + ["--rollout-function-path", "my_custom.rollout", "--custom-generate-function-path",
                           "my_custom.generate", "--custom-rm-path", "my_custom.reward"])
    import my_custom

    assert my_custom.CALLS == [0, 1]
    assert len(set(my_custom.SEEDS)) == len(my_custom.SEEDS) == 8  # one seed per sample and rollout
    assert [m["rollout/raw_reward"] for m in hist] == [0.5, 0.5]
    assert [m["rollout/rollout_log_probs"] for m in hist] == [0.0, 0.0]
    # the default generate + boxed_math on the same file: a random model earns nothing, but it runs
    hist = train(common)
    assert [m["rollout/raw_reward"] for m in hist] == [0.0, 0.0]


def test_bad_python_path_fails_before_any_step(tmp_path, capsys):
    from rlperf.cli import main

    assert main(["train", "--output-dir", str(tmp_path), "--no-progress", "--custom-rm-path", "nope_mod.fn"]) == 2
    assert "--custom-rm-path 'nope_mod.fn' cannot be loaded" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_train_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlperf", "train", "--num-rollout", "1", "--no-progress",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rollout 1/1 | reward" in proc.stderr
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_cli_train_stops_before_step_1_when_a_gate_fails(tmp_path, capsys):
    from rlperf.cli import main

    code = main(["train", "--output-dir", str(tmp_path), "--no-progress", "--num-rollout", "2", "--save",
                 str(tmp_path / "ckpt"), "--memory-limit", "1MiB"])
    assert code == 1
    out = capsys.readouterr()
    assert "FAILED: oom_headroom" in out.out and "stopping before step 1" in out.err
    # no metrics, no checkpoint: the --save directory the run created and left empty is removed
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "ckpt").exists()
