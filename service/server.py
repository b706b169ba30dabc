"""The gRPC servicer: admit -> parse -> validate -> batcher -> reply (ARCHITECTURE.md §5).

Runs on the event loop and only awaits. Retrieve is registered without (de)serialisers
(`grpc_server.add_retrieval`): the handler gets the request's bytes and returns the
reply's bytes, so every refusal is cheap and counted — in order:

    UNAVAILABLE         draining, or no model and index loaded yet
    RESOURCE_EXHAUSTED  larger than the largest valid request (`Limits.max_request_bytes`),
                        or admission refuses it: the queue is full or the deadline does
                        not leave room for the predicted wait (service/admission.py) —
                        all before the bytes are parsed
    DEADLINE_EXCEEDED   the deadline is shorter than the service itself, or it passed
                        while the request waited (queue, stage hand-offs)
    INVALID_ARGUMENT    bytes that are not a RetrieveRequest, or a field outside the
                        contract (the message names it: service/validation.py)
    INTERNAL            anything else

A call the client abandons is counted DEADLINE_EXCEEDED when its deadline had (all but)
passed, CANCELLED otherwise. Every outcome lands in the standard `grpc_server_*` metrics;
refusals and failures are logged as one short line per status code at most every
`LOG_EVERY_SECONDS`, with the number of others since.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from service.batcher import Batcher, DeadlineExpired, Overloaded
from service.grpc_server import SERVICE
from service.metrics import Metrics
from service.pipeline.records import RetrievalResult
from service.pipeline.runtime import ServingHolder
from service.post import encode_ads
from service.request_log import RequestLog
from service.rpc.grace.v1 import retrieval_pb2
from service.validation import InvalidRequest, Limits, validate_request

log = logging.getLogger("grace.server")
LOG_EVERY_SECONDS = 10.0
# The client's deadline reaches the server late (the headers wait for the event loop), so
# a client that gives up at its deadline is seen cancelling a little before the server's
# copy of it: within this share of the timeout (at least DEADLINE_SKEW_MIN) it counts as
# DEADLINE_EXCEEDED.
DEADLINE_SKEW_SHARE = 0.1
DEADLINE_SKEW_MIN = 0.02


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class RateLimitedLog:
    """One line per key at most every `every` seconds, saying how many were held back."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY_SECONDS) -> None:
        self.logger, self.every = logger, every
        self._last: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def log(self, level: int, key: object, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.every) < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        more = f" (and {held} more in the last {self.every:.0f} s)" if held else ""
        self.logger.log(level, "%s%s", message, more)


class RetrievalServicer:
    def __init__(
        self,
        batcher: Batcher,
        limits: Limits,
        serving: ServingHolder,
        metrics: Metrics,
        request_log: RequestLog | None = None,  # settings.request_log; queues, never blocks
    ) -> None:
        self.batcher, self.limits, self.serving, self.metrics = batcher, limits, serving, metrics
        self.request_log = request_log
        self.max_request_bytes = limits.max_request_bytes()
        self.draining = False
        labels = self._labels = ("unary", SERVICE, "Retrieve")
        # the labelled series, looked up once: every refusal under overload pays for each
        self._started = metrics.started.labels(*labels)
        self._handling = metrics.handling.labels(*labels)
        self._handled: dict[grpc.StatusCode, Counter] = {}
        self._log = RateLimitedLog(log)

    async def Retrieve(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        m, t0 = self.metrics, time.perf_counter()
        self._started.inc()
        m.inflight.inc()
        timeout = context.time_remaining()
        deadline = None if timeout is None else time.monotonic() + timeout
        code = grpc.StatusCode.OK
        try:
            return await self._retrieve(request, deadline)
        except Abort as exc:
            code = exc.code
            level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.WARNING
            self._log.log(level, code, f"Retrieve {code.name}: {exc.message}")
            await context.abort(exc.code, exc.message)
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
            self._handling.observe(time.perf_counter() - t0)

    async def _retrieve(self, raw: bytes, deadline: float | None) -> bytes:
        if self.draining:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if not self.serving.ready:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "no model and index loaded yet")
        if len(raw) > self.max_request_bytes:
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request of {len(raw)} bytes exceeds the largest valid one "
                f"({self.max_request_bytes} bytes)",
            )
        try:  # shed before any parsing: under overload refusals must be cheap
            self.batcher.admit(_left(deadline))
        except Overloaded as exc:
            self.metrics.refused.labels(exc.reason).inc()
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
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
        try:
            req = validate_request(request, self.limits)
        except InvalidRequest as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if self.request_log is not None:
            self.request_log.append(request)
        try:
            result: RetrievalResult = await self.batcher.submit(req, _left(deadline))
        except Overloaded as exc:
            self.metrics.refused.labels(exc.reason).inc()
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except DeadlineExpired as exc:
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        except Exception as exc:
            raise Abort(grpc.StatusCode.INTERNAL, f"retrieval failed: {exc}") from None
        try:
            return self._response(result, req.include_sids)
        except Exception as exc:  # counted as INTERNAL, not as an OK the client never got
            raise Abort(grpc.StatusCode.INTERNAL, f"building the reply failed: {exc}") from None

    def _response(self, r: RetrievalResult, include_sids: bool) -> bytes:
        p = r.post
        self.metrics.sids.inc(r.sids_generated)
        self.metrics.expanded.inc(p.ads_expanded)
        self.metrics.eligible.inc(p.ads_eligible)
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
            ),
        )
        # concatenated messages merge: the ads (field 1) and the rest are one reply
        return ads + rest.SerializeToString()


def _left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic), None for none."""
    return None if deadline is None else deadline - time.monotonic()
