"""The beam ladder (`service/beam_ladder.py`): which rung a batch gets from the predicted
time at the full schedule and its shortest deadline, with hysteresis; bounds and pins;
costs from FLOPs until measured (a small batch counting little); the queue behind a batch
bounding its rung; admission scaled to the narrowest rung; the settings
that make it. Pure objects: no clock, no server."""

from __future__ import annotations

import pytest

from service.admission import HEADROOM, Admission, ServiceEstimate, Verdict
from service.beam_ladder import WIDEN_AFTER, Ladder, default_rungs, queue_slack
from service.model.config import PROFILES
from service.model.flops import decoder_flops
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


def test_a_priced_ladder_starts_from_each_rungs_decode_flops() -> None:
    """The server's ladder: each rung's prior cost is its decode FLOPs over the full
    schedule's at the model's profile, falling rung by rung; bounds carried."""
    lad = Ladder.priced(RUNGS, PROFILES["paper"], 0, 1)
    full = decoder_flops(PROFILES["paper"], RUNGS[0]).total
    assert lad.prior == tuple(decoder_flops(PROFILES["paper"], r).total / full for r in RUNGS)
    assert lad.prior[0] == 1.0 and 1.0 > lad.prior[1] > lad.prior[2] > 0
    assert (lad.widest, lad.narrowest) == (0, 1) and lad.floor == lad.prior[1]


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


def test_a_batch_does_not_widen_at_the_expense_of_the_queue_behind() -> None:
    """Under overload the head batch's own deadline may fit a wider rung, but the requests
    queued behind it were admitted at the narrowest rung's cost: without slack for the
    extra time the rung stays narrow; with it the rung widens as before."""
    lad = ladder()
    assert lad.choose(0.300, 0.100) == 2
    # rung 1 fits the batch with room (50 ms <= 0.8 * 80 ms), and would cost the queue
    # (0.5 - 0.25) * 100 ms = 25 ms more than rung 2: 10 ms of slack is not enough
    for _ in range(WIDEN_AFTER * 2):
        assert lad.choose(0.100, 0.100, own=0.100, slack=0.010) == 2
    for _ in range(WIDEN_AFTER - 1):
        assert lad.choose(0.100, 0.100, own=0.100, slack=0.040) == 2
    assert lad.choose(0.100, 0.100, own=0.100, slack=0.040) == 1  # 25 <= 0.8 * 40 ms


def test_a_queue_short_of_time_narrows_the_batch_at_once() -> None:
    lad = ladder()
    assert lad.choose(0.010, 0.100, own=0.100, slack=1.0) == 0
    # rung 0 would cost the queue 75 ms over rung 2, rung 1 25 ms: 30 ms of slack
    assert lad.choose(0.010, 0.100, own=0.100, slack=0.030) == 1
    assert lad.choose(0.010, 0.100, own=0.100, slack=-0.010) == 2  # already late: narrowest
    # without a deadline of its own the queue still bounds it
    assert ladder().choose(5.0, None, own=0.100, slack=0.030) == 1


def test_queue_slack_is_the_least_margin_of_the_queued_requests() -> None:
    est = ServiceEstimate(max_batch=16)
    for k in range(40):  # 16-request batches, 100 ms each, back to back
        est.observe(16, k * 0.1, (k + 1) * 0.1, 0.1)
    now = 100.0
    assert queue_slack(now, [now + 1.0], 0, ServiceEstimate(), 1.0) is None  # cold
    assert queue_slack(now, [None, None], 0, est, 1.0) is None  # no deadlines
    deadlines = [now + 1.0, None, now + 0.5, now + 2.0]
    want = min(HEADROOM * (d - now) - 0.5 * est.predict(32 + i)
               for i, d in enumerate(deadlines) if d is not None)  # fmt: skip
    assert queue_slack(now, deadlines, 32, est, 0.5) == pytest.approx(want)
    assert queue_slack(now, [now + 0.1], 64, est, 1.0) < 0  # already short


def test_a_small_batch_barely_moves_a_rungs_cost() -> None:
    """The lone requests that open a burst after an idle spell are quick: counted as full
    batches they would halve a rung's cost, and with it admission's prediction."""
    lad = ladder()
    lad.observe(0, 0.040)
    lad.observe(2, 0.030)
    assert lad.cost(2) == pytest.approx(0.75)
    lad.observe(2, 0.003, weight=1 / 16)
    assert lad.cost(2) == pytest.approx((0.030 + 0.2 / 16 * (0.003 - 0.030)) / 0.040)
    assert lad.cost(2) > 0.74
    full = ladder()
    full.observe(0, 0.040)
    full.observe(2, 0.030)
    full.observe(2, 0.003)
    assert full.cost(2) == pytest.approx(0.615)
