"""Building many small Python objects at once, with the cyclic garbage collector paused meanwhile.

An index, scan or plan of a real checkpoint makes hundreds of thousands of small containers (header
entries, tensor refs, name keys, ledger slots), none of them in a reference cycle. With the collector
on, every few ten thousand survivors set off a full collection that walks every object of the process
(an imported torch alone is ~180k), so the cost grows with the checkpoint times everything else the
process holds. Paused, the new objects still alive when the pause ends are examined once, by the first
collection after it: a load that builds and drops them all runs whole inside one function under
`paused_gc_call`, so that its locals are gone before the collector is back and that collection sees only
what the function returns.
"""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager
from typing import Callable, Iterator, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def gc_paused() -> Iterator[None]:
    """The block runs with the cyclic GC off; it is back on after (unless it was off before: nested
    pauses, or a caller's own `gc.disable()`, are left as they are)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def paused_gc_call(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` run under `gc_paused`, its frame (and every object only it held) freed before the GC is back on."""
    @functools.wraps(fn)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return fn(*args, **kwargs)
    return paused
