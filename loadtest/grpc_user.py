"""A locust `User` that talks gRPC: locust's documented pattern, without extra packages.

A client interceptor on the user's channel fires `events.request` for every call
(request_type "grpc", name = the full method, response time, response size, and the
failure as `RpcFailure("CODE: details")`), so every call a task makes shows up in
locust's statistics, CSV files and thresholds without any bookkeeping in the task.

gRPC's blocking calls must yield to gevent (locust runs every user on one gevent loop):
`init_gevent()` below patches gRPC, and must run before any channel exists, which is why
this module is imported before anything creates one.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User
from locust.env import Environment

from service import tls

grpc_gevent.init_gevent()


class RpcFailure(Exception):
    """A failed call as locust reports it: grouped by code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Reports each unary call to locust: time from send to the full response."""

    def __init__(self, environment: Environment) -> None:
        self.env = environment

    def intercept_unary_unary(self, continuation, client_call_details, request):
        start = time.perf_counter()
        call = continuation(client_call_details, request)
        length, exception = 0, None
        try:
            length = call.result().ByteSize()  # waits for the response (yields to gevent)
        except grpc.RpcError as exc:
            exception = RpcFailure(exc.code(), exc.details() or "")
        self.env.events.request.fire(
            request_type="grpc",
            name=_method_name(client_call_details.method),
            response_time=(time.perf_counter() - start) * 1000.0,
            response_length=length,
            response=None if exception else call.result(),
            context={},
            exception=exception,
        )
        return call


def _method_name(method: str | bytes) -> str:
    # "/grace.v1.AdRetrieval/Retrieve" -> "grace.v1.AdRetrieval/Retrieve"
    return (method.decode() if isinstance(method, bytes) else method).lstrip("/")


class GrpcUser(User):
    """Abstract: subclasses set `stub_class`; `host` is "host:port" (locust --host)."""

    abstract = True
    stub_class: ClassVar[type | None] = None

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        if self.stub_class is None or not self.host:
            raise ValueError("GrpcUser needs stub_class and a host (--host host:port)")
        target = self.host.removeprefix("grpc://").removeprefix("http://").rstrip("/")
        # each user its own connection, as separate clients have (gRPC otherwise shares
        # one connection among a process's channels to a target): with `grace serve
        # --workers N` connections are what the kernel spreads over the workers. TLS when
        # GRACE_TLS_CA or GRACE_TLS_CERT says so (service/tls.py, docs/ops/security.md)
        options = [("grpc.use_local_subchannel_pool", 1)]
        channel = tls.channel(target, **tls.client_env(), options=options)
        self._channel = grpc.intercept_channel(channel, LocustInterceptor(environment))
        self.stub: Any = self.stub_class(self._channel)

    def on_stop(self) -> None:
        self._channel.close()
