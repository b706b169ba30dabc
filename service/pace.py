"""How background work yields to serving: a model swap's load and prepare (the rollout,
`service/rollout/`) share the GPU, CPU cores and GIL with requests. `Pace` is called
between the steps of such a job and sleeps so that the job takes at most `share` of the
wall time, its GPU work included. Nothing is paced while nothing serves (`active()`) or at
`share = 1`. The setting is `rollout_share` (docs/MODEL.md "Hot swap").
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class Pace:
    """Call between two steps of a background job: it then takes at most `share` of the
    wall time while `active()` (a step longer than `max_sleep / (1/share - 1)` is still
    followed by at most `max_sleep` seconds of rest)."""

    def __init__(
        self,
        share: float,
        *,
        active: Callable[[], bool] = lambda: True,
        device: torch.device | str | None = None,
        max_sleep: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a pace's share must be in (0, 1], not {share}")
        self.share, self._active, self.max_sleep = share, active, max_sleep
        self._device = torch.device(device) if device is not None else None
        self._cuda = self._device is not None and self._device.type == "cuda"
        self._sleep, self._clock = sleep, clock
        self._since: float | None = None  # the end of the last rest
        self.slept = 0.0  # seconds of rest so far (for the swap's log line)

    def begin(self) -> None:
        """A job starts: its first step is measured from now."""
        self._since = self._clock()

    def __call__(self) -> None:
        if self.share >= 1 or not self._active():
            self._since = None
            return
        if self._cuda:  # the step's GPU work counts as work
            torch.cuda.current_stream(self._device).synchronize()
        now = self._clock()
        if self._since is not None:
            rest = min((now - self._since) * (1 / self.share - 1), self.max_sleep)
            self._sleep(rest)
            self.slept += rest
        self._since = self._clock()
