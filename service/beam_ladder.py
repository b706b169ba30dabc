"""Load-adaptive beams (issue #49; docs/RELIABILITY.md "Overload"): a ladder of beam
schedules for the requests that send no `beam_widths`, and the choice of one rung per
batch. A pure object: state in, decision out, no clock, no I/O — the batcher
(`service/batcher.py`) asks it at each dispatch.

    rung 0: the server's `beams` (1, 512, 1024, 1024) ─ rung 1: the last three halved ─
    rung 2: quartered ...; each rung's cost is its decode FLOPs over rung 0's, until the
    served batches have measured it (`observe`: EWMA of each rung's service time)

**Choice.** A batch's budget is `HEADROOM` × the shortest deadline left among its
requests; the prediction is the admission estimate's time to answer it at rung 0
(`ServiceEstimate.predict`, learned in rung-0 units) × the rung's cost. The widest allowed
rung whose prediction fits is wanted; a narrower one is taken at once, a wider one only
after `WIDEN_AFTER` batches in a row wanted it and its prediction fits with `WIDEN_MARGIN`
to spare, one rung at a time, so the rung does not flap with each batch's noise. Without
a deadline the widest allowed rung serves. An operator bounds the ladder (`widest`,
`narrowest`), or pins a rung (both the same). Admission refuses only what the narrowest
rung cannot answer in time (`Ladder.floor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service.admission import ALPHA, HEADROOM

WIDEN_AFTER = 8  # batches in a row that must want a wider rung before it is taken
WIDEN_MARGIN = 0.8  # ... with its prediction at most this share of the budget


def default_rungs(beams: Sequence[int], rungs: int = 3) -> tuple[tuple[int, ...], ...]:
    """`beams`, then the steps after the first halved, quartered, ... (`rungs` in all;
    each width at least 1, rungs that come out equal dropped)."""
    out: list[tuple[int, ...]] = []
    for r in range(rungs):
        rung = (beams[0], *(max(1, m >> r) for m in beams[1:]))
        if rung not in out:
            out.append(rung)
    return tuple(out)


@dataclass
class Ladder:
    """The rungs (widest first) and what each costs; `widest`..`narrowest`: the rungs the
    choice may use (an operator's bound; equal: pinned)."""

    rungs: tuple[tuple[int, ...], ...]
    prior: tuple[float, ...]  # each rung's decode FLOPs over rung 0's (1.0 first)
    widest: int = 0
    narrowest: int | None = None  # None: the last rung
    current: int = 0  # the rung batches get now
    _wanted: int = 0  # batches in a row that wanted a wider rung
    _service: list[float | None] = field(default_factory=list)  # EWMA seconds per rung

    def __post_init__(self) -> None:
        if not self.rungs or len(self.prior) != len(self.rungs):
            raise ValueError("a ladder needs rungs, each with its cost")
        if self.narrowest is None:
            self.narrowest = len(self.rungs) - 1
        if not 0 <= self.widest <= self.narrowest < len(self.rungs):
            raise ValueError(f"rungs {self.widest}..{self.narrowest} are not within the "
                             f"ladder's 0..{len(self.rungs) - 1}")  # fmt: skip
        self.current = self.widest
        self._service = [None] * len(self.rungs)

    def cost(self, rung: int) -> float:
        """A batch's time at `rung` over its time at rung 0: measured once both have been
        served, the FLOPs ratio before."""
        first, mine = self._service[0], self._service[rung]
        if rung and first and mine is not None:
            return mine / first
        return self.prior[rung]

    @property
    def floor(self) -> float:
        """The cost of the narrowest allowed rung: admission's scale."""
        assert self.narrowest is not None
        return self.cost(self.narrowest)

    def choose(self, predicted: float, remaining: float | None) -> int:
        """The rung of a batch that rung 0 would answer in `predicted` seconds, whose
        shortest deadline is `remaining` seconds away (None: no deadline)."""
        assert self.narrowest is not None
        allowed = range(self.widest, self.narrowest + 1)
        if remaining is None:
            want = self.widest
        else:
            budget = HEADROOM * remaining
            want = next((r for r in allowed if predicted * self.cost(r) <= budget),
                        self.narrowest)  # fmt: skip
        if want > self.current:  # narrower: at once
            self.current, self._wanted = want, 0
        elif want < self.current:  # wider: only when it has fitted for a while, with room
            step = self.current - 1
            fits = remaining is None or predicted * self.cost(step) <= (
                WIDEN_MARGIN * HEADROOM * remaining)  # fmt: skip
            self._wanted = self._wanted + 1 if fits else 0
            if self._wanted >= WIDEN_AFTER:
                self.current, self._wanted = step, 0
        else:
            self._wanted = 0
        return self.current

    def observe(self, rung: int, service: float) -> None:
        """A batch served at `rung` took `service` seconds of stage time."""
        old = self._service[rung]
        self._service[rung] = service if old is None else old + ALPHA * (service - old)
