"""Checkpoint IO: a name -> (file, shape, dtype) index and reads by validated header offsets.

The index is built once from the shard headers: `filemap.MappedFile` maps every file once and
checks its header whole, as safetensors' own open does (each byte span dtype x shape long, the spans
tiling the data section), keeping the parsed entries (`header.CheckedEntries`); the index is then
checked against model.safetensors.index.json when present. Reads are strided views over the
mappings (`view`, `gather`); whole files are never loaded, nothing is copied until asked.

| read(ref, index)          | ordinary memory, safe to keep                                     |
| view(ref, index)          | file pages: valid while kept, never for a device copy or to keep  |
| gather(refs, indices)     | [E, ...] stacked into ordinary memory (`scratch=True`: the index's |
|                           | `Scratch`, reused by the thread's next scratch gather)            |
| view_stacked(refs, ...)   | [E, ...] as one strided view of file pages, when evenly spaced    |
| reading_ahead(groups, ..) | planned byte ranges read ahead in parallel; views come from those |
|                           | buffers while it runs (`readahead.py`)                            |
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from functools import partial
from itertools import repeat
from operator import attrgetter
from pathlib import Path
from typing import Collection, Iterator, Mapping, NamedTuple, Sequence

import torch

from ..errors import CheckpointError, format_offenders
from .bulk import gc_paused
from .filemap import Index, MappedFile, gather, stacked_view
from .node import NodeRead
from .readahead import PlannedRange, ReadAhead, ReadOptions
from .scratch import Scratch, destination
from .windows import WindowPlan

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

DTYPES: dict[str, torch.dtype] = {
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
ITEMSIZES: dict[str, int] = {name: dtype.itemsize for name, dtype in DTYPES.items()}


class TensorRef(NamedTuple):
    """Where one tensor lives and what its header says (a named tuple: an index holds one per tensor);
    `begin` is its first byte in `file` as the index that made it read the header (-1: not known, e.g. a
    tensor an engine handed over; the index then looks it up by name)."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int = -1

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return nbytes_of(self.shape, self.dtype)


# A ref from a tuple of its fields: the C-level tuple constructor (the named tuple's own __new__ and _make are Python).
_make_ref = partial(tuple.__new__, TensorRef)


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype`."""
    return math.prod(shape) * dtype.itemsize


class TensorRefs(Mapping[str, TensorRef]):
    """name -> `TensorRef` of every tensor of an index, made when asked from the files' header entries (the
    index keeps one dict entry per tensor, name -> file; iterating gives the names in file order)."""

    def __init__(self, maps: dict[str, MappedFile]) -> None:
        self.files: dict[str, str] = {}  # tensor name -> its file
        self._maps = maps

    def __getitem__(self, name: str) -> TensorRef:
        file = self.files[name]
        entries = self._maps[file].entries
        shape, dtype = entries.shape_dtype(name)
        return TensorRef(name, file, shape, DTYPES[dtype], entries.begin(name))

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def uniform(self, names: Sequence[str], shape: tuple[int, ...],
                dtypes: Collection[torch.dtype]) -> list[TensorRef] | None:
        """The refs of `names` (in order) when every one has `shape` and all one dtype among `dtypes`: one
        pass over their header entries (file by file when they lie in several), one shape tuple shared by
        every ref; None otherwise (the caller then takes each ref alone, for its own error)."""
        files, file = self.files, self.files[names[0]]
        entries = self._maps[file].entries
        dtype = entries.uniform(names, shape)
        if dtype is not None:
            return list(map(_make_ref, zip(names, repeat(file), repeat(shape), repeat(DTYPES[dtype]),
                                           entries.begins(names)))) if DTYPES[dtype] in dtypes else None
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(files[name], []).append(name)
        found = {self._maps[file].entries.uniform(part, shape) for file, part in by_file.items()}
        if len(found) != 1 or None in found or DTYPES[dtype := found.pop()] not in dtypes:
            return None
        return [self[name] for name in names]

    def __len__(self) -> int:
        return len(self.files)


class CheckpointIndex:
    """Every tensor of a safetensors checkpoint folder, readable by slices.

    Use as a context manager, or call `close()` (views already handed out keep their mapping).
    `bytes_read` counts the bytes of every slice returned. `refs[name]` is a tensor's `TensorRef`.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files, weight_map = _shard_files(self.folder)
        self._maps: dict[str, MappedFile] = {}
        self.refs = TensorRefs(self._maps)
        self.metadata: dict[str, dict[str, str]] = {}
        self.bytes_read = 0
        self.scratch = Scratch()  # gathers placed at once (`gather(scratch=True)`): pages that fault once
        with gc_paused():  # header entries of every tensor: see bulk.py
            for file in self.files:
                self._index_file(file)
            if weight_map is not None:
                _check_index_file(self.folder / INDEX_FILE, weight_map, self.refs.files)

    def _index_file(self, file: str) -> None:
        """Map and check one file; its names join the index (every dtype known, no name in two files)."""
        mapped = self._maps[file] = MappedFile(self.folder / file, ITEMSIZES)
        self.metadata[file] = mapped.metadata
        files, before = self.refs.files, len(self.refs.files)
        files.update(dict.fromkeys(mapped.entries, file))
        if len(files) != before + len(mapped.entries) or not mapped.dtype_names() <= DTYPES.keys():
            self._refuse(file, mapped)

    def _refuse(self, file: str, mapped: MappedFile) -> None:
        """The error for the first entry of `file` that an earlier file holds too or that has an unknown dtype."""
        for name, entry in mapped.entries.items():
            first = next((other for other, earlier in self._maps.items() if other != file and name in earlier.entries),
                         None)
            if first is not None:
                raise CheckpointError(f"tensor {name!r} is stored twice, in {first} and {file}; "
                                      f"a checkpoint must hold each tensor once.")
            if entry.dtype not in DTYPES:
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {entry.dtype!r}, which this "
                                      f"loader does not know; known: {sorted(DTYPES)}.")

    def __enter__(self) -> "CheckpointIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the mappings (each is unmapped once no view of it is left) and this thread's scratch."""
        self._maps.clear()
        self.scratch.release()

    @contextmanager
    def reading_ahead(self, groups: Sequence[Sequence[PlannedRange]], options: ReadOptions, *,
                      pin: bool = False, node_windows: WindowPlan | None = None,
                      node_cold: bool = False) -> Iterator[ReadAhead | NodeRead]:
        """A `ReadAhead` of `groups` (in use order; call its `start(i)` before reading group i) whose regions
        this index's views come from while the block runs (`MappedFile.rebased`); closed after it. With
        `options.node` of several ranks and `node_windows` (the same on every rank of the node: `windows_of` the
        groups whose each is the union of the ranks' `groups`), a `NodeRead` of those instead: the node reads them
        together (`node_cold`: local rank 0 found the page cache cold (`node.node_windows`), not to look again)."""
        node = options.node
        together = node is not None and node.size > 1 and node_windows is not None and options.enabled
        ahead = NodeRead(node_windows, options, node, cold=node_cold) if together else \
            ReadAhead(groups, options, pin=pin)
        for mapped in self._maps.values() if ahead.active else ():
            mapped.overlay = ahead
        try:
            yield ahead
        except BaseException as error:
            ahead.fail(error)
            raise
        finally:
            for mapped in self._maps.values():
                mapped.overlay = None
            ahead.close()

    def view(self, ref: TensorRef, index: Index = ()) -> torch.Tensor:
        """`ref[index]` (basic slices and ints) as a VIEW of the file mapping: copy it before keeping it,
        and never hand it to a device copy."""
        begin, file, shape, dtype, rest = self.locate(ref, index)
        tensor = self._maps[file].view(begin, shape, dtype, rest)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read(self, ref: TensorRef, index: Index = ()) -> torch.Tensor:
        """`ref[index]` (basic slices and ints) as an ordinary in-memory tensor (a copy, safe to keep)."""
        return self.view(ref, index).clone(memory_format=torch.contiguous_format)

    def gather(self, refs: Sequence[TensorRef], indices: Sequence[Index], *, pin: bool = False,
               scratch: bool = False) -> torch.Tensor:
        """`[ref[index] for ...]` stacked into fresh ordinary memory (pinned with `pin`), safe to keep; with
        `scratch`, into this index's `Scratch` instead (valid until this thread's next scratch gather: for a
        chunk placed at once). Tensors of one file, dtype and shape under one index (leading ints, e.g. rows of
        a stacked tensor, may differ) are located by offset and copied in one strided pass; others one at a time."""
        together = self._gather_one_file(refs, indices, pin, scratch)
        if together is not None:
            return together
        located = [self.locate(ref, index) for ref, index in zip(refs, indices)]
        begin, file, shape, dtype, index = located[0]
        one = self._maps[file].mapped(begin, shape, dtype, index)
        out = destination((len(located), *one.shape), dtype, pin, self.scratch if scratch else None)
        if all(loc[1:] == located[0][1:] for loc in located):
            gather(self._maps[file], [loc[0] for loc in located], shape, dtype, index, out)
        else:
            torch.stack([self._maps[f].view(b, s, d, i) for b, f, s, d, i in located], out=out)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _gather_one_file(self, refs: Sequence[TensorRef], indices: Sequence[Index], pin: bool,
                         scratch: bool) -> torch.Tensor | None:
        """`gather` of tensors of one file, shape and dtype under one index without leading ints (the
        tensors of one role of a run of experts): their offsets looked up in one pass; None for others."""
        begins = self.locate_run(refs, indices)
        if begins is None:
            return None
        first, index = refs[0], indices[0]
        mapped = self._maps[first.file]
        one = mapped.mapped(begins[0], first.shape, first.dtype, index)
        out = destination((len(refs), *one.shape), first.dtype, pin, self.scratch if scratch else None)
        gather(mapped, begins, first.shape, first.dtype, index, out)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def view_stacked(self, refs: Sequence[TensorRef], indices: Sequence[Index]) -> torch.Tensor | None:
        """`[ref[index] for ...]` as ONE strided view [E, ...] of a file mapping (no copy; file memory, as
        `view`) when the slices lie evenly spaced in one file with one shape, dtype and index; else None."""
        begins = self.locate_run(refs, indices)
        if begins is not None:
            first = refs[0]
            stacked = stacked_view(self._maps[first.file], begins, first.shape, first.dtype, indices[0])
            if stacked is not None:
                self.bytes_read += stacked.numel() * stacked.element_size()
            return stacked
        located = [self.locate(ref, index) for ref, index in zip(refs, indices)]
        if any(loc[1:] != located[0][1:] for loc in located):
            return None
        _, file, shape, dtype, index = located[0]
        stacked = stacked_view(self._maps[file], [loc[0] for loc in located], shape, dtype, index)
        if stacked is not None:
            self.bytes_read += stacked.numel() * stacked.element_size()
        return stacked

    def begin(self, name: str) -> int:
        """The first byte of tensor `name` in its file."""
        return self._maps[self.refs.files[name]].entries.begin(name)

    def first_byte(self, ref: TensorRef) -> int:
        """The first byte of `ref` in its file: as the header said when the ref was made, else looked up by name."""
        return ref.begin if ref.begin >= 0 else self.begin(ref.name)

    def locate_run(self, refs: Sequence[TensorRef], indices: Sequence[Index]) -> list[int] | None:
        """The first bytes of `refs` when they lie in one file with one shape and dtype, all read under one
        index that starts with no int (the tensors of one role of a run of experts: located in one pass;
        every read of such a run passes here); None for others (each goes through `locate`)."""
        if not _one_file(refs, indices):
            return None
        begins = list(map(_BEGIN, refs))  # as the header said when this index made the refs
        return begins if min(begins) >= 0 else self._maps[refs[0].file].begins([ref.name for ref in refs])

    def locate(self, ref: TensorRef, index: Index) -> tuple[int, str, tuple[int, ...], torch.dtype, Index]:
        """Where `ref[index]` lives, from the header offsets (every read passes here): (first byte,
        file, shape, dtype, rest of the index), leading int indices folded into the first byte. Every read
        passes here or through `locate_run`."""
        begin, shape = self.first_byte(ref), ref.shape
        while index and isinstance(index[0], int):
            if not 0 <= index[0] < shape[0]:
                raise IndexError(f"{ref.name}: row {index[0]} outside 0..{shape[0] - 1}")
            begin += index[0] * nbytes_of(shape[1:], ref.dtype)
            index, shape = index[1:], shape[1:]
        return begin, ref.file, shape, ref.dtype, index


def _one_file(refs: Sequence[TensorRef], indices: Sequence[Index]) -> bool:
    """Whether `refs` lie in one file with one shape and dtype, all read under one index that starts with
    no int (the tensors of one role of a run of experts)."""
    first, index = refs[0], indices[0]
    if (index and isinstance(index[0], int)) or indices.count(index) != len(indices):
        return False
    count = len(refs)  # each field compared over every ref in C
    return all(list(map(field, refs)).count(getattr(first, name)) == count for name, field in _RUN_FIELDS)


_RUN_FIELDS = tuple((name, attrgetter(name)) for name in ("file", "shape", "dtype"))
_BEGIN = attrgetter("begin")


def _allowed_roots(folder: Path) -> tuple[Path, ...]:
    """Where a shard file may really live: the folder, and for a Hugging Face cache snapshot
    (`<repo>/snapshots/<rev>/`, whose files are symlinks into `<repo>/blobs/`) that blobs folder."""
    roots = [folder.resolve()]
    if folder.resolve().parent.name == "snapshots":
        roots.append(folder.resolve().parent.parent / "blobs")
    return tuple(roots)


def _inside(folder: Path, entry: str) -> Path:
    """`folder / entry`, refusing entries (or symlinks) that leave the folder."""
    path = Path(entry)
    resolved = (folder / path).resolve()
    if path.is_absolute() or ".." in path.parts:
        raise CheckpointError(f"{folder / INDEX_FILE}: entry {entry!r} points outside the checkpoint folder "
                              f"{folder}; refusing to read it.")
    if not any(resolved.is_relative_to(root) for root in _allowed_roots(folder)):
        raise CheckpointError(f"{folder / entry}: a symlink to {resolved}, outside the checkpoint folder {folder}; "
                              f"refusing to read it. Copy the file into the folder.")
    return resolved


def _shard_files(folder: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of a checkpoint, by the Hugging Face rule: the files of
    model.safetensors.index.json when it exists; else model.safetensors alone when it exists (a stray
    *.safetensors beside it, e.g. a reference dump, is not part of the model); else every *.safetensors.
    Also the index file's weight map (None without one)."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder (no such directory).")
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map, files = _weight_map(index_path)
        for file in files:
            if not _inside(folder, file).is_file():
                raise CheckpointError(f"{index_path}: names {file!r}, which does not exist in {folder}.")
        return files, weight_map
    files = [SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(p.name for p in folder.glob("*.safetensors"))
    for file in files:
        _inside(folder, file)
    if files:
        return files, None
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{folder}: holds only pickle checkpoints {pickles[:5]}; they can run code when "
                              f"loaded and are refused. Convert them to safetensors first.")
    raise CheckpointError(f"{folder}: no *.safetensors files and no {INDEX_FILE}.")


def _weight_map(index_path: Path) -> tuple[dict[str, str], list[str]]:
    """The index file's weight map (tensor name -> file) and its files, sorted."""
    try:
        data = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index_path}: not valid JSON ({exc}).") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    try:
        files = set(weight_map.values()) if isinstance(weight_map, dict) else {None}
    except TypeError:  # an unhashable value (a list, an object)
        files = {None}
    if not all(isinstance(file, str) for file in files):  # the distinct values: one per file
        raise CheckpointError(f"{index_path}: expected an object with a `weight_map` of tensor name -> file.")
    return weight_map, sorted(files)


def _check_index_file(index_path: Path, weight_map: dict[str, str], files: dict[str, str]) -> None:
    """The index file's weight map and the shard headers (`files`: tensor name -> file) must agree name for
    name (one dict comparison in C when they do; the per-name comparison only to list the differences)."""
    if weight_map == files:
        return
    problems = [f"{name}: index says {file}, header says {files.get(name, 'nowhere')}"
                for name, file in weight_map.items() if files.get(name) != file]
    problems += [f"{name}: in {file} but not in the index" for name, file in files.items() if name not in weight_map]
    if problems:
        raise CheckpointError(f"{index_path} disagrees with the shard headers for {len(problems)} tensors:\n"
                              f"{format_offenders(problems)}")
