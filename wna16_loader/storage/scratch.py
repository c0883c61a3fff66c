"""Host memory reused from one gathered chunk to the next.

A load gathers a rank's words a chunk of experts at a time (a few MiB) and places each chunk before it
gathers the next. A fresh buffer per chunk is memory the allocator hands back to the system and takes
again: one page fault per 4 KiB, every chunk (a TP 8 rank of a 16-layer Qwen3-30B-A3B cut: ~44,000
faults, a tenth of the rank's time). A `Scratch` keeps one buffer per thread, grown to the largest chunk,
so its pages fault once.

| Scratch().take(shape, dtype)      | a tensor carved from the start of this thread's buffer: valid until |
|                                   | the thread's next `take` (or `release`) on the same Scratch         |
| Scratch().release()               | this thread's buffer freed (a later `take` makes a new one)         |
| destination(shape, dtype, pin, s) | a gather's CPU destination: from Scratch `s`, or fresh (pinned)     |
"""

from __future__ import annotations

import math
import threading

import torch

EMPTY = torch.empty(0, dtype=torch.uint8)


class Scratch:
    """One growing uint8 buffer per thread; `take` hands out its start (module table). A copy or a pickle of it
    (of an engine module holding one, say) is a new, empty Scratch: what it holds is only reused memory."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __reduce__(self) -> tuple[type["Scratch"], tuple[()]]:
        return Scratch, ()

    @property
    def buffer(self) -> torch.Tensor:
        """This thread's buffer (empty until its first `take`)."""
        return getattr(self._local, "buffer", EMPTY)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous `shape`/`dtype` tensor over this thread's buffer (grown when too small: the old buffer
        goes once no tensor holds it). Whatever the previous `take` returned is overwritten by the next use."""
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self.buffer
        if buffer.numel() < nbytes:
            buffer = self._local.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        """The bytes this thread's buffer holds."""
        return self.buffer.numel()

    def release(self) -> None:
        """Free this thread's buffer (tensors already taken keep it alive until they go)."""
        self._local.buffer = EMPTY


def destination(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, scratch: Scratch | None) -> torch.Tensor:
    """A gather's CPU destination: taken from `scratch` when given (and not `pin`: pinned memory is never scratch),
    else fresh memory (pinned with `pin`)."""
    return scratch.take(shape, dtype) if scratch is not None and not pin else \
        torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
