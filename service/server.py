"""The gRPC servicer: admit -> parse -> validate -> batcher -> reply (ARCHITECTURE.md §5).

Runs on the event loop and only awaits. Retrieve is registered as bytes in, bytes out
(`grpc_server.add_retrieval`), so every refusal is cheap and counted: UNAVAILABLE
(draining, nothing loaded yet), RESOURCE_EXHAUSTED (too long, or refused by admission:
both before parsing), DEADLINE_EXCEEDED, INVALID_ARGUMENT (service/validation.py),
INTERNAL. The codes and their `google.rpc.Status` details (service/rpc_status.py):
docs/SERVICE.md "Status codes". Every outcome lands in the `grpc_server_*` metrics;
refusals and failures log one line per code at most every `LOG_EVERY_SECONDS`; every call
has a request id (service/request_id.py) and may get an access-log line (service/logs.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.trace import Span, Status, StatusCode
from prometheus_client import Counter

from contracts.targeting_schema import DEFAULT, TargetingSchema
from service.batcher import Batcher, DeadlineExpired, Overloaded
from service.grpc_server import SERVICE
from service.logs import AccessLog
from service.metrics import Metrics
from service.pipeline.records import RetrievalResult
from service.pipeline.runtime import ServingHolder
from service.post import encode_ads
from service.request_id import (
    METADATA_KEY,
    call_request_id,
    current_request_id,
    for_metadata,
    usable,
)
from service.request_log import RequestLog
from service.rpc.grace.v1 import retrieval_pb2
from service.rpc_status import Abort, bad_request, retry_info
from service.tracing import Tracing
from service.validation import InvalidRequest, Limits, validate_request

log = logging.getLogger("grace.server")
RETRIEVE_METHOD = f"/{SERVICE}/Retrieve"  # the RPC span's name, less the slash
LOG_EVERY_SECONDS = 10.0
# The client's deadline reaches the server late (the headers wait for the event loop), so
# a client giving up at its deadline cancels a little before the server's copy of it: a
# cancel within this share of the timeout (at least DEADLINE_SKEW_MIN) is DEADLINE_EXCEEDED
DEADLINE_SKEW_SHARE = 0.1
DEADLINE_SKEW_MIN = 0.02
# RetryInfo of UNAVAILABLE: a draining server's port closes within moments (retry on a new
# connection, which lands on another replica); loading a model and index takes seconds
RETRY_DRAINING_SECONDS = 0.1
RETRY_LOADING_SECONDS = 1.0


@dataclass
class _Call:
    """One Retrieve call's facts, filled in as it goes (its log lines and access line)."""

    request_id: str  # the reply's request_id
    result: RetrievalResult | None = None  # an answered call's

    @property
    def log_id(self) -> str:
        """The id on log lines and in the trailer: percent-encoded beyond printable ASCII."""
        return for_metadata(self.request_id)


class RateLimitedLog:
    """One line per key at most every `every` seconds, saying how many were held back."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY_SECONDS) -> None:
        self.logger, self.every = logger, every
        self._last: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def log(self, level: int, key: object, message: str, request_id: str | None = None) -> None:
        """`message` at `level` unless one of `key` went out less than `every` s ago;
        `request_id`: the call's (on the line as its field)."""
        now = time.monotonic()
        if now - self._last.get(key, -self.every) < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        more = f" (and {held} more in the last {self.every:.0f} s)" if held else ""
        self.logger.log(level, "%s%s", message, more, extra={"request_id": request_id})


class RetrievalServicer:
    def __init__(
        self,
        batcher: Batcher,
        limits: Limits,
        serving: ServingHolder,
        metrics: Metrics,
        request_log: RequestLog | None = None,  # settings.request_log; queues, never blocks
        access_log: AccessLog | None = None,  # settings.access_log_sample; None: none
        tracing: Tracing | None = None,  # settings.tracing; None: off
    ) -> None:
        self.batcher, self.limits, self.serving, self.metrics = batcher, limits, serving, metrics
        self.tracing = tracing or Tracing()
        self.request_log = request_log
        self.access_log = access_log if access_log is not None else AccessLog(0.0)
        # the schema of the index served at start (a later one's larger requests are
        # refused as too long: docs/FORMAT.md §1)
        self.max_request_bytes = limits.max_request_bytes(self._schema())
        self.draining = False
        labels = self._labels = ("unary", SERVICE, "Retrieve")
        # the labelled series, looked up once: every refusal under overload pays for each
        self._started = metrics.started.labels(*labels)
        self._handling = metrics.handling.labels(*labels)
        self._handled: dict[grpc.StatusCode, Counter] = {}
        self._log = RateLimitedLog(log)

    def _schema(self) -> TargetingSchema:
        """The served index's targeting schema (the default before one is served)."""
        return self.serving.current.index.schema if self.serving.ready else DEFAULT

    async def Retrieve(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """One call, in its trace span when tracing is on (service/tracing.py)."""
        with self.tracing.rpc(RETRIEVE_METHOD, context.invocation_metadata()) as span:
            return await self._call(request, context, span)

    async def _call(
        self, request: bytes, context: grpc.aio.ServicerContext, span: Span | None
    ) -> bytes:
        m, t0 = self.metrics, time.perf_counter()
        self._started.inc()
        m.inflight.inc()
        call = _Call(call_request_id(request, context.invocation_metadata()))
        logged = current_request_id.set(call.log_id)  # this call's task only
        timeout = context.time_remaining()
        deadline = None if timeout is None else time.monotonic() + timeout
        code = grpc.StatusCode.OK
        try:
            reply = await self._retrieve(request, deadline, call)
            context.set_trailing_metadata(((METADATA_KEY, call.log_id),))
            return reply
        except Abort as exc:
            code = exc.code
            level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.WARNING
            self._log.log(level, code, f"Retrieve {code.name}: {exc.message}", call.log_id)
            trailer = (*exc.trailing_metadata(), (METADATA_KEY, call.log_id))
            await context.abort(exc.code, exc.message, trailing_metadata=trailer)
            raise  # unreachable: abort raises
        except asyncio.CancelledError:
            # grpc cancels the handler when the client's deadline passes or it cancels:
            # count what the client saw, not OK (the availability SLO reads these codes)
            code = grpc.StatusCode.CANCELLED
            if deadline is not None and timeout is not None:
                skew = max(DEADLINE_SKEW_MIN, DEADLINE_SKEW_SHARE * timeout)
                if time.monotonic() >= deadline - skew:
                    code = grpc.StatusCode.DEADLINE_EXCEEDED
            raise
        finally:
            m.inflight.dec()
            handled = self._handled.get(code)
            if handled is None:
                handled = self._handled[code] = m.handled.labels(*self._labels, code.name)
            handled.inc()
            seconds = time.perf_counter() - t0
            self._handling.observe(seconds)
            if self.access_log.wants(code == grpc.StatusCode.OK):
                self.access_log.record(call.log_id, code.name, seconds, context.peer(), call.result)
            if span is not None:
                _annotate(span, call, code)
            current_request_id.reset(logged)

    async def _retrieve(self, raw: bytes, deadline: float | None, call: _Call) -> bytes:
        unavailable = grpc.StatusCode.UNAVAILABLE
        if self.draining:
            raise Abort(unavailable, "server is draining", (retry_info(RETRY_DRAINING_SECONDS),))
        if not self.serving.ready:
            raise Abort(
                unavailable, "no model and index loaded yet", (retry_info(RETRY_LOADING_SECONDS),)
            )
        if len(raw) > self.max_request_bytes:  # no RetryInfo: it would be refused again
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request of {len(raw)} bytes exceeds the largest valid one "
                f"({self.max_request_bytes} bytes)",
            )
        try:  # shed before any parsing: under overload refusals must be cheap
            self.batcher.admit(_left(deadline))
        except Overloaded as exc:
            raise self._refused(exc, deadline) from None
        except DeadlineExpired as exc:
            self.metrics.refused.labels("hopeless").inc()
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        try:
            request = retrieval_pb2.RetrieveRequest.FromString(raw)
        except DecodeError:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the {len(raw)} bytes received are not a grace.v1.RetrieveRequest",
            ) from None
        own = usable(request.request_id)
        if own is not None and own != call.request_id:  # its field 1 was not first on the wire
            call.request_id = own
            current_request_id.set(call.log_id)
        try:
            index = self.serving.current.index if self.serving.ready else None
            req = validate_request(request, self.limits, self._schema(),
                                   index.blockable if index is not None else ())  # fmt: skip
        except InvalidRequest as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), (bad_request(exc),)) from None
        if self.request_log is not None:
            self.request_log.append(request)
        if req.request_id != call.request_id:  # the call's id (metadata or made) from here on
            req = dataclasses.replace(req, request_id=call.request_id)
        try:
            result: RetrievalResult = await self.batcher.submit(
                req, _left(deadline), self.tracing.current()
            )
        except Overloaded as exc:
            raise self._refused(exc, deadline) from None
        except DeadlineExpired as exc:
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        except Exception as exc:
            raise Abort(grpc.StatusCode.INTERNAL, f"retrieval failed: {exc}") from None
        call.result = result
        try:
            return self._response(result, req.include_sids, call.request_id)
        except Exception as exc:  # counted as INTERNAL, not as an OK the client never got
            raise Abort(grpc.StatusCode.INTERNAL, f"building the reply failed: {exc}") from None

    def _refused(self, exc: Overloaded, deadline: float | None) -> Abort:
        """RESOURCE_EXHAUSTED for an admission refusal (counted), with when to come back."""
        self.metrics.refused.labels(exc.reason).inc()
        b = self.batcher
        delay = b.admission.retry_after(
            exc.reason == "queue_full", _left(deadline), b.depth, b.inflight_requests
        )
        return Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (retry_info(delay),))

    def _response(self, r: RetrievalResult, include_sids: bool, request_id: str) -> bytes:
        p = r.post
        self.metrics.sids.inc(r.sids_generated)
        self.metrics.expanded.inc(p.ads_expanded)
        self.metrics.eligible.inc(p.ads_eligible)
        removed = p.ads_removed
        for rule, n in removed.items():
            if n:
                self.metrics.removed.labels(rule).inc(n)
        # the ads as wire bytes from C++: building ~1,000 Python `Ad` messages per reply
        # would cost the event loop ~1 ms per request
        ads = encode_ads(p.ad_ids, p.scores, p.sids if include_sids else None)
        rest = retrieval_pb2.RetrieveResponse(
            index_version=r.index_version,
            model_version=r.model_version,
            stats=retrieval_pb2.Stats(
                sids_generated=r.sids_generated,
                ads_expanded=p.ads_expanded,
                ads_eligible=p.ads_eligible,
                stage_ms=r.stage_ms,
                ads_removed={rule: n for rule, n in removed.items() if n},
                catalog_seq=r.catalog_seq,
                beam_widths=r.beams,
                beam_rung=r.rung,
            ),
            request_id=request_id,
        )
        # concatenated messages merge: the ads (field 1) and the rest are one reply
        reply = ads + rest.SerializeToString()
        if len(p.ad_ids) == 0:  # OK without ads: GraceEmptyAnswers watches their share
            self.metrics.empty_answers.inc()
        return reply


def _annotate(span: Span, call: _Call, code: grpc.StatusCode) -> None:
    """An RPC span's outcome: its code, request id and, answered, what answered it."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_attribute("grace.request_id", call.log_id)
    r = call.result
    if r is not None:
        span.set_attribute("grace.index_version", r.index_version)
        span.set_attribute("grace.model_version", r.model_version)
        span.set_attribute("grace.ads_returned", len(r.post.ad_ids))
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))


def _left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic), None for none."""
    return None if deadline is None else deadline - time.monotonic()
