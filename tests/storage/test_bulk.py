"""bulk.gc_paused: the cyclic GC is off inside the block and back as it was after, errors included."""

from __future__ import annotations

import gc

import pytest

from wna16_loader.storage.bulk import gc_paused


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
