"""gRPC plumbing shared by a serving process (`service/app.py`) and the request front of
several workers (`service/balancer.py`): the service name, health, the drain notice, the
Retrieve registration and the server options. It imports no torch, nor anything that does.

Health and reflection are asyncio servicers: an open Watch stream holds no thread (the
synchronous servicer parks an executor thread per Watch, and a few wedge every later Check
and the shutdown). Checks are paced by a token bucket and Watches capped, so probes in
tight loops cannot take the event loop from Retrieve; streams per connection are capped
against HTTP/2 rapid reset, and connections below the open-files limit, which `grace
serve` raises to its hard limit (docs/RELIABILITY.md "Health, shutdown and the event
loop", "Hostile clients", "Open files and connections").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer  # the aio servicer

from service.rpc.grace.v1 import retrieval_pb2
from service.settings import ServerSettings
from service.tls import server_credentials

SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["AdRetrieval"].full_name
REFLECTION_V1 = "grpc.reflection.v1"
DRAIN_NOTICE_SECONDS = 0.5  # NOT_SERVING is visible this long before the port closes
# gRPC's own receive limit is this many times the largest valid request: longer messages
# are refused by the transport (RESOURCE_EXHAUSTED) before any handler runs; shorter ones
# that are still too long are refused, counted and logged by the Retrieve handler
TRANSPORT_LIMIT_FACTOR = 2

# per connection; gRPC counts a stream until the server has released it, so a client
# resetting streams in a loop is pushed back on its own connection instead of filling the
# queue of calls not yet handed over, which gRPC sheds at random across all connections
MAX_CONCURRENT_STREAMS = 256
HEALTH_CHECKS_PER_SECOND = 200.0
HEALTH_CHECK_BURST = 50
# a Check that would wait longer is answered RESOURCE_EXHAUSTED after this long, not at
# once: a caller in a loop would just ask again
HEALTH_CHECK_MAX_WAIT_SECONDS = 1.0
MAX_HEALTH_WATCHES = 1024
# open files no client connection may take: the rollout's files, metrics scrapes, the
# runtime's own (docs/RELIABILITY.md "Open files and connections")
FD_RESERVE = 512
log = logging.getLogger("grace.serve")

RawHandler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


class HealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 on the event loop, its Checks paced and its Watches capped."""

    def __init__(
        self,
        checks_per_second: float = HEALTH_CHECKS_PER_SECOND,
        burst: int = HEALTH_CHECK_BURST,
        max_watches: int = MAX_HEALTH_WATCHES,
    ) -> None:
        super().__init__()
        self.rate, self.burst, self.max_watches = checks_per_second, burst, max_watches
        self._tokens, self._at = float(burst), time.monotonic()
        self.watches = 0  # Watch streams open now

    def _reserve(self) -> float | None:
        """Take a token; the seconds to wait for it, or None (and no token) when that is
        more than HEALTH_CHECK_MAX_WAIT_SECONDS."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        wait = (1.0 - self._tokens) / self.rate
        if wait > HEALTH_CHECK_MAX_WAIT_SECONDS:
            return None
        self._tokens -= 1.0
        return max(wait, 0.0)

    async def Check(self, request, context):
        wait = self._reserve()
        if wait is None:
            await asyncio.sleep(HEALTH_CHECK_MAX_WAIT_SECONDS)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many health checks")
        if wait:
            await asyncio.sleep(wait)
        return await super().Check(request, context)

    async def Watch(self, request, context):
        if self.watches >= self.max_watches:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many health watches")
        self.watches += 1
        try:
            return await super().Watch(request, context)
        finally:
            self.watches -= 1


async def set_health(servicer: HealthServicer, serving: bool) -> None:
    """Overall and per-service health, which probes and balancers read."""
    reply = health_pb2.HealthCheckResponse
    status = reply.SERVING if serving else reply.NOT_SERVING
    for name in ("", SERVICE):
        await servicer.set(name, status)


def add_health_and_reflection(server: grpc.aio.Server, servicer: HealthServicer) -> None:
    """Register grpc.health.v1 (answered by `servicer`) and server reflection — as
    grpc.reflection.v1 and v1alpha — for AdRetrieval, health and reflection itself."""
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    v1 = _reflection_v1_service()
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             v1, reflection.SERVICE_NAME)  # fmt: skip
    reflection.enable_server_reflection(names, server)
    # grpcio-reflection serves v1alpha only; v1 is the same protocol under another
    # package (field for field), so the v1alpha servicer answers it with its messages
    answer = ReflectionServicer(names).ServerReflectionInfo
    method = grpc.stream_stream_rpc_method_handler(
        answer,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(v1, {"ServerReflectionInfo": method}),)
    )


def _reflection_v1_service() -> str:
    """grpc.reflection.v1's file in the default descriptor pool (made from v1alpha's by
    renaming its package, unless a grpcio-reflection with v1 put it there), so reflection
    can describe itself under both names; returns v1's service name."""
    pool = descriptor_pool.Default()
    name = REFLECTION_V1 + ".ServerReflection"
    with contextlib.suppress(KeyError):  # KeyError: not there yet
        pool.FindServiceByName(name)
        return name
    old = "." + reflection_pb2.DESCRIPTOR.package
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", REFLECTION_V1
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(old + "."):
                f.type_name = "." + REFLECTION_V1 + f.type_name[len(old) :]
    for service in proto.service:
        for m in service.method:
            m.input_type = "." + REFLECTION_V1 + m.input_type[len(old) :]
            m.output_type = "." + REFLECTION_V1 + m.output_type[len(old) :]
    pool.AddSerializedFile(proto.SerializeToString())
    return name


def add_retrieval(server: grpc.aio.Server, retrieve: RawHandler) -> None:
    """Register AdRetrieval/Retrieve as bytes in, bytes out: the handler parses the
    request itself (so undecodable bytes are its INVALID_ARGUMENT, counted) and returns
    the reply already serialised."""
    method = grpc.unary_unary_rpc_method_handler(retrieve)  # no (de)serialisers
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Retrieve": method}),)
    )


def bind(server: grpc.aio.Server, address: str, settings: ServerSettings) -> int:
    """Listen on `address`, with TLS when the settings name a certificate (service/tls.py:
    reloaded on rotation; health and reflection share the port, so its terms); a unix
    socket — the request front's hop to a worker on this host — stays plain text."""
    if settings.tls_cert is None or address.startswith("unix:"):
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(settings))


def raise_fd_limit(settings: ServerSettings) -> None:
    """Raise this process's soft open-files limit to its hard one (containers commonly
    start at 1,024; workers inherit it) and log both and the connection cap, on one line."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # an unlimited hard limit: above nr_open
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    log.info("open files: soft limit %d, now %d (hard %d); client connections capped at %s",
             soft, now, hard, max_connections(settings) or "none")  # fmt: skip


def max_connections(settings: ServerSettings) -> int:
    """The setting, else the soft open-files limit less FD_RESERVE (at least half of it);
    0: no cap."""
    if settings.max_connections is not None:
        return settings.max_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 0 if soft == resource.RLIM_INFINITY else max(soft - FD_RESERVE, soft // 2)


def tcp_connections(port: int) -> int:
    """Established TCP connections to `port` that this process holds: the rows of
    /proc/net/tcp{,6} whose socket is one of its descriptors (0 without /proc)."""
    mine, held = set[str](), 0
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                mine.add(os.readlink(f"/proc/self/fd/{fd}"))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in rows.readlines()[1:]:  # sl local rem st ... inode
                f = row.split()
                local_port = int(f[1].rsplit(":", 1)[1], 16)
                held += f[3] == "01" and local_port == port and f"socket:[{f[9]}]" in mine
    return held


def server_options(
    settings: ServerSettings, max_request_bytes: int | None = None
) -> list[tuple[str, int]]:
    """gRPC core options of a server: connection ageing lets clients rebalance across
    replicas; the receive limit follows the largest valid request; connections beyond
    `max_connections` are closed as they come (a clean UNAVAILABLE, not a timeout)."""
    options = [("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS)]
    if cap := max_connections(settings):
        options.append(("grpc.max_allowed_incoming_connections", cap))
    if max_request_bytes is not None:
        limit = TRANSPORT_LIMIT_FACTOR * max_request_bytes
        options.append(("grpc.max_receive_message_length", limit))
    age, grace = settings.max_connection_age_seconds, settings.max_connection_age_grace_seconds
    if age > 0:
        options.append(("grpc.max_connection_age_ms", int(age * 1e3)))
        options.append(("grpc.max_connection_age_grace_ms", int(grace * 1e3)))
    return options
