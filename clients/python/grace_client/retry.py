"""Deadlines and retries of one call (`Backoff`, `Schedule`), shared by the sync client
(client.py) and the asyncio one (aio.py), which only sleep differently.

A call has one budget, the client's `timeout` (or the call's own): every attempt runs with
the time still left as its gRPC deadline, so retries never stretch a call past it. After
a retryable failure (`GraceError.retryable`) the next attempt waits the server's RetryInfo delay
when the error carries one, else an exponential backoff with jitter; when that wait would
end at or past the deadline, or the retries are used up, the call fails with the error.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from grace_client.errors import GraceError


@dataclass(frozen=True)
class Backoff:
    """Pause before retry n (0-based): `min(maximum, initial * multiplier**n)` seconds, of
    which a random share up to `jitter` is taken off (1: "full jitter", anywhere between
    0 and the cap, so clients refused together do not come back together; 0: none)."""

    initial: float = 0.025
    maximum: float = 1.0
    multiplier: float = 2.0
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"need 0 < initial <= maximum, got {self.initial}, {self.maximum}")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry `retry` (0 for the first retry)."""
        cap = min(self.maximum, self.initial * self.multiplier**retry)
        return cap * (1.0 - self.jitter * rng.random())


class Schedule:
    """One call's deadline and retries: `attempt()` before each try, `pause(error)` after
    a failed one (seconds to wait, or None: give up and raise the error)."""

    def __init__(
        self,
        retries: int,
        backoff: Backoff,
        timeout: float | None,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retries, self.backoff, self.rng, self.clock = retries, backoff, rng, clock
        self.deadline = None if timeout is None else clock() + timeout
        self.attempts = 0  # attempts started

    def attempt(self) -> float | None:
        """Count an attempt; its gRPC timeout (the time left), or None for no deadline."""
        self.attempts += 1
        if self.deadline is None:
            return None
        return max(self.deadline - self.clock(), 0.0)

    def pause(self, error: GraceError) -> float | None:
        """How long to wait before retrying after `error`, or None when it is final."""
        if not error.retryable or self.attempts > self.retries:
            return None
        if error.retry_delay is not None:  # the server knows when it can take the call
            wait = error.retry_delay
        else:
            wait = self.backoff.delay(self.attempts - 1, self.rng)
        if self.deadline is not None and self.clock() + wait >= self.deadline:
            return None  # no time left for another attempt
        return wait
