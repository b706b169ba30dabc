"""Request batching on the event loop: the first stop of every Retrieve (DESIGN.md §2, §5).

    Retrieve handler ──submit──► bounded queue ──Batcher.run──► [≤ max_batch Pending]
    ──dispatch (stage 1 thread)──► pipeline ──Pending.resolve──► handler's await returns

A batch closes at `max_batch` requests, or `max_wait` after its first request arrived
while the pipeline is nearly idle (fewer than `busy_batches` batches in flight: the
server's default, `default_busy_batches`, is 1 on a GPU and 2 on a CPU). When
the pipeline is busy a small batch would only queue behind the others, and the GPU runs
a padded bucket for it at almost the cost of a full one (DESIGN.md §2: batches of 16), so
the batch keeps filling for up to `max_wait_busy`: at moderate load batches are full, not
three requests every `max_wait` — the difference between saturating near half the GPU's
throughput and reaching it (docs/SERVICE.md).
The queue is bounded: when it is full, `submit` raises `Overloaded` at once (the server
answers RESOURCE_EXHAUSTED) instead of building a backlog. A request whose deadline has
passed when its batch closes is answered `DeadlineExpired` and never reaches stage 1. At
most `max_inflight` batches are in the pipeline at once; while all slots are taken the
batcher stops taking requests, the queue fills, and overload shows at the door.

Only this module's coroutines run on the event loop; `dispatch` must hand the batch to a
thread and return at once, and pipeline threads resolve results with `Pending.resolve`,
which is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Batches in flight that make the pipeline busy, by default: on a GPU 1 — a batch keeps
# filling while anything computes and goes when the pipeline drains, so batches stop
# queueing on the shared GPU (H200, 2 workers: P99 56–63 ms at 800–850 req/s where 2 read
# 270–280 ms at 800–900); on a CPU 2 — the stage threads share the cores, and a second
# batch in flight keeps them busy (CPU demo at 120 req/s: P99 220 ms with 2, 410–450 with
# 1). docs/OPERATIONS.md has both runs.
BUSY_BATCHES = 2
BUSY_BATCHES_GPU = 1


def default_busy_batches(device: str) -> int:
    """The busy threshold for a server on `device` ("cpu", "cuda", "cuda:N")."""
    return BUSY_BATCHES_GPU if device.startswith("cuda") else BUSY_BATCHES


BUSY_POLL = 0.001  # seconds between looks at a busy pipeline when max_wait is 0


class Overloaded(RuntimeError):
    """The request queue is full."""


class DeadlineExpired(RuntimeError):
    """The request's deadline passed before its batch was dispatched."""


@dataclass(eq=False)
class Pending:
    """One request waiting for its result; created on the event loop."""

    payload: Any  # the validated request
    deadline: float | None  # time.monotonic() by which it must be answered; None = none
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

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
    ) -> None:
        if max_wait_busy is None:
            max_wait_busy = 4 * max_wait
        if (
            min(max_batch, capacity, max_inflight, busy_batches) < 1
            or not 0 <= max_wait <= max_wait_busy
        ):
            raise ValueError(
                "max_batch, capacity, max_inflight and busy_batches must be >= 1, "
                "0 <= max_wait <= max_wait_busy"
            )
        self._dispatch = dispatch
        self.max_batch, self.max_wait, self.max_wait_busy = max_batch, max_wait, max_wait_busy
        self.busy_batches = busy_batches
        self.inflight = 0  # dispatched batches not yet done (event loop only)
        self._queue: asyncio.Queue[Pending] = asyncio.Queue(maxsize=capacity)
        self._slots = asyncio.Semaphore(max_inflight)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.expired = 0  # requests dropped for their deadline, for metrics

    @property
    def full(self) -> bool:
        """No room in the queue: a new request would be refused."""
        return self._queue.full()

    @property
    def depth(self) -> int:
        """Requests waiting for a batch."""
        return self._queue.qsize()

    async def submit(self, payload: Any, timeout: float | None = None) -> Any:
        """Queue a request and wait for its result (raises Overloaded when full)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = Pending(payload, deadline, loop.create_future(), loop)
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            raise Overloaded(f"request queue full ({self._queue.maxsize})") from None
        return await pending.future

    def batch_done(self) -> None:
        """A dispatched batch left the pipeline (call from any thread)."""
        assert self._loop is not None, "batcher not started"
        self._loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        self.inflight -= 1
        self._slots.release()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="grace-batcher")

    async def stop(self) -> None:
        """Stop forming batches; requests still queued fail with Overloaded."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while not self._queue.empty():
            p = self._queue.get_nowait()
            _set(p.future, None, Overloaded("server shutting down"))

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            batch = [await self._queue.get()]
            first = time.monotonic()
            while len(batch) < self.max_batch:
                if not self._queue.empty():  # already waiting: no reason to close without it
                    batch.append(self._queue.get_nowait())
                    continue
                busy = self.inflight >= self.busy_batches
                remaining = (
                    first + (self.max_wait_busy if busy else self.max_wait) - time.monotonic()
                )
                if remaining <= 0:
                    break
                # a busy pipeline may drain meanwhile: look again every max_wait (>= 1 ms)
                wait = min(remaining, max(self.max_wait, BUSY_POLL)) if busy else remaining
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), wait))
                except TimeoutError:
                    continue
            now = time.monotonic()
            live = []
            for p in batch:
                if p.future.done():  # cancelled by the client while queued
                    continue
                if p.expired(now):
                    self.expired += 1
                    _set(p.future, None, DeadlineExpired("deadline passed before processing"))
                else:
                    live.append(p)
            if live:
                self.inflight += 1
                self._dispatch(live)
            else:
                self._slots.release()
