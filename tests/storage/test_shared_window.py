"""storage/shared_window.py: a node's window file in /dev/shm, which other users of the host may share.

In one process: the waits' errors (a leader that never comes, ranks that planned differently, a failed rank, no
room), and every way a name another user (or a link, or a file others may write) holds fails closed on both sides
with SharedMemoryError naming the file, its owner and mode, reads nothing from it and leaves nothing of ours in
/dev/shm; a leader that cannot make the window tells the others at once. Then four real processes whose window name
was taken all raise the named error, well inside their timeout. (CI runs as root: a file is given another owner
with os.chown.)
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from processes import ran

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.errors import NodeError, SharedMemoryError
from wna16_loader.parallel.config import Node
from wna16_loader.storage import shared_window as window_module
from wna16_loader.storage.buffers import ALIGN
from wna16_loader.storage.readahead import ReadOptions
from wna16_loader.storage.shared_window import FILE_WORDS, HEADER, MAGIC, SharedWindow, Word
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

SHM = Path("/dev/shm")
OTHER_UID = 4242  # a user that is not this process's


@pytest.fixture
def key() -> Iterator[str]:
    """A fresh node key; every file of it left in /dev/shm removed after the test (the test asserts none of ours)."""
    key = f"test-{uuid.uuid4().hex}"
    yield key
    for path in SHM.glob(f"wna16-node-{key}*"):
        path.unlink()


def ours(key: str) -> list[str]:
    """The names in /dev/shm of this key's files."""
    return sorted(path.name for path in SHM.glob(f"wna16-node-{key}*"))


def squat(path: Path, *, uid: int = OTHER_UID, mode: int = 0o666, size: int = HEADER + 3 * ALIGN) -> None:
    """Another user's file at `path`, made to pass every check but ownership: a window header that fits."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.ftruncate(fd, size)
    os.pwrite(fd, bytes((ctypes.c_int64 * FILE_WORDS)(MAGIC, size, 2, 0, 0)), 0)
    os.close(fd)
    os.chown(path, uid, uid)
    os.chmod(path, mode)


def rank(key: str, local: int, part: int | None = ALIGN, timeout_s: float = 30) -> SharedWindow:
    return SharedWindow(Node((0, 1), local, key, timeout_s=timeout_s), part)


def test_a_follower_without_its_leader_times_out_naming_the_key(key: str) -> None:
    node = Node((0, 1), 1, key, timeout_s=0.2)
    with pytest.raises(NodeError, match=f"node {node.key}: local rank 0 \\(global rank 0\\) did not create the "
                                        f"shared window /dev/shm/wna16-node-{node.key} within timeout_s=0.2; start "
                                        f"every rank of the node with the same Node.key"):
        SharedWindow(node, ALIGN)


def test_ranks_that_planned_different_windows_are_told_so(key: str) -> None:
    leader = rank(key, 0, 2 * ALIGN, timeout_s=1)
    try:
        with pytest.raises(NodeError, match=f"the shared window /dev/shm/wna16-node-{key} holds {4096 + 6 * ALIGN} "
                                            f"bytes for 2 ranks, this rank planned {4096 + 3 * ALIGN} bytes for 2: "
                                            f"the ranks planned different loads"):
            rank(key, 1, ALIGN, timeout_s=1)
    finally:
        leader.unlink()
        leader.close()


def test_a_failed_rank_is_named_by_the_others(key: str) -> None:
    leader, follower = rank(key, 0, timeout_s=5), rank(key, 1, timeout_s=5)
    leader.unlink()
    follower.set(Word.FAILED, 1)
    with pytest.raises(NodeError, match=f"node {key}: rank\\(s\\) 1 \\(pid {os.getpid()}\\) failed while the node was "
                                        f"reading window 0 of 1 \\(its own error says why\\); rank 0 stops its load "
                                        f"too. Restart every rank of the node."):
        leader.wait(Word.READ, 1, "reading window 0 of 1", lambda: None)
    leader.close()
    follower.close()


def test_node_rejects_what_cannot_name_a_window() -> None:
    with pytest.raises(ValueError, match="Node: key='a/b' must be 1-120 letters, digits"):
        Node((0, 1), 0, "a/b")
    with pytest.raises(ValueError, match="Node: local_rank=2 is out of range for 2 ranks; valid local ranks are 0..1."):
        Node((0, 1), 2, "k")


def test_a_window_file_without_room_raises_naming_it_and_leaves_no_file(
        key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local rank 0 writes the window file's header (not a store through its mapping, which would kill the
    process with SIGBUS where /dev/shm is full): ENOSPC raises SharedMemoryError, and no file is left behind."""
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(window_module.os, "pwrite", full)
    with pytest.raises(SharedMemoryError) as caught:
        rank(key, 0, 2 * ALIGN, timeout_s=1)
    monkeypatch.undo()
    assert re.fullmatch(
        f"node {key}: writing 40 bytes of /dev/shm/wna16-node-{key}\\.[0-9a-f]{{16}}\\.tmp failed \\(\\[Errno 28\\] No "
        f"space left on device\\): /dev/shm has \\d+ bytes free\\. Give the machine's shared memory room for it and "
        f"for whatever else uses it \\(Docker: --shm-size=1g or more, or --ipc=host; Kubernetes: a memory-backed "
        f"emptyDir mounted at /dev/shm\\)\\.", str(caught.value)), str(caught.value)
    assert ours(key) == []


# --- a name that is not the job's own ---------------------------------------------------------------------------

def taken(key: str, what: str) -> str:
    """What local rank 0 is told when `what` holds its window's name."""
    path = SHM / f"wna16-node-{key}"
    return (f"node {key}: cannot create {path}: {what} already holds the name (another user's file, or one a job "
            f"that did not finish left); nothing was read from it. Remove it if no job uses it (its owner or root: "
            f"rm {path}), or start the job again: a node that Node.from_environment made names its window with a "
            f"secret new to each job.")


def refused(key: str, what: str) -> str:
    """What another rank is told when `what` holds the window's name."""
    path = SHM / f"wna16-node-{key}"
    return (f"node {key}: {path} is not this job's own file: it is {what}. Nothing was read from it. Remove it if no "
            f"job uses it (its owner or root: rm {path}), or start the job again: a node that Node.from_environment "
            f"made names its window with a secret new to each job.")


def both_refuse(key: str, leader_text: str, follower_text: str) -> None:
    """Local rank 0 and another rank each raise SharedMemoryError with their text, at once (timeouts of 30 s)."""
    start = time.monotonic()
    with pytest.raises(SharedMemoryError) as leader:
        rank(key, 0)
    with pytest.raises(SharedMemoryError) as follower:
        rank(key, 1)
    assert (str(leader.value), str(follower.value)) == (leader_text, follower_text)
    assert time.monotonic() - start < 10  # (not the 30 s timeouts)


def test_another_users_file_at_the_name_is_refused_by_every_rank(key: str) -> None:
    squat(SHM / f"wna16-node-{key}")
    me = "uid 0 (root)" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    both_refuse(key, taken(key, f"a regular file owned by uid {OTHER_UID}, mode 0666"),
                refused(key, f"a file owned by uid {OTHER_UID}, not by this process's {me}; mode 0666 lets group or "
                             f"others in (expected 0600)"))
    assert ours(key) == [f"wna16-node-{key}"]  # the squatter's file alone: no temporary file of ours


def test_a_symbolic_link_at_the_name_is_refused_by_every_rank(key: str, tmp_path: Path) -> None:
    target = tmp_path / "window"
    squat(target, uid=os.geteuid(), mode=0o600)  # (a link to a file that would pass every check)
    (SHM / f"wna16-node-{key}").symlink_to(target)
    me = "uid 0 (root)" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    what = f"a symbolic link to {target} owned by {me}, mode 0777"
    both_refuse(key, taken(key, what), refused(key, what))
    assert ours(key) == [f"wna16-node-{key}"]


def test_a_file_of_this_user_that_others_may_write_is_refused(key: str) -> None:
    squat(SHM / f"wna16-node-{key}", uid=os.geteuid(), mode=0o644)
    me = "uid 0 (root)" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    both_refuse(key, taken(key, f"a regular file owned by {me}, mode 0644"),
                refused(key, "a file mode 0644 lets group or others in (expected 0600)"))
    assert ours(key) == [f"wna16-node-{key}"]


def test_a_name_taken_while_local_rank_0_makes_the_window_fails_both_sides(
        key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The name is free when local rank 0 starts, and taken before it publishes its file."""
    made = window_module.create_private

    def then_taken(path: Path, who: str) -> tuple[int, Path]:
        found = made(path, who)
        squat(path)
        return found
    monkeypatch.setattr(window_module, "create_private", then_taken)
    me = "uid 0 (root)" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    both_refuse(key, taken(key, f"a regular file owned by uid {OTHER_UID}, mode 0666"),
                refused(key, f"a file owned by uid {OTHER_UID}, not by this process's {me}; mode 0666 lets group or "
                             f"others in (expected 0600)"))
    assert ours(key) == [f"wna16-node-{key}"]


def test_a_leader_that_cannot_make_the_window_tells_the_others_at_once(
        key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing the window's carried bytes fails (ENOSPC); the header-only file that says so still fits: the other
    rank raises NodeError naming local rank 0 at once, not after its 30 s timeout, and nothing is left."""
    write = os.pwrite

    def full_past_a_page(fd: int, data: bytes, at: int) -> int:
        if len(data) > HEADER:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data, at)
    monkeypatch.setattr(window_module.os, "pwrite", full_past_a_page)
    errors: list[BaseException] = []

    def leader() -> None:
        try:
            SharedWindow(Node((0, 1), 0, key, timeout_s=30), ALIGN, carry=bytes(2 * HEADER))
        except BaseException as error:
            errors.append(error)
    thread, start = threading.Thread(target=leader), time.monotonic()
    thread.start()
    follower = SharedWindow(Node((0, 1), 1, key, timeout_s=30), None)
    with pytest.raises(NodeError) as caught:
        follower.wait(Word.PID, 1, "attaching the shared window", lambda: None)
    follower.close()
    thread.join(30)
    assert str(caught.value) == (f"node {key}: rank(s) 0 (pid {os.getpid()}) failed while the node was attaching the "
                                 f"shared window (its own error says why); rank 1 stops its load too. Restart every "
                                 f"rank of the node.")
    assert [type(error) for error in errors] == [SharedMemoryError]
    assert "No space left on device" in str(errors[0])
    assert time.monotonic() - start < 10 and ours(key) == []


# --- four real processes -------------------------------------------------------------------------------------

def _squatted(local: int, key: str, folder: str, out: str) -> None:
    node = Node((0, 1, 2, 3), local, key, timeout_s=60)
    start = time.monotonic()
    try:
        load_experts(folder, ParallelConfig(tp_size=4, tp_rank=local), reads=ReadOptions(node=node))
        text, kind = "no error", ""
    except Exception as exc:
        text, kind = str(exc), type(exc).__name__
    Path(out, f"rank{local}.json").write_text(json.dumps({"error": text, "type": kind,
                                                          "seconds": time.monotonic() - start}))


def test_four_ranks_whose_window_name_was_taken_all_raise_the_named_error(key: str, tmp_path: Path) -> None:
    """Another user took the name of the node's first rendezvous (`.plan`) with a file that fits: every rank
    raises SharedMemoryError, none waits out its 60 s timeout, and none loads."""
    ckpt = write_checkpoint(tmp_path / "ckpt", quant_config("awq"), num_experts=4, hidden=128, intermediate=256,
                            num_layers=2, references=False)
    squat(SHM / f"wna16-node-{key}.plan")
    ran(_squatted, (key, str(ckpt.folder), str(tmp_path)), 4)
    results = [json.loads((tmp_path / f"rank{local}.json").read_text()) for local in range(4)]
    assert [r["type"] for r in results] == ["SharedMemoryError"] * 4, results
    assert results[0]["error"].startswith(f"node {key}: cannot create {SHM}/wna16-node-{key}.plan: a regular file "
                                          f"owned by uid {OTHER_UID}, mode 0666 already holds the name")
    for result in results[1:]:
        assert result["error"].startswith(f"node {key}: {SHM}/wna16-node-{key}.plan is not this job's own file")
    assert all(r["seconds"] < 30 for r in results), results
    assert ours(key) == [f"wna16-node-{key}.plan"]
