"""Deadline-aware admission: will this request finish before its deadline?
(docs/RELIABILITY.md "Overload" says why and how; docs/ARCHITECTURE.md §5)

    Retrieve ─► Admission.decide(remaining, queued, in_flight) ─► admit / refuse at once
    pipeline: every finished batch ─► ServiceEstimate.observe(...) (learns online)

    predicted = wait + scale × (ceil(ahead / max_batch) × per_batch + ahead × per_request
                                + service)      (ahead = queued + in flight)
    admitted  iff  predicted <= HEADROOM × remaining deadline

(`scale`: with a beam ladder, service/beam_ladder.py, the narrowest rung's cost over the
full schedule's, the unit the estimate is kept in; 1.0 without one.)

`per_batch` + size × `per_request` is a least-squares line (small batches cost more per
request than full ones) through recent batches' busy times: the union of their time in the
pipeline, so overlapping and back-to-back batches both count right. `service` is a batch's
own stage time (EWMA); `wait` how long its batch may still wait to fill. A deadline
shorter than the fastest recent service is hopeless (DEADLINE_EXCEEDED); one that does not
fit is refused with RESOURCE_EXHAUSTED and a `retry_after`. Pure Python, no locks: every
method runs on the event loop.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

ALPHA = 0.2  # EWMA weight of the newest batch: ~5 batches of memory
FLOOR_WINDOW = 64  # batches over which the fastest service time is taken
RATE_WINDOW = 32  # batches the cost line is fitted over
MIN_SIZE_VARIANCE = 0.5  # per batch: below it the sizes are too alike to fit a line
HEADROOM = 0.8  # admit when the prediction is at most this share of the time left (its error)
# RetryInfo on a refusal (service/server.py): when the same request may be sent again to
# this server, bounded so a cold estimate never asks for nothing or for seconds
RETRY_MIN_SECONDS = 0.01
RETRY_MAX_SECONDS = 1.0


class Verdict(enum.Enum):
    ADMIT = "admit"
    OVERLOADED = "overloaded"  # cannot finish behind the work ahead: RESOURCE_EXHAUSTED
    HOPELESS = "hopeless"  # shorter than the service itself: DEADLINE_EXCEEDED


@dataclass
class ServiceEstimate:
    """What recent batches say requests cost; fed by every finished batch."""

    max_batch: int = 16  # the batcher's: how many requests one batch of the queue takes
    per_batch: float = 0.0  # seconds of pipeline time per batch ...
    per_request: float | None = None  # ... plus these per request in it
    service: float | None = None  # seconds of a batch's own stage time (EWMA)
    _fastest: deque[float] = field(default_factory=lambda: deque(maxlen=FLOOR_WINDOW))
    # (size, busy seconds) of the latest batches
    _busy: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    _last_done: float | None = None

    def observe(
        self, size: int, dispatched: float, done: float, service: float, scale: float = 1.0
    ) -> None:
        """A batch of `size` requests dispatched at `dispatched` finished at `done`
        (time.monotonic) after `service` seconds of stage time; `scale`: its cost over the
        unit the estimate is kept in (a narrower beam rung's, service/beam_ladder.py)."""
        if size < 1:
            return
        self.service = _ewma(self.service, service / scale)
        self._fastest.append(service)
        start = dispatched if self._last_done is None else max(dispatched, self._last_done)
        self._busy.append((size, max(done - start, 0.0) / scale))
        self._last_done = done if self._last_done is None else max(self._last_done, done)
        self.per_batch, self.per_request = _line(self._busy)

    @property
    def fastest(self) -> float:
        """The shortest recent service time (0 before any batch)."""
        return min(self._fastest, default=0.0)

    def predict(self, ahead: int) -> float:
        """Seconds until a request with `ahead` requests before it is answered (0 before
        any batch: the first requests are admitted and teach the estimate)."""
        if self.service is None or self.per_request is None:
            return 0.0
        batches = -(-ahead // self.max_batch)
        return batches * self.per_batch + ahead * self.per_request + self.service


@dataclass
class Admission:
    """The admission rule over a `ServiceEstimate`; `wait` is added for batch forming."""

    estimate: ServiceEstimate = field(default_factory=ServiceEstimate)
    wait: float = 0.0  # longest a request waits now for its batch to close, seconds
    # the work's cost at the narrowest beam schedule load may bring, over the estimate's
    # (service/beam_ladder.py; 1.0 without a ladder)
    scale: float = 1.0

    def decide(self, remaining: float | None, queued: int, in_flight: int) -> Verdict:
        """`remaining`: seconds left of the request's deadline (None: no deadline, always
        admitted here — the queue's capacity still bounds it)."""
        if remaining is None:
            return Verdict.ADMIT
        if remaining <= self.estimate.fastest:
            return Verdict.HOPELESS
        if HEADROOM * remaining < self.predicted(queued, in_flight):
            return Verdict.OVERLOADED
        return Verdict.ADMIT

    def predicted(self, queued: int, in_flight: int) -> float:
        """Seconds until a request arriving now is answered (what `decide` judges)."""
        return self.wait + self.scale * self.estimate.predict(queued + in_flight)

    def predicted_ms(self, queued: int, in_flight: int) -> float:
        """The prediction a refusal message quotes, in milliseconds."""
        return 1e3 * self.predicted(queued, in_flight)

    def retry_after(
        self, queue_full: bool, remaining: float | None, queued: int, in_flight: int
    ) -> float:
        """Seconds a refused request should wait before it is sent to this server again:
        refused as overloaded (`remaining` seconds of deadline left), until the work ahead
        has shrunk by what its prediction overshot the admitted share of the deadline;
        refused by a full queue, until one batch has left it. Within RETRY_MIN..MAX_SECONDS."""
        e = self.estimate
        if not queue_full and remaining is not None:
            delay = self.predicted(queued, in_flight) - HEADROOM * remaining
        elif e.per_request is not None:
            delay = e.per_batch + e.max_batch * e.per_request
        else:
            delay = 0.0
        return min(max(delay, RETRY_MIN_SECONDS), RETRY_MAX_SECONDS)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


def _line(points: deque[tuple[int, float]]) -> tuple[float, float]:
    """(per_batch, per_request) >= 0 of busy ≈ per_batch + size × per_request, by least
    squares; a plain ratio (per_batch 0) while the sizes hardly vary."""
    n = len(points)
    total_size = sum(x for x, _ in points)
    total_busy = sum(y for _, y in points)
    ratio = (0.0, total_busy / total_size)
    mean_x, mean_y = total_size / n, total_busy / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var < MIN_SIZE_VARIANCE * n:
        return ratio
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    intercept = mean_y - slope * mean_x
    if slope <= 0 or intercept < 0:  # noise, or no fixed cost to see: the ratio is safer
        return ratio
    return intercept, slope
