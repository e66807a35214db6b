"""Keep one GPU architecture's device code in a shared library, zero the rest (a packing tool).

    python -m rlperf.bench.fatbin_keep_arch IN.so OUT.so [--arch 90]

A CUDA shared library carries its kernels in the ELF section ``.nv_fatbin``: a run of fat binaries, each
a header (magic ``0xBA55ED50``, version u16, header size u16, payload size u64) followed by entries, one
per compiled form of one translation unit: a kind (1 = PTX, 2 = cubin), its header size u32 and payload
size u64 at offsets 4 and 8, and the target SM at offset 28 (75, 80, 89, 90, 100, ...). At load time the
driver picks, per fat binary, the cubin of the GPU's SM (or JIT-compiles PTX when there is none).

This tool keeps every header and the cubin payloads of ``--arch`` and overwrites every other payload (other
SMs' cubins and all PTX) with zero bytes, so the file keeps its size, its layout and every host-side
pointer into the section, and compresses to a fraction: Transformer Engine 2.12's
``libtransformer_engine.so`` (466 MiB, 440 of them device code for seven SMs) goes from 137 MiB to 9 MiB
under ``xz -6`` with the H100/H200's SM 90 kept, so it travels to a GPU machine in one device call
(``bench/pack_te.sh``). It refuses a fat binary that has no cubin of ``--arch``: a GPU of that SM would
then fall back to a zeroed PTX. The result runs only on GPUs of that SM.
"""
from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2


def elf_section(data: bytes | bytearray, name: str) -> tuple[int, int]:
    """(file offset, size) of ELF64 little-endian section ``name``; ValueError if absent or not ELF64."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    for name_off, _type, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", names + name_off)
        if bytes(data[names + name_off:end]).decode() == name:
            return offset, size
    raise ValueError(f"no {name} section")


def fatbin_entries(data: bytes | bytearray, offset: int, size: int):
    """Yield (fat binary index, kind, sm, payload offset, payload size) for every entry of the fat binaries
    in ``data[offset:offset + size]`` (the section may pad between fat binaries: 8-byte steps to the next
    magic)."""
    p, end, index = offset, offset + size, 0
    while p + 16 <= end:
        magic, _version, header, payload = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8
            continue
        q, stop = p + header, p + header + payload
        if stop > end:
            raise ValueError(f"fat binary {index} at {p:#x} runs past its section")
        while q < stop:
            kind, _unknown, entry_header, entry_payload = struct.unpack_from("<HHIQ", data, q)
            sm = struct.unpack_from("<I", data, q + 28)[0]
            if entry_header < 32 or q + entry_header + entry_payload > stop:
                raise ValueError(f"fat binary {index}: entry at {q:#x} has a bad size")
            yield index, kind, sm, q + entry_header, entry_payload
            q += entry_header + entry_payload
        p, index = stop, index + 1


def keep_arch(data: bytearray, sm: int) -> dict:
    """Zero, in place, every ``.nv_fatbin`` payload but the cubins of ``sm``; the counts and bytes of each."""
    offset, size = elf_section(data, ".nv_fatbin")
    entries = list(fatbin_entries(data, offset, size))
    binaries = {e[0] for e in entries}
    with_sm = {e[0] for e in entries if e[1] == KIND_CUBIN and e[2] == sm}
    if binaries - with_sm:
        raise ValueError(f"{len(binaries - with_sm)} of {len(binaries)} fat binaries have no SM {sm} cubin: "
                         f"zeroing their other code would leave that GPU nothing to run")
    kept = zeroed = 0
    for _index, kind, entry_sm, start, length in entries:
        if kind == KIND_CUBIN and entry_sm == sm:
            kept += length
        else:
            data[start:start + length] = bytes(length)
            zeroed += length
    return {"fat_binaries": len(binaries), "entries": len(entries), "kept_bytes": kept, "zeroed_bytes": zeroed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="the shared library to read")
    p.add_argument("dst", type=Path, help="where to write the copy with one SM's device code")
    p.add_argument("--arch", type=int, default=90, help="the SM whose cubins stay (default: 90, H100/H200)")
    args = p.parse_args(argv)
    try:
        data = bytearray(args.src.read_bytes())
        counts = keep_arch(data, args.arch)
    except (OSError, ValueError) as exc:
        print(f"fatbin_keep_arch: {args.src}: {exc}", file=sys.stderr)
        return 2
    args.dst.write_bytes(data)
    print(f"fatbin_keep_arch: {args.dst}: {counts['fat_binaries']} fat binaries, {counts['entries']} entries; kept "
          f"SM {args.arch} cubins ({counts['kept_bytes'] / 2**20:.1f} MiB), zeroed "
          f"{counts['zeroed_bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
