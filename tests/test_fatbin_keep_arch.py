"""``python -m rlperf.bench.fatbin_keep_arch`` (bench/pack_te.sh's size cut) on ELF files built here: a
``.nv_fatbin`` section of two fat binaries, each with cubins for three SMs and PTX. Only the kept SM's cubin
payloads keep their bytes; every header, the file's size and every byte outside the payloads stay."""
from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from rlperf.bench.fatbin_keep_arch import FATBIN_MAGIC, KIND_CUBIN, KIND_PTX, elf_section, fatbin_entries, keep_arch


def _entry(kind: int, sm: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, sm)
    return bytes(header) + payload


def _fatbin(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf(section: bytes) -> bytes:
    """A little-endian ELF64 file with sections: null, .nv_fatbin (``section``), .shstrtab."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_off = 64
    str_off = fat_off + len(section)
    sh_off = str_off + len(names)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, sh_off)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)
    sections = bytes(64)  # SHT_NULL
    sections += struct.pack("<IIQQQQ", 1, 1, 0, 0, fat_off, len(section)).ljust(64, b"\0")
    sections += struct.pack("<IIQQQQ", 12, 3, 0, 0, str_off, len(names)).ljust(64, b"\0")
    return bytes(header) + section + names + sections


def _library(sms=(80, 90, 100)):
    payload = lambda tag: bytes((tag + i) % 255 + 1 for i in range(200))  # noqa: E731  (no zero byte)
    binaries = []
    for b in range(2):
        entries = [_entry(KIND_CUBIN, sm, payload(b * 16 + sm)) for sm in sms] + [_entry(KIND_PTX, 90, payload(b + 7))]
        binaries.append(_fatbin(entries))
    section = binaries[0] + bytes(8) + binaries[1]  # 8 bytes of padding between fat binaries
    return _elf(section)


def test_only_the_kept_sms_cubins_keep_their_bytes():
    original = _library()
    data = bytearray(original)
    counts = keep_arch(data, 90)
    assert counts == {"fat_binaries": 2, "entries": 8, "kept_bytes": 400, "zeroed_bytes": 1200}
    assert len(data) == len(original)
    kept_ranges = []
    for _index, kind, sm, start, length in fatbin_entries(data, *elf_section(original, ".nv_fatbin")):
        if kind == KIND_CUBIN and sm == 90:
            assert data[start:start + length] == original[start:start + length]
            kept_ranges.append((start, length))
        else:
            assert data[start:start + length] == bytes(length)
    assert len(kept_ranges) == 2
    # outside the zeroed payloads nothing moved: headers, padding, other sections
    zeroed = bytearray(original)
    for _index, kind, sm, start, length in fatbin_entries(original, *elf_section(original, ".nv_fatbin")):
        if not (kind == KIND_CUBIN and sm == 90):
            zeroed[start:start + length] = bytes(length)
    assert data == zeroed


def test_a_fat_binary_without_the_sm_is_refused_and_nothing_written(tmp_path):
    src, dst = tmp_path / "lib.so", tmp_path / "out.so"
    src.write_bytes(_library(sms=(80, 100)))
    with pytest.raises(ValueError, match="2 of 2 fat binaries have no SM 90 cubin"):
        keep_arch(bytearray(src.read_bytes()), 90)
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.fatbin_keep_arch", str(src), str(dst)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no SM 90 cubin" in proc.stderr and not dst.exists(), proc.stderr


def test_the_command_writes_the_copy_and_says_what_it_kept(tmp_path):
    src, dst = tmp_path / "lib.so", tmp_path / "out.so"
    src.write_bytes(_library())
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.fatbin_keep_arch", str(src), str(dst), "--arch", "100"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "2 fat binaries, 8 entries; kept SM 100 cubins" in proc.stdout
    assert dst.stat().st_size == src.stat().st_size and dst.read_bytes() != src.read_bytes()
    not_elf = tmp_path / "x.so"
    not_elf.write_bytes(b"not an elf file at all")
    proc = subprocess.run([sys.executable, "-m", "rlperf.bench.fatbin_keep_arch", str(not_elf), str(dst)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "not a little-endian ELF64 file" in proc.stderr
