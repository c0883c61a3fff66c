"""A node's window file (`storage/node.py` reads through it): one file in /dev/shm that local rank 0 creates and
the node's other ranks attach, and whose header words are how the ranks wait for each other.

| [0, HEADER) | int64 words: magic, size, ranks, warm, bytes carried; then per rank: pid, windows read, windows |
|             | used, failed                                                                                     |
| then        | PARTS parts of `part_bytes` (none when warm), then the bytes local rank 0 carries to the others |

/dev/shm may be shared with other users and containers (`--ipc=host`): the file is created under a random name,
mode 0600, and named only once whole, never over a file already there; every other rank opens it without
following a link and checks it is its own user's, private, regular file on /dev/shm's file system
(`storage/shmfile.py`) before it maps it. A node from `Node.from_environment` names it with a secret its ranks
share (`parallel.config`), so no one else can know the name in advance.

Every wait watches the other ranks: one that failed, exited or stays behind longer than `timeout_s` makes this rank
raise `NodeError` (never a hang); a local rank 0 that cannot create the file tells the others at once
(`SharedWindow._tell_failed`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from enum import IntEnum
from pathlib import Path
from typing import Callable

import torch

from ..errors import NodeError, SharedMemoryError
from ..parallel.config import Node
from .shm import SHM, room_for, shared_room
from .shmfile import create_private, open_own, publish, remedy
from .windows import PARTS

HEADER = 4096
MAGIC = 0x5741_3136_4E4F_4445  # "WA16NODE"
FILE_WORDS = 5  # magic, size, ranks, warm, bytes carried; then each rank's `Word`s
LIVENESS_S = 0.2  # how often a waiting rank looks whether the ranks it waits for still run


class Word(IntEnum):
    """A rank's words in the header (after the three of the file)."""

    PID = 0
    READ = 1  # windows this rank has read its stripe of
    USED = 2  # windows this rank is done with (their views no longer used)
    FAILED = 3  # Failure: why this rank stopped (0 while it runs or once it is done)


class Failure(IntEnum):
    """A rank's FAILED word."""

    NONE = 0
    OWN = 1  # its own load failed
    PEER = 2  # it stopped because another rank failed or exited
    DONE = 3  # it finished: every window read and used (its process may exit)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


class SharedWindow:
    """The node's window file: created by local rank 0, attached by the others, unlinked once all have it;
    its header words are how the ranks wait for each other."""

    def __init__(self, node: Node, part_bytes: int | None, *, warm: bool = False, suffix: str = "",
                 carry: bytes = b"") -> None:
        """`warm` (local rank 0's word, the others learn it): the page cache holds the planned bytes (WARM_AT of
        their pages), so the ranks read through their mappings and the window holds no data. `suffix`: of the
        file's name (a node's other rendezvous). `carry`: bytes local rank 0 hands to the others (`carried`);
        they pass `part_bytes=None` and take the file as local rank 0 made it."""
        self.node, self.warm, self.carried = node, warm and node.local_rank == 0, carry
        self.part_bytes = 0 if self.warm or part_bytes is None else part_bytes
        self._sized = part_bytes is not None
        self.path = SHM / f"wna16-node-{node.key}{suffix}"
        self._map = self._create() if node.local_rank == 0 else self._attach()
        self.words = (ctypes.c_int64 * (HEADER // 8)).from_buffer(self._map)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8, count=PARTS * self.part_bytes, offset=HEADER) \
            if self.part_bytes else torch.empty(0, dtype=torch.uint8)
        self.set(Word.PID, os.getpid())

    @property
    def _who(self) -> str:
        return f"node {self.node.key}"

    @property
    def size(self) -> int:
        return HEADER + PARTS * self.part_bytes + len(self.carried)

    def _create(self) -> mmap.mmap:
        """The file, made under a random temporary name (`shmfile.create_private`: mode 0600) and named once whole
        (`publish`: never over a file already at the name). Its header and carried bytes are written, not stored
        through the mapping: a /dev/shm without room then raises SharedMemoryError here, where a store would kill
        the process (SIGBUS). The parts' pages come as the ranks read into them. Where it fails before the file
        is named, the other ranks are told at once (`_tell_failed`)."""
        header = (ctypes.c_int64 * FILE_WORDS)(MAGIC, self.size, self.node.size, int(self.warm), len(self.carried))
        try:
            writes = ((bytes(header), 0), (self.carried, self.size - len(self.carried)))
            mapped, temporary = self._made(self.size, writes)
        except Exception:
            self._tell_failed()
            raise
        try:
            publish(temporary, self.path, self._who)
        except BaseException:
            mapped.close()
            raise
        return mapped

    def _made(self, size: int, writes: tuple[tuple[bytes, int], ...]) -> tuple[mmap.mmap, Path]:
        """(mapping, temporary name) of a new private file of `size` bytes beside the window's name, with each
        (data, at) of `writes` written (nothing is left where it fails)."""
        fd, temporary = create_private(self.path, self._who)
        try:
            os.ftruncate(fd, size)
            for data, at in writes:
                self._write(fd, data, at, temporary)
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED), temporary
        except BaseException:
            os.unlink(temporary)
            raise
        finally:
            os.close(fd)

    def _tell_failed(self) -> None:
        """Local rank 0 could not make the window: a header-only file at its name, whose FAILED word of local rank
        0 says so, tells the other ranks at once (their first wait raises); removed once they all attached it
        (or after the node's timeout). Where even that cannot be made (no page free, the name taken), the
        others find out by themselves: a taken name fails their own check, else they wait out their timeout."""
        words = (ctypes.c_int64 * (FILE_WORDS + len(Word)))(MAGIC, HEADER, self.node.size, 0, 0)
        words[FILE_WORDS + Word.PID], words[FILE_WORDS + Word.FAILED] = os.getpid(), Failure.OWN
        try:
            marker, temporary = self._made(HEADER, ((bytes(words), 0),))
            publish(temporary, self.path, self._who)
        except (OSError, SharedMemoryError):  # the error that brought us here is the one raised
            return
        seen = (ctypes.c_int64 * (HEADER // 8)).from_buffer(marker)
        deadline = time.monotonic() + self.node.timeout_s
        while time.monotonic() < deadline and not all(seen[FILE_WORDS + len(Word) * i + Word.PID]
                                                      for i in range(1, self.node.size)):
            time.sleep(LIVENESS_S / 20)
        del seen
        self.unlink()
        marker.close()

    def _write(self, fd: int, data: bytes, at: int, path: Path) -> None:
        """`data` into file `fd` (`path`) at byte `at`; SharedMemoryError where its file system is full."""
        done = 0
        try:
            while done < len(data):
                done += os.pwrite(fd, data[done:], at + done)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            free = shared_room(path.parent)
            raise SharedMemoryError(f"node {self.node.key}: writing {len(data)} bytes of {path} failed ({error}): "
                                    f"{path.parent} has {free} bytes free. {room_for(self.size)}") from error

    def _attach(self) -> mmap.mmap:
        """Local rank 0's file, once it is named: opened without following a link and checked to be this job's
        own (`shmfile.open_own`: SharedMemoryError at once where another user's file, a link or a file others may
        write holds the name), then mapped."""
        deadline, delay = time.monotonic() + self.node.timeout_s, 1e-3
        while (fd := open_own(self.path, self._who)) is None:
            if time.monotonic() > deadline:
                raise NodeError(f"node {self.node.key}: local rank 0 (global rank {self.node.ranks[0]}) did not "
                                f"create the shared window {self.path} within timeout_s={self.node.timeout_s}; start "
                                f"every rank of the node with the same Node.key, or raise timeout_s.")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER:
                raise NodeError(f"node {self.node.key}: {self.path} holds {size} bytes, less than a window's "
                                f"{HEADER}-byte header: it is no window local rank 0 made. {remedy(self.path)}")
            return self._checked(mmap.mmap(fd, size, flags=mmap.MAP_SHARED))
        finally:
            os.close(fd)

    def _checked(self, mapped: mmap.mmap) -> mmap.mmap:
        words = (ctypes.c_int64 * (HEADER // 8)).from_buffer(mapped)
        magic, size, ranks, self.warm, carried = words[0], words[1], words[2], bool(words[3]), words[4]
        stopped = magic == MAGIC and words[FILE_WORDS + Word.FAILED] != Failure.NONE  # (local rank 0's)
        del words
        if stopped:  # (`_tell_failed`'s file, or a window whose local rank 0 failed since): the first wait says so
            self.part_bytes, self.carried = 0, b""
            return mapped
        self.part_bytes = 0 if self.warm else self.part_bytes
        if not self._sized and magic == MAGIC and len(mapped) == size >= HEADER + carried:
            self.carried = bytes(mapped[size - carried:size])
        if magic != MAGIC or size != self.size or ranks != self.node.size or len(mapped) != size:
            mapped.close()
            raise NodeError(f"node {self.node.key}: the shared window {self.path} holds {size} bytes for {ranks} "
                            f"ranks, this rank planned {self.size} bytes for {self.node.size}: the ranks planned "
                            f"different loads; load the same checkpoint with the same ReadOptions and parallel "
                            f"sizes on every rank of the node.")
        if hasattr(mmap, "MADV_WILLNEED"):
            mapped.madvise(mmap.MADV_WILLNEED)
        return mapped

    def word(self, local_rank: int, word: Word) -> int:
        return self.words[FILE_WORDS + len(Word) * local_rank + word]

    def set(self, word: Word, value: int) -> None:
        self.words[FILE_WORDS + len(Word) * self.node.local_rank + word] = value

    def part(self, window: int) -> torch.Tensor:
        """The bytes of the part window `window` is read into."""
        start = window % PARTS * self.part_bytes
        return self.data[start:start + self.part_bytes]

    def wait(self, word: Word, target: int, doing: str, own: Callable[[], None]) -> None:
        """Until every rank's `word` is at least `target` (`own()` raises this rank's own failure). Raises
        NodeError when a rank failed, exited, or stays behind longer than the node's timeout."""
        now = time.monotonic()
        deadline, delay, alive_at = now + self.node.timeout_s, 1e-4, now
        while True:
            own()
            behind = [i for i in range(self.node.size) if self.word(i, word) < target]
            self._check(doing, time.monotonic() >= alive_at)  # (a look at /proc: every LIVENESS_S at most)
            if not behind:
                return
            now = time.monotonic()
            alive_at = alive_at if alive_at > now else now + LIVENESS_S
            if now > deadline:
                raise NodeError(self._about(behind, f"did not finish {doing} within timeout_s={self.node.timeout_s}"
                                                    f" (raise Node.timeout_s for a slower storage)"))
            time.sleep(delay)
            delay = min(2 * delay, 5e-3)

    def _check(self, doing: str, liveness: bool) -> None:
        """Raise NodeError naming the ranks that exited while running (looked for with `liveness`; one that
        failed or stopped first says so itself), else those whose load failed, else those that stopped because
        of another."""
        states = [(i, Failure(self.word(i, Word.FAILED)), self.word(i, Word.PID)) for i in range(self.node.size)]
        liveness = liveness or any(state in (Failure.OWN, Failure.PEER) for _, state, _ in states)  # (the cause?)
        gone = [i for i, state, pid in states if liveness and pid and state is Failure.NONE and not alive(pid)]
        # (read again: a rank that stops sets its word before it exits, which may have been after `states`)
        gone = [i for i in gone if self.word(i, Word.FAILED) == Failure.NONE]
        if gone:
            raise NodeError(self._about(gone, f"exited while the node was {doing}"))
        for failure, what in ((Failure.OWN, "failed"), (Failure.PEER, "stopped because of another rank")):
            if found := [i for i, state, _ in states if state is failure]:
                raise NodeError(self._about(found, f"{what} while the node was {doing} (its own error says why)"))

    def _about(self, local: list[int], what: str) -> str:
        ranks = ", ".join(f"{self.node.ranks[i]} (pid {self.word(i, Word.PID) or 'not started'})" for i in local)
        return (f"node {self.node.key}: rank(s) {ranks} {what}; rank {self.node.rank} stops its load too. Restart "
                f"every rank of the node.")

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop this object's hold on the mapping (unmapped once no view of it is left)."""
        self.words = None
        self.data = torch.empty(0, dtype=torch.uint8)


def window_file_bytes(part: int) -> int:
    """The bytes of the window file of a node reading into parts of `part` bytes (`WindowPlan.part`)."""
    return HEADER + PARTS * part
