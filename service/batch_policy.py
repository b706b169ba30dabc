"""When a forming batch closes and which queued requests join it: the batching policy, a
pure object (state in, decision out, no clock, no I/O) that the batcher
(`service/batcher.py`) and the batching model (`bench/model_batching.py`) both call.

**Close.** At `max_batch` requests, or `max_wait` after its first request joined while the
pipeline is nearly idle (fewer than `busy_batches` in flight). While it is busy a small
batch would only queue, and on the GPU cost almost a full bucket, so it keeps filling for
up to `max_wait_busy`, looking again every `max_wait` (at least `BUSY_POLL`).

**Groups.** A batch holds at most `max_groups` decode groups (one beam schedule and filter
mode each, one decode run): in queue order it takes requests of a group it has, or of a
new one while there is room; the others keep their place (docs/RELIABILITY.md).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from service.settings import BUSY_BATCHES, MAX_GROUPS

BUSY_POLL = 0.001  # seconds between looks at a busy pipeline when max_wait is 0
LOOKAHEAD = 256  # queued requests a forming batch looks through for its groups


@dataclass(frozen=True)
class BatchPolicy:
    max_batch: int = 16
    max_wait: float = 0.005  # seconds a batch waits for more requests, pipeline idle
    max_wait_busy: float = 0.02  # ... while at least `busy_batches` batches are in flight
    busy_batches: int = BUSY_BATCHES
    max_groups: int = MAX_GROUPS  # decode groups one batch may hold
    max_inflight: int = 4  # batches in the pipeline at once

    def __post_init__(self) -> None:
        if (
            min(self.max_batch, self.max_inflight, self.busy_batches, self.max_groups) < 1
            or not 0 <= self.max_wait <= self.max_wait_busy
        ):
            raise ValueError(
                "max_batch, max_inflight, busy_batches and max_groups must be >= 1, "
                "0 <= max_wait <= max_wait_busy"
            )

    def busy(self, inflight: int) -> bool:
        """Whether `inflight` batches in the pipeline make it busy."""
        return inflight >= self.busy_batches

    def wait(self, inflight: int) -> float:
        """How long a batch, once it has a request, waits for more."""
        return self.max_wait_busy if self.busy(inflight) else self.max_wait

    def look_again(self, size: int, first: float, now: float, inflight: int) -> float | None:
        """A batch of `size` requests, the first of which joined at `first`: None to close
        it at `now`, else when to look at it again (or sooner, as requests arrive)."""
        due = first + self.wait(inflight)
        if size >= self.max_batch or now >= due:
            return None
        return min(due, now + max(self.max_wait, BUSY_POLL)) if self.busy(inflight) else due

    def joins(self, groups: set[Hashable], key: Hashable) -> bool:
        """Whether a request of group `key` may join a batch holding `groups`."""
        return key in groups or len(groups) < self.max_groups

    def admission_wait(self, queued: int, inflight: int) -> float:
        """How long the batch a new request joins may still wait for more requests: none
        when the queue (with it) already fills one."""
        return self.wait(inflight) if queued + 1 < self.max_batch else 0.0
