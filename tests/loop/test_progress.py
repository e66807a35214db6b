"""rlperf train's console output: one clean line per step in a log file or pipe, the tqdm bar only on a terminal."""
import io
import re
import sys

from rlperf.cli import main

SMALL = ["--skip-gates", "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--global-batch-size", "4"]
STEP_LINE = re.compile(r"rollout [12]/2 \| reward ")


def test_not_a_terminal_one_plain_line_per_step(tmp_path, capsys):
    assert main(["train", "--output-dir", str(tmp_path), *SMALL]) == 0  # capsys: stderr is not a terminal
    err = capsys.readouterr().err
    assert "\r" not in err and "%|" not in err  # no bar redraws mixed into the log
    steps = [line for line in err.splitlines() if STEP_LINE.search(line)]
    assert [line.split(" | ")[0] for line in steps] == ["rollout 1/2", "rollout 2/2"]
    assert all(STEP_LINE.match(line) for line in steps)  # each starts its own line


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_keeps_the_bar_and_writes_step_lines_above_it(tmp_path, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["train", "--output-dir", str(tmp_path), *SMALL]) == 0
    out = term.getvalue()
    assert "rlperf train:" in out and "%|" in out  # the bar is drawn
    # tqdm.write clears the bar's line first: every step line starts a line and ends with a newline
    assert len(re.findall(r"(?:^|[\r\n])rollout [12]/2 \| reward [^\r\n]*\n", out)) == 2
