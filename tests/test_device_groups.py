"""bench/device.sh runs the GPU suite in groups that each fit one device call: every test file with a
``gpu`` test must be in exactly one group, or a GPU run silently leaves it out."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b|pytestmark\s*=.*\bgpu\b")


def device_groups() -> dict[int, list[str]]:
    out = subprocess.run(["bash", str(ROOT / "bench" / "device.sh"), "groups"], capture_output=True, text=True,
                         check=True).stdout
    groups = {}
    for line in out.splitlines():
        number, files = line.split(":", 1)
        groups[int(number)] = files.split()
    return groups


def files_with_gpu_tests() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").rglob("test_*.py"))
            if p != Path(__file__).resolve() and GPU_MARK.search(p.read_text())}  # this file only names the mark


def test_every_gpu_test_file_is_in_exactly_one_group():
    groups = device_groups()
    assert sorted(groups) == list(range(1, len(groups) + 1))
    listed = [f for files in groups.values() for f in files]
    twice = sorted({f for f in listed if listed.count(f) > 1})
    assert not twice, f"in more than one group of bench/device.sh: {twice}"
    missing = sorted(files_with_gpu_tests() - set(listed))
    assert not missing, f"GPU tests in no group of bench/device.sh (add them to TEST_GROUPS): {missing}"
    stale = sorted(set(listed) - files_with_gpu_tests())
    assert not stale, f"bench/device.sh groups name files without GPU tests: {stale}"


def test_a_group_number_out_of_range_is_refused_before_anything_runs():
    n = len(device_groups())
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device.sh"), "tests", str(n + 1)], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and f"the groups are 1..{n}" in proc.stderr


def test_the_gpu_mark_pattern_finds_marked_files_only():
    assert GPU_MARK.search("@pytest.mark.gpu\ndef test_x(): pass")
    assert GPU_MARK.search("pytestmark = [pytest.mark.gpu]")
    assert not GPU_MARK.search("def test_gpu_name_only(): pass")
