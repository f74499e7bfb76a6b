"""How the commands print what went wrong: one ``recscale: error: ...`` line (a bad-line
report may add lines of its own) with every control character of what the user or a
file put in it - a path, a value - shown escaped. A path holding ESC sequences would
otherwise rewrite the terminal it is printed to (colours, the title, the screen)."""

from __future__ import annotations

import sys

# C0 controls but the line feed (reports span lines), DEL and the C1 controls
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c != 0x0A}


def printable(text: str) -> str:
    """``text`` with control characters written as ``\\xNN`` (line feeds kept)."""
    return text.translate(_CONTROL)


def print_error(message: object) -> None:
    """``recscale: error: MESSAGE`` on standard error, control characters escaped."""
    print(f"recscale: error: {printable(str(message))}", file=sys.stderr)
