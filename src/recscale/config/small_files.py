"""Small files at paths a user names or shares: reading a config, a plan, a calibration
or a device catalogue (a regular file of bounded size, or a one-line error naming the
key), and writing a run's records (never through a link planted at the name).

``Path.read_text`` on such a name would hang on a FIFO (the open waits for a writer) and
read ``/dev/zero`` until the memory is gone; these files are kilobytes, so anything that
is not a regular file, or is larger than ``MAX_BYTES``, is refused before it is read.
``Path.write_text`` follows a symbolic link: one planted in a run directory (a shared
``/tmp``) would have a run overwrite the file it points to.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import tempfile
import tomllib
from pathlib import Path
from typing import Any

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


def kind_of(path: str | os.PathLike) -> str:
    """What an existing ``path`` is, for a message: "a file", "a directory", "a
    character device" (``--run-dir /dev/null`` read "is a file")..."""
    mode = os.stat(path).st_mode
    return not_a_file(mode) or "a file"


def user_cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/recscale``, or ``~/.cache/recscale``: where a host's calibration
    and probe records are kept. The variable counts only when absolute (the XDG rule):
    set empty or relative, the files landed in whatever directory a command ran from.
    None when there is no home to find (no HOME and no password entry)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "recscale"
    try:
        return Path.home() / ".cache" / "recscale"
    except RuntimeError:  # "Could not determine home directory"
        return None


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


def loads_json(text: str) -> Any:
    """``json.loads``, with a document nested deeper than Python's recursion limit (a
    damaged or hostile file: 10^5 ``[``) a ``json.JSONDecodeError`` as any other
    malformed JSON, not a RecursionError that no caller expects."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def json_text(obj: Any, **dumps_args: Any) -> str:
    """``obj`` as standard JSON: a float that is not finite (the AUC of a split holding one
    class) becomes null - Python writes ``NaN``, which is not JSON and which other
    readers (jq, JavaScript, most JSON libraries) reject."""

    def finite(o: Any) -> Any:
        if isinstance(o, float):
            return o if math.isfinite(o) else None
        if isinstance(o, dict):
            return {k: finite(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [finite(v) for v in o]
        return o

    return json.dumps(finite(obj), allow_nan=False, **dumps_args)


def loads_toml(text: str) -> dict[str, Any]:
    """``tomllib.loads``, with arrays nested deeper than Python's recursion limit a
    ``tomllib.TOMLDecodeError`` as any other malformed TOML (tomllib parses nested
    arrays recursively: a RecursionError otherwise)."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise tomllib.TOMLDecodeError("nests arrays or tables too deeply") from None


def write_text_atomic(path: str | Path, text: str) -> None:
    """``path`` replaced whole or not at all: ``text`` goes into a new file beside it
    (created with a random name, never opened through a link), which is renamed over
    ``path`` - a rename replaces a symbolic link at ``path``, it does not write through
    it. The temporary file goes on any error (a full disk included), and the error says
    which file could not be written."""
    write_bytes_atomic(path, text.encode("utf-8"))


def refuse_replacing_special(path: str | Path) -> None:
    """An OSError where ``path`` is a device, FIFO or socket: a rename over it replaces
    the node itself (as root, ``--out /dev/null`` left a regular file at /dev/null). A
    regular file or a symbolic link (the link is replaced, never its target) passes."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    kind = None if stat.S_ISLNK(mode) else not_a_file(mode)
    if kind is not None:
        raise OSError(errno.EEXIST, f"cannot write {path}: it is {kind}; refused (name a file)")


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """:func:`write_text_atomic` for bytes (a plot's PNG); never over a device, FIFO or
    socket (:func:`refuse_replacing_special`)."""
    path = Path(path)
    refuse_replacing_special(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would make it (mkstemp: 0600)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
        raise


def open_log(path: str | Path, append: bool):
    """``path`` opened for writing text lines (appending, or from empty; ``\\n`` written
    as is, as csv wants), refused where it is a symbolic link or not a regular file (a
    FIFO would block the open)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_APPEND if append else os.O_TRUNC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        why = "a symbolic link" if os.path.islink(path) else e.strerror
        raise OSError(e.errno, f"cannot write {path}: {why}; refused") from None
    kind = not_a_file(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise OSError(0, f"cannot write {path}: it is {kind}; refused")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a" if append else "w", encoding="utf-8", newline="")


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it to read it,
    a moment in which another thread's new file would get the wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
