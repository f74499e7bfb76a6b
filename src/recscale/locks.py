"""One writer per directory: a run directory, a dataset being written.

``hold(path, what)`` takes an exclusive ``flock`` on ``path`` (a lock file, created
without following a link) and writes this process's pid into it; a second writer gets
``LockedError`` naming the holder's pid. The lock is the kernel's: it goes with the
process however that ends (a crash, SIGKILL), so a stale lock file never blocks.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

_held: dict[str, int] = {}  # path -> fd, for the life of the process (or release())


class LockedError(RuntimeError):
    """Another process writes there; the message names it and its pid."""


def hold(path: Path, what: str) -> None:
    """Lock ``path`` for this process (again in the same process: a no-op)."""
    key = str(Path(path).absolute())
    if key in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LockedError(f"{path} is a symbolic link; refusing to use it as a lock") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        # a FIFO, a device, or a hard link to a file elsewhere: the lock's pid would be
        # written into (and the file truncated under) whatever it is
        os.close(fd)
        raise LockedError(
            f"{path} is not a lock file recscale made ("
            + ("a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a regular file")
            + "); remove it if nothing else needs it"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise LockedError(f"{what} is being written by another process (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = fd


def release(path: Path) -> None:
    """Give the lock up (and remove its file) before the process ends."""
    fd = _held.pop(str(Path(path).absolute()), None)
    if fd is not None:
        Path(path).unlink(missing_ok=True)
        os.close(fd)
