"""Ctrl-C and SIGTERM while training: stop at the next step boundary, never mid-step.

A ``KeyboardInterrupt`` raised wherever the signal lands can cut a step in half (the
fused sparse update done on some tables and not on others, in the checkpoint that
follows) or land inside a thread pool's wait and surface as a ``RuntimeError`` from its
lock instead. So while the loop runs, the first SIGINT or SIGTERM only records itself;
the loop reads it once a step and ends there - every rank at the same step, since the
request rides on the step's all-reduce (``train.parallel.reduce_step``). A second
signal stops at once (``KeyboardInterrupt``), for a step that hangs.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StopRequest:
    """The first stop signal received (``signum``), or None."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def handler(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: now
        self.signum = signum


@contextmanager
def stop_at_step_boundary() -> Iterator[StopRequest]:
    """Handlers for SIGINT and SIGTERM that fill the yielded request, restored after.
    Off the main thread (signals go to it only) nothing is installed. A signal the
    process was started ignoring (``nohup``) stays ignored."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, prev in previous.items():
        if prev is not signal.SIG_IGN:
            signal.signal(s, request.handler)
    try:
        yield request
    finally:
        for s, prev in previous.items():
            if prev is not None:
                signal.signal(s, prev)
