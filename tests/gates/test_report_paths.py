"""Report paths (``--report-json``, ``--junit-xml``) that hold something other than a regular file are
refused, exit 2 naming the flag, and left as they were (issue #24): the reports are written by atomic
rename, which would replace a symbolic link, a FIFO or a device node instead of writing through it."""
import os
import stat

import pytest

from rlperf.cli import main as rlperf
from rlperf.gates.checks import GateResult
from rlperf.gates.report import GateReport

CHEAP = ("--no-progress", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--num-rollout", "1")


def _make(kind, tmp_path):
    """A path holding ``kind``; a function telling whether it is still exactly that."""
    path = tmp_path / "report"
    if kind == "device":  # a node of its own (never the system's: a regression would replace it)
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("creating a device node needs privileges")
        return str(path), lambda: stat.S_ISCHR(os.lstat(path).st_mode)
    if kind == "symlink":
        target = tmp_path / "target.txt"
        target.write_text("keep me")
        path.symlink_to(target)
        return str(path), lambda: path.is_symlink() and target.read_text() == "keep me"
    if kind == "dangling symlink":
        path.symlink_to(tmp_path / "nowhere")
        return str(path), lambda: path.is_symlink() and not (tmp_path / "nowhere").exists()
    os.mkfifo(path)
    return str(path), lambda: stat.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "fifo", "device"])
@pytest.mark.parametrize("flag", ["--junit-xml", "--report-json"])
def test_a_report_path_that_is_not_a_regular_file_is_refused(tmp_path, capsys, flag, kind):
    path, unchanged = _make(kind, tmp_path)
    code = rlperf(["gate", "--output-dir", str(tmp_path / "out"), *CHEAP, flag, path])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith(f"rlperf gate: {flag} {path}: cannot write the report") and "Traceback" not in err, err
    assert "gates passed" not in out and unchanged()


def _report():
    return GateReport([GateResult(name="sanity", passed=True, message="ok", measured={"x": 1.0}, threshold=0.0)])


def test_writing_refuses_a_link_that_appeared_after_the_check_and_replaces_a_regular_file(tmp_path):
    report = _report()
    target = tmp_path / "target.txt"
    target.write_text("keep me")
    link = tmp_path / "r.json"
    link.symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        report.write_json(str(link))
    assert link.is_symlink() and target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "target.txt"]  # no temporary file left
    regular = tmp_path / "old.xml"
    regular.write_text("old")
    report.write_junit(str(regular))
    assert regular.read_text().startswith("<?xml") and not regular.is_symlink()
