"""Reading a load's planned byte ranges ahead of their use: large requests, several in flight.

A load knows which bytes of which files it will read before it reads any (`load/plan.py`). `ReadAhead`
takes them as groups in use order (a layer each) and keeps the next `ahead` groups (`node_ahead` for a rank of a
node of several ranks) in flight on
`threads` workers (`os.preadv` and `os.posix_fadvise` release the GIL) while the caller converts the
group it is on. Each group's ranges are coalesced file by file (ranges less than `gap_bytes` apart read as
one) and cut into requests of at most `request_bytes`:

| a range marked shared | bytes other ranks of the node read too (a TP cut of a GPTQ w13 row: every 4 KiB page  |
| (`PlannedRange`)      | holds every rank's columns): brought into the page cache (`CacheFill`), where the     |
|                       | caller's file mapping (and the other ranks) find them: each page read from storage    |
|                       | once per node                                                                         |
| a range of the rank's | read into a buffer of our own (`Region`, 4 KiB aligned; `FileReader`: O_DIRECT where  |
| own                   | the file system takes it, buffered where it refuses O_DIRECT or the page cache holds   |
|                       | some of the bytes already, mincore), which the caller reads views of instead of the   |
|                       | mapping (`MappedFile.rebased`): no page faults. Spans the page cache holds whole are   |
|                       | left to the mapping (faults cost less CPU than a copy). Own ranges in a                |
|                       | file where the group also has shared ones (a TP rank's rows of w2 between w13's        |
|                       | columns) go to the page cache with those: views of several experts span both kinds     |

A load from a checkpoint folder marks nothing shared: a rank alone reads every byte it needs itself, and
the ranks of one machine that pass `ReadOptions(node=...)` read together instead (`storage/node.py`). The
in-place fill of an engine's parameters (`load/inplace.py`) marks everything shared: its memory stays the
parameters.

| ReadAhead.start(i)       | group i is about to be read: groups i..i+depth submitted, groups before i released     |
| ReadAhead.covering(...)  | the `Region` holding file bytes [lo, hi), once read (waits for it), or None            |

A region's buffer is reused for later groups once its group is released: views of it are valid until the
next `start` (a load copies every view into its output before it moves on to the next layer).
"""

from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import torch

from ..errors import WNA16Error
from ..parallel.config import Node
from .advice import PageCache, advice_bytes, will_need
from .buffers import ALIGN, BufferPool, Region

DIRECT = getattr(os, "O_DIRECT", 0)
FileSpans = dict[Path, list[tuple[int, int]]]  # [begin, end) byte ranges, file by file
MORE_WORKERS = 4  # at most this many times `threads` requests in flight, where requests are short (`workers`)


class CacheFill(Enum):
    """How shared bytes are brought into the page cache ahead of the mapping's reads."""

    ADVISE = "advise"  # posix_fadvise(WILLNEED) in calls the kernel reads whole (storage/advice.py): it queues
    #                    the reads and returns; pages already cached cost a lookup (the default: on 2 busy cores
    #                    READ's copies cost 7 CPU s warm)
    READ = "read"  # a buffered preadv into a worker's scratch buffer, dropped: the worker waits for the
    #                storage (for file systems that ignore WILLNEED)


class PlannedRange(NamedTuple):
    """File bytes [begin, end) a load will read; `shared`: other ranks of the node read these pages too."""

    file: Path
    begin: int
    end: int
    shared: bool


@dataclass(frozen=True)
class ReadOptions:
    """How a load reads its planned bytes ahead (the knobs of `load_experts(..., reads=)`).

    `threads` requests in flight (up to MORE_WORKERS times more where the requests are short: `workers`), each
    at most `request_bytes`; ranges closer than `gap_bytes` are read as
    one; `ahead` groups (layers) submitted beyond the one being read (`node_ahead` by each rank of a `node` of
    several ranks that reads its own ranges: the ranks together keep the storage busy, and every layer more is
    fresh buffer memory in every rank); `direct`: O_DIRECT for the rank's own
    bytes (buffered where the file system refuses it, or with False); `min_bytes`: loads planning fewer
    bytes than this read through the mapping alone (threads would cost more than they save), and so do
    layers whose expert tensors are all under `min_tensor_bytes` (a range per tiny tensor costs more);
    `enabled=False` reads everything through the mapping, as before read-ahead existed; `fill`: how
    shared bytes reach the page cache (`CacheFill`); `node`: the ranks of this machine loading together
    (`parallel.Node`, e.g. `Node.from_environment()`): a load from a checkpoint folder reads each byte the
    node needs once, into a shared window (`storage/node.py`); without one (or of one rank) a rank loads
    alone and reads every byte it needs itself, direct."""

    threads: int = 8
    request_bytes: int = 16 << 20
    gap_bytes: int = 256 << 10
    ahead: int = 2
    node_ahead: int = 1
    direct: bool = True
    min_bytes: int = 64 << 20
    min_tensor_bytes: int = 64 << 10
    enabled: bool = True
    fill: CacheFill = CacheFill.ADVISE
    node: Node | None = None

    def __post_init__(self) -> None:
        for name, least, why in (("threads", 1, "one request in flight"), ("ahead", 1, "the next layer read ahead"),
                                 ("node_ahead", 1, "the next layer read ahead"),
                                 ("request_bytes", ALIGN, f"a request is whole {ALIGN}-byte pages"),
                                 ("gap_bytes", 0, "a distance in bytes")):
            if getattr(self, name) < least:
                raise WNA16Error(f"ReadOptions: {name}={getattr(self, name)} but at least {least} is needed "
                                 f"({why}); pass {name}>={least}.")

    @property
    def depth(self) -> int:
        """Groups submitted beyond the one being read: `node_ahead` in a node of several ranks, else `ahead`."""
        return self.node_ahead if self.node is not None and self.node.size > 1 else self.ahead


def coalesced(ranges: Iterable[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted, merged [begin, end) spans covering `ranges` (empty ones dropped); spans less than `gap`
    bytes apart merge (the bytes between are read too)."""
    out: list[list[int]] = []
    for begin, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and begin - out[-1][1] < gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([begin, end])
    return [(begin, end) for begin, end in out]


def pieces(begin: int, end: int, size: int) -> list[tuple[int, int]]:
    """[begin, end) cut into consecutive pieces of at most `size` bytes."""
    return [(at, min(at + size, end)) for at in range(begin, end, size)]


def _by_kind(group: Sequence[PlannedRange]) -> tuple[FileSpans, FileSpans]:
    """A group's ranges file by file: (the rank's own, shared). Own ranges in a file where the group has shared
    ones too count as shared: the mapping reads them between those (views of several experts span both)."""
    own: FileSpans = {}
    shared: FileSpans = {}
    for planned in group:
        (shared if planned.shared else own).setdefault(planned.file, []).append((planned.begin, planned.end))
    for path in own.keys() & shared.keys():
        shared[path] += own.pop(path)
    return own, shared


def workers(groups: Sequence[Sequence[PlannedRange]], options: ReadOptions) -> int:
    """Requests in flight for `groups`: `options.threads`, more (up to MORE_WORKERS times) where the rank's own
    requests are shorter than `request_bytes` on average, so that about `threads` full requests' bytes stay in
    flight. The storage a node's ranks share serves each by the bytes it asks for: an EP rank whose experts a
    name-sorting writer scatters (experts 0, 1, 10, then 100..109 of others, 11, ...) reads short runs and fell
    behind the others. Judged on the first group with own ranges (`_by_kind`; the layers of one checkpoint are cut
    alike)."""
    own = next((own for own, _ in map(_by_kind, groups) if own), {})
    cuts = [cut for spans in own.values() for begin, end in coalesced(spans, options.gap_bytes)
            for cut in pieces(begin, end, options.request_bytes)]
    total = sum(end - begin for begin, end in cuts)
    wanted = -(-options.threads * options.request_bytes * len(cuts) // total) if total else 0
    return min(MORE_WORKERS * options.threads, max(options.threads, wanted))


def span_of(begin: int, shape: tuple[int, ...], itemsize: int, index: Sequence[slice | int]) -> tuple[int, int, int]:
    """(first byte, end byte, bytes) of `tensor[index]` (basic slices of step 1 and ints over the leading dims)
    for a row-major tensor of `shape` at file byte `begin`: the span covering every element it selects,
    and how many bytes of that span it selects. (begin, begin, 0) when it selects nothing."""
    low = high = 0
    count, stride = 1, itemsize
    bounds = list(index) + [slice(None)] * (len(shape) - len(index))
    for size, cut in reversed(list(zip(shape, bounds))):
        start, stop = (cut, cut + 1) if isinstance(cut, int) else cut.indices(size)[:2]
        if stop <= start:
            return begin, begin, 0
        low, high, count = low + start * stride, high + (stop - 1) * stride, count * (stop - start)
        stride *= size
    return begin + low, begin + high + itemsize, count * itemsize


class FileReader:
    """File bytes into memory, shared by worker threads: direct (O_DIRECT, where the file system takes it) when
    `direct`, except bytes the page cache holds already (a buffered read copies them from memory; a direct one
    would fetch them from storage again); one descriptor per file and mode."""

    def __init__(self, direct: bool) -> None:
        self.direct = direct and bool(DIRECT)
        self.pages = PageCache()
        self._fds: dict[tuple[Path, bool], int] = {}

    def read(self, path: Path, begin: int, view: memoryview) -> int:
        """`view` filled from byte `begin` of `path` (short only at the end of the file); the bytes read."""
        direct = self.direct and not self.pages.holds(path, begin, begin + len(view))
        try:
            return read_fully(self.fd(path, direct), view, begin, direct)
        except OSError:
            if not direct:
                raise
            return read_fully(self.fd(path, False), view, begin)

    def fd(self, path: Path, direct: bool) -> int:
        """A shared descriptor of `path` (O_DIRECT with `direct`, when the file system takes it)."""
        key = (path, direct)
        if key not in self._fds:
            try:
                fd = os.open(path, os.O_RDONLY | (DIRECT if direct else 0))
            except OSError:
                if not direct:
                    raise
                fd = self.fd(path, False)
            self._fds.setdefault(key, fd)
        return self._fds[key]

    def close(self) -> None:
        for fd in set(self._fds.values()):
            os.close(fd)
        self._fds.clear()
        self.pages.close()


class ReadAhead:
    """Reads `groups` of `PlannedRange`s (one a layer, in use order) ahead of the caller (module table)."""

    def __init__(self, groups: Sequence[Sequence[PlannedRange]], options: ReadOptions, *, pin: bool = False) -> None:
        self.options = options
        planned = sum(r.end - r.begin for group in groups for r in group)
        self.groups = list(groups) if options.enabled and planned >= options.min_bytes else []
        self._workers = ThreadPoolExecutor(workers(self.groups, options), thread_name_prefix="wna16-read") \
            if self.groups else None
        self._buffers = BufferPool(pin)
        self._regions: dict[int, list[Region]] = {}  # group -> its regions, while submitted and not released
        self._held: dict[int, torch.Tensor] = {}  # group -> the buffer its regions are carved out of
        self._files: dict[Path, tuple[list[int], list[Region]]] = {}  # path -> (begins, regions), sorted
        self._reader = FileReader(options.direct)
        self._fills: list[Future[None]] = []
        self._submitted = 0
        self._scratch = threading.local()
        self._step = max(ALIGN, options.request_bytes // ALIGN * ALIGN)

    window_bytes = 0  # (a node's read reports its shared window here)

    @property
    def buffer_bytes(self) -> int:
        """Memory of this rank's own read-ahead buffers (made as needed, then reused: `storage/buffers.py`)."""
        return self._buffers.allocated

    @property
    def active(self) -> bool:
        """Whether anything is read ahead (False: every read goes through the mapping)."""
        return bool(self.groups)

    def start(self, group: int) -> None:
        """Group `group` is about to be read: it and the `options.depth` groups after it are submitted, and the
        buffers of the groups before it go back to the pool (their views must no longer be used)."""
        if not self.groups:
            return
        for done in [g for g in self._regions if g < group]:  # first: their buffers serve the groups submitted now
            for region in self._regions.pop(done):
                region.wait()
            if len(buffer := self._held.pop(done)):  # (a group the page cache held whole had none)
                self._buffers.release(buffer)
        while self._submitted < min(group + 1 + self.options.depth, len(self.groups)):
            self._submit(self._submitted)
            self._submitted += 1
        self._reindex()

    def covering(self, path: Path, low: int, high: int) -> Region | None:
        """The region of `path` holding bytes [low, high), once its reads are done; None when none does."""
        found = self._files.get(path)
        if found is None:
            return None
        at = bisect.bisect_right(found[0], low) - 1
        if at < 0 or found[1][at].end < high:
            return None
        region = found[1][at]
        region.wait()
        return region

    def overlaps(self, path: Path, low: int, high: int) -> bool:
        """Whether a region of `path` submitted and not released holds any of file bytes [low, high)."""
        return overlapping(self._files, path, low, high)

    def _submit(self, group: int) -> None:
        own, shared = _by_kind(self.groups[group])
        spans = [(path, begin // ALIGN * ALIGN, end) for path, ranges in own.items()
                 for begin, end in coalesced(ranges, self.options.gap_bytes)
                 if not self._reader.pages.holds(path, begin, end)]  # (spans cached whole: the mapping reads them)
        self._regions[group], self._held[group] = self._regions_of(spans)
        for path, ranges in shared.items():
            for begin, end in coalesced(ranges, self.options.gap_bytes):
                self._fills += [self._workers.submit(self._fill, path, *piece)
                                for piece in pieces(begin, end, self._step)]

    def _regions_of(self, spans: list[tuple[Path, int, int]]) -> tuple[list[Region], torch.Tensor]:
        """A region of each span of file bytes [begin, end) (begin aligned), carved out of one buffer for them
        all (`storage/buffers.py`), their requests submitted; and that buffer."""
        lengths = [-(-(end - begin) // ALIGN) * ALIGN for _, begin, end in spans]
        buffer = self._buffers.take(sum(lengths)) if spans else torch.empty(0, dtype=torch.uint8)
        regions, at = [], 0
        for (path, begin, end), length in zip(spans, lengths):
            region = Region(path, begin, end, buffer[at:at + length])
            region.futures = [self._workers.submit(self._read, region, piece, stop)
                              for piece, stop in pieces(begin, begin + length, self._step)]
            regions.append(region)
            at += length
        return regions, buffer

    def _reindex(self) -> None:
        files: dict[Path, list[Region]] = {}
        for regions in self._regions.values():
            for region in regions:
                files.setdefault(region.path, []).append(region)
        self._files = {path: ([r.begin for r in found], found)
                       for path, found in ((p, sorted(rs, key=lambda r: r.begin)) for p, rs in files.items())}

    def _read(self, region: Region, begin: int, end: int) -> None:
        """File bytes [begin, end) into the region's buffer (`FileReader`: direct unless already cached)."""
        self._reader.read(region.path, begin, memoryview(region.buffer.numpy())[begin - region.begin:end - region.begin])

    def _fill(self, path: Path, begin: int, end: int) -> None:
        """File bytes [begin, end) into the page cache (read into a scratch buffer and dropped, or advised)."""
        if self.options.fill is CacheFill.ADVISE:  # in calls the kernel reads whole (storage/advice.py)
            will_need(self._reader.fd(path, False), begin, end, advice_bytes(path))
            return
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None:
            scratch = self._scratch.buffer = bytearray(self._step)
        read_fully(self._reader.fd(path, False), memoryview(scratch)[:end - begin], begin)

    def fail(self, error: BaseException) -> None:
        """The load stopped on `error`: requests not started yet are dropped now (`close` waits for the
        running ones)."""
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop reading ahead (requests not started are dropped), wait for those running, close the files."""
        if self._workers is not None:
            self._workers.shutdown(wait=True, cancel_futures=True)
        self._regions.clear()
        self._held.clear()
        self._files.clear()
        self._reader.close()


def overlapping(files: dict[Path, tuple[list[int], list[Region]]], path: Path, low: int, high: int) -> bool:
    """Whether a region of `path` in `files` (path -> begins and regions, sorted and disjoint) holds any of
    file bytes [low, high)."""
    found = files.get(path)
    at = -1 if found is None else bisect.bisect_left(found[0], high) - 1
    return at >= 0 and found[1][at].end > low


def read_fully(fd: int, view: memoryview, at: int, direct: bool = False) -> int:
    """Fill `view` from byte `at` of `fd`, stopping early only at the end of the file (a direct read that
    comes back short has reached it: its next offset would not be aligned); the bytes read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], at + done)
        if got <= 0 or (direct and got % ALIGN):
            return done + max(got, 0)
        done += got
    return done


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as one flat uint8 view of its memory (no copy)."""
    return tensor.view(-1).view(torch.uint8)

