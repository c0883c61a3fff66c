"""WILLNEED advice in calls the kernel reads whole (storage/advice.py): the per-call cap is read from the
file's block-device queue in sysfs (a partition's from its disk, the fallback where sysfs says nothing), the
calls tile the advised range, and on a real file system every advised byte reaches the page cache even when
the range is several times the cap (one call over it would leave the tail unread).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wna16_loader.storage import advice
from wna16_loader.storage.advice import FALLBACK_BYTES, advice_bytes, will_need
from wna16_loader.storage.readahead import PlannedRange, ReadAhead, ReadOptions


def fake_sysfs(root: Path, file: Path, *, queue: dict[str, str], partition: bool) -> Path:
    """A sysfs tree under `root` whose dev/block entry for `file`'s device holds `queue` (in the disk's
    folder, the entry linking to a partition folder below it when `partition`)."""
    device = os.stat(file).st_dev
    disk = root / "devices" / "virtual" / "block" / "vdz"
    target = disk / "vdz1" if partition else disk
    target.mkdir(parents=True)
    (disk / "queue").mkdir()
    for name, text in queue.items():
        (disk / "queue" / name).write_text(text)
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(device)}:{os.minor(device)}").symlink_to(target)
    return root


@pytest.mark.parametrize("partition", [False, True])
@pytest.mark.parametrize(("read_ahead_kb", "max_sectors_kb", "expected"),
                         [("8192\n", "4096\n", 8192 << 10), ("128\n", "1280\n", 1280 << 10), ("0\n", "512\n", 512 << 10)])
def test_the_cap_is_the_larger_of_the_queue_settings(tmp_path, partition, read_ahead_kb, max_sectors_kb,
                                                     expected) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    sysfs = fake_sysfs(tmp_path / "sys", file, queue={"read_ahead_kb": read_ahead_kb,
                                                      "max_sectors_kb": max_sectors_kb}, partition=partition)
    assert advice_bytes(file, sysfs=sysfs) == expected


def test_without_a_queue_in_sysfs_the_cap_is_the_default_window(tmp_path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    assert advice_bytes(file, sysfs=tmp_path / "no-sysfs") == FALLBACK_BYTES
    unreadable = fake_sysfs(tmp_path / "sys", file, queue={"read_ahead_kb": "n/a"}, partition=False)
    assert advice_bytes(file, sysfs=unreadable) == FALLBACK_BYTES


def test_a_file_system_without_a_block_queue_uses_its_read_ahead_window(tmp_path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    device = os.stat(file).st_dev
    bdi = tmp_path / "sys" / "class" / "bdi" / f"{os.major(device)}:{os.minor(device)}"
    bdi.mkdir(parents=True)
    (bdi / "read_ahead_kb").write_text("15360\n")  # e.g. NFS: 15 x a 1 MiB rsize
    assert advice_bytes(file, sysfs=tmp_path / "sys") == 15360 << 10


@given(begin=st.integers(0, 1 << 40), step=st.integers(1, 1 << 24), whole=st.integers(0, 64), data=st.data())
def test_calls_tile_the_range_none_over_the_step(begin, step, whole, data) -> None:
    """Any range (up to 65 steps long, so that a step of 1 byte costs no more than one of 16 MiB; the last step
    whole, partial or absent) is tiled by calls of at most `step` bytes, in order, with no gap or overlap."""
    length = whole * step + data.draw(st.integers(0, step - 1), label="tail")
    calls: list[tuple[int, int]] = []
    original = os.posix_fadvise
    os.posix_fadvise = lambda fd, offset, size, how: calls.append((offset, size))  # type: ignore[assignment]
    try:
        made = will_need(-1, begin, begin + length, step)
    finally:
        os.posix_fadvise = original
    assert made == len(calls) == -(-length // step)
    assert all(0 < size <= step for _, size in calls)
    assert [offset for offset, _ in calls] == list(range(begin, begin + length, step))
    assert sum(size for _, size in calls) == length


def resident(path: Path) -> int:
    """Bytes of `path` in the page cache (ReadAhead's own mincore, over whole pages)."""
    probe = ReadAhead([], ReadOptions())
    try:
        size = path.stat().st_size
        pages = (size + 4095) // 4096
        return sum(4096 for page in range(pages) if probe._reader.pages.holds(path, page * 4096, page * 4096 + 4096))
    finally:
        probe.close()


def cold_file(tmp_path: Path, size: int) -> Path:
    """A file of `size` bytes written, synced and evicted; skips where the file system keeps its pages."""
    file = tmp_path / "cold.bin"
    file.write_bytes(os.urandom(size))
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident(file) > size // 8:
        pytest.skip(f"{tmp_path}: the file system keeps a file's pages after POSIX_FADV_DONTNEED (tmpfs?)")
    return file


def test_a_shared_range_four_times_the_cap_reaches_the_page_cache_whole(tmp_path) -> None:
    cap = advice_bytes(tmp_path)
    if cap > 16 << 20:
        pytest.skip(f"{tmp_path}: one WILLNEED call reads {cap >> 20} MiB here: a file 4x that is too large")
    file = cold_file(tmp_path, 4 * cap)
    ranges = [[PlannedRange(file, 0, 4 * cap, True)]]
    ahead = ReadAhead(ranges, ReadOptions(threads=2, request_bytes=4 * cap, min_bytes=0))
    try:
        ahead.start(0)
        for future in ahead._fills:
            future.result()
    finally:
        ahead.close()
    deadline = time.monotonic() + 10
    while resident(file) < 4 * cap and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident(file) == 4 * cap, f"{resident(file)} of {4 * cap} bytes advised are in the page cache"


def test_the_cap_is_looked_up_once_per_device(tmp_path) -> None:
    advice._device_advice_bytes.cache_clear()
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(b"x")
        advice_bytes(tmp_path / name)
    assert advice._device_advice_bytes.cache_info().misses == 1
