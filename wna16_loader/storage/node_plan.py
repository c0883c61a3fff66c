"""What a node's ranks read together, decided once by local rank 0 and handed to every rank (`storage/node.py`
reads it).

| node_windows(node, files, plan, gap) | local rank 0 plans the node's windows (or finds the node warm, or its  |
|                                      | window without room in shared memory: None) and every rank gets them   |
| fitting(node, windows)               | the windows, or None (and one warning) where their file does not fit   |
|                                      | in /dev/shm (`storage/shm.py`: its room and what a node is told)       |

A node's window is a file in /dev/shm, a tmpfs whose size is whatever the machine or container gives it (Docker's
default is 64 MiB; `--shm-size` or `--ipc=host` give more). Where the window does not fit, the node reads alone
(each rank its own bytes, direct), with one warning that says what the window needs and how to give it room:
a window that ran out of pages mid-read would fail every rank of the load.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from ..logs import log
from ..parallel.config import Node
from .advice import PageCache
from .node import mostly_cached
from .shared_window import LIVENESS_S, Failure, SharedWindow, Word, window_file_bytes
from .shm import SHM, no_room, shared_room
from .readahead import PlannedRange
from .windows import WindowPlan, decoded, encoded, windows_of


def node_windows(node: Node, files: Sequence[Path], plan: Callable[[], Sequence[Sequence[PlannedRange]] | None],
                 gap: int) -> WindowPlan | None:
    """What the ranks of `node` read together, worked out once by local rank 0 and handed to every rank (the
    others wait for it up to the node's timeout): None where local rank 0 finds at least WARM_AT of the pages of
    `files` in the page cache (a warm node has nothing to share: each rank reads its mappings alone, the few pages
    missing read once for the node through the page cache), where `plan()` (the node's groups, called on local
    rank 0 only) is None, or where their window does not fit in SHM (`fitting`); else those groups' `windows_of`
    (the node's `window_bytes`; ranges `gap` apart read as one). Where local rank 0 fails to plan, every rank
    raises (the others a NodeError)."""
    carry, error = b"", None
    if node.local_rank == 0:
        try:
            groups = None if _cached(files) else plan()
            carry = encoded(None if groups is None else fitting(node, windows_of(groups, node.window_bytes, gap)))
        except BaseException as exc:  # the others learn it now, not at their timeout
            error = exc
    shared = SharedWindow(node, 0 if node.local_rank == 0 else None, suffix=".plan", carry=carry)
    try:
        if error is not None:
            shared.set(Word.FAILED, Failure.OWN)
            _until_attached(shared)
            raise error
        shared.wait(Word.PID, 1, "agreeing what it reads together", lambda: None)
        return decoded(shared.carried)
    finally:
        if node.local_rank == 0:
            shared.unlink()
        shared.close()


def fitting(node: Node, windows: WindowPlan, *, directory: Path = SHM) -> WindowPlan | None:
    """`windows`, or None where their window file does not fit in `directory` (`shared_room`): the node then reads
    alone, and says so once (a warning with the bytes needed and free, and the fixes)."""
    needed, free = window_file_bytes(windows.part), shared_room(directory)
    if needed <= free:
        return windows
    log.warning("%s Until then its ranks read alone: each reads every byte it needs itself, direct.",
                no_room(node, needed, windows.part, free, directory=directory))
    return None


def _cached(files: Sequence[Path]) -> bool:
    """Whether the page cache holds at least WARM_AT of the pages of `files`."""
    pages = PageCache()
    try:
        return mostly_cached(pages.resident(f, 0, f.stat().st_size) for f in files)
    finally:
        pages.close()


def _until_attached(shared: SharedWindow) -> None:
    """Wait until every rank has attached `shared` (each then reads local rank 0's words), or the node's timeout."""
    deadline = time.monotonic() + shared.node.timeout_s
    while not all(shared.word(i, Word.PID) for i in range(shared.node.size)) and time.monotonic() < deadline:
        time.sleep(LIVENESS_S / 20)
