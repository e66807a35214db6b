"""Receive one gloo broadcast and know that it was exactly as long as announced.

gloo completes a receive of ``nbytes`` when the sender's message is shorter, as if it were whole, and
it tells nobody how many bytes came (a longer message aborts the receiving process instead, which
:mod:`rlperf.sync.receiver` survives by receiving in a child). Bytes past a short message keep what
the buffer held before, so no content check can tell a short message from a whole one: a sentinel at
the end of the range misses a shortfall smaller than the sentinel, and a whole message may end in
the sentinel's own bytes.

What the kernel can tell is whether a page was ever written. :func:`receive_exact` receives into a
fresh anonymous mapping laid out so that the range's last byte is the first byte of its own page (the
*guard page*), with transparent huge pages off for the mapping (a huge page would make the guard
page present as soon as any byte near it is written). Nothing touches the guard page before the
broadcast; after it, the page is present (or swapped out) in ``/proc/self/pagemap`` exactly when the
last byte was written, that is, exactly when the whole announced range arrived. Only then are the
bytes copied to their destination; a short message is a :class:`ShortBroadcast` naming the announced
bytes and at most how many arrived (the end of the last page that was written).

Cost: one copy of each range, and host memory for the largest range while it is received. Where a
sandbox hides ``/proc/self/pagemap`` the receive goes straight to its destination, unchecked here.
"""
from __future__ import annotations

import mmap
import struct

import torch

PAGE = mmap.PAGESIZE
_PRESENT_OR_SWAPPED = 3 << 62  # /proc/<pid>/pagemap: bit 63 page present, bit 62 page swapped
_PAGEMAP: bool | None = None  # pagemap_works(), asked once


class ShortBroadcast(RuntimeError):
    """A broadcast that brought fewer bytes than announced (gloo completed it as if whole)."""


def _written_pages(addr: int, npages: int) -> list[bool]:
    """For each page from ``addr`` (page-aligned): whether it was ever touched (present or swapped)."""
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        f.seek(addr // PAGE * 8)
        raw = f.read(8 * npages)
    if len(raw) != 8 * npages:
        raise OSError(f"/proc/self/pagemap gave {len(raw)} of {8 * npages} bytes")
    return [bool(v & _PRESENT_OR_SWAPPED) for v in struct.unpack(f"<{npages}Q", raw)]


def pagemap_works() -> bool:
    """Whether this process can read its own page flags (Linux ``/proc/self/pagemap``; some sandboxes
    hide it): a page written here must read as present, one never touched as absent."""
    try:
        mm = mmap.mmap(-1, 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            t = torch.frombuffer(mm, dtype=torch.uint8)
            t[0] = 1
            ok = _written_pages(t.data_ptr(), 2) == [True, False]
            del t
        finally:
            try:
                mm.close()
            except BufferError:
                pass
        return ok
    except (OSError, ValueError):
        return False


def receive_exact(group, dest: torch.Tensor) -> None:
    """Take part in one broadcast of ``group`` (``broadcast(tensor)`` returning a work for
    ``wait(work, host=True)``, as :class:`rlperf.sync.distributed.WeightUpdateGroup`) into ``dest``
    (a contiguous uint8 CPU tensor of the announced size). :class:`ShortBroadcast` when fewer bytes
    arrived; ``dest`` is then left as it was. A longer message aborts the process (gloo). Where page
    flags cannot be read (:func:`pagemap_works`), the broadcast goes straight into ``dest`` unchecked
    (the engine's sentinel check is then the only one, as before)."""
    global _PAGEMAP
    if _PAGEMAP is None:
        _PAGEMAP = pagemap_works()
    nbytes = dest.numel()
    if nbytes == 0 or not _PAGEMAP:
        group.wait(group.broadcast(dest), host=True)
        return
    pad = (-(nbytes - 1)) % PAGE  # the last byte at pad + nbytes - 1, the first byte of a page
    guard = (pad + nbytes - 1) // PAGE
    mm = mmap.mmap(-1, (guard + 1) * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            mm.madvise(mmap.MADV_NOHUGEPAGE)
        whole = torch.frombuffer(mm, dtype=torch.uint8)  # shares the mapping, touches no page
        buf = whole[pad:pad + nbytes]
        group.wait(group.broadcast(buf), host=True)
        base = whole.data_ptr()
        if not _written_pages(base + guard * PAGE, 1)[0]:
            written = _written_pages(base, guard)
            last = max((i for i, w in enumerate(written) if w), default=-1)
            at_most = min(max((last + 1) * PAGE - pad, 0), nbytes - 1)
            raise ShortBroadcast(f"a broadcast of {nbytes} announced bytes arrived short: at most {at_most} "
                                 f"bytes were received")
        dest.copy_(buf)
        del buf, whole
    finally:
        try:
            mm.close()
        except BufferError:  # a view still alive (an exception's traceback): freed with it
            pass
