"""The train pipeline: batch t+1's input dist and cache prefetch run while batch t computes.

A background thread takes the next local batch, moves it to the device, runs the
sharded collection's input dist (bucketize, all-to-all of lengths, ids and weights,
regroup) on the ``input`` process group, makes its rows resident in any host/ssd
tier's cache (``prefetch``), and hands the :class:`LocalBatch` over (``enqueue``); the
training step's forward finds it ready and goes straight to the lookups. The GIL is
released inside the collectives, file reads and tensor kernels, so the two overlap on
a multi-core host. At world size 1 the input dist is the identity and only the
prefetch runs (the pipeline is used there only for tiered tables).

The thread runs at a lower scheduling priority (``BACKGROUND_NICE``, Linux): it is
work ahead of time, and where the cores are all busy (2 vCPUs: the step's two OpenMP
threads and this one) a full time slice of it stalls the step's parallel regions -
config A at a 10% ssd cache spent 8 ms a step in a lookup waiting for it. When the
step waits for its batch, the thread has the cores to itself anyway.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator

from recscale.data.batch import Batch
from recscale.distributed.sharded_embedding import ShardedEmbeddingBagCollection

_DONE = object()
BACKGROUND_NICE = 10  # added to the pipeline thread's nice value (Linux threads only)


class InputStalled(RuntimeError):
    """No batch came from the pipeline's thread within its ``stall_seconds``."""


def lower_thread_priority(by: int = BACKGROUND_NICE) -> bool:
    """Lower the calling thread's priority by ``by`` (Linux: a thread's own nice value;
    elsewhere ``setpriority`` would take the whole process, so nothing is done)."""
    if sys.platform != "linux":
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:  # a sandbox without it: the run goes on at the same priority
        return False
    return True


class EmbeddingPipeline:
    """Iterate local batches whose input dist already ran ``ahead`` batches early.

    Collectives must match across ranks, so the thread distributes batch t+ahead+1
    only once the consumer has taken batch t (a permit per consumed batch): ranks that
    stop after the same number of steps have run exactly the same collectives, and
    ``close()`` can join the thread without a rank waiting on a partner that stopped.

    ``stall_seconds`` > 0: a batch that the thread has not handed over after that long
    raises :class:`InputStalled` with ``stall_message`` (what it waits on: a tier's file on
    a stalled device, or a peer rank that stopped) instead of waiting for ever.
    """

    def __init__(
        self,
        batches: Iterable[Batch],
        ebc: ShardedEmbeddingBagCollection,
        device,
        ahead: int = 1,
        stall_seconds: float = 0.0,
        stall_message: str = "",
    ) -> None:
        self._batches, self._ebc, self._device = iter(batches), ebc, device
        self._stall, self._stall_message = stall_seconds, stall_message
        self.stalled = False  # InputStalled was raised: close() need not wait the thread out
        self._permits = threading.Semaphore(ahead)
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.prefetch_seconds = 0.0  # time spent making rows resident (cached tiers)
        self._thread = threading.Thread(target=self._run, name="recscale-input-dist", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_thread_priority()
        try:
            while True:
                # A permit once taken is always used, stop or not: every rank then runs
                # exactly ``ahead`` + (batches consumed) input collectives.
                while not self._permits.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                batch = next(self._batches, None)
                if batch is None:
                    self._queue.put(_DONE)
                    return
                batch = batch.to(self._device, non_blocking=True)
                local = self._ebc.distribute_input(
                    batch.values, batch.offsets, batch.batch_size, batch.weights
                )
                t = time.perf_counter()
                self._ebc.prefetch(local)
                self.prefetch_seconds += time.perf_counter() - t
                self._ebc.enqueue(local)
                self._queue.put(batch)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put(e)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            try:
                item = self._queue.get(timeout=self._stall or None)
            except queue.Empty:
                self.stalled = True
                raise InputStalled(
                    f"no batch in {self._stall:g} s: {self._stall_message}".rstrip(": ")
                ) from None
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            self._permits.release()
            yield item

    def close(self, timeout: float | None = None) -> None:
        """Stop after the collective in flight (every rank has the same one in flight)."""
        self._stop.set()
        self._thread.join(timeout)
        self._ebc.clear_ready()
