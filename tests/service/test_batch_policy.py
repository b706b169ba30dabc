"""The batching policy (`service/batch_policy.py`) on a fake clock: when a forming batch
closes, idle and busy, which groups may join, and the wait admission predicts."""

from __future__ import annotations

import pytest

from service.batch_policy import BUSY_POLL, BatchPolicy

P = BatchPolicy(max_batch=4, max_wait=0.005, max_wait_busy=0.02, busy_batches=1, max_groups=2)


def test_a_full_batch_closes_at_once_whatever_the_time() -> None:
    assert P.look_again(4, first=10.0, now=10.0, inflight=0) is None
    assert P.look_again(4, first=10.0, now=10.0, inflight=3) is None


def test_an_idle_pipeline_waits_max_wait_then_closes() -> None:
    assert P.look_again(1, first=10.0, now=10.001, inflight=0) == pytest.approx(10.005)
    assert P.look_again(1, first=10.0, now=10.005, inflight=0) is None


def test_a_busy_pipeline_keeps_filling_and_looks_again_every_max_wait() -> None:
    assert P.look_again(1, first=10.0, now=10.001, inflight=1) == pytest.approx(10.006)
    assert P.look_again(1, first=10.0, now=10.018, inflight=1) == pytest.approx(10.02)
    assert P.look_again(1, first=10.0, now=10.02, inflight=1) is None
    zero = BatchPolicy(max_batch=4, max_wait=0.0, max_wait_busy=0.02, busy_batches=1)
    assert zero.look_again(1, first=10.0, now=10.0, inflight=1) == pytest.approx(10 + BUSY_POLL)


def test_a_batch_takes_its_own_groups_and_new_ones_while_there_is_room() -> None:
    assert P.joins(set(), "a") and P.joins({"a"}, "b") and P.joins({"a", "b"}, "a")
    assert not P.joins({"a", "b"}, "c")


def test_admission_counts_the_wait_only_while_the_queue_does_not_fill_a_batch() -> None:
    assert P.admission_wait(queued=0, inflight=0) == 0.005
    assert P.admission_wait(queued=0, inflight=1) == 0.02
    assert P.admission_wait(queued=3, inflight=1) == 0.0


@pytest.mark.parametrize(
    "bad",
    [{"max_batch": 0}, {"max_inflight": 0}, {"busy_batches": 0}, {"max_groups": 0},
     {"max_wait": 0.01, "max_wait_busy": 0.005}, {"max_wait": -1.0}],
)  # fmt: skip
def test_nonsense_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="max_batch, max_inflight"):
        BatchPolicy(**bad)
