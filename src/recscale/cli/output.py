"""How the commands print: what went wrong as one ``recscale: error: ...`` line (a
bad-line report may add lines of its own), and everything a command prints - errors,
progress, the paths it wrote - with every control character of what the user or a file
put in it (a path, a value) shown escaped. A path holding ESC sequences would otherwise
rewrite the terminal it is printed to (colours, the title, the screen).

Under torchrun every rank runs the same command, and a bad config fails each of them
the same way: the error is printed by the first rank on a host to say it
(:func:`said_by_another_rank`), not once per rank."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

# C0 controls but the line feed (reports span lines), DEL and the C1 controls; and the
# lone surrogates that stand for a path's bytes that are not UTF-8 (``\udc9b`` is the
# byte 0x9b, a terminal's CSI): written as the byte they stand for, ``\x9b`` - a strict
# UTF-8 stream (any locale but C) cannot encode them and raised mid-command.
_CONTROL = {
    **{c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c != 0x0A},
    **{c: f"\\x{c - 0xDC00:02x}" for c in range(0xDC80, 0xDD00)},
}


# What a command's own output may carry: line feeds, and the carriage return that
# redraws the progress bar in place (tqdm); JSON output escapes its controls itself.
_CONTROL_BUT_CR = {c: r for c, r in _CONTROL.items() if c != 0x0D}


def printable(text: str) -> str:
    """``text`` with control characters written as ``\\xNN`` (line feeds kept)."""
    return text.translate(_CONTROL)


def print_error(message: object) -> None:
    """``recscale: error: MESSAGE`` on standard error, control characters escaped; nothing
    where another rank of this torchrun job on this host printed the same."""
    text = printable(str(message))
    if not said_by_another_rank(text):
        print(f"recscale: error: {text}", file=sys.stderr)


def said_by_another_rank(text: str) -> bool:
    """Whether another process of this torchrun job and attempt, on this host, has
    reported ``text``; else this one claims it and returns False.

    The claim is an empty file created exclusively in torchrun's own directory for the
    attempt (the parent of each rank's ``TORCHELASTIC_ERROR_FILE`` directory, beside the
    ranks' folders torchrun makes and leaves there), named by a hash of the text: no race
    between ranks that fail at once, and a message that differs - a rank's own - is
    printed by that rank. Outside torchrun, or where the directory cannot be written,
    always False."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not error_file or os.environ.get("LOCAL_WORLD_SIZE", "1").strip() in ("", "0", "1"):
        return False
    attempt_dir = os.path.dirname(os.path.dirname(error_file))
    digest = hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:32]
    try:
        fd = os.open(
            os.path.join(attempt_dir, f"recscale-error-{digest}"),
            os.O_CREAT | os.O_EXCL | os.O_WRONLY,
            0o600,
        )
    except FileExistsError:
        return True
    except OSError:  # no such directory, read-only: print it
        return False
    os.close(fd)
    return False


class EscapingStream:
    """A text stream that writes through to ``raw`` with control characters (but line
    feeds and carriage returns) escaped; everything else (``isatty``, ``fileno``,
    ``encoding``, ``flush``) is the raw stream's."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(text.translate(_CONTROL_BUT_CR))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


@contextlib.contextmanager
def escaped_output() -> Iterator[None]:
    """Standard output and error as ``EscapingStream``s for the block (a command's run),
    then as they were."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = EscapingStream(sys.stdout), EscapingStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
