"""`service/pace.py`: a swap's load and prepare rest between their steps so that they take
at most `rollout_share` of the wall time while the server serves, and never at start-up."""

from __future__ import annotations

import pytest

from service.pace import Pace


class FakeTime:
    """A clock that only moves when work is done or a rest is taken."""

    def __init__(self) -> None:
        self.now = 0.0
        self.rests: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.rests.append(seconds)
        self.now += seconds

    def work(self, seconds: float) -> None:
        self.now += seconds


def paced(share: float, steps: list[float], *, active: bool = True, max_sleep: float = 10.0):
    t = FakeTime()
    pace = Pace(share, active=lambda: active, max_sleep=max_sleep, sleep=t.sleep, clock=t.clock)
    pace.begin()
    for step in steps:
        t.work(step)
        pace()
    return t, pace


def test_a_paced_job_takes_its_share_of_the_wall_time() -> None:
    steps = [0.2, 0.05, 0.4, 0.1]
    t, pace = paced(0.25, steps)
    assert t.rests == pytest.approx([3 * s for s in steps])  # each step rests 3x its work
    assert sum(steps) / t.now == pytest.approx(0.25)
    assert pace.slept == pytest.approx(sum(t.rests))


@pytest.mark.parametrize(("share", "active"), [(1.0, True), (0.1, False)])
def test_no_rest_when_pacing_is_off_or_nothing_serves(share: float, active: bool) -> None:
    t, pace = paced(share, [0.3, 0.3], active=active)
    assert t.rests == [] and pace.slept == 0


def test_a_long_step_rests_at_most_max_sleep() -> None:
    t, _ = paced(0.1, [5.0, 0.01], max_sleep=1.0)
    assert t.rests == pytest.approx([1.0, 0.09])


def test_serving_starting_mid_job_paces_from_then_on() -> None:
    t = FakeTime()
    serving = False
    pace = Pace(0.5, active=lambda: serving, sleep=t.sleep, clock=t.clock)
    pace.begin()
    t.work(1.0)
    pace()  # start-up: nothing serves
    serving = True
    t.work(1.0)
    pace()  # first paced step: no start measured yet since pacing turned on
    t.work(0.2)
    pace()
    assert t.rests == pytest.approx([0.2])


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="share must be in"):
        Pace(share)
