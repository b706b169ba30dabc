"""Per-request balancing over the workers (`grace serve --workers N --balance request`).

With the default `balance = "connection"` the workers share the public port through
SO_REUSEPORT and the kernel spreads *connections* over them; every request follows its
connection. On the H200 that split 64 client connections' requests anywhere from 48/52
to 65/35 between runs, and the loaded worker's queue is what failed the P99
(docs/OPERATIONS.md). With `balance = "request"` the supervisor (`service/workers.py`)
runs this front instead, in a thread of its own process:

    client ──gRPC──► front (public port) ──least in flight──► worker i (unix socket)

- each worker serves on a private unix socket (no TCP, no SO_REUSEPORT);
- each Retrieve goes, as raw bytes (never parsed here), to the worker with the fewest
  calls in flight, ties in turn; deadline and metadata go with it, and the worker's
  answer, status, details and trailing metadata come back unchanged;
- the front answers health and reflection itself: NOT_SERVING until every worker says
  SERVING, then it binds the public port (nothing connects to a server still loading);
  on stop it says NOT_SERVING, waits the drain notice, and lets calls in flight finish.
The price is one local hop per request (measured on CPU in docs/SERVICE.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.rpc.grace.v1 import retrieval_pb2
from service.settings import ServerSettings

log = logging.getLogger("grace.balancer")
SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["AdRetrieval"].full_name
FORWARDED = f"/{SERVICE}/"  # methods sent on to a worker; the rest are the front's own
DRAIN_NOTICE_SECONDS = 1.0  # as the workers: let health checkers see NOT_SERVING first
READY_POLL_SECONDS = 0.5


class Front(grpc.GenericRpcHandler):
    """The public gRPC server of a `balance = "request"` supervisor."""

    def __init__(self, settings: ServerSettings, workers: Sequence[str]) -> None:
        self.settings, self.workers = settings, list(workers)
        self.inflight = [0] * len(self.workers)
        self.answered = [0] * len(self.workers)  # calls each worker finished (tests, logs)
        self._turn = itertools.count()
        self._channels: list[grpc.aio.Channel] = []
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self.health = health.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    def pick(self) -> int:
        """The worker with the fewest calls in flight; ties go round in turn."""
        low = min(self.inflight)
        tied = [i for i, n in enumerate(self.inflight) if n == low]
        return tied[next(self._turn) % len(tied)]

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        if not method.startswith(FORWARDED):
            return None  # health, reflection: registered on the front itself
        if method not in self._handlers:
            self._handlers[method] = grpc.unary_unary_rpc_method_handler(self._forwarder(method))
        return self._handlers[method]

    def _forwarder(self, method: str):
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            i = self.pick()
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
        from service.app import server_options

        self._channels = [grpc.aio.insecure_channel(a) for a in self.workers]
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        while not await self._all_serving():
            try:
                await asyncio.wait_for(stopping.wait(), READY_POLL_SECONDS)
                return False
            except TimeoutError:
                pass
        self.server = grpc.aio.server(options=server_options(self.settings))
        self.server.add_generic_rpc_handlers((self,))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)  # fmt: skip
        reflection.enable_server_reflection(names, self.server)
        self.port = self.server.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        if not self.port:
            raise OSError(f"cannot bind {self.settings.host}:{self.settings.port}")
        await self.server.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
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
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
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


def _client_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple:
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
        self._started = threading.Event()

    def run(self) -> None:
        async def main() -> None:
            self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
            self._started.set()
            await self.front.run(self._stopping)

        try:
            asyncio.run(main())
        except Exception:
            log.exception("the request front failed: stopping the workers")
            self.failed = True
            self.on_error()
        finally:
            self._started.set()

    def stop(self) -> None:
        """Ask the front to drain and stop (any thread; returns at once)."""
        self._started.wait(10)
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # its loop has already closed
                loop.call_soon_threadsafe(stopping.set)
