"""For tests that start child processes: SIGINT delivered as a terminal delivers it; ranks forked from a fork
server that imported torch once; files evicted from the page cache (a cold start)."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


def sigint_default() -> None:
    """`preexec_fn` of a child that a test sends SIGINT: a pytest started in the background by a
    non-interactive shell passes SIGINT on ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def forkserver() -> Any:
    """The multiprocessing context of `start_ranks`' fork server (torch and the package imported once)."""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "wna16_loader.load", "wna16_loader.engine"])
    return mp.get_context("forkserver")


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`, its processes forked by a fork server that has imported
    torch and the package once (started on first use, then shared by every later call of the session): a rank
    costs a fork, not an interpreter start and a torch import. The server never ran a parallel region nor a
    process group, so forking it is safe; each rank still starts with nothing but those imports."""
    forkserver()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def ran(target: Callable[..., None], args: tuple[Any, ...], count: int, *, join_s: float = 120) -> list[Any]:
    """`count` processes from the fork server, process i running `target(i, *args)`, once all have ended (or
    `join_s` passed for each): their exit codes and pids are the caller's to check."""
    context = forkserver()
    processes = [context.Process(target=target, args=(local, *args)) for local in range(count)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(join_s)
    return processes


def evicted(files: list[Path]) -> int:
    """Write back, drop every file's pages from the page cache, and return the bytes still resident."""
    os.sync()
    libc, left = ctypes.CDLL(None, use_errno=True), 0
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        anchor = ctypes.c_char.from_buffer(mapped)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector)
        del anchor
        mapped.close()
        left += size if rc else sum(v & 1 for v in vector) * mmap.PAGESIZE
    return left
