"""gRPC plumbing shared by a serving process (`service/app.py`) and the request front of
several workers (`service/balancer.py`): the service name, health, the drain notice, the
Retrieve registration and the server options. It imports no torch, nor anything that does.

Health is the asyncio servicer (`grpc_health.v1.health.aio`): its Check and Watch run on
the event loop, so open Watch streams hold no thread — the synchronous servicer parks one
executor thread per Watch for ever, and six of them wedge every later Check and the
shutdown (docs/RELIABILITY.md). Reflection on an aio server is asyncio too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.rpc.grace.v1 import retrieval_pb2
from service.settings import ServerSettings

SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["AdRetrieval"].full_name
DRAIN_NOTICE_SECONDS = 0.5  # NOT_SERVING is visible this long before the port closes
# gRPC's own receive limit is this many times the largest valid request: longer messages
# are refused by the transport (RESOURCE_EXHAUSTED) before any handler runs; shorter ones
# that are still too long are refused, counted and logged by the Retrieve handler
TRANSPORT_LIMIT_FACTOR = 2

HealthServicer = health.aio.HealthServicer
RawHandler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


async def set_health(servicer: HealthServicer, serving: bool) -> None:
    """Overall and per-service health, which probes and balancers read."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else (
        health_pb2.HealthCheckResponse.NOT_SERVING
    )  # fmt: skip
    for name in ("", SERVICE):
        await servicer.set(name, status)


def add_health_and_reflection(server: grpc.aio.Server, servicer: HealthServicer) -> None:
    """Register grpc.health.v1 (answered by `servicer`) and server reflection for
    AdRetrieval, health and reflection itself."""
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)  # fmt: skip
    reflection.enable_server_reflection(names, server)


def add_retrieval(server: grpc.aio.Server, retrieve: RawHandler) -> None:
    """Register AdRetrieval/Retrieve as bytes in, bytes out: the handler parses the
    request itself (so undecodable bytes are its INVALID_ARGUMENT, counted) and returns
    the reply already serialised."""
    method = grpc.unary_unary_rpc_method_handler(retrieve)  # no (de)serialisers
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Retrieve": method}),)
    )


def server_options(
    settings: ServerSettings, max_request_bytes: int | None = None
) -> list[tuple[str, int]]:
    """gRPC core options of a server: connection ageing lets clients rebalance across
    replicas; the receive limit follows the largest valid request."""
    options = []
    if max_request_bytes is not None:
        limit = TRANSPORT_LIMIT_FACTOR * max_request_bytes
        options.append(("grpc.max_receive_message_length", limit))
    if settings.max_connection_age_seconds > 0:
        options += [
            ("grpc.max_connection_age_ms", int(settings.max_connection_age_seconds * 1e3)),
            (
                "grpc.max_connection_age_grace_ms",
                int(settings.max_connection_age_grace_seconds * 1e3),
            ),
        ]
    return options
