"""Checkpoint IO: a name -> (file, shape, dtype) index and lazy slice reads.

Reads go through safetensors `safe_open(...).get_slice` only; whole files are
never loaded. The index is built once from the shard headers (and checked
against model.safetensors.index.json when present); file handles stay open.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import CheckpointError, format_offenders

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

DTYPES: dict[str, torch.dtype] = {
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives and what its header says."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return nbytes_of(self.shape, self.dtype)


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype`."""
    return math.prod(shape) * dtype.itemsize


class CheckpointIndex:
    """Every tensor of a safetensors checkpoint folder, readable by slices.

    Use as a context manager, or call `close()`. `bytes_read` counts the bytes
    of every slice returned.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files = _shard_files(self.folder)
        self._handles: dict[str, Any] = {}
        self.refs: dict[str, TensorRef] = {}
        self.metadata: dict[str, dict[str, str]] = {}
        self.bytes_read = 0
        for file in self.files:
            self._index_file(file)
        _check_index_file(self.folder, self.refs)

    def _index_file(self, file: str) -> None:
        try:
            handle = safe_open(str(self.folder / file), framework="pt")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{self.folder / file}: not a readable safetensors file ({exc}).") from None
        self._handles[file] = handle
        self.metadata[file] = handle.metadata() or {}
        for name in handle.keys():
            if name in self.refs:
                raise CheckpointError(f"tensor {name!r} is stored twice, in {self.refs[name].file} and {file}; "
                                      f"a checkpoint must hold each tensor once.")
            view = handle.get_slice(name)
            dtype = DTYPES.get(view.get_dtype())
            if dtype is None:
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {view.get_dtype()!r}, which this "
                                      f"loader does not know; known: {sorted(DTYPES)}.")
            self.refs[name] = TensorRef(name, file, tuple(view.get_shape()), dtype)

    def __enter__(self) -> "CheckpointIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the open file handles."""
        self._handles.clear()

    def read(self, ref: TensorRef, index: tuple[slice | int, ...] = ()) -> torch.Tensor:
        """Read `ref[index]` (basic slices and ints): a view of the file's mapping, not a copy. Copy it
        into memory of your own before any device copy (see device.py): never DMA from a mapping."""
        view = self._handles[ref.file].get_slice(ref.name)
        tensor = view[index] if index else view[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


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


def _shard_files(folder: Path) -> list[str]:
    """The safetensors files of a checkpoint, by the Hugging Face rule: the files of
    model.safetensors.index.json when it exists; else model.safetensors alone when it exists (a stray
    *.safetensors beside it, e.g. a reference dump, is not part of the model); else every *.safetensors."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder (no such directory).")
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        files = sorted(set(_weight_map(index_path).values()))
        for file in files:
            if not _inside(folder, file).is_file():
                raise CheckpointError(f"{index_path}: names {file!r}, which does not exist in {folder}.")
        return files
    files = [SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(p.name for p in folder.glob("*.safetensors"))
    for file in files:
        _inside(folder, file)
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{folder}: holds only pickle checkpoints {pickles[:5]}; they can run code when "
                              f"loaded and are refused. Convert them to safetensors first.")
    raise CheckpointError(f"{folder}: no *.safetensors files and no {INDEX_FILE}.")


def _weight_map(index_path: Path) -> dict[str, str]:
    try:
        data = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index_path}: not valid JSON ({exc}).") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: expected an object with a `weight_map` of tensor name -> file.")
    return weight_map


def _check_index_file(folder: Path, refs: dict[str, TensorRef]) -> None:
    """The index file (when present) and the shard headers must agree name for name."""
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        return
    weight_map = _weight_map(index_path)
    problems = [f"{name}: index says {file}, header says {refs[name].file if name in refs else 'nowhere'}"
                for name, file in weight_map.items() if name not in refs or refs[name].file != file]
    problems += [f"{name}: in {ref.file} but not in the index" for name, ref in refs.items()
                 if name not in weight_map]
    if problems:
        raise CheckpointError(f"{index_path} disagrees with the shard headers for {len(problems)} tensors:\n"
                              f"{format_offenders(problems)}")
