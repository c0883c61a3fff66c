"""Safe files for a pre-shard output: temporary name + fsync + rename, the output lock, and OSErrors
turned into PreshardErrors that name the file, the errno and the fix."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..errors import PreshardError
from ..storage.shared_window import alive

LOCK_NAME = ".wna16-shard.lock"


ERRNO_FIXES = {errno.ENOSPC: "free disk space or choose an output folder on a larger disk, then re-run with --resume",
               errno.EDQUOT: "raise the disk quota or free space, then re-run with --resume",
               errno.EFBIG: "raise the file size limit (ulimit -f) or use a smaller --max-file-size, then re-run "
                            "with --resume",
               errno.EACCES: "make {folder} writable (chmod u+w {folder}) or choose another output folder",
               errno.EPERM: "make {folder} writable (chmod u+w {folder}) or choose another output folder",
               errno.EROFS: "{folder} is on a read-only file system; choose an output folder on a writable one"}

UNFINISHED = "No manifest was written, so the output is marked unfinished."
NOTHING_WRITTEN = "Nothing was written."


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """fsync `tmp`, rename it over `final`, fsync the folder."""
    with open(tmp, "rb+") as handle:
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON (stable formatting) through a temporary file, fsync and rename; a file that already holds
    exactly that text is left untouched (its mtime too)."""
    text = json.dumps(data, indent=2) + "\n"
    if _holds(path, text.encode("utf-8")):
        return
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path, tmp):
        tmp.write_text(text, encoding="utf-8")
        commit(tmp, path)


def _holds(path: Path, data: bytes) -> bool:
    """Whether `path` is a file holding exactly `data`."""
    try:
        return path.stat().st_size == len(data) and path.read_bytes() == data
    except OSError:
        return False


def same_bytes(a: Path, b: Path) -> bool:
    """Whether files `a` and `b` both exist and hold the same bytes (small files: both are read whole)."""
    try:
        return a.is_file() and _holds(b, a.read_bytes())
    except OSError:
        return False


def sha256_file(path: Path) -> str:
    """sha256 of a whole file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(16 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def copy_file(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` safely (temporary name, fsync, rename); a `dst` with the same bytes is left untouched."""
    if same_bytes(src, dst):
        return
    tmp = dst.with_name(f".{dst.name}.tmp")
    with writing(dst, tmp):
        shutil.copyfile(src, tmp)
        commit(tmp, dst)


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """OUT/.wna16-shard.lock (O_CREAT|O_EXCL, holding the pid); a live holder refuses, a dead one is taken over."""
    path = out / LOCK_NAME
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            holder = _lock_holder(path)
            if holder is not None and alive(holder):
                raise PreshardError(f"{path}: another wna16-shard run (pid {holder}) is writing into {out}; wait "
                                    f"for it to finish, or delete the lock file if that process is gone.") from None
            path.unlink(missing_ok=True)  # stale: its process died (e.g. killed); resume is safe
        except OSError as exc:
            raise write_error(path, exc, NOTHING_WRITTEN) from None
    else:
        raise PreshardError(f"{path}: could not create the lock file; delete it and retry.")
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def locked_by_another(out: Path) -> bool:
    """Whether a live process other than this one holds OUT's lock (read only; nothing is written)."""
    holder = _lock_holder(out / LOCK_NAME)
    return holder is not None and holder != os.getpid() and alive(holder)


def _lock_holder(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def make_dir(folder: Path) -> None:
    """Create `folder` (and its parents); an OSError names the folder that refused: the first existing
    ancestor when `folder` does not exist yet (its parent is the one to make writable)."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if existing == folder:
            raise write_error(folder, exc) from None
        what = f"cannot create it in {existing}"
        raise write_error(folder, exc, NOTHING_WRITTEN, what=what, folder=existing) from None


@contextmanager
def writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """Turn an OSError while writing `path` into a PreshardError naming it, its errno and the fix
    (the temporary file `tmp` is removed)."""
    try:
        yield
    except OSError as exc:
        if tmp is not None:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        raise write_error(path, exc) from None


def write_error(path: Path, exc: OSError, outcome: str = UNFINISHED, *, what: str = "write failed",
                folder: Path | None = None) -> PreshardError:
    """The PreshardError for an OSError while writing `path`: errno text, the fix (naming `folder`, by
    default the one holding `path`) and the `outcome` (the output is unfinished, or nothing was written)."""
    fix = ERRNO_FIXES.get(exc.errno, "check the output folder and disk, then re-run with --resume")
    name = errno.errorcode.get(exc.errno, "?") if exc.errno else "?"
    fix = fix.format(folder=folder or path.parent)
    return PreshardError(f"{path}: {what}: {exc.strerror or exc} ({name}); {fix}. {outcome}")


def read_json(path: Path) -> Any:
    """A JSON file of OUT, or a PreshardError saying it is corrupt and what to do."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PreshardError(f"{path}: corrupt ({type(exc).__name__}: {exc}); it cannot be trusted to resume "
                            f"from. Delete {path.parent} and run wna16-shard again without --resume.") from None
