"""Per-request balancing over the workers (`grace serve --workers N --balance request`;
docs/SERVICE.md "Balancing requests, not connections"). SO_REUSEPORT spreads connections,
and a request follows its connection's worker, however unevenly; with `balance =
"request"` the supervisor (`service/workers.py`) runs this front in a thread instead:

    client ──gRPC──► front (public port) ──least in flight──► worker i (unix socket)

Each Retrieve goes as raw bytes to the worker with the fewest calls in flight (ties in
turn, workers the supervisor marked down skipped), with its deadline and metadata; status,
details and trailing metadata come back unchanged, except that a call a worker answers
UNAVAILABLE (it died or is draining) is sent once more to another while its deadline
allows: Retrieve only reads. The front answers health and reflection itself, binds the
public port once every worker is SERVING, says NOT_SERVING while none is up, and on stop
lets its calls in flight finish before the supervisor tells the workers to drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.grpc_server import (
    DRAIN_NOTICE_SECONDS,
    SERVICE,
    HealthServicer,
    add_health_and_reflection,
    bind,
    server_options,
    set_health,
)
from service.rpc.grace.v1 import retrieval_pb2
from service.settings import ServerSettings

log = logging.getLogger("grace.balancer")
# the methods sent on to a worker (the rest — health, reflection — are the front's own)
FORWARDED = tuple(
    f"/{SERVICE}/{m.name}" for m in retrieval_pb2.DESCRIPTOR.services_by_name["AdRetrieval"].methods
)
READY_POLL_SECONDS = 0.5
# a worker binds its socket early (NOT_SERVING while loading): retry the hop quickly, not
# with gRPC's default backoff (up to 120 s) — its readiness is polled every 0.5 s
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class Front(grpc.GenericRpcHandler):
    """The public gRPC server of a `balance = "request"` supervisor."""

    def __init__(self, settings: ServerSettings, workers: Sequence[str]) -> None:
        self.settings, self.workers = settings, list(workers)
        self.inflight = [0] * len(self.workers)
        self.answered = [0] * len(self.workers)  # calls each worker finished (tests, logs)
        self.down: set[int] = set()  # workers not serving (the supervisor's word)
        self._turn = itertools.count()
        self._channels: list[grpc.aio.Channel] = []
        self._handlers = {
            m: grpc.unary_unary_rpc_method_handler(self._forwarder(m)) for m in FORWARDED
        }
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def mark(self, i: int, up: bool) -> None:
        """Worker i serves (again), or does not: send it nothing; health says whether any
        worker is up."""
        (self.down.discard if up else self.down.add)(i)
        if self.server is not None:  # ignored once draining
            await set_health(self.health, serving=len(self.down) < len(self.workers))

    def pick(self, not_this: int | None = None) -> int:
        """The worker with the fewest calls in flight among those not down (all, if every
        one is), other than `not_this` where there is another; ties go round in turn."""
        up = [i for i in range(len(self.workers)) if i not in self.down and i != not_this]
        up = up or [i for i in range(len(self.workers)) if i != not_this] or [0]
        low = min(self.inflight[i] for i in up)
        tied = [i for i in up if self.inflight[i] == low]
        return tied[next(self._turn) % len(tied)]

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._handlers.get(details.method)  # None: health, reflection, or unknown

    def _forwarder(
        self, method: str
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            tried = None
            while True:
                i = self.pick(tried)
                self.inflight[i] += 1
                call = self._channels[i].unary_unary(method)(  # no (de)serialisers: bytes
                    request,
                    timeout=context.time_remaining(),
                    metadata=_client_metadata(context.invocation_metadata()),
                )
                try:
                    response = await call
                    context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
                    return response
                except grpc.aio.AioRpcError as exc:
                    left = context.time_remaining()
                    if (exc.code() == grpc.StatusCode.UNAVAILABLE and tried is None
                            and len(self.workers) > 1 and (left is None or left > 0)):  # fmt: skip
                        tried = i
                        continue
                    context.set_trailing_metadata(tuple(exc.trailing_metadata() or ()))
                    await context.abort(exc.code(), exc.details() or "")
                    raise  # abort raises; this keeps type checkers content
                finally:
                    self.inflight[i] -= 1
                    self.answered[i] += 1

        return forward

    async def start(self, stopping: asyncio.Event) -> bool:
        """Wait until every worker is SERVING, then serve on the public port; False when
        told to stop first."""
        self._channels = [
            grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self.workers
        ]
        await set_health(self.health, serving=False)
        while not await self._all_serving():
            try:
                await asyncio.wait_for(stopping.wait(), READY_POLL_SECONDS)
                return False
            except TimeoutError:
                pass
        options = [*server_options(self.settings), ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=options)
        self.server.add_generic_rpc_handlers((self,))
        add_health_and_reflection(self.server, self.health)
        address = f"{self.settings.host}:{self.settings.port}"
        try:
            self.port = bind(self.server, address, self.settings)
        except RuntimeError as exc:  # taken (SO_REUSEPORT is off) or not ours to bind
            raise OSError(f"the request front cannot bind {address}: {exc}") from exc
        await self.server.start()
        await set_health(self.health, serving=True)
        log.info("balancing requests over %d workers on port %d", len(self.workers), self.port)
        return True

    async def _all_serving(self) -> bool:
        for channel in self._channels:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1)
            except grpc.aio.AioRpcError:
                return False
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
        return True

    async def stop(self) -> None:
        """NOT_SERVING, the drain notice, then let calls in flight finish (drain_seconds)."""
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await asyncio.sleep(DRAIN_NOTICE_SECONDS)
            await self.server.stop(self.settings.drain_seconds)
        for channel in self._channels:
            await channel.close()
        log.info("front stopped; requests answered per worker: %s", self.answered)

    async def run(self, stopping: asyncio.Event) -> None:
        """Serve until `stopping` is set, then stop."""
        try:
            if await self.start(stopping):
                await stopping.wait()
        finally:
            await self.stop()


def _client_metadata(
    metadata: Sequence[tuple[str, str | bytes]] | None,
) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's own metadata for the hop to the worker: gRPC's reserved keys and the
    transport's own (user-agent) are set again by the front's channel."""
    return tuple(
        (k, v) for k, v in metadata or () if not k.startswith(("grpc-", ":")) and k != "user-agent"
    )


class FrontThread(threading.Thread):
    """`Front` on its own event loop in a thread of the supervisor, whose main thread
    watches the worker processes; `on_error` runs if the front fails (say, the port is
    taken), so the supervisor stops the workers and exits non-zero."""

    def __init__(
        self, settings: ServerSettings, workers: Sequence[str], on_error: Callable[[], None]
    ) -> None:
        super().__init__(name="grace-front", daemon=True)
        self.front = Front(settings, workers)
        self.on_error = on_error
        self.failed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_asked = threading.Event()

    def run(self) -> None:
        async def main() -> None:
            self._stopping = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            if self._stop_asked.is_set():  # stop() came before the loop existed
                self._stopping.set()
            await self.front.run(self._stopping)

        try:
            asyncio.run(main())
        except Exception:
            log.exception("the request front failed: stopping the workers")
            self.failed = True
            self.on_error()

    def mark(self, i: int, up: bool) -> None:
        """`Front.mark` from the supervisor's thread (before the loop runs: at once)."""
        loop = self._loop
        if loop is None:
            (self.front.down.discard if up else self.front.down.add)(i)
            return
        marked = self.front.mark(i, up)
        try:
            asyncio.run_coroutine_threadsafe(marked, loop)
        except RuntimeError:  # its loop has already closed
            marked.close()

    def stop(self) -> None:
        """Ask the front to drain and stop: from any thread, before or after it started,
        returning at once (join the thread to wait for the drain)."""
        self._stop_asked.set()
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # its loop has already closed
                loop.call_soon_threadsafe(stopping.set)
