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

**The queue behind.** Admission let every queued request in on the promise that the work
ahead of it runs at the narrowest rung; a batch decoded wider makes all of them wait
longer. So a rung must also fit `queue_slack` — the least, over the queued requests, of
`HEADROOM` × their time left less their predicted answer at the narrowest rung — with
the batch's extra time over the narrowest rung (its own rung-0 time × the cost
difference). Under overload the queue settles at admission's edge, its slack near 0, and
batches stay at the narrowest rung instead of widening for the head of the queue while
the requests behind it miss (issue #49: on the CPU demo at 2-3× offered the misses came
in bursts right after such widened batches); when the slack runs out (service slowed)
batches narrow at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from service.admission import ALPHA, HEADROOM, ServiceEstimate
from service.model.config import ModelConfig
from service.model.flops import decoder_flops

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

    @classmethod
    def priced(cls, rungs: tuple[tuple[int, ...], ...], config: ModelConfig, widest: int = 0,
               narrowest: int | None = None) -> Ladder:  # fmt: skip
        """The ladder of `rungs` (settings `beam_ladder`, bounded by `beam_rungs`), each
        rung's prior cost its decode FLOPs at `config` over the full schedule's."""
        full = decoder_flops(config, rungs[0]).total
        prior = tuple(decoder_flops(config, r).total / full for r in rungs)
        return cls(rungs, prior, widest, narrowest)

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

    def choose(
        self,
        predicted: float,
        remaining: float | None,
        own: float = 0.0,
        slack: float | None = None,
    ) -> int:
        """The rung of a batch that rung 0 would answer in `predicted` seconds, whose
        shortest deadline is `remaining` seconds away (None: no deadline); `own`: the
        batch's own pipeline time at rung 0, `slack`: how much later the queued requests
        behind it may be answered than at the narrowest rung (`queue_slack`; None: no
        bound)."""
        assert self.narrowest is not None
        allowed = range(self.widest, self.narrowest + 1)
        floor = self.floor

        def behind(r: int, margin: float = 1.0) -> bool:  # the queue still fits
            return slack is None or (self.cost(r) - floor) * own <= margin * slack

        if remaining is None:
            want = next((r for r in allowed if behind(r)), self.narrowest)
        else:
            budget = HEADROOM * remaining
            want = next((r for r in allowed if predicted * self.cost(r) <= budget
                         and behind(r)), self.narrowest)  # fmt: skip
        if want > self.current:  # narrower: at once
            self.current, self._wanted = want, 0
        elif want < self.current:  # wider: only when it has fitted for a while, with room
            step = self.current - 1
            fits = (remaining is None or predicted * self.cost(step) <= (
                WIDEN_MARGIN * HEADROOM * remaining)) and behind(step, WIDEN_MARGIN)  # fmt: skip
            self._wanted = self._wanted + 1 if fits else 0
            if self._wanted >= WIDEN_AFTER:
                self.current, self._wanted = step, 0
        else:
            self._wanted = 0
        return self.current

    def observe(self, rung: int, service: float, weight: float = 1.0) -> None:
        """A batch served at `rung` took `service` seconds of stage time; `weight` (0..1]:
        how much it counts, its size over a full batch's — the lone requests that start
        a burst after an idle spell must not halve a rung's cost in one batch (the
        estimate in rung-0 units and admission's scale follow it: issue #49)."""
        old = self._service[rung]
        alpha = ALPHA * min(max(weight, 0.0), 1.0)
        self._service[rung] = service if old is None else old + alpha * (service - old)


def queue_slack(
    now: float,
    deadlines: Iterable[float | None],
    ahead: int,
    estimate: ServiceEstimate,
    scale: float,
) -> float | None:
    """Seconds by which the queued requests with `deadlines` (time.monotonic; in queue
    order, the first with `ahead` requests before it) may all be answered later than the
    estimate predicts at `scale` (the narrowest rung's cost, admission's) and still fit
    `HEADROOM` of their time left: the least such margin, negative when one already does
    not fit. None when none has a deadline, or before the estimate has learned."""
    if estimate.service is None or estimate.per_request is None:
        return None
    least: float | None = None
    for i, deadline in enumerate(deadlines):
        if deadline is None:
            continue
        margin = HEADROOM * (deadline - now) - scale * estimate.predict(ahead + i)
        least = margin if least is None else min(least, margin)
    return least
