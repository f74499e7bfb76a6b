"""SIGTERM (what schedulers, ``timeout`` and torchrun send) ends any command as Ctrl-C
does: a ``KeyboardInterrupt`` in the main thread, so the command's own clean-up runs (a
preprocess removes its temporary dataset, training writes its final checkpoint and
metrics.json) and the exit code is 143 (128 + SIGTERM). While the training loop runs, its
own handlers take over (train/stop.py: the loop ends at a step boundary)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_seen = threading.Event()  # the SIGTERM of the command running now (``terminated()``)


def terminated() -> bool:
    """Whether the command running now received SIGTERM."""
    return _seen.is_set()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """For the ``with`` block: SIGTERM raises KeyboardInterrupt (a second one exits at
    once, 143); the previous handler is restored after it (the CLI may run inside
    another program, a test). Outside the main thread, nothing changes."""
    global _seen
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen = _seen = threading.Event()

    def handler(signum, frame):
        if seen.is_set():  # a second SIGTERM: stop now
            raise SystemExit(143)
        seen.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
