"""The fake GRACE server of the client's tests (conftest.py, and the Node example's test in
tests/clients): AdRetrieval from the client's own stubs, answered by `FakeRetrieval` from a
script of failures, pauses and a canned reply, and grpc.health.v1 Check from statuses the
test sets, served over real gRPC by `serve`. No service code, no torch."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from grace_client import _wire
from grace_client.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc

REPLY = retrieval_pb2.RetrieveResponse(
    ads=[retrieval_pb2.Ad(ad_id=11, score=-1.5), retrieval_pb2.Ad(ad_id=12, score=-2.0)],
    index_version="idx-1",
    model_version="tiny-test",
)


@dataclass(frozen=True)
class Answer:
    """One scripted answer: fail with `code` (and, in the status details, a RetryInfo of
    `retry_delay` seconds and a BadRequest of `violations`; `request_id` in the trailer
    x-request-id), after sleeping `sleep` seconds; no code = the canned reply."""

    code: grpc.StatusCode | None = None
    message: str = ""
    retry_delay: float | None = None
    violations: tuple[tuple[str, str], ...] = ()
    sleep: float = 0.0
    request_id: str = ""


@dataclass
class Call:
    """What the server saw of one attempt."""

    at: float  # time.monotonic() on arrival
    request: retrieval_pb2.RetrieveRequest
    metadata: dict[str, str]
    time_remaining: float | None  # the attempt's deadline as the server saw it


def status_details(
    code: grpc.StatusCode,
    message: str,
    retry_delay: float | None = None,
    violations: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A google.rpc.Status with a RetryInfo and/or a BadRequest, serialised for
    `grpc-status-details-bin` (as the service's server.py writes it)."""
    status = _wire.Status(code=code.value[0], message=message)
    if retry_delay is not None:
        info = _wire.RetryInfo()
        info.retry_delay.FromNanoseconds(int(retry_delay * 1e9))
        status.details.add().Pack(info)
    if violations:
        bad = _wire.BadRequest()
        for name, description in violations:
            bad.field_violations.add(field=name, description=description)
        status.details.add().Pack(bad)
    return status.SerializeToString()


@dataclass
class FakeRetrieval(retrieval_pb2_grpc.AdRetrievalServicer):
    script: deque[Answer] = field(default_factory=deque)
    calls: list[Call] = field(default_factory=list)
    health: dict[str, int] = field(default_factory=lambda: {"": 1, "grace.v1.AdRetrieval": 1})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, *answers: Answer) -> None:
        self.script.extend(answers)

    def Retrieve(self, request, context):
        with self.lock:
            self.calls.append(Call(time.monotonic(), request,
                                   dict(context.invocation_metadata()),
                                   context.time_remaining()))  # fmt: skip
            step = self.script.popleft() if self.script else Answer()
        time.sleep(step.sleep)
        if step.code is None:
            return REPLY
        trailer: list[tuple[str, str | bytes]] = []
        if step.request_id:
            trailer.append(("x-request-id", step.request_id))
        if step.retry_delay is not None or step.violations:
            details = status_details(step.code, step.message, step.retry_delay, step.violations)
            trailer.append((_wire.STATUS_DETAILS_KEY, details))
        context.set_trailing_metadata(tuple(trailer))
        context.abort(step.code, step.message)

    def Check(self, request, context):
        if request.service not in self.health:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return _wire.HealthCheckResponse(status=self.health[request.service])


@contextlib.contextmanager
def serve(fake: FakeRetrieval) -> Iterator[str]:
    """`fake` on a free localhost port, as AdRetrieval and grpc.health.v1 Check: its target."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    retrieval_pb2_grpc.add_AdRetrievalServicer_to_server(fake, server)
    check = grpc.unary_unary_rpc_method_handler(
        fake.Check,
        request_deserializer=_wire.HealthCheckRequest.FromString,
        response_serializer=_wire.HealthCheckResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": check}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
