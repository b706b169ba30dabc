"""The beam ladder (`service/beam_ladder.py`): which rung a batch gets from the predicted
time at the full schedule and its shortest deadline, with hysteresis; bounds and pins;
costs from FLOPs until measured; admission scaled to the narrowest rung; the settings
that make it. Pure objects: no clock, no server."""

from __future__ import annotations

import pytest

from service.admission import HEADROOM, Admission, ServiceEstimate, Verdict
from service.beam_ladder import WIDEN_AFTER, Ladder, default_rungs
from service.settings import ServerSettings

RUNGS = ((1, 512, 1024, 1024), (1, 256, 512, 512), (1, 128, 256, 256))
PRIOR = (1.0, 0.5, 0.25)


def ladder(**kw) -> Ladder:
    return Ladder(RUNGS, PRIOR, **kw)


def test_default_rungs_halve_and_quarter_the_steps_after_the_first() -> None:
    assert default_rungs((1, 512, 1024, 1024)) == RUNGS
    assert default_rungs((1, 2, 2, 1)) == ((1, 2, 2, 1), (1, 1, 1, 1))  # equal rungs dropped
    assert default_rungs((1, 64, 128, 128), 1) == ((1, 64, 128, 128),)


def test_the_widest_rung_that_fits_the_deadline_is_taken_at_once() -> None:
    lad = ladder()
    # 100 ms deadline: 80 ms budget. 60 ms at rung 0 fits.
    assert lad.choose(0.060, 0.100) == 0
    # 120 ms at rung 0: rung 1 (60 ms) fits; narrower is taken at once
    assert lad.choose(0.120, 0.100) == 1
    # 300 ms at rung 0: 75 ms at rung 2 is the only fit
    assert lad.choose(0.300, 0.100) == 2
    # nothing fits: the narrowest (admission refuses what it cannot answer)
    assert lad.choose(1.0, 0.100) == 2


def test_a_wider_rung_comes_back_only_after_it_fitted_for_a_while_with_room() -> None:
    lad = ladder()
    assert lad.choose(0.300, 0.100) == 2
    # load falls: rung 1 would fit with room (0.10 * 0.5 = 50 ms <= 0.8 * 80 ms)
    for _ in range(WIDEN_AFTER - 1):
        assert lad.choose(0.100, 0.100) == 2  # not yet
    assert lad.choose(0.100, 0.100) == 1  # one rung at a time
    for _ in range(WIDEN_AFTER - 1):
        assert lad.choose(0.010, 0.100) == 1
    assert lad.choose(0.010, 0.100) == 0
    # a batch that only just fits rung 1 (no room) resets the count
    lad2 = ladder()
    lad2.choose(0.300, 0.100)
    for _ in range(WIDEN_AFTER * 2):
        # rung 1 at 0.150 s: 75 ms fits the 80 ms budget but not with WIDEN_MARGIN's room
        assert lad2.choose(0.150, 0.100) == 2


def test_no_deadline_serves_the_widest_allowed_rung() -> None:
    lad = ladder()
    assert lad.choose(5.0, None) == 0


def test_bounds_and_pins() -> None:
    pinned = ladder(widest=1, narrowest=1)
    assert {pinned.choose(p, 0.1) for p in (0.001, 0.5, 10.0)} == {1}
    bounded = ladder(narrowest=1)
    assert bounded.choose(10.0, 0.1) == 1  # never past rung 1
    assert bounded.floor == 0.5
    with pytest.raises(ValueError, match="within"):
        ladder(widest=2, narrowest=1)
    with pytest.raises(ValueError, match="within"):
        ladder(narrowest=3)


def test_costs_are_flops_until_each_rung_is_measured() -> None:
    lad = ladder()
    assert lad.cost(2) == 0.25
    lad.observe(2, 0.030)
    assert lad.cost(2) == 0.25  # rung 0 not measured yet: the prior still
    lad.observe(0, 0.040)
    assert lad.cost(2) == pytest.approx(0.75)  # fixed costs make a narrow rung dearer
    assert lad.floor == pytest.approx(0.75)


def test_admission_refuses_only_what_the_narrowest_rung_cannot_answer() -> None:
    est = ServiceEstimate(max_batch=16)
    for k in range(40):  # 16-request batches, 100 ms each, back to back
        est.observe(16, k * 0.1, (k + 1) * 0.1, 0.1)
    full = Admission(est)
    scaled = Admission(est, scale=0.25)
    queued = 64  # four batches ahead: ~0.5 s at the full schedule
    assert full.decide(0.4, queued, 0) is Verdict.OVERLOADED
    assert scaled.decide(0.4, queued, 0) is Verdict.ADMIT
    assert scaled.predicted_ms(queued, 0) == pytest.approx(full.predicted_ms(queued, 0) / 4)
    assert scaled.predicted_ms(queued, 0) / 1e3 <= HEADROOM * 0.4


def test_the_estimate_learns_in_the_full_schedules_units() -> None:
    est = ServiceEstimate(max_batch=16)
    for k in range(40):  # batches at a rung costing half: 50 ms each
        est.observe(16, k * 0.05, (k + 1) * 0.05, 0.05, scale=0.5)
    assert est.service == pytest.approx(0.1)
    assert est.predict(0) == pytest.approx(0.1 + est.per_batch, rel=0.05)


def test_settings_make_the_ladder_and_refuse_bad_ones() -> None:
    s = ServerSettings(profile="paper")
    assert s.ladder() == RUNGS and s.rung_bounds() == (0, 2)
    assert ServerSettings(profile="paper", beam_ladder="off").ladder() == RUNGS[:1]
    assert ServerSettings(profile="paper", beam_rungs="1").rung_bounds() == (1, 1)
    own = ServerSettings(profile="paper", beam_ladder="1,512,1024,1024; 1,64,64,64")
    assert own.ladder() == (RUNGS[0], (1, 64, 64, 64))
    with pytest.raises(ValueError, match="start with beams"):
        ServerSettings(profile="paper", beam_ladder="1,64,64,64")
    with pytest.raises(ValueError, match="not within"):
        ServerSettings(profile="paper", beam_rungs="1-5")
    with pytest.raises(ValueError, match="expected 'A-B'"):
        ServerSettings(profile="paper", beam_rungs="wide")
