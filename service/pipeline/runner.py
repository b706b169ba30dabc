"""Four stage threads connected by queues: batch n+1 packs while batch n computes.

`Pipeline.dispatch` is the batcher's hand-off: it takes one index reference for the batch
and queues it for stage 1; it never blocks (the batcher bounds batches in flight). Each
thread runs one stage for one batch at a time and passes the batch on; stage 4 resolves
every request and frees the batcher's slot. An exception in any stage fails that batch's
requests (the server answers INTERNAL) and the pipeline carries on with the next batch.
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
        on_batch_done: Callable[[], None],
        observe: Callable[[str, float], None] = lambda stage, seconds: None,
    ) -> None:
        self.stages, self.indexes = stages, indexes
        self._done = on_batch_done
        self._observe = observe
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
        self._queues[0].put(BatchState(pending, self.indexes.current))

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the batches already dispatched, then end the threads."""
        self._queues[0].put(_STOP)
        for t in self._threads:
            t.join(timeout)

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
            t = time.perf_counter()
            try:
                out = body(batch)
            except Exception as exc:  # one batch fails, the pipeline goes on
                log.exception("stage %s failed for a batch of %d", name, len(batch.pending))
                for p in batch.pending:
                    p.fail(exc)
                self._finish()
                continue
            seconds = time.perf_counter() - t
            batch.stage_ms[name] = seconds * 1e3
            self._observe(name, seconds)
            if i + 1 < len(STAGES):
                self._queues[i + 1].put(batch)
                continue
            for p, result in zip(batch.pending, out, strict=True):
                result.stage_ms[name] = batch.stage_ms[name]
                p.resolve(result)
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            self.in_flight -= 1
        self._done()
