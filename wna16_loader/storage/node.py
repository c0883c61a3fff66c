"""Reading a checkpoint together: the ranks of one machine (`parallel.Node`) read every byte their loads
need once, into one shared window, and each rank takes its own slices from there.

The node's planned byte ranges (the union over its ranks, a group a layer, in use order) are packed into
windows of whole layers; each window is cut into requests dealt round-robin to the ranks (`stripes`), and
each rank reads its requests (O_DIRECT where the file system takes it) into the window's part of a shared
file in /dev/shm while the ranks convert an earlier window from another part (PARTS of them):

| window file   | `storage/shared_window.py`: a header of words, then part 0 (windows 0, 3, ...), part 1  |
| (/dev/shm,    | (windows 1, 4, ...) and part 2, each `part_bytes` long (none when warm: local rank 0    |
| unlinked once | found WARM_AT of the planned pages cached, and every rank reads through its own         |
| all have it)  | mapping); then bytes local rank 0 carries to the others (`node_windows`: the plan)     |

| NodeRead.start(i)      | group i is about to be read: once its window is read by every rank, its regions are |
|                        | the ones `covering` finds (views valid until the next window starts)                |
| NodeRead.covering(...) | the region holding file bytes [lo, hi) in the current window, or None               |

Every wait watches the other ranks: one that failed, exited or stays behind longer than `timeout_s`
makes this rank raise `NodeError` (never a hang).
"""

from __future__ import annotations

import bisect
import errno
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

from ..errors import NodeError, SharedMemoryError
from ..parallel.config import Node
from .advice import PageCache
from .buffers import ALIGN, Region
from .readahead import FileReader, ReadOptions, overlapping
from .shared_window import Failure, SharedWindow, Word
from .shm import no_room, shared_room
from .windows import PARTS, Placed, WindowPlan, stripe

WARM_AT = 0.99  # of a checkpoint's pages cached: a warm node (a page cache under pressure drops a few pages)


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
