"""storage/node_plan.py: local rank 0 plans what the node reads together and hands it to every rank (threads of one
process here: each rank's `node_windows` waits for rank 0's answer in /dev/shm), or finds the node warm, or its
window without room in shared memory (then every rank reads alone, and rank 0 says why)."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path

import pytest
from processes import evicted

from wna16_loader.errors import NodeError
from wna16_loader.parallel.config import Node
from wna16_loader.storage import node_plan
from wna16_loader.storage.advice import PageCache
from wna16_loader.storage.node import ALIGN, WARM_AT
from wna16_loader.storage.shared_window import HEADER
from wna16_loader.storage.node_plan import node_windows
from wna16_loader.storage.shm import shared_room
from wna16_loader.storage.readahead import PlannedRange
from wna16_loader.storage.windows import PARTS, windows_of


WINDOW = 48 * ALIGN  # (the node's window in these tests: small, whatever room the machine's /dev/shm has)


def _windows(files: list[Path], plan) -> dict[int, object]:
    """`node_windows` of a node of two ranks (threads here, the follower started first: it waits for rank 0), each
    rank's answer, or the error it raised."""
    key, answers = f"test-{uuid.uuid4().hex}", {}

    def rank(local: int) -> None:
        try:
            answers[local] = node_windows(Node((0, 1), local, key, window_bytes=WINDOW, timeout_s=30), files,
                                          lambda: plan(local), ALIGN)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            answers[local] = error
    threads = [threading.Thread(target=rank, args=(local,)) for local in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not (Path("/dev/shm") / f"wna16-node-{key}.plan").exists()
    return answers


def _answers(files: list[Path]) -> dict[int, bool]:
    """Whether each rank of a node of two was told the node is warm (no windows: each reads its mappings)."""
    return {local: found is None for local, found in _windows(
        files, lambda local: [[PlannedRange(files[0], 0, 2 * ALIGN, True)]]).items()}


def test_local_rank_0_plans_the_node_read_and_hands_every_rank_its_windows(tmp_path: Path) -> None:
    """Cold: the node's groups are planned on local rank 0 only, and every rank gets their windows (the same);
    None from the plan (ranks that share too few pages) reaches every rank as None; a plan that raises on local
    rank 0 raises there and makes the other rank raise NodeError at once, naming it."""
    files = _cold_files(tmp_path)
    groups = [[PlannedRange(files[0], 0, 3 * ALIGN, True), PlannedRange(files[1], ALIGN, 2 * ALIGN, True)],
              [PlannedRange(files[1], 8 * ALIGN, 9 * ALIGN, False)]]
    planned_on = []
    answers = _windows(files, lambda local: planned_on.append(local) or groups)
    assert planned_on == [0] and answers[0] == answers[1] == windows_of(groups, WINDOW, ALIGN)
    assert _windows(files, lambda local: None) == {0: None, 1: None}

    def failing(local: int) -> None:
        raise ValueError("no plan")
    failed = _windows(files, failing)
    assert isinstance(failed[0], ValueError) and isinstance(failed[1], NodeError)
    assert "rank(s) 0 (pid" in str(failed[1]) and "failed while the node was agreeing what it reads together" in \
        str(failed[1])


def test_every_rank_gets_local_rank_0s_answer_on_a_warm_page_cache(tmp_path: Path) -> None:
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for file in files:
        file.write_bytes(os.urandom(64 * ALIGN))
        file.read_bytes()
    assert _answers(files) == {0: True, 1: True}
    kept = evicted(files[1:]) == 64 * ALIGN  # (a file system that keeps its pages: still warm)
    assert _answers(files) == {0: kept, 1: kept}


def test_a_page_cache_that_dropped_a_few_pages_is_still_warm(tmp_path: Path) -> None:
    """At least WARM_AT of the pages cached is warm (a page cache under pressure drops a few); fewer is cold."""
    file = tmp_path / "a.bin"
    file.write_bytes(os.urandom(256 * ALIGN))
    file.read_bytes()
    for dropped, warm in ((1, 255 / 256 >= WARM_AT), (16, 240 / 256 >= WARM_AT)):
        os.sync()
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, dropped * ALIGN, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        pages = PageCache()
        held = pages.resident(file, 0, 256 * ALIGN)
        pages.close()
        kept = held == (256, 256)  # (a file system that keeps its pages: warm whatever was asked)
        assert kept or held == (256 - dropped, 256), held
        assert _answers([file]) == {0: kept or warm, 1: kept or warm}
        file.read_bytes()
    assert (255 / 256 >= WARM_AT, 240 / 256 >= WARM_AT) == (True, False)


def _cold_files(tmp_path: Path) -> list[Path]:
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for file in files:
        file.write_bytes(os.urandom(64 * ALIGN))
    if evicted(files):
        pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED: a node here is always warm")
    return files


def test_a_window_without_room_in_shared_memory_makes_the_node_read_alone_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A container's /dev/shm (Docker's default: 64 MiB) may not hold the window: local rank 0 then hands every
    rank None (each reads alone) and warns once, with the bytes needed and free and the ways to give it room;
    a window that fits exactly is read together."""
    files = _cold_files(tmp_path)
    groups = [[PlannedRange(files[0], 0, 3 * ALIGN, True)], [PlannedRange(files[1], 0, 5 * ALIGN, True)]]
    plan = windows_of(groups, WINDOW, ALIGN)
    needed = HEADER + PARTS * plan.part
    assert plan.part == 16 * ALIGN  # (WINDOW / PARTS, the layers being smaller)
    for free, together in ((needed - 1, False), (needed, True)):
        monkeypatch.setattr(node_plan, "shared_room", lambda directory, free=free: free)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="wna16_loader"):
            answers = _windows(files, lambda local: groups)
        assert answers == ({0: plan, 1: plan} if together else {0: None, 1: None})
        warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert warnings == ([] if together else [
            f"node {_key(warnings)}: its shared window needs {needed} bytes ({needed / 2**20:.1f} MiB: {PARTS} parts "
            f"of {plan.part} bytes, Node.window_bytes={WINDOW} / {PARTS} grown to the largest layer the node reads) "
            f"in /dev/shm, which has {free} bytes free. Give the machine's shared memory room for it and for "
            f"whatever else uses it (Docker: --shm-size=1g or more, or --ipc=host; Kubernetes: a memory-backed "
            f"emptyDir mounted at /dev/shm). Or pass Node(window_bytes=...) smaller (down to {PARTS} times the "
            f"largest layer). Until then its ranks read alone: each reads every byte it needs itself, direct."])


def _key(warnings: list[str]) -> str:
    """The node key a warning names (each `_windows` call makes a fresh one)."""
    return warnings[0].split(":", 1)[0].removeprefix("node ") if warnings else ""


def test_shared_room_is_what_statvfs_leaves_a_user_and_none_where_there_is_no_directory(tmp_path: Path) -> None:
    found = os.statvfs(tmp_path)
    room = shared_room(tmp_path)
    assert room % found.f_frsize == 0 and abs(room - found.f_bavail * found.f_frsize) <= 64 * found.f_frsize
    assert shared_room(tmp_path / "missing") == 0
