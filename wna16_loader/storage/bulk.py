"""Building many small Python objects at once, with the cyclic garbage collector paused meanwhile.

An index, scan or plan of a real checkpoint makes hundreds of thousands of small containers (header
entries, tensor refs, name keys, ledger slots), none of them in a reference cycle. With the collector
on, every few ten thousand survivors set off a full collection that walks every object of the process
(an imported torch alone is ~180k), so the cost grows with the checkpoint times everything else the
process holds. Paused, the new objects are examined once, by the first collection after the pause.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


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
