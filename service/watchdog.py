"""The stall watchdog: a serving process whose pipeline stops making progress (a GPU call
that never returns, a deadlock) is wedged and must not stay up answering nothing
(docs/RELIABILITY.md "Wedged pipeline").

A thread reads `stalled_for()` (the pipeline's seconds without a finished stage while
batches are in flight) every `tick_s`; at `limit_s`, `on_stall` runs: by default `wedged`,
which logs, dumps every thread's stack and exits 3 so the process is restarted. A wedge
that holds the GIL stops this thread too, so each tick re-arms a timer in C
(`faulthandler.dump_traceback_later`) that dumps and exits 1 without it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("grace.watchdog")
EXIT_WEDGED = 3


def wedged(stalled_s: float) -> None:
    """Log why, write every thread's stack to stderr and exit with EXIT_WEDGED."""
    log.critical(
        "pipeline wedged: no stage finished for %.0f s with batches in flight; every "
        "thread's stack follows; exiting %d so the process is restarted", stalled_s, EXIT_WEDGED,
    )  # fmt: skip
    for handler in logging.getLogger().handlers:
        handler.flush()
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_WEDGED)


class Watchdog:
    def __init__(
        self,
        stalled_for: Callable[[], float],
        limit_s: float,
        *,
        tick_s: float | None = None,
        on_stall: Callable[[float], None] = wedged,
        arm: Callable[[float], None] = lambda s: faulthandler.dump_traceback_later(s, exit=True),
        disarm: Callable[[], None] = faulthandler.cancel_dump_traceback_later,
    ) -> None:
        if limit_s <= 0:
            raise ValueError(f"limit_s must be > 0, got {limit_s}")
        self.limit_s = limit_s
        self.tick_s = tick_s if tick_s is not None else min(1.0, limit_s / 4)
        self._stalled_for, self._on_stall = stalled_for, on_stall
        self._arm, self._disarm = arm, disarm
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="grace-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._disarm()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            stalled = self._stalled_for()
            if stalled >= self.limit_s:
                self._disarm()
                self.fired = True
                self._on_stall(stalled)
                return
            # the C backstop: fires only if this thread misses its next few ticks
            self._arm(self.limit_s - stalled + 4 * self.tick_s)
