"""The page cache: what it holds (`PageCache`, mincore(2)) and `posix_fadvise(WILLNEED)` that reads every byte
it is asked for.

Linux reads at most max(`read_ahead_kb`, `max_sectors_kb`) of the file's block device per WILLNEED call
(mm/readahead.c, `force_page_cache_ra`: `nr_to_read` is capped at max(bdi->io_pages, ra->ra_pages)) and
silently leaves the rest of a larger range unread. Measured on this project's VM (read_ahead_kb 8192): one
call over 32 MiB of a cold file brought in 8.0 MiB; calls of 16 MiB over 1.88 GB brought in 0.96 GB. On a
common NVMe setting (read_ahead_kb 128, max_sectors_kb 1280) a 16 MiB call reads 8 % of its range.

| advice_bytes(path)                 | the most one call reads for `path`'s device (from sysfs: its block    |
|                                    | queue, or the read-ahead window of a network or FUSE file system), or |
|                                    | FALLBACK_BYTES where sysfs does not say                                |
| will_need(fd, begin, end, step)    | WILLNEED over file bytes [begin, end) in calls of at most `step` bytes |
| PageCache().holds(path, begin, end)| whether every page of file bytes [begin, end) is cached                |
| PageCache().resident(path, b, e)   | (pages of those bytes cached, pages of the range)                      |
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import threading
from pathlib import Path

FALLBACK_BYTES = 128 << 10  # the kernel's default read-ahead window (VM_READAHEAD_PAGES): a call never reads less
SYSFS = Path("/sys")


def advice_bytes(path: Path, *, sysfs: Path = SYSFS) -> int:
    """The most one WILLNEED call reads of `path`: max(read_ahead_kb, max_sectors_kb) of the queue of the
    block device holding it (a partition's queue is its disk's), in bytes; FALLBACK_BYTES when unknown. One
    stat per call; sysfs is read once per device."""
    device = os.stat(path).st_dev
    return _device_advice_bytes(os.major(device), os.minor(device), sysfs)


@functools.lru_cache(maxsize=64)
def _device_advice_bytes(major: int, minor: int, sysfs: Path) -> int:
    """A block device's queue (its own, or its disk's for a partition); else the read-ahead window of a
    device without a block queue (NFS, FUSE: `class/bdi/MAJ:MIN`); else FALLBACK_BYTES."""
    block = sysfs / "dev" / "block" / f"{major}:{minor}"
    for queue in (block / "queue", block.resolve().parent / "queue"):
        known = [k for k in (_read_kib(queue / "read_ahead_kb"), _read_kib(queue / "max_sectors_kb")) if k]
        if known:
            return max(known) << 10
    window = _read_kib(sysfs / "class" / "bdi" / f"{major}:{minor}" / "read_ahead_kb")
    return window << 10 if window else FALLBACK_BYTES


def _read_kib(file: Path) -> int:
    """The integer in a sysfs file, 0 where there is none."""
    try:
        return int(file.read_text().strip())
    except (OSError, ValueError):
        return 0


def will_need(fd: int, begin: int, end: int, step: int) -> int:
    """Advise WILLNEED over file bytes [begin, end) of `fd` in calls of at most `step` bytes (see the module
    table: a larger call leaves its tail unread); the number of calls made."""
    assert step > 0, f"will_need: step {step} must be positive"
    calls = 0
    for at in range(begin, end, step):
        os.posix_fadvise(fd, at, min(step, end - at), os.POSIX_FADV_WILLNEED)
        calls += 1
    return calls


LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if ctypes.util.find_library("c") else None
PAGE = mmap.PAGESIZE  # mincore takes a page-aligned address


class PageCache:
    """Which file bytes the page cache holds: mincore(2) over a private mapping of each file (made once, and
    faulting in nothing)."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._lock = threading.Lock()

    def holds(self, path: Path, begin: int, end: int) -> bool:
        """Whether every page of file bytes [begin, end) is in the page cache (False where mincore is not to
        be had)."""
        held, pages = self.resident(path, begin, end)
        return pages > 0 and held == pages

    def resident(self, path: Path, begin: int, end: int) -> tuple[int, int]:
        """(pages of file bytes [begin, end) in the page cache, pages of the range); none held where mincore is
        not to be had."""
        with self._lock:
            if path not in self._maps:
                with open(path, "rb") as handle:
                    self._maps[path] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            mapped = self._maps[path]
        begin, end = begin // PAGE * PAGE, min(end, len(mapped))  # mincore takes a page-aligned address
        pages = max(0, (end - begin + PAGE - 1) // PAGE)
        if not pages or LIBC is None:
            return 0, pages
        vector = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(mapped, begin)
        try:
            failed = LIBC.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(end - begin), vector)
        finally:
            del anchor
        return (0 if failed else sum(bytes(vector)), pages)  # (each entry 0 or 1)

    def close(self) -> None:
        with self._lock:
            for mapped in self._maps.values():
                mapped.close()
            self._maps.clear()
