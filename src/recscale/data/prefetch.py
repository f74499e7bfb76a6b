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
    def __init__(self, source: Iterable[T], depth: int = 4, pin: bool = False) -> None:
        """``pin``: page-lock each item (``item.pin_memory()``) on the producer thread, for
        asynchronous copies to a GPU (see :class:`DeviceFeeder`)."""
        self._source = source
        self._depth = depth
        self._pin = pin

    def __iter__(self) -> Iterator[T]:
        if self._depth <= 0:
            yield from self._source
            return
        q: queue.Queue = queue.Queue(maxsize=self._depth)
        stop = threading.Event()

        def produce() -> None:
            try:
                for item in self._source:
                    if self._pin:
                        item = item.pin_memory()
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


class DeviceFeeder:
    """Batches already on ``device`` when the step asks for them.

    On CUDA: each batch (pinned by the loader's thread: ``Prefetcher(pin=True)``) is
    copied to the GPU one batch ahead on a side stream, so the copy of batch t+1
    overlaps step t; the step's stream waits on the copy's event, and the tensors are
    marked as used by that stream (so the caching allocator never hands their memory
    out while the step still reads them). Elsewhere it yields the batches as they come
    (``batch.to`` in the step is then a no-op or a plain copy).
    """

    def __init__(self, batches: Iterable, device) -> None:
        import torch

        self._batches, self._device = batches, device
        self._cuda = device.type == "cuda" and torch.cuda.is_available()

    def __iter__(self) -> Iterator:
        if not self._cuda:
            yield from self._batches
            return
        import torch

        side = torch.cuda.Stream(device=self._device)
        pending, source = None, iter(self._batches)
        while True:
            try:
                batch = next(source)
            except StopIteration:
                break
            except BaseException:
                # the step whose batch is already here runs first (as on the CPU, where
                # an error or Ctrl-C while reading batch t+1 comes after step t)
                if pending is not None:
                    yield self._hand_over(*pending)
                raise
            with torch.cuda.stream(side):
                moved = batch.to(self._device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(side)
            if pending is not None:
                yield self._hand_over(*pending)
            pending = (moved, ready)
        if pending is not None:
            yield self._hand_over(*pending)

    @staticmethod
    def _hand_over(batch, ready):
        import torch

        main = torch.cuda.current_stream()
        main.wait_event(ready)
        for t in batch.tensors():
            t.record_stream(main)
        return batch
