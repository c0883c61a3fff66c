"""scripts/bench/pages.py: the cold condition (eviction) and its check (mincore), on a file in tmp_path."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from bench import pages


def written(path: Path, size: int) -> Path:
    path.write_bytes(bytes(range(256)) * (size // 256))
    return path


def test_a_read_file_is_resident_and_an_evicted_one_is_not(tmp_path: Path) -> None:
    file = written(tmp_path / "a.safetensors", 64 * mmap.PAGESIZE)
    warm = pages.make_warm([file])
    assert warm == pages.Residency(1, file.stat().st_size, file.stat().st_size)
    cold = pages.make_cold([file])
    if cold.resident:  # a file system that keeps what DONTNEED asks to drop (tmpfs) cannot be made cold
        pytest.skip(f"{tmp_path}: this file system keeps the pages POSIX_FADV_DONTNEED drops ({cold.text()})")
    assert cold == pages.Residency(1, file.stat().st_size, 0)
    assert cold.text() == f"0.00 of {file.stat().st_size / 1e9:.2f} GB resident (1 files)"


def test_resident_bytes_counts_the_pages_read_since(tmp_path: Path) -> None:
    """After an eviction, reading the first 8 pages makes (about) those resident: readahead may add more, never
    fewer, and never more than the file."""
    file = written(tmp_path / "b.safetensors", 256 * mmap.PAGESIZE)
    pages.evict([file])
    if pages.resident_bytes(file):
        pytest.skip(f"{tmp_path}: this file system keeps the pages POSIX_FADV_DONTNEED drops")
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only what is read comes in
        os.pread(fd, 8 * mmap.PAGESIZE, 0)
    finally:
        os.close(fd)
    assert 8 * mmap.PAGESIZE <= pages.resident_bytes(file) <= file.stat().st_size


def test_an_empty_file_has_nothing_resident(tmp_path: Path) -> None:
    (tmp_path / "empty.safetensors").write_bytes(b"")
    assert pages.resident_bytes(tmp_path / "empty.safetensors") == 0


def test_files_of_finds_every_safetensors_file_below(tmp_path: Path) -> None:
    for name in ("rank-00000-of-00002/model.safetensors", "common/model.safetensors", "config.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert pages.files_of(tmp_path) == [tmp_path / "common/model.safetensors",
                                        tmp_path / "rank-00000-of-00002/model.safetensors"]
