"""The page cache under the benchmark: warming files, evicting them (the cold condition) and counting what is
resident (mincore through ctypes), so that every cold run reports how cold it really started."""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from pathlib import Path


def files_of(folder: Path) -> list[Path]:
    """Every safetensors file below `folder`, sorted."""
    return sorted(folder.rglob("*.safetensors"))


def warm(files: list[Path]) -> None:
    """Read every file once, so that its pages are in the page cache."""
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            while handle.read(64 << 20):
                pass


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache: os.sync() first (a dirty page cannot be dropped), then
    posix_fadvise(POSIX_FADV_DONTNEED) over each whole file."""
    os.sync()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(file: Path) -> int:
    """Bytes of `file` in the page cache, by mincore(2) over a fresh private mapping (which faults in nothing)."""
    size = file.stat().st_size
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    with open(file, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    anchor = ctypes.c_char.from_buffer(mapped)
    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
    rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
    err = ctypes.get_errno()
    del anchor
    mapped.close()
    if rc != 0:
        raise OSError(err, f"mincore of {file} failed: {os.strerror(err)}")
    return min(size, sum(v & 1 for v in vec) * page)


@dataclass(frozen=True)
class Residency:
    """How much of a set of files the page cache held at one moment."""

    files: int
    total: int  # bytes of the files
    resident: int  # bytes of them in the page cache

    @classmethod
    def of(cls, files: list[Path]) -> "Residency":
        return cls(len(files), sum(f.stat().st_size for f in files), sum(resident_bytes(f) for f in files))

    def text(self) -> str:
        """e.g. `0.00 of 15.22 GB resident (48 files)`."""
        return f"{self.resident / 1e9:.2f} of {self.total / 1e9:.2f} GB resident ({self.files} files)"


def make_cold(files: list[Path]) -> Residency:
    """Evict the files and report what stayed resident (0 when the eviction worked)."""
    evict(files)
    return Residency.of(files)


def make_warm(files: list[Path]) -> Residency:
    """Read the files into the page cache (unless every page already is) and report what is resident (all of
    them unless memory is short)."""
    now = Residency.of(files)
    if now.resident == now.total:
        return now
    warm(files)
    return Residency.of(files)
