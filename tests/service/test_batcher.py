"""The batcher: batch size and wait limits, overload at the door, expired deadlines."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.batcher import Batcher, DeadlineExpired, Overloaded, Pending


class FakePipeline:
    """A stage thread that doubles payloads; `gate` holds batches until set."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.inbox: queue.Queue[list[Pending] | None] = queue.Queue()
        self.batcher: Batcher | None = None
        self.service: float | None = None  # stage time reported per batch (None: none)
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def dispatch(self, batch: list[Pending], rung: int | None = None) -> None:
        self.inbox.put(batch)

    def _work(self) -> None:
        while (batch := self.inbox.get()) is not None:
            dispatched = time.monotonic()
            self.gate.wait()
            self.batches.append([p.payload for p in batch])
            for p in batch:
                p.resolve(p.payload * 2)
            assert self.batcher is not None
            self.batcher.batch_done(len(batch), dispatched, self.service)

    def close(self) -> None:
        self.gate.set()
        self.inbox.put(None)
        self.thread.join(5)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def make(**kw) -> tuple[Batcher, FakePipeline]:
    pipe = FakePipeline()
    batcher = Batcher(pipe.dispatch, **kw)
    pipe.batcher = batcher
    batcher.start()
    return batcher, pipe


def test_concurrent_requests_are_batched_up_to_max_batch() -> None:
    async def main() -> None:
        batcher, pipe = make(max_batch=16, max_wait=0.05)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(40)))
        assert results == [2 * i for i in range(40)]
        sizes = [len(b) for b in pipe.batches]
        assert max(sizes) == 16 and sum(sizes) == 40
        assert sorted(x for b in pipe.batches for x in b) == list(range(40))
        await batcher.stop()
        pipe.close()

    run(main())


def test_a_lone_request_waits_at_most_max_wait() -> None:
    async def main() -> None:
        batcher, pipe = make(max_batch=16, max_wait=0.05)
        t = time.monotonic()
        assert await batcher.submit(7) == 14
        assert 0.04 <= time.monotonic() - t < 1.0
        await batcher.stop()
        pipe.close()

    run(main())


def test_full_queue_answers_overloaded_at_once_and_accepted_requests_succeed() -> None:
    async def main() -> None:
        batcher, pipe = make(max_batch=2, max_wait=0.0, capacity=3, max_inflight=1)
        pipe.gate.clear()  # the pipeline stalls
        first = asyncio.ensure_future(batcher.submit(0))
        await asyncio.sleep(0.05)  # batch [0] dispatched and stuck; the slot is taken
        accepted = [asyncio.ensure_future(batcher.submit(i)) for i in (1, 2, 3)]
        await asyncio.sleep(0.01)
        t = time.monotonic()
        with pytest.raises(Overloaded):
            await batcher.submit(4)
        assert time.monotonic() - t < 0.05  # refused immediately, not queued
        assert batcher.depth == 3
        pipe.gate.set()
        assert await first == 0
        assert await asyncio.gather(*accepted) == [2, 4, 6]
        await batcher.stop()
        pipe.close()

    run(main())


def test_expired_requests_never_reach_the_pipeline() -> None:
    async def main() -> None:
        dropped: list[int] = []
        batcher, pipe = make(max_batch=4, max_wait=0.0, max_inflight=1, on_expired=dropped.append)
        pipe.gate.clear()
        blocker = asyncio.ensure_future(batcher.submit(100))
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(batcher.submit(1, timeout=0.01))
        fine = asyncio.ensure_future(batcher.submit(2, timeout=10))
        await asyncio.sleep(0.1)  # the deadline passes while the pipeline is busy
        pipe.gate.set()
        with pytest.raises(DeadlineExpired):
            await late
        assert await fine == 4 and await blocker == 200
        assert all(1 not in b for b in pipe.batches)
        assert dropped == [1]  # counted once, through on_expired
        await batcher.stop()
        pipe.close()

    run(main())


def test_stop_fails_queued_requests() -> None:
    async def main() -> None:
        batcher, pipe = make(max_batch=1, max_wait=0.0, max_inflight=1)
        pipe.gate.clear()
        running = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0.01)
        await batcher.stop()
        with pytest.raises(Overloaded, match="shutting down"):
            await queued
        pipe.gate.set()
        assert await running == 2
        pipe.close()

    run(main())


async def submit_trickle(batcher: Batcher, items, gap: float = 0.01) -> list[asyncio.Future]:
    """Submit `items` one every `gap` seconds (slower than the tests' max_wait)."""
    out = []
    for i in items:
        out.append(asyncio.ensure_future(batcher.submit(i)))
        await asyncio.sleep(gap)
    return out


def test_a_busy_pipeline_fills_batches_instead_of_closing_at_max_wait() -> None:
    """With two batches held in the pipeline, a trickle of requests (one every 10 ms or
    more, slower than max_wait) forms one full batch, not one batch each; once the pipeline
    is idle again, a lone request goes after max_wait, not max_wait_busy. max_wait_busy is
    far above any stall of a busy machine, so every batch closes on a condition (full, or
    idle after max_wait), never on a race between the trickle and a timer."""

    async def main() -> None:
        batcher, pipe = make(max_batch=5, max_wait=0.005, max_wait_busy=60.0)
        pipe.gate.clear()  # hold dispatched batches: they stay in flight
        held = []
        for i in (100, 101):  # each closes alone after max_wait: the pipeline is not busy
            held.append(asyncio.ensure_future(batcher.submit(i)))
            while batcher.inflight < len(held):
                await asyncio.sleep(0.001)
        trickle = await submit_trickle(batcher, range(5))
        pipe.gate.set()
        assert await asyncio.gather(*held, *trickle) == [200, 202, 0, 2, 4, 6, 8]
        assert pipe.batches == [[100], [101], [0, 1, 2, 3, 4]]  # the trickle waited
        while batcher.inflight:
            await asyncio.sleep(0.001)
        t = time.monotonic()
        assert await batcher.submit(9) == 18
        assert time.monotonic() - t < 30.0  # idle: max_wait, not max_wait_busy (60 s)
        await batcher.stop()
        pipe.close()

    run(main())


def test_busy_batches_sets_when_a_forming_batch_keeps_filling() -> None:
    """With one batch held in the pipeline: under the default (busy from two batches in
    flight) the next request closes alone after max_wait, and the batch after it, with two
    in flight, keeps filling; with busy_batches=1 the pipeline is busy already and a
    trickle (slower than max_wait) fills one batch. Batches close when full or, idle,
    after max_wait: no outcome hangs on how fast the machine runs the trickle."""

    async def hold_one(busy_batches: int) -> tuple[Batcher, FakePipeline, asyncio.Future]:
        batcher, pipe = make(
            max_batch=4, max_wait=0.005, max_wait_busy=60.0, busy_batches=busy_batches
        )
        pipe.gate.clear()  # the first batch stays in flight
        held = asyncio.ensure_future(batcher.submit(100))
        while batcher.inflight < 1:
            await asyncio.sleep(0.001)
        return batcher, pipe, held

    async def finish(batcher: Batcher, pipe: FakePipeline, futures) -> list[list[int]]:
        pipe.gate.set()
        await asyncio.gather(*futures)
        await batcher.stop()
        pipe.close()
        return pipe.batches[1:]

    async def default_busy() -> list[list[int]]:
        batcher, pipe, held = await hold_one(2)
        first = asyncio.ensure_future(batcher.submit(0))
        while batcher.inflight < 2:  # one in flight is not busy: [0] closes after max_wait
            await asyncio.sleep(0.001)
        rest = await submit_trickle(batcher, range(1, 5))
        return await finish(batcher, pipe, [held, first, *rest])

    async def busy_from_one() -> list[list[int]]:
        batcher, pipe, held = await hold_one(1)
        rest = await submit_trickle(batcher, range(4))
        return await finish(batcher, pipe, [held, *rest])

    assert run(default_busy()) == [[0], [1, 2, 3, 4]]
    assert run(busy_from_one()) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="busy_batches"):
        Batcher(lambda batch: None, busy_batches=0)


def test_max_wait_busy_below_max_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="max_wait_busy"):
        Batcher(lambda batch: None, max_wait=0.01, max_wait_busy=0.005)


def test_queued_requests_join_a_batch_even_with_no_wait() -> None:
    """max_wait 0 while busy: requests already queued fill the batch at once (no spin of
    empty waits, no batches of one)."""

    async def main() -> None:
        batcher, pipe = make(max_batch=16, max_wait=0.0, max_wait_busy=0.02)
        pipe.gate.clear()
        held = []
        for i in (100, 101):
            held.append(asyncio.ensure_future(batcher.submit(i)))
            while batcher.inflight < len(held):
                await asyncio.sleep(0.001)
        queued = [asyncio.ensure_future(batcher.submit(i)) for i in range(40)]
        await asyncio.sleep(0.05)
        pipe.gate.set()
        assert await asyncio.gather(*queued) == [2 * i for i in range(40)]
        sizes = [len(b) for b in pipe.batches[2:]]
        assert sum(sizes) == 40 and max(sizes) == 16 and len(sizes) <= 4, sizes
        await asyncio.gather(*held)
        await batcher.stop()
        pipe.close()

    run(main())


def test_a_batch_holds_at_most_max_groups_decode_groups() -> None:
    """Requests of a third schedule wait for a later batch, keeping their place: no batch
    mixes more than two, nothing is lost, each schedule is served in arrival order."""

    async def main() -> None:
        batcher, pipe = make(max_batch=8, max_wait=0.0, max_inflight=1, max_groups=2,
                             group_key=lambda x: x % 3)  # fmt: skip
        pipe.gate.clear()
        blocker = asyncio.ensure_future(batcher.submit(99))
        while batcher.inflight < 1:
            await asyncio.sleep(0.001)
        queued = [asyncio.ensure_future(batcher.submit(i)) for i in range(30)]
        await asyncio.sleep(0.01)
        pipe.gate.set()
        assert await asyncio.gather(*queued) == [2 * i for i in range(30)]
        await blocker
        batches = pipe.batches[1:]
        assert all(len({x % 3 for x in b}) <= 2 for b in batches), batches
        assert sorted(x for b in batches for x in b) == list(range(30))
        for key in range(3):
            order = [x for b in batches for x in b if x % 3 == key]
            assert order == sorted(order)
        await batcher.stop()
        pipe.close()

    run(main())


@settings(max_examples=25, deadline=None)
@given(
    keys=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    max_groups=st.integers(1, 3),
    max_batch=st.integers(1, 8),
)
def test_grouped_batching_serves_every_request_once(keys, max_groups, max_batch) -> None:
    async def main() -> list[list[int]]:
        batcher, pipe = make(max_batch=max_batch, max_wait=0.0, max_inflight=1,
                             max_groups=max_groups, group_key=lambda i: keys[i])  # fmt: skip
        pipe.gate.clear()
        futures = [asyncio.ensure_future(batcher.submit(i)) for i in range(len(keys))]
        await asyncio.sleep(0)
        pipe.gate.set()
        assert await asyncio.gather(*futures) == [2 * i for i in range(len(keys))]
        await batcher.stop()
        pipe.close()
        return pipe.batches

    batches = run(main())
    assert sorted(i for b in batches for i in b) == list(range(len(keys)))
    assert all(1 <= len(b) <= max_batch and len({keys[i] for i in b}) <= max_groups
               for b in batches)  # fmt: skip


def test_deadlines_that_do_not_fit_are_refused_at_once() -> None:
    """Once batches have shown what requests cost, a deadline shorter than the service
    is hopeless and one that does not fit behind the work ahead is overloaded — both
    refused before queueing; a request without a deadline is still queued."""

    async def main() -> None:
        batcher, pipe = make(max_batch=4, max_wait=0.0, max_inflight=1)
        for t in (0.0, 0.2):  # two batches of 4, 200 ms each, one after the other
            batcher.admission.estimate.observe(4, dispatched=t, done=t + 0.2, service=0.2)
        with pytest.raises(DeadlineExpired, match="shorter than the service"):
            await batcher.submit(2, timeout=0.1)
        pipe.gate.clear()
        held = [asyncio.ensure_future(batcher.submit(i)) for i in range(8)]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="predicted") as refused:
            await batcher.submit(3, timeout=0.3)
        assert refused.value.reason == "overloaded" and batcher.depth == 4
        pipe.gate.set()
        assert await asyncio.gather(*held) == [2 * i for i in range(8)]
        await batcher.stop()
        pipe.close()

    run(main())


def test_a_queued_request_that_can_no_longer_finish_is_dropped() -> None:
    """Admitted, then held in the queue until less time is left than the fastest service:
    it is answered DeadlineExpired at once and counted, never dispatched."""

    async def main() -> None:
        dropped: list[int] = []
        batcher, pipe = make(max_batch=4, max_wait=0.0, max_inflight=1, on_expired=dropped.append)
        pipe.service = 0.05
        assert await batcher.submit(1) == 2  # the estimate: 50 ms of service
        while batcher.inflight:  # its batch released (and observed) before the blocker comes
            await asyncio.sleep(0.001)
        pipe.gate.clear()
        blocker = asyncio.ensure_future(batcher.submit(100))
        while batcher.inflight < 1:
            await asyncio.sleep(0.001)
        late = asyncio.ensure_future(batcher.submit(7, timeout=0.3))
        await asyncio.sleep(0.28)  # less than 50 ms left, still queued behind the blocker
        pipe.gate.set()
        with pytest.raises(DeadlineExpired, match="can no longer be met"):
            await late
        assert await blocker == 200
        assert dropped == [1]
        assert all(7 not in b for b in pipe.batches)
        await batcher.stop()
        pipe.close()

    run(main())
