"""bench/pack_sglang.sh + bench/unpack_sglang.sh on a small installed folder (no download): the trim keeps
sglang-kernel's Python, sm90/common_ops and spatial_ops only and follows the TRIM list (its "!" entries kept);
a small pack is one chunk; chunks of a pack split smaller reassemble over separate calls that each carry one
chunk, the still-missing ones named; a broken chunk is refused; unpacks started together (the lanes of one
device call) take turns and all find the site. bench/sglang_imports.py names every missing
module of an import walk, with its importer."""
import fnmatch
import os
import shutil
import subprocess
import sys
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


def test_unpacks_started_together_take_turns_and_all_find_the_site(tmp_path):
    site, files = _site(tmp_path)
    pack, dest = tmp_path / "pack", tmp_path / "dest"
    env = {"PACK_DIR": str(pack), "DEST": str(dest), "SITE": str(site), "XZ_LEVEL": "0"}
    assert _run("pack_sglang.sh", env, ROOT).returncode == 0
    procs = [subprocess.Popen(["bash", str(ROOT / "bench" / "unpack_sglang.sh")], env={**os.environ, **env}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [(p.wait(timeout=60), *p.communicate()) for p in procs]
    assert all(rc == 0 for rc, _, _ in outs), outs
    assert sum("chunks joined and unpacked" in out for _, out, _ in outs) == 1  # the others found it complete
    assert (dest / "site/flashinfer/data.bin").read_bytes() == files["flashinfer/data.bin"]


def test_trim_follows_the_trim_list_and_the_packs_own_site_is_trimmed_in_place(tmp_path):
    site = tmp_path / "pack" / "site"  # --from-site PACK_DIR/site: trimmed where it is, not deleted first
    files = {"sglang/__init__.py": b"", "sglang-0.5.17.dist-info/METADATA": b"m",
             "sglang/srt/models/registry.py": b"", "sglang/srt/models/qwen3.py": b"", "sglang/srt/models/gemma3.py": b"",
             "sglang/srt/models/deepseek_common/utils.py": b"", "sglang/srt/server/_core.cpython-312-x86_64-linux-gnu.so": b"",
             "sglang/multimodal_gen/x.py": b"", "xgrammar/__init__.py": b"", "xgrammar/lib/libxgrammar.a": b"a",
             "transformers/models/__init__.py": b"", "transformers/models/auto/configuration_auto.py": b"",
             "transformers/models/qwen3/configuration_qwen3.py": b"", "transformers/models/bert/modeling_bert.py": b"",
             "jedi/__init__.py": b"", "jedi-0.20.1.dist-info/METADATA": b"m", "IPython/display.py": b"",
             "tiktoken/__init__.py": b"", "tiktoken-0.14.0.dist-info/METADATA": b"m", "msgspec/__init__.pyi": b"",
             "bin/sglang": b"", "gguf/__init__.py": b"", "soundfile.py": b"", "sgl_kernel/sm90/common_ops.abi3.so": b"k"}
    for name, data in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(data)
    env = {"PACK_DIR": str(tmp_path / "pack"), "SITE": str(site), "XZ_LEVEL": "0"}
    out = _run("pack_sglang.sh", env, ROOT)
    assert out.returncode == 0, out.stderr
    assert [c.name for c in (tmp_path / "pack").glob("chunk-*")] == ["chunk-00"]  # one chunk
    kept = {n for n in files if (site / n).exists()}
    assert kept == {"sglang/__init__.py", "sglang-0.5.17.dist-info/METADATA", "sglang/srt/models/registry.py",
                    "sglang/srt/models/qwen3.py", "sglang/srt/models/deepseek_common/utils.py", "xgrammar/__init__.py",
                    "transformers/models/__init__.py", "transformers/models/auto/configuration_auto.py",
                    "transformers/models/qwen3/configuration_qwen3.py", "IPython/display.py", "gguf/__init__.py",
                    "soundfile.py", "sgl_kernel/sm90/common_ops.abi3.so"}
    manifest = (tmp_path / "pack" / "MANIFEST").read_text()
    assert "package sglang-0.5.17" in manifest and "jedi" not in manifest and "tiktoken" not in manifest


def test_the_trim_list_is_one_array_whose_keep_entries_name_what_an_earlier_glob_takes():
    text = (ROOT / "bench" / "pack_sglang.sh").read_text()
    body = text.split("\nTRIM=(\n", 1)[1].split("\n)\n", 1)[0]
    entries = [e for line in body.splitlines() for e in line.split("#")[0].split()]
    assert "'xgrammar/lib'" in entries and "'jedi'" in entries and "'sglang/srt/models/*'" in entries
    removes = [e.strip("'") for e in entries if not e.startswith("'!")]
    for keep in (e.strip("'!") for e in entries if e.startswith("'!")):
        assert any(fnmatch.fnmatch(keep, r) for r in removes), keep  # a keep entry without a removal is stale
    for needed in ("sgl_kernel", "flashinfer", "IPython", "gguf", "soundfile", "sentencepiece", "openai"):
        assert not any(fnmatch.fnmatch(needed, r) for r in removes), needed  # imported at module level


def test_sglang_imports_names_every_missing_module_and_who_imports_it(tmp_path):
    pkg = tmp_path / "fakesgl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import absent_one\nfrom absent_two import thing\nclass X(thing.Base):\n    pass\n")
    (pkg / "fine.py").write_text("import json\n")
    (tmp_path / "fine_top.py").write_text("import json\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    script = str(ROOT / "bench" / "sglang_imports.py")
    out = subprocess.run([sys.executable, script, "fakesgl", "fakesgl.fine"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "missing absent_one (imported by fakesgl)" in lines and "missing absent_two (imported by fakesgl)" in lines
    assert "2 of 2 modules imported, 2 missing, 0 errors" in out.stdout
    ok = subprocess.run([sys.executable, script, "fine_top", "json"], env=env, capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0 and "0 missing, 0 errors" in ok.stdout, ok.stdout + ok.stderr
