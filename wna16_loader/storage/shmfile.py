"""Files in shared memory that only this job uses: a node's window (`storage/node.py`) lives in /dev/shm, which
every user and container that shares the host's IPC namespace (`docker run --ipc=host`) can write to. A file found
there is trusted only once its open descriptor shows it is this job's own.

| create_private(path, who)  | a new file beside `path` under a random temporary name: O_CREAT|O_EXCL|O_NOFOLLOW, |
|                            | mode 0600 (whatever the umask), checked like an opened one                          |
| publish(temporary, path)   | `temporary` linked at `path`, never over anything already there, then unnamed       |
| open_own(path, who)        | the file at `path`, opened without following a link, or None where there is none   |

A file is this job's own (`check_own`) when it is a regular file, owned by this process's effective user, with no
permission bit for group or others, on the file system of its directory. Anything else at the name (another user's
file, a link, a file others may write) raises SharedMemoryError naming the file, its owner and mode, and what to do:
nothing is read from it.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from ..errors import SharedMemoryError

OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
PRIVATE = 0o600


def create_private(path: Path, who: str) -> tuple[int, Path]:
    """(descriptor, name) of a new, empty file beside `path`, named `{path.name}.{random}.tmp` (no one can take its
    name first), mode 0600, opened read-write. `who`: the owner of the file, for messages (e.g. `node KEY`)."""
    temporary = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(temporary, OPEN | os.O_CREAT | os.O_EXCL, PRIVATE)
    except OSError as error:
        raise SharedMemoryError(f"{who}: cannot create {temporary} ({error}): {path.parent} must be a directory "
                                f"this user may write, as /dev/shm is (mode 1777).") from error
    try:
        os.fchmod(fd, PRIVATE)
        check_own(fd, temporary, who)
    except BaseException:
        os.close(fd)
        os.unlink(temporary)
        raise
    return fd, temporary


def publish(temporary: Path, path: Path, who: str) -> None:
    """Give file `temporary` the name `path` (a hard link, which never replaces what holds the name), then drop its
    temporary name. Raises SharedMemoryError naming what holds `path` where something does (the temporary file is
    removed either way)."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise SharedMemoryError(f"{who}: cannot create {path}: {describe(path)} already holds the name (another "
                                f"user's file, or one a job that did not finish left); nothing was read from it. "
                                f"{remedy(path)}") from None
    except OSError as error:
        raise SharedMemoryError(f"{who}: cannot name {temporary} {path} ({error}).") from error
    finally:
        os.unlink(temporary)


def open_own(path: Path, who: str) -> int | None:
    """A read-write descriptor of the file at `path`, opened without following a link and checked to be this job's
    own (`check_own`); None where no file has the name. SharedMemoryError where one that is not its own does."""
    try:
        fd = os.open(path, OPEN)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO, errno.EISDIR):
            raise
        raise _not_own(path, who, describe(path)) from None
    try:
        check_own(fd, path, who)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_own(fd: int, path: Path, who: str) -> None:
    """Raise SharedMemoryError unless open file `fd` (named `path`) is this job's own: a regular file of this
    process's effective user, without permission bits for group or others, on the file system of `path`'s
    directory."""
    found = os.fstat(fd)
    wrong = [what for what, bad in (
        ("not a regular file", not stat.S_ISREG(found.st_mode)),
        (f"owned by {_user(found.st_uid)}, not by this process's {_user(os.geteuid())}", found.st_uid != os.geteuid()),
        (f"mode {_mode(found.st_mode)} lets group or others in (expected {_mode(PRIVATE)})", found.st_mode & 0o077),
        (f"on another file system than {path.parent}", found.st_dev != os.stat(path.parent).st_dev),
    ) if bad]
    if wrong:
        raise _not_own(path, who, f"a file {'; '.join(wrong)}")


def describe(path: Path) -> str:
    """What holds `path`, as a message says it: its kind, owner and mode (a link: and where it points)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return "nothing (it was removed meanwhile)"
    kind = "a regular file" if stat.S_ISREG(found.st_mode) else "a file of another kind"
    if stat.S_ISLNK(found.st_mode):
        kind = f"a symbolic link to {os.readlink(path)}"
    elif stat.S_ISDIR(found.st_mode):
        kind = "a directory"
    return f"{kind} owned by {_user(found.st_uid)}, mode {_mode(found.st_mode)}"


def _not_own(path: Path, who: str, what: str) -> SharedMemoryError:
    return SharedMemoryError(f"{who}: {path} is not this job's own file: it is {what}. Nothing was read from it. "
                             f"{remedy(path)}")


def remedy(path: Path) -> str:
    return (f"Remove it if no job uses it (its owner or root: rm {path}), or start the job again: a node that "
            f"Node.from_environment made names its window with a secret new to each job.")


def _user(uid: int) -> str:
    """`uid 1000 (alice)`, the name where the system knows one."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _mode(mode: int) -> str:
    return f"0{stat.S_IMODE(mode):o}"
