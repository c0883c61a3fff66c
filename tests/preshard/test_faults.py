"""wna16-shard under faults: disk full, kill -9, read-only output, OUT inside SRC, changed source, corrupt JSON.

Every fault must raise a WNA16Error subclass naming the file, and leave no manifest (an output without
wna16_manifest.json is unfinished and refused by load_experts).
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
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

    def serialize(handle, metas, fetch, metadata):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(code, os.strerror(code))
        return real(handle, metas, fetch, metadata)

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
    assert run.stderr.startswith("wna16-shard: error: ") and "Traceback" not in run.stderr
    assert "write failed: File too large (EFBIG)" in run.stderr and ".safetensors" in run.stderr
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
            pytest.skip("running as root: chmod 0o555 does not stop writes (see the EACCES test below)")
        with pytest.raises(PreshardError, match=r"ro/\.wna16-shard\.lock: write failed: Permission denied "
                                                r"\(EACCES\); make the output folder writable"):
            preshard_checkpoint(src, out, **ARGS)
        assert list(out.iterdir()) == []
    finally:
        out.chmod(0o755)


def test_permission_denied_mid_run(clean: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = clean
    out = tmp_path / "out"
    fail_writes(monkeypatch, errno.EACCES, after=0)
    with pytest.raises(PreshardError, match=r"common/model.*\.safetensors: write failed: Permission denied \(EACCES\); "
                                            r"make the output folder writable \(chmod u\+w\)"):
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
    with pytest.raises(PreshardError, match=r"(?s)changed source.*source file model-00002-of-00002.safetensors: "
                                            r"written .*size.*now"):
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
