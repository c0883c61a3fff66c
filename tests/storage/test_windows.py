"""storage/windows.py: a node's planned ranges packed into windows and dealt to the ranks as stripes (hypothesis
properties: every planned byte once, each window as if its groups' ranges were coalesced together)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from wna16_loader.storage.readahead import ALIGN, PlannedRange
from wna16_loader.storage.windows import placed, stripe, windows_of

FILES = [Path("/f/a.safetensors"), Path("/f/b.safetensors")]


@st.composite
def layer_groups(draw: st.DrawFn) -> list[list[PlannedRange]]:
    groups = []
    for _ in range(draw(st.integers(1, 6))):
        group = []
        for _ in range(draw(st.integers(0, 5))):
            begin = draw(st.integers(0, 1 << 20))
            group.append(PlannedRange(draw(st.sampled_from(FILES)), begin, begin + draw(st.integers(1, 1 << 18)),
                                      draw(st.booleans())))
        groups.append(group)
    return groups


def covered(spans: list[tuple[Path, int, int]]) -> set[tuple[Path, int]]:
    """The ALIGN-sized pages of `spans`."""
    return {(path, page) for path, begin, end in spans for page in range(begin // ALIGN, -(-end // ALIGN))}


@settings(max_examples=60, deadline=None)
@given(layer_groups(), st.integers(1, 1 << 20), st.integers(1, 8), st.sampled_from([ALIGN, 4 * ALIGN, 64 * ALIGN]))
def test_windows_and_stripes_cover_every_planned_byte_once(groups: list[list[PlannedRange]], window_bytes: int,
                                                           ranks: int, request: int) -> None:
    windows, part = windows_of(groups, window_bytes, gap=ALIGN)
    assert [(w.first, w.stop) for w in windows][0][0] == 0 and windows[-1].stop == len(groups)
    assert all(a.stop == b.first for a, b in zip(windows, windows[1:]))
    for window in windows:
        assert window.nbytes <= part and part % ALIGN == 0
        assert window.spans == placed([r for g in groups[window.first:window.stop] for r in g], ALIGN)[0]
        planned = covered([(r.file, r.begin, r.end) for g in groups[window.first:window.stop] for r in g])
        assert covered([(s.path, s.begin, s.end) for s in window.spans]) >= planned
        requests = [r for rank in range(ranks) for r in stripe(window, rank, ranks, request)]
        assert sorted((r.offset, r.end - r.begin) for r in requests) == sorted(
            (s.offset + at - s.begin, min(request, s.end - at)) for s in window.spans for at in range(s.begin, s.end,
                                                                                                      request))
        assert sum(r.end - r.begin for r in requests) == window.nbytes
        assert all(r.begin % ALIGN == 0 and r.offset % ALIGN == 0 and r.end - r.begin <= request for r in requests)


def test_placed_lays_coalesced_spans_back_to_back() -> None:
    a, b = FILES
    spans, nbytes = placed([PlannedRange(a, 5000, 6000, False), PlannedRange(a, 100, 200, True),
                            PlannedRange(b, 3 * ALIGN, 3 * ALIGN + 1, False)], gap=ALIGN)
    assert [(s.path, s.begin, s.end, s.offset) for s in spans] == [
        (a, 0, 2 * ALIGN, 0), (b, 3 * ALIGN, 4 * ALIGN, 2 * ALIGN)]
    assert nbytes == 3 * ALIGN


def test_a_layer_larger_than_a_part_of_the_window_grows_the_part() -> None:
    group = [PlannedRange(FILES[0], 0, 10 * ALIGN, False)]
    windows, part = windows_of([group, [PlannedRange(FILES[1], 0, ALIGN, True)]], window_bytes=4 * ALIGN, gap=0)
    assert part == 10 * ALIGN and [(w.first, w.stop) for w in windows] == [(0, 1), (1, 2)]
