"""bulk.gc_paused: the cyclic GC is off inside the block and back as it was after, errors included; paused_gc_call
frees the call's own objects before it is back."""

from __future__ import annotations

import gc

import pytest

from wna16_loader.storage.bulk import gc_paused, paused_gc_call


def test_paused_inside_and_back_on_after() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner block leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_back_on_after_an_error() -> None:
    with pytest.raises(KeyError):
        with gc_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_a_callers_own_disable_is_left_alone() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_paused_call_frees_its_frame_before_the_gc_is_back() -> None:
    """What only the call held is freed while the GC is still paused: the first collection after it sees none
    of it (a load's index, scan and plans), only what the call returns."""
    freed_with_gc_on: list[bool] = []

    class Held:
        def __del__(self) -> None:
            freed_with_gc_on.append(gc.isenabled())

    @paused_gc_call
    def build(count: int) -> int:
        held = [Held() for _ in range(count)]
        assert not gc.isenabled()
        return len(held)

    assert build(3) == 3
    assert freed_with_gc_on == [False] * 3 and gc.isenabled()
