"""Four stage threads connected by queues: batch n+1 packs while batch n computes.

`Pipeline.dispatch` is the batcher's hand-off: it takes one index reference for the batch
and queues it for stage 1; it never blocks (the batcher bounds batches in flight). Each
thread runs one stage for one batch at a time and passes the batch on; stage 4 resolves
every request and frees the batcher's slot. An exception in any stage fails that batch's
requests (the server answers INTERNAL) and the pipeline carries on with the next batch.

Before each stage the batch drops the requests whose deadline has passed or whose client
went away (`BatchState.drop`, counted through `on_dropped(stage, reason, n)`); a batch with
none left skips its remaining stages, so no GPU or C++ work is spent on answers nobody
reads. `on_batch_done(size, dispatched, service)` tells the batcher a batch has left and,
when it ran every stage, what they cost (the admission estimate learns from it; None for
a batch that failed or was dropped part-way).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from service.batcher import Pending
from service.pipeline.records import BatchState
from service.pipeline.stages import Stages
from service.serving_index import IndexHolder

log = logging.getLogger("grace.pipeline")
STAGES = ("input", "features", "compute", "post")
_STOP = object()


class Pipeline:
    def __init__(
        self,
        stages: Stages,
        indexes: IndexHolder,
        on_batch_done: Callable[[int, float, float | None], None],
        observe: Callable[[str, float], None] = lambda stage, seconds: None,
        on_dropped: Callable[[str, str, int], None] = lambda stage, reason, n: None,
    ) -> None:
        self.stages, self.indexes = stages, indexes
        self._done = on_batch_done
        self._observe = observe
        self._on_dropped = on_dropped
        self._queues: list[queue.Queue[object]] = [queue.Queue() for _ in STAGES]
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"grace-{name}", daemon=True)
            for i, name in enumerate(STAGES)
        ]
        for t in self._threads:
            t.start()
        self._lock = threading.Lock()
        self.in_flight = 0  # batches between dispatch and the end of stage 4

    def dispatch(self, pending: list[Pending]) -> None:
        with self._lock:
            self.in_flight += 1
        self._queues[0].put(BatchState(pending, self.indexes.current, time.monotonic()))

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the batches already dispatched, then end the threads (waiting at most
        `timeout` seconds in all: they are daemon threads)."""
        self._queues[0].put(_STOP)
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(end - time.monotonic(), 0.0))

    def _loop(self, i: int) -> None:
        name = STAGES[i]
        body = getattr(self.stages, name)
        while True:
            item = self._queues[i].get()
            if item is _STOP:
                if i + 1 < len(STAGES):
                    self._queues[i + 1].put(_STOP)
                return
            batch: BatchState = item  # type: ignore[assignment]
            if not self._keep(name, batch):
                self._finish(batch)  # nobody waits for any of it: skip the other stages
                continue
            t = time.perf_counter()
            try:
                out = body(batch)
            except Exception as exc:  # one batch fails, the pipeline goes on
                log.exception("stage %s failed for a batch of %d", name, len(batch.pending))
                for p in batch.pending:
                    p.fail(exc)
                self._finish(batch)
                continue
            seconds = time.perf_counter() - t
            batch.stage_ms[name] = seconds * 1e3
            self._observe(name, seconds)
            if i + 1 < len(STAGES):
                self._queues[i + 1].put(batch)
                continue
            for row, result in zip(batch.live_rows, out, strict=True):
                result.stage_ms[name] = batch.stage_ms[name]
                batch.pending[row].resolve(result)
            self._finish(batch, sum(batch.stage_ms.values()) / 1e3)

    def _keep(self, stage: str, batch: BatchState) -> bool:
        """Drop the batch's dead requests at this hand-off; False when none is left."""
        expired, abandoned = batch.drop(time.monotonic())
        if expired:
            self._on_dropped(stage, "deadline", expired)
        if abandoned:
            self._on_dropped(stage, "cancelled", abandoned)
        return any(batch.live)

    def _finish(self, batch: BatchState, service: float | None = None) -> None:
        with self._lock:
            self.in_flight -= 1
        try:
            self._done(len(batch.pending), batch.dispatched, service)
        except Exception:  # the stage thread must outlive a faulty callback
            log.exception("reporting a finished batch failed")
