"""bench/pack_sglang.sh + bench/unpack_sglang.sh on a small installed folder (no download): the trim keeps
sglang-kernel's Python, sm90/common_ops and spatial_ops only; chunks reassemble over separate calls that each
carry one chunk, the still-missing ones named; a broken chunk is refused."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("xz") is None or shutil.which("split") is None, reason="needs xz and split")


def _site(tmp_path):
    site = tmp_path / "installed"
    files = {"sgl_kernel/__init__.py": b"x = 1\n", "sgl_kernel/sm90/common_ops.abi3.so": os.urandom(3000),
             "sgl_kernel/spatial_ops.abi3.so": os.urandom(2000), "sgl_kernel/flash_ops.abi3.so": os.urandom(5000),
             "sgl_kernel/sm100/common_ops.abi3.so": os.urandom(4000), "sglang/__init__.py": b"__version__ = '0.5.17'\n",
             "sglang/tests/test_x.py": b"", "sglang/__pycache__/a.pyc": b"", "sglang-0.5.17.dist-info/METADATA": b"m",
             "flashinfer/data.bin": os.urandom(9000)}
    for name, data in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(data)
    return site, files


def _run(script, env, cwd):
    args = [] if "unpack" in script else ["--from-site", env["SITE"]]
    return subprocess.run(["bash", str(cwd / "bench" / script), *args],
                          env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_pack_splits_and_unpack_joins_one_call_at_a_time_refusing_a_broken_chunk(tmp_path):
    site, files = _site(tmp_path)
    pack, dest = tmp_path / "pack", tmp_path / "dest"
    env = {"PACK_DIR": str(pack), "DEST": str(dest), "SITE": str(site), "CHUNK_BYTES": "4096", "XZ_LEVEL": "0"}
    out = _run("pack_sglang.sh", env, ROOT)
    assert out.returncode == 0, out.stderr
    chunks = sorted(pack.glob("chunk-*"))
    assert len(chunks) >= 3 and all(c.stat().st_size <= 4096 for c in chunks)
    manifest = (pack / "MANIFEST").read_text()
    assert "package sglang-0.5.17" in manifest and manifest.count("\nchunk ") == len(chunks)
    # each device call carries the MANIFEST and one chunk
    stash = tmp_path / "stash"
    stash.mkdir()
    for c in chunks:
        shutil.move(str(c), stash / c.name)
    broken = pack / chunks[0].name  # a chunk that does not match the MANIFEST is refused, named
    broken.write_bytes(b"\0" + (stash / chunks[0].name).read_bytes()[1:])
    out = _run("unpack_sglang.sh", env, ROOT)
    assert out.returncode == 2 and chunks[0].name in out.stderr and "broken copy" in out.stderr
    broken.unlink()
    for i, c in enumerate(chunks):
        shutil.copy(stash / c.name, pack / c.name)
        out = _run("unpack_sglang.sh", env, ROOT)
        (pack / c.name).unlink()
        if i < len(chunks) - 1:
            assert out.returncode == 75, out.stderr
            assert f"{i + 1} of {len(chunks)} chunks" in out.stdout and chunks[i + 1].name in out.stdout
        else:
            assert out.returncode == 0, out.stderr
    got = dest / "site"
    assert (got / "sgl_kernel/sm90/common_ops.abi3.so").read_bytes() == files["sgl_kernel/sm90/common_ops.abi3.so"]
    assert (got / "sgl_kernel/spatial_ops.abi3.so").exists() and (got / "sgl_kernel/__init__.py").exists()
    assert not (got / "sgl_kernel/flash_ops.abi3.so").exists() and not list(got.glob("sgl_kernel/sm100/*.so"))
    assert not (got / "sglang/tests").exists() and not (got / "sglang/__pycache__").exists()
    assert (got / "flashinfer/data.bin").read_bytes() == files["flashinfer/data.bin"]
    again = _run("unpack_sglang.sh", env, ROOT)  # a later call finds it complete
    assert again.returncode == 0 and "is complete" in again.stdout
