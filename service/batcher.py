"""Request batching on the event loop: the first stop of every Retrieve (ARCHITECTURE.md §2, §5).

    Retrieve handler ──admit──submit──► FIFO queue ──Batcher._run──► [≤ max_batch Pending]
    ──dispatch (stage 1 thread)──► pipeline ──Pending.resolve──► handler's await returns
                                           └─batch_done──► ServiceEstimate (admission)

**Admission** (service/admission.py): a request is queued only if its deadline leaves room
for the predicted wait behind the work already queued and in flight; otherwise `admit`
raises at once — `Overloaded` (RESOURCE_EXHAUSTED) when it does not fit,
`DeadlineExpired` (DEADLINE_EXCEEDED) when its deadline is shorter than the service
itself. The queue is bounded too (`capacity`): requests without a deadline are refused
when it is full.

**Batches** close at `max_batch` requests, or `max_wait` after the first request while
the pipeline is nearly idle (fewer than `busy_batches` batches in flight: the server's
default, `service.settings.default_busy_batches`, is 1 on a GPU and 2 on a CPU). When
the pipeline is busy a small batch would only queue behind the others, and the GPU runs
a padded bucket for it at almost the cost of a full one (ARCHITECTURE.md §2: batches of
16), so the batch keeps filling for up to `max_wait_busy`: at moderate load batches are
full, not three requests every `max_wait` (docs/SERVICE.md). A batch holds at most
`max_groups` decode groups (requests sharing a `group_key`: beam schedule and filter
mode, each one decode run): the batch takes the queue's requests in order whose group it
already has, or a new group while there is room; others wait for a later batch, keeping
their place. At most `max_inflight` batches are in the pipeline at once.

**Dropped in the queue**: a request the client gave up on (its future is done), or whose
remaining time is below the fastest recent service time — it cannot finish, so it is
answered `DeadlineExpired` at once and never reaches stage 1 (`on_expired` counts it).

Only this module's coroutines run on the event loop; `dispatch` must hand the batch to a
thread and return at once, and pipeline threads resolve results with `Pending.resolve` and
report finished batches with `batch_done`, both thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.admission import Admission, ServiceEstimate, Verdict
from service.settings import BUSY_BATCHES, MAX_GROUPS

LOOKAHEAD = 256  # queued requests a forming batch looks through for its groups
BUSY_POLL = 0.001  # seconds between looks at a busy pipeline when max_wait is 0


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
    ) -> None:
        if max_wait_busy is None:
            max_wait_busy = 4 * max_wait
        if (
            min(max_batch, capacity, max_inflight, busy_batches, max_groups) < 1
            or not 0 <= max_wait <= max_wait_busy
        ):
            raise ValueError(
                "max_batch, capacity, max_inflight, busy_batches and max_groups must be "
                ">= 1, 0 <= max_wait <= max_wait_busy"
            )
        self._dispatch = dispatch
        self.max_batch, self.max_wait, self.max_wait_busy = max_batch, max_wait, max_wait_busy
        self.capacity, self.busy_batches, self.max_groups = capacity, busy_batches, max_groups
        self._key, self._on_expired = group_key, on_expired
        self.admission = Admission(ServiceEstimate(max_batch=max_batch))
        self.inflight = 0  # dispatched batches not yet done (event loop only)
        self.inflight_requests = 0  # the requests in them
        self._queue: deque[Pending] = deque()
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(max_inflight)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def full(self) -> bool:
        """No room in the queue: a new request would be refused."""
        return len(self._queue) >= self.capacity

    @property
    def depth(self) -> int:
        """Requests waiting for a batch."""
        return len(self._queue)

    def admit(self, timeout: float | None) -> None:
        """Raise at once if a request with `timeout` seconds left would be refused:
        `Overloaded` (queue full, or it would not finish behind the work ahead) or
        `DeadlineExpired` (shorter than the service itself). Cheap: call it before
        parsing the request."""
        if self.full:
            raise Overloaded(f"request queue full ({self.capacity})", "queue_full")
        # the batch it joins waits for more requests unless the queue already fills it
        busy = self.inflight >= self.busy_batches
        filling = len(self._queue) + 1 < self.max_batch
        self.admission.wait = (self.max_wait_busy if busy else self.max_wait) if filling else 0.0
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

    def batch_done(self, size: int, dispatched: float, service: float | None) -> None:
        """A batch of `size` requests, dispatched at `dispatched` (time.monotonic), left
        the pipeline after `service` seconds of stage time — None when it failed or was
        dropped part-way, which teaches the estimate nothing (call from any thread)."""
        assert self._loop is not None, "batcher not started"
        self._loop.call_soon_threadsafe(self._release, size, dispatched, time.monotonic(), service)

    def _release(self, size: int, dispatched: float, done: float, service: float | None) -> None:
        self.inflight -= 1
        self.inflight_requests -= size
        self._slots.release()
        if service is not None:
            self.admission.estimate.observe(size, dispatched, done, service)

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
                busy = self.inflight >= self.busy_batches
                remaining = first + (self.max_wait_busy if busy else self.max_wait)
                remaining -= time.monotonic()
                if remaining <= 0:
                    break
                # a busy pipeline may drain meanwhile: look again every max_wait (>= 1 ms)
                await self._wait_arrival(
                    min(remaining, max(self.max_wait, BUSY_POLL)) if busy else remaining
                )
            live = [p for p in batch if not p.abandoned]  # cancelled while it was formed
            if live:
                self.inflight += 1
                self.inflight_requests += len(live)
                self._dispatch(live)
            else:
                self._slots.release()

    async def _wait_arrival(self, timeout: float | None) -> None:
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout)

    def _take(self, batch: list[Pending], groups: set[Hashable]) -> bool:
        """Move queued requests into `batch`, in queue order: those of a group it holds,
        or of a new group while it has fewer than `max_groups`; requests of other groups
        keep their place. Abandoned and hopeless ones are dropped. True if any was taken."""
        now, floor = time.monotonic(), self.admission.estimate.fastest
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
            if key not in groups and len(groups) >= self.max_groups:
                skipped.append(p)
                continue
            groups.add(key)
            batch.append(p)
            taken += 1
        self._queue.extendleft(reversed(skipped))
        if expired:
            self._on_expired(expired)
        return taken > 0
