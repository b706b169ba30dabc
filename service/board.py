"""What the supervisor of `grace serve --workers N` (service/supervisor.py) and its
workers share, in shared memory: each worker's last heartbeat and how often it was
restarted. A worker beats from its event loop once SERVING (`service/app.py`); the
supervisor reads the beats to see a frozen worker, and every worker's metrics
(`grace_workers_serving`, `grace_worker_restarts_total`) read the board, so any one of
them tells the whole host's state."""

from __future__ import annotations

import time
from multiprocessing.context import BaseContext

HEARTBEAT_SECONDS = 0.5  # a serving worker's beat interval; the timeout is a setting


class Board:
    """`beats[i]`: worker i's last beat (`time.monotonic`, one clock for every process of
    the host), 0 while it is not serving; `restarts[i]`: its restarts so far."""

    def __init__(self, ctx: BaseContext, workers: int, timeout: float) -> None:
        self.beats = ctx.Array("d", workers, lock=False)  # one writer each: no lock
        self.restarts = ctx.Array("i", workers, lock=False)
        self.workers, self.timeout = workers, timeout

    def beat(self, i: int) -> None:
        self.beats[i] = time.monotonic()

    def clear(self, i: int) -> None:
        """Worker i is gone or starting again: not serving until its first beat."""
        self.beats[i] = 0.0

    def fresh(self, i: int, now: float | None = None) -> bool:
        """Worker i beat within the timeout (any beat at all, when the timeout is 0)."""
        last = self.beats[i]
        if last == 0.0:
            return False
        return self.timeout <= 0 or (time.monotonic() if now is None else now) - last < self.timeout

    def serving(self) -> int:
        now = time.monotonic()
        return sum(self.fresh(i, now) for i in range(self.workers))
