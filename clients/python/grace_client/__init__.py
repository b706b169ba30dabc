"""grace-client: a light Python client of the GRACE serving gRPC API (`grace.v1.AdRetrieval`),
installable on its own (`pip install ./clients/python`: grpcio and protobuf only).

    from grace_client import GraceClient

    with GraceClient("localhost:50051", timeout=0.2) as client:
        reply = client.retrieve(user_id=7, country="US", age=31, max_ads=10)

Modules: client.py (GraceClient), aio.py (AsyncGraceClient), request.py (build_request),
retry.py (deadlines and backoff), errors.py (GraceError, InvalidRequestError), rpc/ (the
generated stubs of proto/grace/v1/retrieval.proto). It never imports the service package
(nor torch).
"""

from __future__ import annotations

from grace_client.aio import AsyncGraceClient
from grace_client.client import GraceClient, ServingStatus, tls_credentials
from grace_client.errors import RETRYABLE, GraceError, InvalidRequestError
from grace_client.request import RequestFields, build_request
from grace_client.retry import Backoff
from grace_client.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc

__version__ = "0.1.0"
__all__ = [
    "RETRYABLE",
    "AsyncGraceClient",
    "Backoff",
    "GraceClient",
    "GraceError",
    "InvalidRequestError",
    "RequestFields",
    "ServingStatus",
    "build_request",
    "retrieval_pb2",
    "retrieval_pb2_grpc",
    "tls_credentials",
]
