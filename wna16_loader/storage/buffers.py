"""Memory that reads land in: `Region`s of file bytes carved out of one buffer per layer, from a `BufferPool`
that hands buffers back out once their layer is done.

A rank reading alone brings every byte it needs into buffers of its own, O_DIRECT. The first layers read
into fresh memory, and every fresh 4 KiB page costs a fault, a zeroed page and a memory-cgroup charge inside
the read (the kernel pins the pages for the device); a buffer per region (a TP rank's run of one expert,
~1.7 MiB) can never take a huge page. One buffer per layer, advised MADV_HUGEPAGE, is faulted 2 MiB at a
time where transparent huge pages are on (`enabled` = always or madvise), and reused for a later layer of
about the same size (`size_class`: sizes are rounded up by less than 1/8), so that reading ahead of the
caller costs fresh memory for `depth + 1` layers once. A direct read into huge pages is also as large a device
request as the device takes, where 4 KiB pages cap one at its segments per request (a virtio disk's 254: ~1 MiB):
on such a disk direct reads ran at 1.2-1.5 GB/s into huge pages against 0.5-0.9 GB/s into 4 KiB pages.

| BufferPool.take(n)    | a buffer of at least n bytes (ALIGN-aligned): the smallest free one that fits, else a |
|                       | new one of `size_class(n)` bytes (pinned with `pin`; else huge-page advised)          |
| BufferPool.release(b) | `b` is free again                                                                     |
| BufferPool.allocated  | bytes of every buffer made so far (the read-ahead's memory)                           |
| host_tensor(s, d)     | an empty CPU tensor, from HUGE_PAGE up in huge-page advised memory of its own: a CPU   |
|                       | load writes every byte of its outputs once, so their first touch is its cost too       |
"""

from __future__ import annotations

import bisect
import math
import mmap
import threading
from concurrent.futures import Future
from pathlib import Path

import torch

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and memory on every Linux file system in use
HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) transparent huge page
CLASSES_PER_DOUBLING = 8  # `size_class` steps between n and 2n


def size_class(nbytes: int) -> int:
    """`nbytes` rounded up to one of CLASSES_PER_DOUBLING sizes per power of two (by less than 1/8; a multiple of
    ALIGN, and of HUGE_PAGE above 16 MiB): buffers of layers that differ by a few pages share a size."""
    step = max(ALIGN, 1 << max(0, (nbytes - 1).bit_length() - CLASSES_PER_DOUBLING.bit_length()))
    return -(-nbytes // step) * step


class Region:
    """File bytes [begin, end) of `path` (begin a multiple of ALIGN) read into `buffer` (uint8, at least
    end - begin long), request by request; `wait()` returns once every request is done (raising the first
    error of any)."""

    def __init__(self, path: Path, begin: int, end: int, buffer: torch.Tensor) -> None:
        self.path, self.begin, self.end, self.buffer = path, begin, end, buffer
        self.futures: list[Future[None]] = []
        self._flat: dict[torch.dtype, torch.Tensor] = {}

    def wait(self) -> None:
        for future in self.futures:
            future.result()

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer as 1-D `dtype` elements, element 0 at file byte `begin`."""
        if dtype not in self._flat:
            self._flat[dtype] = self.buffer[:len(self.buffer) // dtype.itemsize * dtype.itemsize].view(dtype)
        return self._flat[dtype]


class BufferPool:
    """uint8 buffers of ALIGN-aligned memory (pinned with `pin`), handed back by `release` and reused."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.allocated = 0
        self._free: list[torch.Tensor] = []  # sorted by length
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes`: the smallest free one that fits, else a new one of `size_class(nbytes)`."""
        with self._lock:
            at = bisect.bisect_left([len(b) for b in self._free], nbytes)
            if at < len(self._free):
                return self._free.pop(at)
            size = size_class(nbytes)
            self.allocated += size
        return pinned(size) if self.pin else huge_paged(size)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            bisect.insort(self._free, buffer, key=len)


def pinned(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory (uint8, ALIGN-aligned)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


def huge_paged(nbytes: int) -> torch.Tensor:
    """`nbytes` of anonymous memory of its own mapping (uint8, page-aligned), advised MADV_HUGEPAGE where the
    system has it (a no-op where transparent huge pages are off). Freed with the last tensor that views it."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, as any memory
            pass
    return torch.frombuffer(memory, dtype=torch.uint8)


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty contiguous CPU tensor: from HUGE_PAGE bytes up a view of `huge_paged` memory (freed with its
    last view), smaller ones `torch.empty`. A fresh 4 KiB page costs a fault, a zeroing and a charge at its first
    write: on this VM, 8 layers of a TP 8 rank's outputs (317 MiB), written warm, took 0.49-0.52 s in huge-page
    advised memory against 0.62-0.65 s, interleaved."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    return huge_paged(nbytes).view(dtype).view(shape)
