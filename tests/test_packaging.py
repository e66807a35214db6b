"""`import rlperf.kernels` works from a wheel install, not only from the editable checkout."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_install_exposes_top_level_subpackages(tmp_path):
    env = dict(os.environ, RLPERF_NO_EXTENSION="1")  # the extension is not what this test is about
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True, env=env, capture_output=True,
    )
    wheel = next((tmp_path / "dist").glob("rlperf-*.whl"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = (
        "import rlperf, rlperf.kernels, rlperf.kernels.reference, rlperf.bench.harness, rlperf.model;"
        "from rlperf.kernels import precompile;"
        "print(rlperf.kernels.__file__); print(len(list(precompile.MANIFEST_DIR.glob('*.jsonl'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(target)),
                         capture_output=True, text=True, check=True).stdout
    assert str(target) in out, out
    assert int(out.split()[-1]) >= 1, "the wheel lacks the shipped kernel manifests (kernels/manifests/*.jsonl)"
