"""Four stage threads connected by queues: batch n+1 packs while batch n computes.

`Pipeline.dispatch` (the batcher's hand-off; never blocks) takes the current (model, index)
pair for the batch and queues it for stage 1; stage 4 resolves every request. A stage that
raises fails its batch's requests and the pipeline carries on. At every hand-off requests
whose deadline passed or whose client went away are dropped (docs/RELIABILITY.md); a batch
with none left skips its remaining stages.

Device memory: the CUDA caching allocator reuses a freed block on the stream that
allocated it without waiting for other streams, so a stage's buffer freed once the next
stage has queued its kernels could be refilled with the next batch's inputs before it is
read (wrong features, or a dead CUDA context). So every record of a batch lives until the
batch leaves, after its last stage's event is complete (`_finish`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from service.batcher import DeadlineExpired, Pending
from service.pipeline.records import Batch, Decoded, Embedded, Packed
from service.pipeline.runtime import ServingHolder
from service.pipeline.stages import Stages
from service.request_id import for_metadata
from service.tracing import Tracing

log = logging.getLogger("grace.pipeline")
STAGES = ("input", "features", "compute", "post")
_STOP = object()
_T = TypeVar("_T")


@dataclass
class _Flight:
    """A batch between stages, as the runner tracks it."""

    batch: Batch
    live: list[bool]  # per request: still to be answered
    stage_ms: dict[str, float] = field(default_factory=dict)  # wall time of each stage run
    # every stage's record so far: their device buffers live until the batch leaves
    records: list[Packed | Embedded | Decoded] = field(default_factory=list)
    span: Any = None  # the batch's trace span (service/tracing.py), None untraced

    @property
    def out(self) -> Packed | Embedded | Decoded | None:
        """The last stage's record (what the next stage reads)."""
        return self.records[-1] if self.records else None

    @property
    def live_rows(self) -> list[int]:
        return [i for i, alive in enumerate(self.live) if alive]

    def drop(self, now: float) -> tuple[int, int]:
        """Stop working for requests whose deadline passed (answered DEADLINE_EXCEEDED)
        or whose client went away; returns how many of each were dropped now."""
        expired = abandoned = 0
        for i, p in enumerate(self.batch.pending):
            if not self.live[i]:
                continue
            if p.abandoned:
                abandoned += 1
            elif p.expired(now):
                expired += 1
                p.fail(DeadlineExpired("deadline passed during processing"))
            else:
                continue
            self.live[i] = False
        return expired, abandoned


class Pipeline:
    def __init__(
        self,
        stages: Stages,
        serving: ServingHolder,
        on_batch_done: Callable[[int, float, float | None, int | None], None],
        observe: Callable[[str, float], None] = lambda stage, seconds: None,
        on_dropped: Callable[[str, str, int], None] = lambda stage, reason, n: None,
        on_dispatch: Callable[[Batch], None] = lambda batch: None,
        tracing: Tracing | None = None,
        rungs: tuple[tuple[int, ...], ...] = (),  # the beam ladder's schedules, widest first
    ) -> None:
        self.stages, self.serving, self.rungs = stages, serving, rungs
        self._tracing = tracing or Tracing()
        self._done = on_batch_done
        self._observe = observe
        self._on_dropped = on_dropped
        self._on_dispatch = on_dispatch
        s = stages  # each stage reads the record of the one before it
        self._bodies: tuple[Callable[[_Flight], object], ...] = (
            lambda f: s.input(f.batch),
            lambda f: s.features(f.batch, _as(f.out, Packed)),
            lambda f: s.compute(f.batch, _as(f.out, Embedded), f.live),
            lambda f: s.post(f.batch, _as(f.out, Decoded), f.live_rows, f.stage_ms),
        )
        self._queues: list[queue.Queue[object]] = [queue.Queue() for _ in STAGES]
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"grace-{name}", daemon=True)
            for i, name in enumerate(STAGES)
        ]
        for t in self._threads:
            t.start()
        self._lock = threading.Lock()
        self.in_flight = 0  # batches between dispatch and the end of stage 4
        self._progress_at = time.monotonic()  # the last stage end (or dispatch into idle)

    def stalled_for(self) -> float:
        """Seconds since any stage last finished while batches are in flight; 0 when the
        pipeline is idle (the stall watchdog's reading: service/watchdog.py)."""
        with self._lock:
            return 0.0 if self.in_flight == 0 else time.monotonic() - self._progress_at

    def dispatch(self, pending: list[Pending], rung: int | None = None) -> None:
        """Start a batch (the batcher's hand-off); its requests without beam_widths of
        their own decode at ladder rung `rung` (None: at the server's schedule)."""
        beams = None if rung is None else self.rungs[rung]
        batch = Batch.of(pending, self.serving.current, time.monotonic(), rung or 0, beams)
        self._on_dispatch(batch)
        with self._lock:
            if self.in_flight == 0:
                self._progress_at = time.monotonic()
            self.in_flight += 1
        flight = _Flight(batch, [True] * len(pending))
        if self._tracing.enabled:
            pair = batch.serving
            flight.span = self._tracing.batch([p.trace for p in pending], {
                "grace.batch.size": len(pending), "grace.batch.decode_groups": len(batch.groups),
                "grace.index_version": pair.index.version,
                "grace.model_version": pair.model.model_version,
            })  # fmt: skip
        self._queues[0].put(flight)

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the dispatched batches, then end the (daemon) threads: `timeout` s at most."""
        self._queues[0].put(_STOP)
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(end - time.monotonic(), 0.0))

    def _loop(self, i: int) -> None:
        name, body = STAGES[i], self._bodies[i]
        while True:
            item = self._queues[i].get()
            if item is _STOP:
                if i + 1 < len(STAGES):
                    self._queues[i + 1].put(_STOP)
                return
            flight: _Flight = item  # type: ignore[assignment]
            if not self._keep(name, flight):
                self._finish(flight)  # nobody waits for any of it: skip the other stages
                continue
            t = time.perf_counter()
            try:
                with self._tracing.stage(flight.span, name):
                    out = body(flight)
            except Exception as exc:  # one batch fails, the pipeline goes on
                ids = " ".join(for_metadata(r.request_id) for r in flight.batch.requests)
                log.exception("stage %s failed for a batch of %d (request ids %s)", name,
                              len(flight.live), ids)  # fmt: skip
                for p in flight.batch.pending:
                    p.fail(exc)
                self._finish(flight, failed=i)
                continue
            seconds = time.perf_counter() - t
            with self._lock:
                self._progress_at = time.monotonic()
            flight.stage_ms[name] = seconds * 1e3
            self._observe(name, seconds)
            if i + 1 < len(STAGES):
                flight.records.append(out)  # type: ignore[arg-type]
                self._queues[i + 1].put(flight)
                continue
            for row, result in zip(flight.live_rows, out, strict=True):  # type: ignore[call-overload]
                result.stage_ms[name] = flight.stage_ms[name]
                flight.batch.pending[row].resolve(result)
            self._finish(flight, sum(flight.stage_ms.values()) / 1e3)

    def _keep(self, stage: str, flight: _Flight) -> bool:
        """Drop the batch's dead requests at this hand-off; False when none is left."""
        expired, abandoned = flight.drop(time.monotonic())
        if expired:
            self._on_dropped(stage, "deadline", expired)
        if abandoned:
            self._on_dropped(stage, "cancelled", abandoned)
        return any(flight.live)

    def _finish(
        self, flight: _Flight, service: float | None = None, failed: int | None = None
    ) -> None:
        """The batch leaves, once the device is done with its buffers (module docstring;
        `failed`: the stage that raised, whose own queued work is waited for too)."""
        try:
            self.stages.settle(flight.out, failed)
        except Exception:  # a dead CUDA context: the stall watchdog ends the process
            log.exception("waiting for a batch's device work failed")
        if flight.span is not None:
            error = None if failed is None else f"stage {STAGES[failed]} failed"
            answered = 0 if failed is not None else sum(flight.live)  # a failed batch: none
            Tracing.end(flight.span, error, **{"grace.batch.answered": answered})
        with self._lock:
            self.in_flight -= 1
            self._progress_at = time.monotonic()
        try:
            b = flight.batch
            self._done(len(flight.live), b.dispatched, service,
                       b.rung if b.rung_beams is not None else None)  # fmt: skip
        except Exception:  # the stage thread must outlive a faulty callback
            log.exception("reporting a finished batch failed")


def _as(record: object, kind: type[_T]) -> _T:
    """The previous stage's record, which must be a `kind` (the wiring above)."""
    assert isinstance(record, kind), f"expected {kind.__name__}, got {type(record).__name__}"
    return record
