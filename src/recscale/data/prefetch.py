"""Run a batch iterator ahead of the consumer on a background thread.

The producer (data generation, file reads) releases the GIL inside NumPy/torch
kernels, so on a multi-core machine preparing batch t+1 overlaps with step t.
Exceptions raised by the producer are re-raised in the consumer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_DONE = object()


class Prefetcher(Generic[T]):
    def __init__(self, source: Iterable[T], depth: int = 4) -> None:
        self._source = source
        self._depth = depth

    def __iter__(self) -> Iterator[T]:
        if self._depth <= 0:
            yield from self._source
            return
        q: queue.Queue = queue.Queue(maxsize=self._depth)
        stop = threading.Event()

        def produce() -> None:
            try:
                for item in self._source:
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                q.put(_DONE)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                q.put(e)

        thread = threading.Thread(target=produce, name="recscale-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=5)
