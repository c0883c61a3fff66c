"""Read-ahead of planned byte ranges (storage/readahead.py): the views a reader gets while a `ReadAhead`
overlays a file hold exactly the bytes of the file's mapping, whatever the requests' size, the gaps bridged,
the grouping of ranges into layers and the mix of own and shared ranges; the rank's own bytes come from
buffers of its own (not the mapping), and O_DIRECT refused by the file system falls back to buffered reads.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from wna16_loader.errors import WNA16Error
from wna16_loader.parallel import Node
from wna16_loader.storage import readahead
from wna16_loader.storage.advice import PageCache
from wna16_loader.storage.buffers import size_class
from wna16_loader.storage.filemap import MappedFile, gather, grid_view, stacked_view
from wna16_loader.storage.index import ITEMSIZES
from wna16_loader.storage.readahead import (
    ALIGN,
    CacheFill,
    PlannedRange,
    ReadAhead,
    ReadOptions,
    coalesced,
    overlapping,
    pieces,
    span_of,
    workers,
)

ROWS, COLS = 40, 300  # 40 int32 tensors of [ROWS, COLS]: 48,000 bytes each, at offsets that are not page-aligned


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """One safetensors file of identifiable int32 words (tensor t, element i holds t * 1e6 + i)."""
    path = tmp_path_factory.mktemp("readahead") / "model.safetensors"
    tensors = {f"t{t:02d}": torch.arange(ROWS * COLS, dtype=torch.int32).reshape(ROWS, COLS) + t * 1_000_000
               for t in range(40)}
    save_file(tensors, str(path))
    return path, tensors


def evict(path: Path) -> bool:
    """Drop `path`'s pages from the page cache; whether they are gone (some file systems keep them). Dropped
    again until two looks 20 ms apart count the same pages: reads an earlier example left in flight (pages
    under I/O survive a drop) must not land between a test's look at the cache and its read-ahead's own."""
    probe = ReadAhead([], ReadOptions())
    size, seen = path.stat().st_size, None
    try:
        for _ in range(50):
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            found = probe._reader.pages.resident(path, 0, size)[0]
            if found == seen:
                break
            seen = found
            time.sleep(0.02)
        return not seen
    finally:
        probe.close()


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[list[tuple[str, slice, slice, bool]]], ReadOptions]:
    """Groups of (tensor, rows, columns, shared) reads and the options they are read ahead with."""
    groups = []
    for _ in range(draw(st.integers(1, 4))):
        reads = []
        for _ in range(draw(st.integers(1, 6))):
            r0 = draw(st.integers(0, ROWS - 1))
            c0 = draw(st.integers(0, COLS - 1))
            rows = slice(r0, draw(st.integers(r0 + 1, ROWS)))
            cols = draw(st.sampled_from([slice(None), slice(c0, draw(st.integers(c0 + 1, COLS)))]))
            reads.append((f"t{draw(st.integers(0, 39)):02d}", rows, cols, draw(st.booleans())))
        groups.append(reads)
    options = ReadOptions(threads=draw(st.integers(1, 4)), request_bytes=ALIGN * draw(st.integers(1, 40)),
                          gap_bytes=draw(st.sampled_from([0, 1, 5000, 1 << 20])), ahead=draw(st.integers(1, 3)),
                          direct=draw(st.booleans()), min_bytes=0, fill=draw(st.sampled_from(list(CacheFill))))
    return groups, options


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans())
def test_views_hold_the_mapping_bytes_in_any_chunking(checkpoint, plan) -> None:
    path, tensors = checkpoint
    groups, options = plan
    mapped = MappedFile(path, ITEMSIZES)
    planned = []
    for reads in groups:
        ranges = []
        for name, rows, cols, shared in reads:
            (shape, _), begin = mapped.entries.shape_dtype(name), mapped.entries.begin(name)
            low, high, _ = span_of(begin, shape, 4, (rows, cols))
            ranges.append(PlannedRange(path, low, high, shared))
        planned.append(ranges)
    ahead = ReadAhead(planned, options)
    mapped.overlay = ahead
    pages = PageCache()
    try:
        if options.direct:  # else warm: the mapping's own reads are checked
            evict(path)
        # the first group's own ranges the page cache does not hold whole come from a buffer of the read-ahead's
        # own, not the file's pages (pages still mapped somewhere survive the eviction: those the mapping reads;
        # later groups may find pages that earlier reads cached)
        cold = [options.direct and not pages.holds(path, r.begin, r.end) for r in planned[0]] if planned else []
        for number, reads in enumerate(groups):
            ahead.start(number)
            own_only = not any(shared for *_, shared in reads)
            for i, (name, rows, cols, _) in enumerate(reads):
                begin = mapped.entries.begin(name)
                got = mapped.view(begin, (ROWS, COLS), torch.int32, (rows, cols))
                assert torch.equal(got, tensors[name][rows, cols])
                if own_only and number == 0 and cold[i]:
                    assert got.untyped_storage().data_ptr() != mapped.flat(torch.uint8, 0).data_ptr()
    finally:
        mapped.overlay = None
        ahead.close()
        pages.close()


@contextmanager
def overlaid(mapped: MappedFile, planned: list[PlannedRange]) -> Iterator[ReadAhead]:
    """`mapped`'s file evicted and `planned` (one group, no gaps bridged) read ahead as its overlay, started."""
    ahead = ReadAhead([planned], ReadOptions(min_bytes=0, gap_bytes=0))
    mapped.overlay = ahead
    try:
        if not evict(mapped.path):
            pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED: no read ahead of cached bytes")
        ahead.start(0)
        yield ahead
    finally:
        mapped.overlay = None
        ahead.close()


def test_experts_in_two_regions_are_stacked_from_each(checkpoint) -> None:
    """A stacked view over tensors 0 and 2 (evenly spaced) when only those two are read ahead, in two
    regions: each row comes from its region, none from the mapping, the elements those of the file."""
    path, tensors = checkpoint
    mapped = MappedFile(path, ITEMSIZES)
    begins = [mapped.entries.begin(name) for name in ("t00", "t02")]
    nbytes = ROWS * COLS * 4
    with overlaid(mapped, [PlannedRange(path, b, b + nbytes, False) for b in begins]):
        step = (begins[1] - begins[0]) // 4
        first = mapped.mapped(begins[0], (ROWS, COLS), torch.int32)
        both = mapped.rebased(first.as_strided((2, ROWS, COLS), (step, COLS, 1), first.storage_offset()))
        assert torch.equal(both, torch.stack([tensors["t00"], tensors["t02"]]))
        assert both.untyped_storage().data_ptr() != mapped.flat(torch.uint8, 0).data_ptr()


def test_a_stacked_view_over_two_regions_is_none_and_never_a_copy(checkpoint) -> None:
    """Tensors 0 and 2 read ahead alone (two regions: an EP rank's experts 2 and 3 lie 11 experts apart in a file
    whose writer sorts names): no one strided view holds both, so `stacked_view` says None (its callers then view
    or gather each expert) rather than stacking a copy into fresh memory; tensors 0 and 1 in one region are one
    view of it."""
    path, tensors = checkpoint
    mapped = MappedFile(path, ITEMSIZES)
    nbytes = ROWS * COLS * 4
    ranges = [(name, mapped.entries.begin(name)) for name in ("t00", "t01", "t02")]
    with overlaid(mapped, [PlannedRange(path, ranges[0][1], ranges[1][1] + nbytes, False),
                           PlannedRange(path, ranges[2][1], ranges[2][1] + nbytes, False)]) as ahead:
        picked = (slice(3, 9), slice(10, 40))
        assert stacked_view(mapped, [ranges[0][1], ranges[2][1]], (ROWS, COLS), torch.int32, picked) is None
        near = stacked_view(mapped, [ranges[0][1], ranges[1][1]], (ROWS, COLS), torch.int32, picked)
        assert torch.equal(near, torch.stack([tensors["t00"][picked], tensors["t01"][picked]]))
        region = ahead.covering(path, ranges[0][1], ranges[1][1] + nbytes)
        assert near.untyped_storage().data_ptr() == region.buffer.untyped_storage().data_ptr()
        got = gather(mapped, [ranges[0][1], ranges[2][1]], (ROWS, COLS), torch.int32, picked)
        assert torch.equal(got, torch.stack([tensors["t00"][picked], tensors["t02"][picked]]))


@pytest.mark.parametrize("read", ((("t00", "t03"),), (("t00", "t00"), ("t03", "t03"))))
def test_a_gather_on_a_grid_reads_the_overlay(checkpoint, read) -> None:
    """Tensors 0, 2 and 3 lie on the grid of one tensor's bytes (not evenly spaced): read ahead in one region
    (tensors 0 to 3), their rows come from that region's buffer; in two regions that each hold part of the grid
    (tensor 0, tensor 3), view by view (tensor 2 from the mapping). The elements are the file's either way."""
    path, tensors = checkpoint
    mapped = MappedFile(path, ITEMSIZES)
    nbytes, names = ROWS * COLS * 4, ("t00", "t02", "t03")
    planned = [PlannedRange(path, mapped.entries.begin(a), mapped.entries.begin(b) + nbytes, False) for a, b in read]
    with overlaid(mapped, planned):
        picked = (slice(1, 5), slice(7, 20))
        begins = [mapped.entries.begin(n) for n in names]
        got = gather(mapped, begins, (ROWS, COLS), torch.int32, picked)
        assert torch.equal(got, torch.stack([tensors[n][picked] for n in names]))
        if len(read) == 1:
            view, rows = grid_view(mapped, begins, (ROWS, COLS), torch.int32, picked)
            assert rows.tolist() == [0, 2, 3]
            assert view.untyped_storage().data_ptr() != mapped.flat(torch.uint8, 0).data_ptr()
        else:
            assert grid_view(mapped, begins, (ROWS, COLS), torch.int32, picked) is None


def test_direct_io_refused_falls_back_to_buffered(checkpoint, monkeypatch) -> None:
    """A file system that refuses O_DIRECT (tmpfs, some FUSE mounts: EINVAL at open) is read buffered."""
    path, tensors = checkpoint
    real_open, refused = os.open, []

    def refusing(file, flags, *args):
        if flags & readahead.DIRECT:
            refused.append(file)
            raise OSError(22, "Invalid argument")
        return real_open(file, flags, *args)

    cold = evict(path)  # out of the page cache, so that the read is direct

    monkeypatch.setattr(readahead, "DIRECT", os.O_DIRECT if hasattr(os, "O_DIRECT") else 0o40000)
    monkeypatch.setattr(readahead.os, "open", refusing)
    mapped = MappedFile(path, ITEMSIZES)
    begin = mapped.entries.begin("t05")
    ahead = ReadAhead([[PlannedRange(path, begin, begin + ROWS * COLS * 4, False)]], ReadOptions(min_bytes=0))
    mapped.overlay = ahead
    try:
        ahead.start(0)
        got = mapped.view(begin, (ROWS, COLS), torch.int32)
        assert torch.equal(got, tensors["t05"])
        if cold:
            assert refused == [path]
            assert got.untyped_storage().data_ptr() != mapped.flat(torch.uint8, 0).data_ptr()
    finally:
        mapped.overlay = None
        ahead.close()


@pytest.mark.parametrize("node,beyond", [(None, 2), (Node((0, 1), 0, "readahead-depth"), 1)], ids=["alone", "node"])
def test_a_rank_of_a_node_keeps_fewer_layers_in_flight(checkpoint, node, beyond) -> None:
    """Alone, a rank keeps `ahead` groups (2) in flight beyond the one it is on; a rank of a node of several ranks
    reading its own ranges keeps `node_ahead` (1): the ranks keep the storage busy together, and every group more
    is fresh buffer memory in every rank."""
    path, _ = checkpoint
    mapped = MappedFile(path, ITEMSIZES)
    nbytes = ROWS * COLS * 4
    begins = [mapped.entries.begin(f"t{t:02d}") for t in (0, 10, 20, 30)]
    options = ReadOptions(min_bytes=0, gap_bytes=0, node=node)
    ahead = ReadAhead([[PlannedRange(path, b, b + nbytes, False)] for b in begins], options)
    try:
        if not evict(path):
            pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED: no read ahead of cached bytes")
        ahead.start(0)
        assert options.depth == beyond
        assert [ahead.overlaps(path, b, b + nbytes) for b in begins] == [i <= beyond for i in range(4)]
        ahead.start(1)
        assert [ahead.overlaps(path, b, b + nbytes) for b in begins] == [0 < i <= 1 + beyond for i in range(4)]
    finally:
        ahead.close()


def test_a_group_reads_into_one_buffer_and_three_groups_hold_all_the_memory(checkpoint) -> None:
    """Each group's regions are carved out of one buffer of its own; reading ahead by `ahead` (2), the buffers of
    the groups done go back before the next are taken, so the load makes buffers for 3 groups once, and later
    groups of about the same size (`size_class`) reuse them."""
    path, tensors = checkpoint
    mapped = MappedFile(path, ITEMSIZES)
    nbytes = ROWS * COLS * 4
    groups = [[PlannedRange(path, mapped.entries.begin(f"t{t:02d}"), mapped.entries.begin(f"t{t:02d}") + nbytes,
                            False) for t in (g, g + 20)] for g in range(8)]  # (two tensors far apart: 2 regions)
    ahead = ReadAhead(groups, ReadOptions(min_bytes=0, gap_bytes=0, request_bytes=ALIGN))
    mapped.overlay = ahead
    try:
        if not evict(path):
            pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED: no read ahead of cached bytes")
        largest = 0
        for g in range(8):
            ahead.start(g)
            first, second = (ahead.covering(path, r.begin, r.end) for r in groups[g])
            assert second.buffer.data_ptr() == first.buffer.data_ptr() + len(first.buffer)  # one buffer
            view = mapped.view(groups[g][1].begin, (ROWS, COLS), torch.int32)
            assert view.data_ptr() == second.buffer.data_ptr() + groups[g][1].begin - second.begin
            assert torch.equal(view, tensors[f"t{g + 20:02d}"])
            largest = max(largest, sum(-(-(r.end - r.begin // ALIGN * ALIGN) // ALIGN) * ALIGN for r in groups[g]))
        assert ahead.buffer_bytes == 3 * size_class(largest)
    finally:
        mapped.overlay = None
        ahead.close()


def test_small_or_disabled_loads_read_through_the_mapping(checkpoint) -> None:
    path, _ = checkpoint
    ranges = [[PlannedRange(path, 0, 1000, False)]]
    assert not ReadAhead(ranges, ReadOptions()).active  # under min_bytes
    assert not ReadAhead(ranges, ReadOptions(min_bytes=0, enabled=False)).active
    assert ReadAhead(ranges, ReadOptions(min_bytes=0)).active


@given(ranges=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 300)), max_size=20),
       gap=st.integers(0, 500))
def test_coalesced_covers_every_range_and_bridges_only_short_gaps(ranges, gap) -> None:
    spans = [(begin, begin + length) for begin, length in ranges]
    merged = coalesced(spans, gap)
    assert all(a < b for a, b in merged) and all(b1 + gap <= a2 for (_, b1), (a2, _) in zip(merged, merged[1:]))
    assert all(any(a <= b0 and e0 <= b for a, b in merged) for b0, e0 in spans if e0 > b0)
    covered = {i for b0, e0 in spans for i in range(b0, e0)}
    for a, b in merged:  # every byte of a span is read, or lies in a bridged gap shorter than `gap`
        assert a in covered and b - 1 in covered
        missing = sorted(set(range(a, b)) - covered)
        runs = [m for i, m in enumerate(missing) if i == 0 or missing[i - 1] != m - 1]
        assert len(missing) <= len(runs) * max(gap - 1, 0)


@given(spans=st.lists(st.integers(1, 300), min_size=1, max_size=8, unique=True), low=st.integers(0, 40_000),
       length=st.integers(1, 5_000))
def test_overlapping_finds_a_region_holding_any_byte_of_a_range(spans, low, length) -> None:
    regions = [readahead.Region(Path("f"), 100 * at, 100 * at + 60, torch.empty(0, dtype=torch.uint8))
               for at in sorted(spans)]  # disjoint, sorted, 40 bytes apart
    files = {Path("f"): ([r.begin for r in regions], regions)}
    expected = any(r.begin < low + length and low < r.end for r in regions)
    assert overlapping(files, Path("f"), low, low + length) == expected
    assert not overlapping(files, Path("g"), low, low + length)


@given(begin=st.integers(0, 10_000), length=st.integers(0, 100_000), size=st.integers(64, 9_000))
def test_pieces_tile_the_span(begin, length, size) -> None:
    cut = pieces(begin, begin + length, size)
    assert [a for a, _ in cut[1:]] == [b for _, b in cut[:-1]]
    assert (cut[0][0], cut[-1][1]) == (begin, begin + length) if length else cut == []
    assert all(0 < b - a <= size for a, b in cut)


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data())
def test_span_of_is_the_extent_of_the_selected_elements(shape, data) -> None:
    tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).reshape(shape)
    index = []
    for size in shape[:data.draw(st.integers(0, len(shape)))]:
        start = data.draw(st.integers(0, size - 1))
        index.append(data.draw(st.sampled_from([start, slice(start, data.draw(st.integers(start, size)))])))
    picked = tensor[tuple(index)]
    low, high, nbytes = span_of(100, tuple(shape), 4, index)
    if not picked.numel():
        assert (low, high, nbytes) == (100, 100, 0)
        return
    assert (low, high, nbytes) == (100 + 4 * int(picked.min()), 100 + 4 * int(picked.max()) + 4, 4 * picked.numel())


def test_options_refuse_sizes_that_cannot_work() -> None:
    with pytest.raises(WNA16Error, match=r"^ReadOptions: threads=0 but at least 1 is needed \(one request in "
                                         r"flight\); pass threads>=1\.$"):
        ReadOptions(threads=0)
    with pytest.raises(WNA16Error, match=r"ReadOptions: request_bytes=100 but at least 4096 is needed \(a request "
                                         r"is whole 4096-byte pages\); pass request_bytes>=4096\."):
        ReadOptions(request_bytes=100)
    with pytest.raises(WNA16Error, match=r"^ReadOptions: node_ahead=0 but at least 1 is needed \(the next layer "
                                         r"read ahead\); pass node_ahead>=1\.$"):
        ReadOptions(node_ahead=0)


def test_short_requests_get_more_workers_to_keep_the_bytes_in_flight() -> None:
    """`threads` requests in flight for full-size requests; where the rank's own runs are short on average (an EP
    rank's scattered experts), enough more to keep `threads` full requests' bytes in flight, at most MORE_WORKERS
    times as many; shared ranges (advice calls) and groups after the first with own ranges are not counted."""
    file, mib = Path("/f/model.safetensors"), 1 << 20
    options = ReadOptions(threads=8, request_bytes=16 * mib, gap_bytes=0)
    whole = [PlannedRange(file, 0, 64 * mib, False)]  # four full requests
    runs = lambda size, count: [PlannedRange(file, 2 * i * size, (2 * i + 1) * size, False)  # noqa: E731
                                for i in range(count)]
    assert workers([whole], options) == 8
    assert workers([[], runs(4 * mib, 6)], options) == 32  # 4 MiB each: 8 * 16 / 4
    assert workers([runs(8 * mib, 6), runs(mib, 6)], options) == 16  # the first group with own ranges
    assert workers([runs(mib, 6)], options) == 32  # at most 4 x 8
    assert workers([[r._replace(shared=True) for r in runs(mib, 6)] + whole], options) == 8
    assert workers([], options) == 8
