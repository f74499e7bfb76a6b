"""Reading the small files a user names (a config, a plan, a calibration, a device
catalogue): a regular file of bounded size, or a one-line error naming the key.

``Path.read_text`` on such a name would hang on a FIFO (the open waits for a writer) and
read ``/dev/zero`` until the memory is gone; these files are kilobytes, so anything that
is not a regular file, or is larger than ``MAX_BYTES``, is refused before it is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from recscale.config.errors import ConfigError

MAX_BYTES = 16 << 20  # the largest config, plan or catalogue read: 16 MiB (they are kB)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(mode: int) -> str | None:
    """What a ``st_mode`` is when it is not a regular file ("a FIFO"...), else None."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_small_text(path: str | Path, key: str, limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``: a regular file of at most ``limit`` bytes (symbolic
    links followed: a user may link a config). Anything else is a :class:`ConfigError`
    naming ``key`` and what the path is; a file that is not UTF-8 names the byte."""
    try:
        # O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a
        # writer; it changes nothing for a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror or e}") from None
    try:
        kind = not_a_file(os.fstat(fd).st_mode)
        if kind is not None:
            raise ConfigError(key, f"{path} is {kind}; name a file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)  # + 1: a file that grew past its size is still caught
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError(key, f"{path} is larger than {limit >> 20} MiB; this is not such a file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(key, f"{path} is not UTF-8 text (byte {e.start})") from None
