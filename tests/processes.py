"""For tests that start child processes: SIGINT delivered as a terminal delivers it; ranks forked from a fork
server that imported torch once."""

from __future__ import annotations

import multiprocessing
import signal
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
