"""Request batching on the event loop: the first stop of every Retrieve (ARCHITECTURE.md §2).

    Retrieve handler ──admit──submit──► FIFO queue ──Batcher._run──► [≤ max_batch Pending]
    ──dispatch (stage 1 thread)──► pipeline ──Pending.resolve──► handler's await returns
                                           └─batch_done──► ServiceEstimate (admission)

`admit` refuses at once what admission (service/admission.py) or the bounded queue
(`capacity`) will not take. Batches form by the policy (service/batch_policy.py); this
module does the waiting, the queue and the hand-off. A queued request the client gave up
on, or whose remaining time is below what answering it must take (`expiry_margin`: the
fastest recent service, or `HEADROOM` × the predicted time through the batches in flight
ahead of it, whichever is longer), is dropped before stage 1 (`DeadlineExpired`, counted
by `on_expired`): computing it would only take the pipeline from requests that can still
make it (issue #49). `dispatch` must hand the batch to a thread and return at once;
`Pending.resolve` and `batch_done` are called from the pipeline's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.admission import HEADROOM, Admission, ServiceEstimate, Verdict
from service.batch_policy import LOOKAHEAD, BatchPolicy
from service.beam_ladder import Ladder, queue_slack
from service.settings import BUSY_BATCHES, MAX_GROUPS


class Overloaded(RuntimeError):
    """The request cannot be served in time behind the work ahead (`reason` "overloaded")
    or the queue is full ("queue_full")."""

    def __init__(self, message: str, reason: str = "overloaded") -> None:
        super().__init__(message)
        self.reason = reason


class DeadlineExpired(RuntimeError):
    """The request's deadline passed, or cannot be met, before it was processed."""


P = TypeVar("P")  # what a request carries: the server's ValidatedRequest


@dataclass(eq=False)
class Pending(Generic[P]):
    """One request waiting for its result; created on the event loop."""

    payload: P  # the validated request
    deadline: float | None  # time.monotonic() by which it must be answered; None = none
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    trace: Any = None  # its RPC span's context, for the batch span to link (service/tracing.py)

    def expired(self, now: float, margin: float = 0.0) -> bool:
        """Its deadline has passed, or passes within `margin` seconds."""
        return self.deadline is not None and now + margin >= self.deadline

    @property
    def abandoned(self) -> bool:
        """The client went away (its handler was cancelled) or it was answered already.
        A plain read of the future's state: safe from the pipeline threads."""
        return self.future.done()

    def resolve(self, result: Any) -> None:
        """Deliver a result from any thread."""
        self.loop.call_soon_threadsafe(_set, self.future, result, None)

    def fail(self, error: BaseException) -> None:
        """Deliver an error from any thread."""
        self.loop.call_soon_threadsafe(_set, self.future, None, error)


def _set(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the client went away (cancelled) meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Batcher:
    def __init__(
        self,
        dispatch: Callable[[list[Pending]], None],
        *,
        max_batch: int = 16,
        max_wait: float = 0.005,
        max_wait_busy: float | None = None,  # default: 4 * max_wait
        capacity: int = 256,
        max_inflight: int = 4,
        busy_batches: int = BUSY_BATCHES,  # batches in flight that make the pipeline busy
        max_groups: int = MAX_GROUPS,  # decode groups one batch may hold
        group_key: Callable[[Any], Hashable] = lambda payload: None,
        on_expired: Callable[[int], None] = lambda n: None,  # dropped in the queue
        ladder: Ladder | None = None,  # beam schedules for load (service/beam_ladder.py)
        adaptive: Callable[[Any], bool] = lambda payload: False,  # decodes at the rung
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.policy = BatchPolicy(
            max_batch, max_wait, 4 * max_wait if max_wait_busy is None else max_wait_busy,
            busy_batches, max_groups, max_inflight,
        )  # fmt: skip
        self._dispatch = dispatch
        self.max_batch, self.capacity = max_batch, capacity
        self._key, self._on_expired = group_key, on_expired
        self.admission = Admission(ServiceEstimate(max_batch=max_batch))
        self.ladder, self._adaptive = ladder, adaptive
        if ladder is not None:  # refuse only what the narrowest rung cannot answer in time
            self.admission.scale = ladder.floor
        self.inflight = 0  # dispatched batches not yet done (event loop only)
        self.inflight_requests = 0  # the requests in them
        self._queue: deque[Pending] = deque()
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(max_inflight)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def depth(self) -> int:
        """Requests waiting for a batch."""
        return len(self._queue)

    def admit(self, timeout: float | None) -> None:
        """Raise `Overloaded` or `DeadlineExpired` at once if a request with `timeout` seconds
        left would be refused. Cheap: call it before parsing the request."""
        if len(self._queue) >= self.capacity:
            raise Overloaded(f"request queue full ({self.capacity})", "queue_full")
        self.admission.wait = self.policy.admission_wait(len(self._queue), self.inflight)
        verdict = self.admission.decide(timeout, len(self._queue), self.inflight_requests)
        if verdict is Verdict.ADMIT:
            return
        assert timeout is not None
        if verdict is Verdict.HOPELESS:
            raise DeadlineExpired(
                f"deadline {1e3 * timeout:.0f} ms is shorter than the service time "
                f"({1e3 * self.admission.estimate.fastest:.0f} ms)"
            )
        predicted = self.admission.predicted_ms(len(self._queue), self.inflight_requests)
        raise Overloaded(
            f"overloaded: predicted {predicted:.0f} ms to answer, deadline {1e3 * timeout:.0f} ms"
        )

    async def submit(self, payload: Any, timeout: float | None = None, trace: Any = None) -> Any:
        """Admit (see `admit`), queue the request and wait for its result; `trace`: the
        request's span context (service/tracing.py), carried to its batch."""
        self.admit(timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = Pending(payload, deadline, loop.create_future(), loop, trace)
        self._queue.append(pending)
        self._arrived.set()
        return await pending.future

    def batch_done(
        self, size: int, dispatched: float, service: float | None, rung: int | None = None
    ) -> None:
        """A batch of `size` requests, dispatched at `dispatched` (time.monotonic), left
        the pipeline after `service` seconds of stage time — None when it failed or was
        dropped part-way, which teaches the estimate nothing; `rung`: the ladder rung it
        decoded at (None: none). Call from any thread."""
        assert self._loop is not None, "batcher not started"
        self._loop.call_soon_threadsafe(self._release, size, dispatched, time.monotonic(),
                                        service, rung)  # fmt: skip

    def _release(
        self, size: int, dispatched: float, done: float, service: float | None, rung: int | None
    ) -> None:
        self.inflight -= 1
        self.inflight_requests -= size
        self._slots.release()
        if service is None:
            return
        scale = 1.0
        if self.ladder is not None and rung is not None:  # the estimate learns in rung 0's units
            self.ladder.observe(rung, service, size / self.max_batch)
            scale = self.ladder.cost(rung)
            self.admission.scale = self.ladder.floor
        self.admission.estimate.observe(size, dispatched, done, service, scale)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="grace-batcher")

    async def stop(self) -> None:
        """Stop forming batches; requests still queued fail with Overloaded."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self._queue:
            _set(self._queue.popleft().future, None, Overloaded("server shutting down"))

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            batch: list[Pending] = []
            groups: set[Hashable] = set()
            first: float | None = None  # when the batch's first request joined it
            while len(batch) < self.max_batch:
                if self._take(batch, groups) and first is None:
                    first = time.monotonic()
                if len(batch) >= self.max_batch:
                    break
                if first is None:  # nothing yet: wait for the first request, however long
                    await self._wait_arrival(None)
                    continue
                now = time.monotonic()
                look = self.policy.look_again(len(batch), first, now, self.inflight)
                if look is None:
                    break
                await self._wait_arrival(look - now)
            live = [p for p in batch if not p.abandoned]  # cancelled while it was formed
            if live:
                rung = self._rung(live)
                self.inflight += 1
                self.inflight_requests += len(live)
                self._dispatch(live, rung)
            else:
                self._slots.release()

    def expiry_margin(self) -> float:
        """Seconds a queued request must still have to be worth batching now: the
        fastest recent service, or `HEADROOM` × its predicted answer behind the batches
        in flight (at the narrowest rung: admission's scale), whichever is longer. Under
        overload the second is most of it — a request with less time left would be
        computed and then miss, taking compute from the ones behind it."""
        e = self.admission.estimate
        ahead = HEADROOM * self.admission.scale * e.predict(self.inflight_requests)
        return max(e.fastest, ahead)

    def _rung(self, batch: list[Pending]) -> int | None:
        """The ladder rung `batch` decodes at (None: no ladder, or no request of it
        without beam_widths of its own): chosen from what the work ahead and its own
        service are predicted to take at rung 0, its shortest deadline, and what the
        requests still queued behind it can absorb (`queue_slack`)."""
        if self.ladder is None:
            return None
        mine = [p for p in batch if self._adaptive(p.payload)]
        if not mine:
            return None
        now = time.monotonic()
        deadlines = [p.deadline for p in mine if p.deadline is not None]
        remaining = min(deadlines) - now if deadlines else None
        e = self.admission.estimate
        predicted = e.predict(self.inflight_requests + len(batch) - 1)
        own = e.per_batch + len(batch) * (e.per_request or 0.0)  # its busy time at rung 0
        behind = (p.deadline for p in self._queue if not p.abandoned)
        slack = queue_slack(now, behind, self.inflight_requests + len(batch), e,
                            self.admission.scale)  # fmt: skip
        return self.ladder.choose(predicted, remaining, own, slack)

    async def _wait_arrival(self, timeout: float | None) -> None:
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout)

    def _take(self, batch: list[Pending], groups: set[Hashable]) -> bool:
        """Move queued requests into `batch`, in queue order, as far as the policy lets
        them join; requests of other groups keep their place. Abandoned and hopeless ones
        are dropped. True if any was taken."""
        now, floor = time.monotonic(), self.expiry_margin()
        skipped: list[Pending] = []
        taken = expired = 0
        while self._queue and len(batch) < self.max_batch and len(skipped) < LOOKAHEAD:
            p = self._queue.popleft()
            if p.abandoned:
                continue
            if p.expired(now, floor):
                expired += 1
                _set(p.future, None, DeadlineExpired("deadline can no longer be met"))
                continue
            key = self._key(p.payload)
            if not self.policy.joins(groups, key):
                skipped.append(p)
                continue
            groups.add(key)
            batch.append(p)
            taken += 1
        self._queue.extendleft(reversed(skipped))
        if expired:
            self._on_expired(expired)
        return taken > 0
