"""Checkpoint IO by header offsets: each safetensors file mapped once, tensors located from its header.

`MappedFile` maps a file read-only and parses its header (`header.py`: every entry's byte span checked
against its dtype and shape before anything is located). Reads are strided views over the one mapping of
a file: no per-tensor call into safetensors.

| MappedFile.view(begin, shape, dtype, index) | `index` of one tensor: a VIEW of the file pages        |
| gather(file, begins, shape, dtype, index)   | [E, *index shape]: `index` of E tensors, one COPY into |
|                                             | ordinary memory (or the caller's pinned `out`)         |
| stacked_view(file, begins, shape, dtype, i) | the same as one strided VIEW, when evenly spaced       |
| grid_view(file, begins, shape, dtype, i)    | one strided VIEW over the grid the offsets lie on, and |
|                                             | the row of each                                        |

A view keeps the mapping alive (it holds a reference) but is file memory: copy it into ordinary
(pinned) memory before keeping it or handing it to a device copy. While a `readahead.ReadAhead` is the
file's `overlay`, every view whose bytes one of its regions holds is made over that region's buffer
instead (`rebased`: the same elements, read ahead with large requests; valid until the overlay's next
`start`).
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from pathlib import Path
from typing import Sequence

import torch

from ..errors import CheckpointError
from .header import read_checked_header
from .readahead import ReadAhead, byte_view, read_fully

Index = tuple[slice | int, ...]


class MappedFile:
    """One safetensors file, mapped read-only once; its header parsed and checked (`header.py`)."""

    def __init__(self, path: Path, itemsizes: dict[str, int]) -> None:
        """`itemsizes`: bytes per element of every known dtype name (entries of other dtypes are kept
        unchecked, for the caller to refuse by name). The header is checked whole, as safetensors' own
        open checks it, and kept as parsed (`read_checked_header`: an index of thousands of tensors)."""
        self.path = path
        self.metadata, self.entries = read_checked_header(path, itemsizes)
        with open(path, "rb") as handle:
            self.size = os.fstat(handle.fileno()).st_size
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._flat: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self.overlay: ReadAhead | None = None

    def dtype_names(self) -> set[str]:
        """The dtype names of the header's entries."""
        return self.entries.dtype_names()

    def begins(self, names: Sequence[str]) -> list[int]:
        """The first byte of each of `names` in the file."""
        return self.entries.begins(names)

    def flat(self, dtype: torch.dtype, phase: int) -> torch.Tensor:
        """The whole file as a 1-D `dtype` view starting at byte `phase` (< itemsize)."""
        key = (dtype, phase)
        if key not in self._flat:
            count = (self.size - phase) // dtype.itemsize
            with warnings.catch_warnings():  # the mapping is read-only on purpose: writes would fault
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self._flat[key] = torch.frombuffer(self._map, dtype=dtype, count=count, offset=phase)
        return self._flat[key]

    def view(self, begin: int, shape: tuple[int, ...], dtype: torch.dtype, index: Index = ()) -> torch.Tensor:
        """`tensor[index]` of the tensor of `shape`/`dtype` at byte `begin`, as a view of the mapping (or
        of the overlay's region that holds it: `rebased`)."""
        return self.rebased(self.mapped(begin, shape, dtype, index))

    def mapped(self, begin: int, shape: tuple[int, ...], dtype: torch.dtype, index: Index = ()) -> torch.Tensor:
        """`view`, always of the mapping (never rebased)."""
        phase, element = begin % dtype.itemsize, begin // dtype.itemsize
        whole = self.flat(dtype, phase).as_strided(shape, _row_major(shape), element)
        return whole[index] if index else whole

    def span(self, view: torch.Tensor) -> tuple[int, int]:
        """The file bytes [low, high) that `view` (of this file's mapping, not empty) reaches."""
        low = view.data_ptr() - self.flat(torch.uint8, 0).data_ptr()
        return low, low + view.element_size() * (1 + sum((n - 1) * step for n, step in zip(view.shape, view.stride())))

    def rebased(self, view: torch.Tensor) -> torch.Tensor:
        """`view` (of this file's mapping) as the same elements of the overlay's region that holds all its
        bytes, once read; where no region holds it whole but one holds each `view[i]`, those stacked (a copy);
        `view` itself without an overlay, or where neither holds."""
        held = self.held(view)
        if held is not None:
            return held
        parts = []  # e.g. experts in two regions: each from its own
        for part in view.unbind(0):
            if (found := self.rebased(part)) is part:
                return view
            parts.append(found)
        return torch.stack(parts)

    def held(self, view: torch.Tensor) -> torch.Tensor | None:
        """`view` (of this file's mapping) as a VIEW of the overlay's region that holds all its bytes, once read;
        `view` itself without an overlay or where no region holds any of its bytes; None where regions hold
        some of its rows but none all of them (only a copy, `rebased`, brings those together)."""
        if self.overlay is None or not view.numel():
            return view
        size = view.element_size()
        low, high = self.span(view)
        region = self.overlay.covering(self.path, low, high)
        if region is not None and (low - region.begin) % size == 0:
            flat = region.flat(view.dtype)
            return flat.as_strided(view.shape, view.stride(), flat.storage_offset() + (low - region.begin) // size)
        if region is None and view.dim() > 1 and len(view) > 1 and self.overlay.overlaps(self.path, low, high):
            return None
        return view


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def gather(file: MappedFile, begins: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype,
           index: Index = (), out: torch.Tensor | None = None) -> torch.Tensor:
    """`[t[index] for t in tensors]` stacked into `out` (ordinary memory; fresh when None), for tensors of
    one `shape`/`dtype` at byte offsets `begins` of `file`. Evenly spaced offsets (rows of a stacked
    tensor, or a writer's regular layout) are one strided view and one copy; offsets on one grid (a writer
    that sorts names puts expert 10 before expert 2, so experts 0..20 lie on the grid of one expert's bytes,
    out of order and with gaps) one strided view over the grid and one `index_select`; others one view each."""
    stacked = stacked_view(file, begins, shape, dtype, index)
    if stacked is not None:
        return stacked.clone(memory_format=torch.contiguous_format) if out is None else out.copy_(stacked)
    grid = grid_view(file, begins, shape, dtype, index)
    if grid is not None:
        view, rows = grid
        out = torch.empty((len(begins), *view.shape[1:]), dtype=dtype) if out is None else out
        return torch.index_select(view, 0, rows, out=out)
    views = _same_views(file, begins, shape, dtype, index)
    return torch.stack(views) if out is None else torch.stack(views, out=out)


def grid_view(file: MappedFile, begins: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype,
              index: Index = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Tensors of one `shape`/`dtype` whose byte offsets `begins` lie on one grid (`low + i * step`, `step` the
    greatest common divisor of their distances, a whole number of elements) as ONE strided view [R, *index
    shape] over the grid's R rows, and the row of each tensor (int64 [len(begins)]). None where the offsets
    are not on one element phase, or where regions of the file's overlay hold part of the grid but none all
    of it (its views must come from the overlay). File memory, as `view`."""
    low = min(begins)
    step = math.gcd(*(begin - low for begin in begins))
    if not step or step % dtype.itemsize:
        return None
    rows = [(begin - low) // step for begin in begins]
    view = file.held(_strided(file, low, step, max(rows) + 1, shape, dtype, index))
    return None if view is None else (view, torch.tensor(rows, dtype=torch.int64))


def _same_views(file: MappedFile, begins: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype,
                index: Index) -> list[torch.Tensor]:
    """`t[index]` of tensors of one shape at `begins`: the first view's shape and strides are reused, so each
    further view is one `as_strided` (offsets on one element phase; else one `view` each)."""
    if any((begin - begins[0]) % dtype.itemsize for begin in begins):
        return [file.view(begin, shape, dtype, index) for begin in begins]
    first = file.mapped(begins[0], shape, dtype, index)
    flat, size, stride, at = file.flat(dtype, begins[0] % dtype.itemsize), first.shape, first.stride(), \
        first.storage_offset() - begins[0] // dtype.itemsize
    views = [first] + [flat.as_strided(size, stride, at + begin // dtype.itemsize) for begin in begins[1:]]
    return views if file.overlay is None else list(map(file.rebased, views))


def stacked_view(file: MappedFile, begins: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype,
                 index: Index = ()) -> torch.Tensor | None:
    """`[t[index] for t in tensors]` as ONE strided view [E, *index shape] of the mapping (or of the overlay
    region that holds it: `MappedFile.held`) when the tensors (one `shape`/`dtype`, at byte offsets `begins`) are
    evenly spaced; None otherwise, and where the overlay holds them in several regions (never a copy: e.g. an EP
    rank's experts 2 and 3, which a writer that sorts names puts 11 experts apart, each read ahead alone).
    File memory, as `view`."""
    step = begins[1] - begins[0] if len(begins) > 1 else dtype.itemsize
    if step <= 0 or step % dtype.itemsize or \
            list(begins) != list(range(begins[0], begins[0] + step * len(begins), step)):  # evenly spaced, in C
        return None
    return file.held(_strided(file, begins[0], step, len(begins), shape, dtype, index))


def _strided(file: MappedFile, low: int, step: int, count: int, shape: tuple[int, ...], dtype: torch.dtype,
             index: Index) -> torch.Tensor:
    """`[t[index] for t in tensors]` of `count` tensors of one `shape`/`dtype`, the first at byte `low` and each
    `step` bytes (whole elements) after the last, as one strided view [count, *index shape] of the mapping."""
    first = file.mapped(low, shape, dtype)
    stacked = first.as_strided((count, *shape), (step // dtype.itemsize, *first.stride()), first.storage_offset())
    return stacked[(slice(None), *index)] if index else stacked


def read_into(path: Path, begin: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `path` from byte `begin` (pread: the kernel
    copies from the page cache into `out`'s memory, e.g. a pinned staging buffer; no mapping)."""
    if not out.numel():
        return
    buffer = memoryview(byte_view(out).numpy())
    with open(path, "rb", buffering=0) as handle:
        done = read_fully(handle.fileno(), buffer, begin)
    if done < len(buffer):
        raise CheckpointError(f"{path}: ended at byte {begin + done} inside a tensor of {len(buffer)} bytes "
                              f"starting at {begin}; the file is truncated.")
