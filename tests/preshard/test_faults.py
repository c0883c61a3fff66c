"""wna16-shard under faults: disk full, kill -9, read-only output, OUT inside SRC, changed source, corrupt JSON.

Every fault must raise a WNA16Error subclass naming the file, and leave no manifest (an output without
wna16_manifest.json is unfinished and refused by load_experts).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from processes import sigint_default
from sources import make_source, tree_bytes

import wna16_loader.preshard as preshard
import wna16_loader.preshard.writing as writing
from wna16_loader import ParallelConfig, WNA16Error, load_experts
from wna16_loader.errors import CheckpointError, PreshardError
from wna16_loader.preshard import LOCK_NAME, MANIFEST_NAME, PLAN_NAME, make_plan, preshard_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ARGS = dict(tp_size=2, ep_size=2, max_file_size=20_000, progress=False)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source, finished output) shared by the tests that compare against a clean run."""
    base = tmp_path_factory.mktemp("clean")
    src = make_source(base / "src")
    preshard_checkpoint(src, base / "out", **ARGS)
    return src, base / "out"


def fail_writes(monkeypatch: pytest.MonkeyPatch, code: int, after: int) -> None:
    """Make the `after`+1-th safetensors write fail with OSError(code) (a full disk, a read-only folder)."""
    real, calls = writing._serialize, [0]

    def serialize(handle, metas, fetch, metadata, *progress):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(code, os.strerror(code))
        return real(handle, metas, fetch, metadata, *progress)

    monkeypatch.setattr(writing, "_serialize", serialize)


def assert_unfinished(out: Path) -> None:
    assert not (out / MANIFEST_NAME).exists() and not (out / LOCK_NAME).exists()
    assert not list(out.rglob(".*.tmp"))
    with pytest.raises(CheckpointError, match=r"unfinished wna16-shard output \(\.wna16-plan\.json but no"):
        preshard.read_manifest(out)
    with pytest.raises(CheckpointError, match=r"unfinished wna16-shard output.*--resume"):
        preshard.is_presharded(out)  # what load_experts and load_model_experts ask first


def test_disk_full_then_resume(clean: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, reference = clean
    out = tmp_path / "out"
    fail_writes(monkeypatch, errno.ENOSPC, after=3)
    with pytest.raises(PreshardError, match=r"out/rank-00000-of-00004/model-00002-of-00002\.safetensors: write failed: No space left "
                                            r"on device \(ENOSPC\); free disk space.*--resume") as exc:
        preshard_checkpoint(src, out, **ARGS)
    assert not isinstance(exc.value.__cause__, OSError)
    assert_unfinished(out)
    monkeypatch.undo()
    summary = preshard_checkpoint(src, out, resume=True, **ARGS)
    assert sum(r.kept for r in summary.ranks) == 3
    assert tree_bytes(out) == tree_bytes(reference)


def test_file_size_limit_in_subprocess(clean: tuple[Path, Path], tmp_path: Path) -> None:
    """A real failing write: RLIMIT_FSIZE makes write() fail with EFBIG (SIGXFSZ ignored)."""
    src, _ = clean
    out = tmp_path / "out"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (12000, 12000)); "
            "from wna16_loader.cli import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, str(src), str(out), "--tp", "2", "--ep", "2",
                          "--max-file-size", "20000", "--quiet"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2, run.stderr
    *warnings, error = run.stderr.splitlines()  # the serve warnings (no engine serves TP 2 x EP 2 of it) come first
    assert all(line.startswith("wna16-shard: warning: ") for line in warnings) and "Traceback" not in run.stderr
    assert error.startswith("wna16-shard: error: ")
    assert "write failed: File too large (EFBIG)" in error and ".safetensors" in error
    assert_unfinished(out)


def test_kill_at_random_points_then_resume(clean: tuple[Path, Path], tmp_path: Path) -> None:
    src, reference = clean
    total = len(make_plan(src, tp_size=2, ep_size=2, max_file_size=20_000).all_files())
    points = sorted(random.Random(6).sample(range(1, total), 3))
    code = ("import sys, wna16_loader.preshard.writing as p; p.KILL_AFTER_FILES = int(sys.argv[1]); "
            "from wna16_loader.cli import main; sys.exit(main(sys.argv[2:]))")
    for point in points:
        out = tmp_path / f"killed-{point}"
        run = subprocess.run([sys.executable, "-c", code, str(point), str(src), str(out), "--tp", "2", "--ep", "2",
                              "--max-file-size", "20000", "--quiet"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == -9, run.stderr
        assert not (out / MANIFEST_NAME).exists()
        with pytest.raises(CheckpointError, match=r"unfinished wna16-shard output.*--resume"):
            load_experts(out, ParallelConfig(2, 0, 2, 0))
        summary = preshard_checkpoint(src, out, resume=True, **ARGS)
        assert sum(r.kept for r in summary.ranks) == point, point
        assert tree_bytes(out) == tree_bytes(reference), point


def test_read_only_output_folder(clean: tuple[Path, Path], tmp_path: Path) -> None:
    src, _ = clean
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        if os.access(out, os.W_OK):
            pytest.skip("running as root: chmod 0o555 does not stop writes (see the read-only mount tests below)")
        with pytest.raises(PreshardError, match=rf"ro/\.wna16-shard\.lock: write failed: Permission denied "
                                                rf"\(EACCES\); make {out} writable \(chmod u\+w {out}\) or choose "
                                                rf"another output folder\. Nothing was written\.$"):
            preshard_checkpoint(src, out, **ARGS)
        assert list(out.iterdir()) == []
    finally:
        out.chmod(0o755)


READ_ONLY_MOUNT = """set -e
mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" || {
  stage="$(mktemp -d)"; cp -a "$1/." "$stage"; mount -t tmpfs none "$1"; cp -a "$stage/." "$1"
  mount -o remount,ro "$1"; }
shift; exec "$@"
"""


def run_read_only(folder: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`python -m wna16_loader.cli ARGS` with `folder` read-only: chmod where it binds this user; as root (who
    ignores chmod) a read-only bind mount, else a tmpfs remounted read-only, in a mount namespace of its own
    (`unshare -m`: nothing changes outside); skipped when neither is possible."""
    command = [sys.executable, "-m", "wna16_loader.cli", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
    for path in modes:
        path.chmod(modes[path] & ~0o222)
    try:
        if not os.access(folder, os.W_OK):
            return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    probe = subprocess.run(["unshare", "-m", "sh", "-c", READ_ONLY_MOUNT, "ro", str(folder), "sh", "-c",
                            f"! touch {folder}/.probe 2>/dev/null"], capture_output=True, timeout=60) \
        if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("cannot make a folder read-only here (root ignores chmod; no unshare -m with mount)")
    return subprocess.run(["unshare", "-m", "sh", "-c", READ_ONLY_MOUNT, "ro", str(folder), *command], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_complete_output_on_a_read_only_folder(clean: tuple[Path, Path], tmp_path: Path) -> None:
    """The same command on a finished output that is read-only: nothing to do (exit 0), no lock taken first."""
    src, _ = clean
    out = tmp_path / "out"
    preshard_checkpoint(src, out, **ARGS)
    before = tree_bytes(out)
    run = run_read_only(out, [str(src), str(out), "--tp", "2", "--ep", "2", "--max-file-size", "20000"])
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.startswith(f"wna16-shard: {out}: already complete: nothing to do")
    assert tree_bytes(out) == before


def test_unwritable_parent_is_the_folder_blamed(clean: tuple[Path, Path], tmp_path: Path) -> None:
    """OUT does not exist and its parent is read-only: the parent is named, and nothing was written."""
    src, _ = clean
    parent = tmp_path / "shelf"
    parent.mkdir()
    run = run_read_only(parent, [str(src), str(parent / "out"), "--tp", "2"])
    assert run.returncode == 2 and "Traceback" not in run.stderr
    line, = run.stderr.strip().splitlines()
    cause = ("Permission denied (EACCES); make {0} writable (chmod u+w {0}) or choose another output folder"
             if os.geteuid() else "Read-only file system (EROFS); {0} is on a read-only file system; choose an "
             "output folder on a writable one").format(parent)
    assert line == f"wna16-shard: error: {parent / 'out'}: cannot create it in {parent}: {cause}. Nothing was written."
    assert not (parent / "out").exists()


def test_permission_denied_mid_run(clean: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = clean
    out = tmp_path / "out"
    fail_writes(monkeypatch, errno.EACCES, after=0)
    with pytest.raises(PreshardError, match=r"common/model.*\.safetensors: write failed: Permission denied \(EACCES\); "
                                            r"make .*/out/common writable \(chmod u\+w .*/out/common\) or choose another "
                                            r"output folder\. No manifest was written, so the output is marked "
                                            r"unfinished\.$"):
        preshard_checkpoint(src, out, **ARGS)
    assert_unfinished(out)


def test_output_inside_source_refused(clean: tuple[Path, Path], tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    for out in (src / "sharded", src):
        with pytest.raises(PreshardError, match=r"inside the source folder .*src.*Choose an output folder outside"):
            preshard_checkpoint(src, out, **ARGS)
    assert not (src / "sharded").exists()


def test_source_changed_before_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    fail_writes(monkeypatch, errno.ENOSPC, after=2)
    with pytest.raises(PreshardError):
        preshard_checkpoint(src, out, **ARGS)
    monkeypatch.undo()
    victim = src / "model-00002-of-00002.safetensors"
    save_file(load_file(str(victim)), str(victim), metadata={"format": "pt", "edited": "yes"})
    with pytest.raises(PreshardError, match=rf"^{out} was written from {src}, which has changed since: it held "
                                            rf"model-00002-of-00002\.safetensors \(\d+ bytes, header sha256 "
                                            rf"[0-9a-f]{{12}}\); it now holds model-00002-of-00002\.safetensors "
                                            rf"\(\d+ bytes, header sha256 [0-9a-f]{{12}}\)\. Restore that source, or "
                                            rf"use a new output folder"):
        preshard_checkpoint(src, out, resume=True, **ARGS)
    assert_unfinished(out)


@pytest.mark.parametrize("victim", [MANIFEST_NAME, PLAN_NAME])
def test_corrupt_json_on_resume(clean: tuple[Path, Path], tmp_path: Path, victim: str) -> None:
    src, _ = clean
    out = tmp_path / "out"
    preshard_checkpoint(src, out, **ARGS)
    (out / victim).write_text('{"schema_version": 1, "params": {"tp"')
    with pytest.raises(PreshardError, match=rf"{victim}: corrupt \(JSONDecodeError.*Delete .*out and run") as exc:
        preshard_checkpoint(src, out, resume=True, **ARGS)
    assert isinstance(exc.value, WNA16Error) and exc.value.__cause__ is None


SLOW_COMMITS = '''\
"""Every process started with this folder on PYTHONPATH (workers included) commits a file every 0.4 s."""
import time
import wna16_loader.preshard.writing as writing
_real = writing._commit_file
def _slow(*args, **kwargs):
    time.sleep(0.4)
    return _real(*args, **kwargs)
writing._commit_file = _slow
'''


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_says_how_far_it_got(clean: tuple[Path, Path], tmp_path: Path, workers: str) -> None:
    """Ctrl-C from a terminal (SIGINT to the whole process group) once a file is finished: exit 130, one line,
    no traceback (none from a worker either), no temporary, lock or manifest left; --resume then finishes it."""
    src, reference = clean
    out, hooks = tmp_path / "out", tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_COMMITS)
    env = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-m", "wna16_loader.cli", str(src), str(out), "--tp", "2", "--ep", "2",
                             "--max-file-size", "20000", "--quiet", "--workers", workers], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_default)
    journal = out / preshard.JOURNAL_NAME
    deadline = time.monotonic() + 120
    while not (journal.is_file() and journal.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    total = len(make_plan(src, **{k: v for k, v in ARGS.items() if k != "progress"}).all_files())
    assert proc.returncode == 130, stderr
    assert stdout == "" and "Traceback" not in stderr
    *warnings, line = stderr.strip().splitlines()  # the serve warnings (no engine serves TP 2 x EP 2 of it) came
    assert all(" serves this output with --load-format wna16: " in w for w in warnings), stderr  # before the write
    done = int(line.removeprefix("wna16-shard: interrupted after ").split()[0])
    assert line == f"wna16-shard: interrupted after {done} of {total} files; re-run with --resume"
    assert 1 <= done < total
    assert_unfinished(out)
    summary = preshard_checkpoint(src, out, resume=True, **ARGS)
    assert sum(r.kept for r in summary.ranks) == done
    assert tree_bytes(out) == tree_bytes(reference)
