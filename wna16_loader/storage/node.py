"""Reading a checkpoint together: the ranks of one machine (`parallel.Node`) read every byte their loads
need once, into one shared window, and each rank takes its own slices from there.

The node's planned byte ranges (the union over its ranks, a group a layer, in use order) are packed into
windows of whole layers; each window is cut into requests dealt round-robin to the ranks (`stripes`), and
each rank reads its requests (O_DIRECT where the file system takes it) into the window's part of a shared
file in /dev/shm while the ranks convert an earlier window from another part (PARTS of them):

| window file   | [0, HEADER): int64 words: magic, size, ranks, warm, bytes carried; then per rank: pid,  |
| (/dev/shm,    | windows read, windows used, failed. Then part 0 (windows 0, 3, ...), part 1 (windows 1, |
| unlinked once | 4, ...) and part 2, each `part_bytes` long (none when warm: local rank 0 found WARM_AT  |
| all have it)  | of the planned pages cached, and every rank reads through its own mapping); then bytes  |
|               | local rank 0 carries to the others (`node_windows`: the node's `WindowPlan`)             |

| NodeRead.start(i)      | group i is about to be read: once its window is read by every rank, its regions are |
|                        | the ones `covering` finds (views valid until the next window starts)                |
| NodeRead.covering(...) | the region holding file bytes [lo, hi) in the current window, or None               |

Every wait watches the other ranks: one that failed, exited or stays behind longer than `timeout_s`
makes this rank raise `NodeError` (never a hang).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from enum import IntEnum
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..errors import NodeError, SharedMemoryError
from ..parallel.config import Node
from .advice import PageCache
from .buffers import ALIGN, Region
from .readahead import FileReader, ReadOptions, overlapping
from .shm import SHM, no_room, room_for, shared_room
from .windows import PARTS, Placed, WindowPlan, stripe

HEADER = 4096
MAGIC = 0x5741_3136_4E4F_4445  # "WA16NODE"
FILE_WORDS = 5  # magic, size, ranks, warm, bytes carried; then each rank's `Word`s
WARM_AT = 0.99  # of a checkpoint's pages cached: a warm node (a page cache under pressure drops a few pages)
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
    def size(self) -> int:
        return HEADER + PARTS * self.part_bytes + len(self.carried)

    def _create(self) -> mmap.mmap:
        """The file, made under a temporary name and renamed into place once whole. Its header and carried bytes
        are written, not stored through the mapping: a /dev/shm without room then raises SharedMemoryError here,
        where a store would kill the process (SIGBUS). The parts' pages come as the ranks read into them."""
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            header = (ctypes.c_int64 * FILE_WORDS)(MAGIC, self.size, self.node.size, int(self.warm), len(self.carried))
            self._write(fd, bytes(header), 0, temporary)
            self._write(fd, self.carried, self.size - len(self.carried), temporary)
            mapped = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(temporary)
            raise
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        return mapped

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
        deadline, delay = time.monotonic() + self.node.timeout_s, 1e-3
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                fd = -1
            if fd >= 0:
                try:
                    if os.fstat(fd).st_size >= HEADER:
                        mapped = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
                        return self._checked(mapped)
                finally:
                    os.close(fd)
            if time.monotonic() > deadline:
                raise NodeError(f"node {self.node.key}: local rank 0 (global rank {self.node.ranks[0]}) did not "
                                f"create the shared window {self.path} within timeout_s={self.node.timeout_s}; start "
                                f"every rank of the node with the same Node.key, or raise timeout_s.")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _checked(self, mapped: mmap.mmap) -> mmap.mmap:
        words = (ctypes.c_int64 * FILE_WORDS).from_buffer(mapped)
        magic, size, ranks, self.warm, carried = words[0], words[1], words[2], bool(words[3]), words[4]
        del words
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


def mostly_cached(counts: Iterable[tuple[int, int]]) -> bool:
    """Whether `PageCache.resident` counts (pages cached, pages) add up to at least WARM_AT cached: warm, for a
    node (a page cache under pressure drops a few pages)."""
    counts = list(counts)
    return sum(held for held, _ in counts) >= WARM_AT * sum(pages for _, pages in counts)


class NodeRead:
    """The overlay of a load that reads together with its node (module table): `plan` is the windows of the
    node's planned ranges (every rank's: `windows_of` their groups), the same on every rank. `cold`: the caller
    has just found the page cache cold (`node_windows`, local rank 0's answer to every rank), so local rank 0 does
    not look again (a look walks every planned page: seconds at hundreds of GB, while the other ranks wait for
    its window)."""

    def __init__(self, plan: WindowPlan, options: ReadOptions, node: Node, *, cold: bool = False) -> None:
        self.node, self.options = node, options
        self.windows = list(plan.windows)
        self._reader = FileReader(options.direct)
        self.shared = SharedWindow(node, plan.part, warm=node.local_rank == 0 and not cold and self._cached())
        if self.shared.warm:  # every rank reads through its mapping: nothing to share
            self.windows = []
        self.window_of = [w for w, window in enumerate(self.windows) for _ in range(window.first, window.stop)]
        self.window_bytes = PARTS * self.shared.part_bytes
        self.buffer_bytes = 0  # (the window is the memory reads land in)
        self.current = -1
        self.failed = False
        self._files: dict[Path, tuple[list[int], list[Region]]] = {}
        self._error: BaseException | None = None
        self._workers = ThreadPoolExecutor(options.threads, thread_name_prefix="wna16-node")
        try:
            self.shared.wait(Word.PID, 1, "attaching the shared window", self._own)
        except BaseException as error:
            self.fail(error)
            raise
        finally:  # attached by all (or given up): the name is no longer needed
            if node.local_rank == 0:
                self.shared.unlink()
        self._thread = threading.Thread(target=self._read_all, name="wna16-node-reader", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """Whether views come from the window (False when warm: from the mappings)."""
        return bool(self.windows)

    def _cached(self) -> bool:
        """Whether the page cache holds at least WARM_AT of the pages of every window's spans (a warm node, as
        `node_windows` judges one: a page cache under pressure drops a few)."""
        return mostly_cached(self._reader.pages.resident(s.path, s.begin, s.end) for w in self.windows for s in w.spans)

    def start(self, group: int) -> None:
        """Group `group` is about to be read: once every rank has read its window, that window's regions
        are the ones `covering` finds (the previous window's views must no longer be used)."""
        window = self.window_of[group] if self.windows else self.current
        if window == self.current:
            return
        self.shared.set(Word.USED, window)
        self.shared.wait(Word.READ, window + 1, f"reading window {window} of {len(self.windows)}", self._own)
        self.current = window
        part, files = self.shared.part(window), {}
        for span in self.windows[window].spans:
            region = Region(span.path, span.begin, span.end, part[span.offset:span.offset + span.end - span.begin])
            files.setdefault(span.path, []).append(region)
        self._files = {path: ([r.begin for r in regions], regions) for path, regions in files.items()}

    def covering(self, path: Path, low: int, high: int) -> Region | None:
        """The region of the current window holding file bytes [low, high) of `path`, or None."""
        found = self._files.get(path)
        if found is None:
            return None
        at = bisect.bisect_right(found[0], low) - 1
        return found[1][at] if at >= 0 and found[1][at].end >= high else None

    def overlaps(self, path: Path, low: int, high: int) -> bool:
        """Whether a region of the current window holds any of file bytes [low, high) of `path`."""
        return overlapping(self._files, path, low, high)

    def _own(self) -> None:
        if self._error is not None:
            raise self._error

    def _read_all(self) -> None:
        """This rank's stripe of every window, each once every rank is done with the window PARTS before it
        (whose part it reuses)."""
        try:
            for number, window in enumerate(self.windows):
                self.shared.wait(Word.USED, number - PARTS + 1, f"converting window {number - PARTS}", lambda: None)
                part = self.shared.part(number)
                requests = stripe(window, self.node.local_rank, self.node.size, self.options.request_bytes)
                for done in [self._workers.submit(self._read, r, part) for r in requests]:
                    done.result()
                self.shared.set(Word.READ, number + 1)
        except BaseException as exc:  # the main thread raises it at its next wait; the others see FAILED
            self._error = exc
            if self.shared.words is not None:
                self.shared.set(Word.FAILED, Failure.PEER if isinstance(exc, NodeError) else Failure.OWN)

    def _read(self, request: Placed, part: torch.Tensor) -> None:
        """One request into its place in `part` (`FileReader`: direct unless the page cache holds it). Raises
        SharedMemoryError where the kernel cannot back the window's pages (its file system is full: EFAULT)."""
        try:
            self._reader.read(request.path, request.begin,
                              memoryview(part[request.offset:request.offset + request.end - request.begin].numpy()))
        except OSError as error:
            if error.errno != errno.EFAULT:
                raise
            where = self.shared.path.parent
            room = no_room(self.node, self.shared.size, self.shared.part_bytes, shared_room(where), directory=where)
            raise SharedMemoryError(f"{room} (Reading {request.path} into the window: {error}.)") from error

    def fail(self, error: BaseException) -> None:
        """This rank's load stopped on `error`: the other ranks are told at once (they raise NodeError), and
        `close` no longer waits for them."""
        self.failed = True
        if self.shared.words is not None and not self.shared.word(self.node.local_rank, Word.FAILED):
            self.shared.set(Word.FAILED, Failure.PEER if isinstance(error, NodeError) else Failure.OWN)

    def close(self) -> None:
        """End the node's read: unless it failed, once this rank's stripe of every window is read (the
        others need it), raising the reader's error if it had one."""
        try:
            if not self.failed:
                self.shared.set(Word.USED, len(self.windows))
            self._thread.join()
            if not self.failed:
                self._own()
                self.shared.set(Word.FAILED, Failure.DONE)
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            self._workers.shutdown(wait=True, cancel_futures=True)
            self._reader.close()
            self._files.clear()
            if self.node.local_rank == 0:
                self.shared.unlink()
            self.shared.close()
