"""Checkpoint IO by header offsets: each safetensors file mapped once, tensors located from its header.

`MappedFile` maps a file read-only and parses its header (8-byte little-endian length, JSON, data);
every entry's byte span is checked against its dtype and shape and against the file size before
anything is located, here (`HeaderEntries`) or, for a file safetensors has opened, by safetensors
(`CheckedEntries`: the parsed JSON kept as it is). Reads are strided views over the one mapping of a file: no per-tensor call into
safetensors.

| MappedFile.view(begin, shape, dtype, index) | `index` of one tensor: a VIEW of the file pages        |
| gather(file, begins, shape, dtype, index)   | [E, *index shape]: `index` of E tensors, one COPY into |
|                                             | ordinary memory (or the caller's pinned `out`)         |
| stacked_view(file, begins, shape, dtype, i) | the same as one strided VIEW, when evenly spaced       |

A view keeps the mapping alive (it holds a reference) but is file memory: copy it into ordinary
(pinned) memory before keeping it or handing it to a device copy.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import warnings
from operator import itemgetter
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Sequence

import torch

from ..errors import CheckpointError

Index = tuple[slice | int, ...]


class HeaderEntry(NamedTuple):
    """One tensor of a file header: safetensors dtype name, shape and absolute byte span in the file
    (a named tuple: a header holds thousands)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class HeaderEntries(dict[str, HeaderEntry]):
    """The entries of a header checked here, one `HeaderEntry` each (name -> entry)."""

    def begin(self, name: str) -> int:
        """The first byte of tensor `name` in the file."""
        return self[name].begin

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name) of tensor `name`."""
        entry = self[name]
        return entry.shape, entry.dtype

    def begins(self, names: Sequence[str]) -> list[int]:
        """The first byte of each of `names`."""
        return [self[name].begin for name in names]

    def dtype_names(self) -> set[str]:
        """The dtype names of the entries."""
        return {entry.dtype for entry in self.values()}

    def uniform(self, names: Sequence[str], shape: tuple[int, ...]) -> str | None:
        """The one dtype name of `names` when every one is an entry of this header with `shape` and that
        dtype; None otherwise (a name of another file, another shape or a second dtype)."""
        try:
            dtype = self[names[0]].dtype
            return dtype if all((entry := self[name]).shape == shape and entry.dtype == dtype for name in names) \
                else None
        except KeyError:
            return None


_DTYPE, _SHAPE, _OFFSETS, _FIRST = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets"), itemgetter(0)


class CheckedEntries(Mapping[str, HeaderEntry]):
    """The entries of a header that safetensors itself has opened, and so checked (every span inside
    the file, contiguous, dtype x shape long): kept as the parsed JSON, each made a `HeaderEntry`
    when asked, so a header of thousands of tensors costs one `json.loads`."""

    def __init__(self, raw: dict[str, dict], start: int) -> None:
        self._raw, self._start = raw, start

    def __getitem__(self, name: str) -> HeaderEntry:
        raw = self._raw[name]
        begin, end = raw["data_offsets"]
        return HeaderEntry(raw["dtype"], tuple(raw["shape"]), self._start + begin, self._start + end)

    def __contains__(self, name: object) -> bool:
        return name in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def begin(self, name: str) -> int:
        """The first byte of tensor `name` in the file."""
        return self._start + self._raw[name]["data_offsets"][0]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name) of tensor `name` (no entry made)."""
        raw = self._raw[name]
        return tuple(raw["shape"]), raw["dtype"]

    def begins(self, names: Sequence[str]) -> list[int]:
        """The first byte of each of `names` (one pass in C, no entry made)."""
        found = [self._raw[names[0]]] if len(names) == 1 else itemgetter(*names)(self._raw)
        return list(map(self._start.__add__, map(_FIRST, map(_OFFSETS, found))))

    def dtype_names(self) -> set[str]:
        """The dtype names of the entries."""
        return {raw["dtype"] for raw in self._raw.values()}

    def uniform(self, names: Sequence[str], shape: tuple[int, ...]) -> str | None:
        """`HeaderEntries.uniform`, on the parsed JSON (one comparison of its shape list per name)."""
        try:
            found = [self._raw[names[0]]] if len(names) == 1 else itemgetter(*names)(self._raw)
        except KeyError:
            return None
        dtypes = list(map(_DTYPE, found))
        if list(map(_SHAPE, found)).count(list(shape)) != len(found) or dtypes.count(dtypes[0]) != len(found):
            return None
        return dtypes[0]


class MappedFile:
    """One safetensors file, mapped read-only once; its header parsed (and checked, unless safetensors
    already has: `checked`)."""

    def __init__(self, path: Path, itemsizes: dict[str, int], *, checked: bool = False) -> None:
        """`itemsizes`: bytes per element of every known dtype name (entries of other dtypes are kept
        unchecked, for the caller to refuse by name). `checked`: safetensors has opened the file (and
        so checked every span): the entries are taken as they are (`CheckedEntries`)."""
        self.path = path
        self.metadata, self.entries = read_checked_header(path) if checked else read_header(path, itemsizes)
        with open(path, "rb") as handle:
            self.size = os.fstat(handle.fileno()).st_size
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._flat: dict[tuple[torch.dtype, int], torch.Tensor] = {}

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
        """`tensor[index]` of the tensor of `shape`/`dtype` at byte `begin`, as a view of the mapping."""
        phase, element = begin % dtype.itemsize, begin // dtype.itemsize
        whole = self.flat(dtype, phase).as_strided(shape, _row_major(shape), element)
        return whole[index] if index else whole


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
    tensor, or a writer's regular layout), in the order given or in file order (a writer that sorts
    names puts expert 10 before expert 2), are one strided view and one copy; others one view each."""
    stacked = stacked_view(file, begins, shape, dtype, index)
    if stacked is not None:
        return stacked.clone(memory_format=torch.contiguous_format) if out is None else out.copy_(stacked)
    order = sorted(range(len(begins)), key=begins.__getitem__)
    in_file_order = stacked_view(file, [begins[i] for i in order], shape, dtype, index)
    if in_file_order is not None:
        rank = sorted(range(len(order)), key=order.__getitem__)  # position in file order of each tensor
        out = torch.empty(in_file_order.shape, dtype=dtype) if out is None else out
        return torch.index_select(in_file_order, 0, torch.tensor(rank), out=out)
    views = _same_views(file, begins, shape, dtype, index)
    return torch.stack(views) if out is None else torch.stack(views, out=out)


def _same_views(file: MappedFile, begins: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype,
                index: Index) -> list[torch.Tensor]:
    """`t[index]` of tensors of one shape at `begins`: the first view's shape and strides are reused, so each
    further view is one `as_strided` (offsets on one element phase; else one `view` each)."""
    first = file.view(begins[0], shape, dtype, index)
    if any((begin - begins[0]) % dtype.itemsize for begin in begins):
        return [first] + [file.view(begin, shape, dtype, index) for begin in begins[1:]]
    flat, size, stride, at = file.flat(dtype, begins[0] % dtype.itemsize), first.shape, first.stride(), \
        first.storage_offset() - begins[0] // dtype.itemsize
    return [first] + [flat.as_strided(size, stride, at + begin // dtype.itemsize) for begin in begins[1:]]


def stacked_view(file: MappedFile, begins: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype,
                 index: Index = ()) -> torch.Tensor | None:
    """`[t[index] for t in tensors]` as ONE strided view [E, *index shape] of the mapping when the tensors
    (one `shape`/`dtype`, at byte offsets `begins`) are evenly spaced; None otherwise. File memory, as `view`."""
    step = begins[1] - begins[0] if len(begins) > 1 else dtype.itemsize
    if step <= 0 or step % dtype.itemsize or any(b - a != step for a, b in zip(begins, begins[1:])):
        return None
    first = file.view(begins[0], shape, dtype)
    stacked = first.as_strided((len(begins), *shape), (step // dtype.itemsize, *first.stride()),
                               first.storage_offset())
    return stacked[(slice(None), *index)] if index else stacked


MAX_HEADER = 100 * 2**20  # a longer length prefix is garbage, not the header of a truncated file


def truncation(path: Path) -> str | None:
    """`truncated: N of M bytes; ...` when the file at `path` is shorter than its own header says (an interrupted
    download or copy): M from the length prefix and the last data offset; None when it is not (or the header
    is garbage: the caller's own error applies)."""
    try:
        with open(path, "rb") as handle:
            size, prefix = os.fstat(handle.fileno()).st_size, handle.read(8)
            length = int.from_bytes(prefix, "little")
            if len(prefix) < 8 or length > MAX_HEADER:
                return None
            if 8 + length > size:
                return f"truncated: {size} of more than {8 + length} bytes (its header alone is {length} bytes)"
            header = json.loads(handle.read(length))
            end = 8 + length + max((rec["data_offsets"][1] for name, rec in header.items() if name != "__metadata__"),
                                   default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return f"truncated: {size} of {end} bytes (the size its header implies)" if size < end else None


def truncated_error(path: Path, otherwise: str) -> CheckpointError:
    """The error for an unreadable file: `truncated: N of M bytes ...; re-download it` when it is, else `otherwise`."""
    cut = truncation(path)
    return CheckpointError(f"{path}: {cut}; re-download it (an interrupted download or copy)." if cut else otherwise)


def read_header(path: Path, itemsizes: dict[str, int]) -> tuple[dict[str, str], HeaderEntries]:
    """A safetensors file's metadata and header entries (absolute spans, each checked), without mapping it."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        return _parse_header(path, handle.read(8), handle, size, itemsizes)


def read_into(path: Path, begin: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `path` from byte `begin` (pread: the kernel
    copies from the page cache into `out`'s memory, e.g. a pinned staging buffer; no mapping)."""
    if not out.numel():
        return
    buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as handle:
        done = 0
        while done < len(buffer):
            got = os.preadv(handle.fileno(), [buffer[done:]], begin + done)
            if got <= 0:
                raise CheckpointError(f"{path}: ended at byte {begin + done} inside a tensor of {len(buffer)} bytes "
                                      f"starting at {begin}; the file is truncated.")
            done += got


def _parse_header(path: Path, prefix: bytes, handle, size: int,  # noqa: ANN001 (an open binary file)
                  itemsizes: dict[str, int]) -> tuple[dict[str, str], HeaderEntries]:
    """The header's metadata and entries, every byte span checked (safetensors also checks on open)."""
    metadata, header, start = _header_json(path, prefix, handle, size)
    return metadata, _entries(path, header, start, size, itemsizes)


def read_checked_header(path: Path) -> tuple[dict[str, str], CheckedEntries]:
    """`read_header` of a file safetensors has opened (so every span is already checked): the entries are
    kept as parsed (`CheckedEntries`)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        metadata, header, start = _header_json(path, handle.read(8), handle, size)
    return metadata, CheckedEntries(header, start)


def _header_json(path: Path, prefix: bytes, handle, size: int) -> tuple[dict[str, str], dict, int]:  # noqa: ANN001
    """(metadata, the other entries as parsed JSON, first byte of the data section) of an open file."""
    if len(prefix) < 8 or int.from_bytes(prefix, "little") > size - 8:
        raise truncated_error(path, f"{path}: not a readable safetensors file (header length past the end of the "
                                    f"{size}-byte file).")
    length = int.from_bytes(prefix, "little")
    try:
        header = json.loads(handle.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file (header is not JSON: {exc}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (header is not a JSON object).")
    metadata = header.pop("__metadata__", None) or {}
    return metadata, header, 8 + length


def _entries(path: Path, header: dict, start: int, size: int, itemsizes: dict[str, int]) -> HeaderEntries:
    """Every entry of a parsed header: `_entry`'s checks inlined for well-formed entries (a header holds
    thousands); any entry they do not pass goes through `_entry` itself, for its exact error."""
    entries = HeaderEntries()
    prod = math.prod
    for name, raw in header.items():
        try:
            dtype, shape, (begin, end) = raw["dtype"], tuple(raw["shape"]), raw["data_offsets"]
            ok = start <= start + begin <= start + end <= size and end - begin == prod(shape) * itemsizes[dtype]
        except Exception:  # noqa: BLE001 (malformed or unknown: `_entry` decides)
            ok = False
        entries[name] = HeaderEntry(dtype, shape, start + begin, start + end) if ok else \
            _entry(path, name, raw, start, size, itemsizes)
    return entries


def _entry(path: Path, name: str, raw: object, start: int, size: int, itemsizes: dict[str, int]) -> HeaderEntry:
    """One header entry with absolute offsets; its span must fit the file and match dtype x shape."""
    try:
        dtype, shape, (begin, end) = raw["dtype"], tuple(raw["shape"]), raw["data_offsets"]
        entry = HeaderEntry(dtype, shape, start + begin, start + end)
        want = math.prod(shape) * itemsizes[dtype] if dtype in itemsizes else end - begin
    except (TypeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {raw!r} ({exc}); expected "
                              f"dtype, shape and data_offsets.") from None
    if not start <= entry.begin <= entry.end <= size or end - begin != want:
        raise CheckpointError(f"{path}: tensor {name!r} spans bytes [{begin}, {end}) of the data section, but "
                              f"{dtype} {list(shape)} needs {want} bytes and the data section holds "
                              f"{size - start}; the file is corrupt or truncated.")
    return entry
