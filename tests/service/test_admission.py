"""Admission: what recent batches teach the estimate, which deadlines it refuses, and
which queued requests the batcher drops as no longer able to finish."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.admission import HEADROOM, Admission, ServiceEstimate, Verdict
from service.batcher import Batcher, DeadlineExpired, Pending


def busy_run(estimate: ServiceEstimate, batches: int, size: int, gap: float, service: float):
    """Batches of `size` finishing every `gap` seconds, each dispatched before the one
    ahead of it finished (the pipeline never idles)."""
    for i in range(batches):
        done = 10.0 + i * gap
        estimate.observe(size, dispatched=done - 2.5 * gap, done=done, service=service)


def test_throughput_is_learned_from_overlapping_batches() -> None:
    """Batches two or three at a time in the pipeline (CPU): each costs the gap since the
    one before it finished, not its whole time in the pipeline."""
    estimate = ServiceEstimate()
    busy_run(estimate, batches=40, size=16, gap=0.08, service=0.15)
    assert estimate.per_request == pytest.approx(0.08 / 16)
    assert estimate.per_batch == 0.0  # every batch full: no line to fit, the plain ratio
    assert estimate.service == pytest.approx(0.15)
    assert estimate.predict(32) == pytest.approx(32 * 0.005 + 0.15)


def test_a_fixed_cost_per_batch_is_learned_from_batches_of_several_sizes() -> None:
    """Batches one after another (GPU), each costing 4 ms plus 0.7 ms per request: small
    batches cost more per request, and a queue that fills batches is predicted so."""
    estimate = ServiceEstimate(max_batch=16)
    t = 0.0
    for i in range(64):
        size = 1 + i % 16
        busy = 0.004 + 0.0007 * size
        estimate.observe(size, dispatched=t + 0.001, done=t + 0.001 + busy, service=busy)
        t += 0.001 + busy + 0.002  # the next is dispatched after this one finished
    assert estimate.per_batch == pytest.approx(0.004)
    assert estimate.per_request == pytest.approx(0.0007)
    service = estimate.service
    assert service is not None
    assert estimate.predict(32) == pytest.approx(2 * 0.004 + 32 * 0.0007 + service)


def test_an_idle_gap_does_not_count_as_service_time() -> None:
    """A batch dispatched long after the last one finished costs its own time in the
    pipeline, not the idle time before it."""
    estimate = ServiceEstimate()
    busy_run(estimate, batches=40, size=16, gap=0.08, service=0.15)
    estimate.observe(16, dispatched=100.0, done=100.08, service=0.08)  # alone, much later
    assert estimate.per_request == pytest.approx(0.08 / 16)


def test_deadlines_are_admitted_refused_or_hopeless() -> None:
    admission = Admission()
    assert admission.decide(0.001, queued=500, in_flight=64) is Verdict.ADMIT  # knows nothing
    busy_run(admission.estimate, batches=40, size=16, gap=0.08, service=0.15)
    assert admission.decide(None, queued=10_000, in_flight=64) is Verdict.ADMIT  # no deadline
    assert admission.decide(0.1, queued=0, in_flight=0) is Verdict.HOPELESS  # < service
    fits = (0.15 + 100 * 0.005) / HEADROOM
    assert admission.decide(fits * 1.01, queued=90, in_flight=10) is Verdict.ADMIT
    assert admission.decide(fits * 0.99, queued=90, in_flight=10) is Verdict.OVERLOADED
    admission.wait = 0.02  # its batch may wait this long to fill
    assert admission.decide(fits * 1.01, queued=90, in_flight=10) is Verdict.OVERLOADED


@given(
    sizes=st.lists(st.integers(1, 16), min_size=2, max_size=40),
    gap=st.floats(1e-4, 1.0),
    service=st.floats(1e-4, 1.0),
    ahead=st.integers(0, 1000),
)
def test_more_work_ahead_never_predicts_a_shorter_wait(sizes, gap, service, ahead) -> None:
    estimate = ServiceEstimate()
    for i, n in enumerate(sizes):
        estimate.observe(n, dispatched=i * gap - gap / 2, done=i * gap, service=service)
    assert estimate.per_request is not None and estimate.per_request >= 0
    assert estimate.predict(ahead + 1) >= estimate.predict(ahead) >= estimate.service
    admission = Admission(estimate)
    fits = estimate.predict(ahead) / HEADROOM
    assert admission.decide(fits * 0.99, ahead, 0) is not Verdict.ADMIT
    if fits * 1.01 > estimate.fastest:  # not shorter than the service itself
        assert admission.decide(fits * 1.01, ahead, 0) is Verdict.ADMIT
        assert admission.decide(fits * 2, ahead // 2, 0) is Verdict.ADMIT  # less ahead


def test_a_queued_request_that_cannot_get_through_the_batches_in_flight_is_dropped() -> None:
    """Under overload the margin a queued request needs is the work in flight ahead of it,
    not just one batch's fastest service: one with less time left than HEADROOM × its
    predicted answer (at the narrowest rung's scale) is answered DeadlineExpired when
    its batch forms, never computed; one with time enough joins the batch."""

    async def main() -> None:
        dropped: list[int] = []
        batcher = Batcher(lambda batch, rung=None: None, max_batch=16, on_expired=dropped.append)
        est = batcher.admission.estimate
        busy_run(est, batches=40, size=16, gap=0.1, service=0.1)
        assert batcher.expiry_margin() == pytest.approx(est.fastest)  # nothing in flight
        batcher.inflight_requests = 48  # three batches ahead: ~0.4 s
        margin = batcher.expiry_margin()
        assert margin == pytest.approx(HEADROOM * est.predict(48)) and margin > 0.3
        batcher.admission.scale = 0.5  # a narrower rung answers in half the time
        assert batcher.expiry_margin() == pytest.approx(margin / 2)
        batcher.admission.scale = 1.0
        loop = asyncio.get_running_loop()
        now = time.monotonic()  # deadlines a second apart: no timing in the test
        late = Pending(1, now + margin - 0.5, loop.create_future(), loop)
        timely = Pending(2, now + margin + 1.0, loop.create_future(), loop)
        batcher._queue.extend([late, timely])
        batch: list[Pending] = []
        assert batcher._take(batch, set())
        assert batch == [timely] and dropped == [1]
        with pytest.raises(DeadlineExpired):
            late.future.result()

    asyncio.run(main())
