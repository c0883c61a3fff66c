"""safetensors headers: the 8-byte little-endian length, the JSON, and every entry's byte span checked.

Two ways, one rule (safetensors' own: each span dtype x shape long, the spans tiling the data section):
`read_checked_header` checks a whole header in a few passes in C and keeps the parsed JSON
(`CheckedEntries`: the checkpoint index, whose headers hold thousands of entries); `read_header` makes
one `HeaderEntry` per entry, each checked against its dtype, shape and the file size (`HeaderEntries`:
the pre-sharded reader). Entries of a dtype not in `itemsizes` are left for the caller to refuse by name.
"""

from __future__ import annotations

import json
import os
from itertools import chain
from math import prod
from operator import itemgetter, mul, sub
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Sequence

from ..errors import CheckpointError


class HeaderEntry(NamedTuple):
    """One tensor of a file header: safetensors dtype name, shape and absolute byte span in the file
    (a named tuple: a header holds thousands)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


HeaderEntries = dict[str, HeaderEntry]  # the entries of a header checked one by one (`read_header`): name -> entry


_DTYPE, _SHAPE, _OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


class CheckedEntries(Mapping[str, HeaderEntry]):
    """The entries of a header checked in bulk (`read_checked_header`: every span dtype x shape long, the
    spans tiling the data section): kept as the parsed JSON, each made a `HeaderEntry` when asked, so a
    header of thousands of tensors costs one `json.loads` and a few passes in C."""

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
        return list(map(self._start.__add__, map(_FIRST, map(_OFFSETS, self._many(names)))))

    def dtype_names(self) -> set[str]:
        """The dtype names of the entries (one pass in C)."""
        return set(map(_DTYPE, self._raw.values()))

    def _many(self, names: Sequence[str]) -> Sequence[dict]:
        """The parsed entries of `names`, looked up in one call in C (KeyError for a name not in the header)."""
        return [self._raw[names[0]]] if len(names) == 1 else itemgetter(*names)(self._raw)

    def uniform(self, names: Sequence[str], shape: tuple[int, ...]) -> str | None:
        """The one dtype name of `names` when every one is an entry of this header with `shape` and that
        dtype; None otherwise (a name of another file, another shape or a second dtype). One comparison
        of its shape list per name, on the parsed JSON."""
        try:
            found = self._many(names)
        except KeyError:
            return None
        dtypes = list(map(_DTYPE, found))
        if list(map(_SHAPE, found)).count(list(shape)) != len(found) or dtypes.count(dtypes[0]) != len(found):
            return None
        return dtypes[0]


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


def truncated_error(path: Path, otherwise: str, *, cut: str | None = None) -> CheckpointError:
    """The error for an unreadable file: `truncated: N of M bytes ...; re-download it` when it is (`cut`, the
    `truncation` of `path` when the caller has it already), else `otherwise`."""
    cut = cut or truncation(path)
    return CheckpointError(f"{path}: {cut}; re-download it (an interrupted download or copy)." if cut else otherwise)


def read_header(path: Path, itemsizes: dict[str, int]) -> tuple[dict[str, str], HeaderEntries]:
    """A safetensors file's metadata and header entries (absolute spans, each checked), without mapping it."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        return _parse_header(path, handle.read(8), handle, size, itemsizes)


def _parse_header(path: Path, prefix: bytes, handle, size: int,  # noqa: ANN001 (an open binary file)
                  itemsizes: dict[str, int]) -> tuple[dict[str, str], HeaderEntries]:
    """The header's metadata and entries, every byte span checked (safetensors also checks on open)."""
    metadata, header, start = _header_json(path, prefix, handle, size)
    return metadata, _entries(path, header, start, size, itemsizes)


def read_checked_header(path: Path, itemsizes: dict[str, int]) -> tuple[dict[str, str], CheckedEntries]:
    """A safetensors file's metadata and entries, checked as safetensors' own open checks them (every span
    dtype x shape long, the spans in offset order tiling the data section: no gap, no overlap, nothing
    after the last), in a few passes in C; the entries kept as parsed (`CheckedEntries`). A header those
    passes do not clear is checked entry by entry, for the first offender's own error."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        metadata, header, start = _header_json(path, handle.read(8), handle, size)
    if not _tiles(header, size - start, itemsizes):
        cut = truncation(path)
        if cut is not None:
            raise truncated_error(path, "", cut=cut)
        _refuse_tiling(path, _entries(path, header, start, size, itemsizes), start, size, itemsizes)
    return metadata, CheckedEntries(header, start)


def _tiles(header: dict, data: int, itemsizes: dict[str, int]) -> bool:
    """Whether every entry is well formed (int offsets and dims, a known dtype) and dtype x shape long, and
    the spans in offset order tile the `data` bytes of the data section: each a pass in C over the entries.
    Spans of lengths >= 0 tile [0, data) exactly when, sorted apart, the begins are 0 then the ends but the
    last, and the last end is `data` (every byte is then covered once: safetensors' own rule)."""
    entries = list(header.values())
    try:
        shapes, offsets = list(map(_SHAPE, entries)), list(map(_OFFSETS, entries))
        begins, ends = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
        dims = list(chain.from_iterable(shapes))
        if set(map(type, chain(shapes, offsets))) - {list} or set(map(type, chain(dims, begins, ends))) - {int} or \
                set(map(len, offsets)) - {2} or min(dims, default=0) < 0:
            return False
        lengths = list(map(mul, map(prod, shapes), map(itemsizes.__getitem__, map(_DTYPE, entries))))
    except (TypeError, KeyError, IndexError):  # not a dict, a missing key, an unknown dtype
        return False
    return list(map(sub, ends, begins)) == lengths and [0, *sorted(ends)] == [*sorted(begins), data]


def _refuse_tiling(path: Path, entries: HeaderEntries, start: int, size: int, itemsizes: dict[str, int]) -> None:
    """The error for a header whose entries each passed `_entries` but whose spans do not tile the data
    section (or whose dtype is unknown: left to the caller, which names it)."""
    if not {entry.dtype for entry in entries.values()} <= itemsizes.keys():
        return
    end = start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != end:
            what = "overlaps the tensor before it" if entry.begin < end else "leaves a gap after the tensor before it"
            raise CheckpointError(f"{path}: tensor {name!r} spans bytes [{entry.begin - start}, {entry.end - start}) "
                                  f"of the data section, which {what} (ending at byte {end - start}); the file is "
                                  f"corrupt.")
        end = entry.end
    raise CheckpointError(f"{path}: the tensors cover {end - start} bytes of the data section but it holds "
                          f"{size - start}; the file is corrupt or was written with trailing bytes.")


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
    entries: HeaderEntries = {}
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
        want = prod(shape) * itemsizes[dtype] if dtype in itemsizes else end - begin
    except (TypeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {raw!r} ({exc}); expected "
                              f"dtype, shape and data_offsets.") from None
    if not start <= entry.begin <= entry.end <= size or end - begin != want:
        raise CheckpointError(f"{path}: tensor {name!r} spans bytes [{begin}, {end}) of the data section, but "
                              f"{dtype} {list(shape)} needs {want} bytes and the data section holds "
                              f"{size - start}; the file is corrupt or truncated.")
    return entry
