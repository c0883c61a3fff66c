"""The machine's shared memory (/dev/shm), where a node's ranks read together: how much room it has, and what a
node that finds too little is told.

/dev/shm is a tmpfs whose size is whatever the machine or container gives it: half the RAM on a host, 64 MiB in a
Docker container started without `--shm-size` or `--ipc=host`, a memory-backed emptyDir's limit on Kubernetes. A
window that runs out of pages fails the load of every rank of the node, so the node checks first
(`storage/node_plan.py`) and reads alone where the window does not fit.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..parallel.config import Node
from .windows import PARTS

SHM = Path("/dev/shm")


def shared_room(directory: Path) -> int:
    """The bytes a new file in `directory` may still take (statvfs: the blocks free to an unprivileged user);
    0 where `directory` cannot be asked (none there: a machine without /dev/shm)."""
    try:
        found = os.statvfs(directory)
    except OSError:
        return 0
    return found.f_bavail * found.f_frsize


def no_room(node: Node, needed: int, part: int, free: int, *, directory: Path = SHM) -> str:
    """What a node whose window file (`needed` bytes: parts of `part` bytes) does not fit in `directory` is told:
    the bytes needed and free there, and the ways to give it room."""
    return (f"node {node.key}: its shared window needs {needed} bytes ({needed / 2**20:.1f} MiB: {PARTS} parts of "
            f"{part} bytes, Node.window_bytes={node.window_bytes} / {PARTS} grown to the largest layer the node "
            f"reads) in {directory}, which has {free} bytes free. {room_for(needed)} Or pass Node(window_bytes=...) "
            f"smaller (down to {PARTS} times the largest layer).")


def room_for(nbytes: int) -> str:
    """How to give a file of `nbytes` room in the machine's shared memory."""
    return (f"Give the machine's shared memory room for it and for whatever else uses it (Docker: --shm-size="
            f"{-(-nbytes // (1 << 30))}g or more, or --ipc=host; Kubernetes: a memory-backed emptyDir mounted at "
            f"{SHM}).")
