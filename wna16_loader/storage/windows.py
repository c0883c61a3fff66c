"""A node's planned byte ranges packed into windows (pure arithmetic, for `storage.node`).

| placed(ranges, gap)        | ranges coalesced file by file and laid back to back: (spans, bytes)          |
| windows_of(groups, ...)    | consecutive groups (layers) packed into windows of at most one part each     |
|                            | (`WindowPlan`: what every rank of a node reads by, local rank 0's to share)   |
| stripe(window, rank, ...)  | a rank's requests of a window: its spans cut into requests, dealt round-robin |
| encoded(plan) / decoded(b) | a `WindowPlan` (or None) as JSON bytes, and back (what local rank 0 hands on)  |
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Sequence

from .readahead import ALIGN, PlannedRange, coalesced, pieces

PARTS = 3  # a node's window file holds this many windows: one read while the ranks convert another, and a third
#            read ahead, so that a read that runs late (a slower rank, a slower request) does not stall the node


class Placed(NamedTuple):
    """File bytes [begin, end) of `path` (begin aligned) at byte `offset` of a window's part."""

    path: Path
    begin: int
    end: int
    offset: int


class Window(NamedTuple):
    """Groups [first, stop) read together into one part: `spans` in part order, `nbytes` long."""

    first: int
    stop: int
    spans: tuple[Placed, ...]
    nbytes: int


class WindowPlan(NamedTuple):
    """A node's read: its `windows` in use order, each read into a part of `part` bytes (of PARTS)."""

    windows: tuple[Window, ...]
    part: int


def placed(ranges: Sequence[PlannedRange | Placed], gap: int) -> tuple[tuple[Placed, ...], int]:
    """`ranges` (or spans placed before) coalesced file by file (begins aligned down, ends up) and laid one
    after another: the spans and the bytes they take."""
    spans, at = [], 0
    by_file: dict[Path, list[tuple[int, int]]] = {}
    for path, begin, end, _ in ranges:
        found = by_file.get(path)
        (found if found is not None else by_file.setdefault(path, [])).append(
            (begin // ALIGN * ALIGN, -(-end // ALIGN) * ALIGN))
    for path in sorted(by_file):
        for begin, end in coalesced(by_file[path], gap):
            spans.append(Placed(path, begin, end, at))
            at += end - begin
    return tuple(spans), at


def windows_of(groups: Sequence[Sequence[PlannedRange]], window_bytes: int, gap: int) -> WindowPlan:
    """Consecutive groups packed into windows of at most one part each (`window_bytes` // PARTS, grown to the
    largest group where one does not fit): the windows and the part's size. (Each group is coalesced once;
    a window coalesces its groups' spans.)"""
    each = [placed(g, gap) for g in groups]
    part = max(window_bytes // PARTS // ALIGN * ALIGN, max((nbytes for _, nbytes in each), default=0), ALIGN)
    out: list[Window] = []
    first = 0
    together = lambda first, stop: placed([s for spans, _ in each[first:stop] for s in spans], gap)  # noqa: E731
    for stop in range(1, len(groups) + 1):
        if together(first, stop)[1] > part:
            out.append(Window(first, stop - 1, *together(first, stop - 1)))
            first = stop - 1
        if stop == len(groups):
            out.append(Window(first, stop, *together(first, stop)))
    return WindowPlan(tuple(out), part)


def stripe(window: Window, local_rank: int, ranks: int, request_bytes: int) -> list[Placed]:
    """This rank's requests of `window`: its spans cut into requests of at most `request_bytes`, dealt
    round-robin to the node's ranks."""
    requests = [Placed(s.path, begin, end, s.offset + begin - s.begin)
                for s in window.spans for begin, end in pieces(s.begin, s.end, request_bytes)]
    return requests[local_rank::ranks]


def encoded(plan: WindowPlan | None) -> bytes:
    """`plan` (None: nothing read together) as JSON bytes, each file's path written once."""
    if plan is None:
        return b"null"
    paths = sorted({str(span.path) for window in plan.windows for span in window.spans})
    number = {path: i for i, path in enumerate(paths)}
    windows = [[w.first, w.stop, w.nbytes, [[number[str(s.path)], s.begin, s.end, s.offset] for s in w.spans]]
               for w in plan.windows]
    return json.dumps({"part": plan.part, "paths": paths, "windows": windows}).encode()


def decoded(data: bytes) -> WindowPlan | None:
    """The `WindowPlan` (or None) `encoded` wrote (one `Path` per file)."""
    found = json.loads(data)
    if found is None:
        return None
    paths = [Path(path) for path in found["paths"]]
    return WindowPlan(tuple(Window(first, stop, tuple(Placed(paths[at], begin, end, offset)
                                                      for at, begin, end, offset in spans), nbytes)
                            for first, stop, nbytes, spans in found["windows"]), found["part"])
