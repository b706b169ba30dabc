"""gRPC plumbing shared by a serving process (`service/app.py`) and the request front of
several workers (`service/balancer.py`): the service name, health, the drain notice and
the server options. It imports no torch, nor anything that does."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.rpc.grace.v1 import retrieval_pb2
from service.settings import ServerSettings

SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["AdRetrieval"].full_name
DRAIN_NOTICE_SECONDS = 0.5  # NOT_SERVING is visible this long before the port closes


def set_health(servicer: health.HealthServicer, serving: bool) -> None:
    """Overall and per-service health, which probes and balancers read."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else (
        health_pb2.HealthCheckResponse.NOT_SERVING
    )  # fmt: skip
    for name in ("", SERVICE):
        servicer.set(name, status)


def add_health_and_reflection(server: grpc.aio.Server, servicer: health.HealthServicer) -> None:
    """Register grpc.health.v1 (answered by `servicer`) and server reflection for
    AdRetrieval, health and reflection itself."""
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)  # fmt: skip
    reflection.enable_server_reflection(names, server)


def server_options(settings: ServerSettings) -> list[tuple[str, int]]:
    """gRPC core options of the public server: connection ageing lets clients rebalance
    across replicas."""
    if settings.max_connection_age_seconds <= 0:
        return []
    return [
        ("grpc.max_connection_age_ms", int(settings.max_connection_age_seconds * 1e3)),
        ("grpc.max_connection_age_grace_ms", int(settings.max_connection_age_grace_seconds * 1e3)),
    ]
