"""Open-loop arrivals: requests start on a clock, whether or not earlier ones have answered.

A closed-loop user sends its next request only after the previous answer, so a slow
server quietly receives less load and the test measures a server that is never
overloaded. Here each arrival is due at a fixed instant (`start + k / rate`, or Poisson
gaps) and runs in its own greenlet; the dispatcher never waits for a response. When the
server cannot keep up, requests pile up in flight and come back late or as errors
(RESOURCE_EXHAUSTED from its bounded queue, DEADLINE_EXCEEDED at the client's timeout):
the offered rate stays what was asked for.

Two honest limits: at most `max_inflight` calls are in flight per user (an arrival past
it is reported as a failed request, not skipped), and if the generator's own CPU cannot
keep the schedule, arrivals go out late; the largest lateness is recorded and a run
that fell more than `thresholds.MAX_GENERATOR_LAG_S` behind fails.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gevent
from gevent.pool import Group


def arrival_times(rate: float, start: float, rng: random.Random, poisson: bool) -> Iterator[float]:
    """Absolute arrival instants (time.monotonic scale), `rate` per second on average.

    Uniform: evenly spaced from a random phase in the first gap, so several users at the
    same rate interleave instead of firing together. Poisson: exponential gaps.
    """
    if poisson:
        t = start
        while True:
            t += rng.expovariate(rate)
            yield t
    phase = rng.random() / rate
    for k in itertools.count():
        yield start + phase + k / rate  # no drift: never a sum of rounded gaps


@dataclass
class OpenLoopStats:
    """What the dispatchers of one locust process saw (reported when the run quits)."""

    dispatched: int = 0  # arrivals sent
    refused: int = 0  # arrivals over max_inflight, reported as failed requests
    max_lag_s: float = 0.0  # latest dispatch behind its due time


def run_arrivals(
    arrivals: Iterator[float],
    send: Callable[[], object],
    refuse: Callable[[int], object],
    inflight: Group,
    max_inflight: int,
    stats: OpenLoopStats,
) -> None:
    """Dispatch `send` in a new greenlet at each arrival; runs until killed."""
    for due in arrivals:
        delay = due - time.monotonic()
        gevent.sleep(max(delay, 0.0))  # yields even when behind: calls in flight progress
        stats.max_lag_s = max(stats.max_lag_s, time.monotonic() - due)
        if len(inflight) >= max_inflight:
            stats.refused += 1
            refuse(len(inflight))
        else:
            stats.dispatched += 1
            inflight.spawn(send)
