"""The gRPC servicer: validate -> batcher -> pipeline -> RetrieveResponse (DESIGN.md §5).

Runs on the event loop and only awaits: validation is cheap, the batcher hands batches to
the pipeline threads, and every failure maps to a status code — INVALID_ARGUMENT naming
the field, RESOURCE_EXHAUSTED when the queue is full, DEADLINE_EXCEEDED when the deadline
passed before processing, UNAVAILABLE while no index is loaded or the server drains,
INTERNAL for anything else. Standard `grpc_server_*` metrics are kept here.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from service.batcher import Batcher, DeadlineExpired, Overloaded
from service.grpc_server import SERVICE
from service.metrics import Metrics
from service.pipeline.records import RetrievalResult
from service.post import encode_ads
from service.request_log import RequestLog
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.serving_index import IndexHolder
from service.validation import InvalidRequest, Limits, validate_request


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class RetrievalServicer(retrieval_pb2_grpc.AdRetrievalServicer):
    def __init__(
        self,
        batcher: Batcher,
        limits: Limits,
        indexes: IndexHolder,
        metrics: Metrics,
        request_log: RequestLog | None = None,  # settings.request_log; queues, never blocks
    ) -> None:
        self.batcher, self.limits, self.indexes, self.metrics = batcher, limits, indexes, metrics
        self.request_log = request_log
        self.draining = False
        self._labels = ("unary", SERVICE, "Retrieve")

    async def Retrieve(
        self, request: retrieval_pb2.RetrieveRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.RetrieveResponse:
        m, t0 = self.metrics, time.perf_counter()
        m.started.labels(*self._labels).inc()
        m.inflight.inc()
        code = grpc.StatusCode.OK
        try:
            return await self._retrieve(request, context)
        except Abort as exc:
            code = exc.code
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises
        except asyncio.CancelledError:
            # grpc cancels the handler when the client's deadline passes or it cancels:
            # count what the client saw, not OK (the availability SLO reads these codes)
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        finally:
            m.inflight.dec()
            m.handled.labels(*self._labels, code.name).inc()
            m.handling.labels(*self._labels).observe(time.perf_counter() - t0)

    async def _retrieve(self, request, context) -> retrieval_pb2.RetrieveResponse:
        if self.draining:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if not self.indexes.ready:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "no index loaded yet")
        if self.batcher.full:  # shed before any parsing: under overload refusals must be cheap
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "request queue full")
        try:
            req = validate_request(request, self.limits)
        except InvalidRequest as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if self.request_log is not None:
            self.request_log.append(request)
        try:
            result: RetrievalResult = await self.batcher.submit(req, context.time_remaining())
        except Overloaded as exc:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except DeadlineExpired as exc:
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        except Exception as exc:
            raise Abort(grpc.StatusCode.INTERNAL, f"retrieval failed: {exc}") from None
        try:
            return self._response(result, req.include_sids)
        except Exception as exc:  # counted as INTERNAL, not as an OK the client never got
            raise Abort(grpc.StatusCode.INTERNAL, f"building the reply failed: {exc}") from None

    def _response(self, r: RetrievalResult, include_sids: bool) -> retrieval_pb2.RetrieveResponse:
        p = r.post
        self.metrics.sids.inc(r.sids_generated)
        self.metrics.expanded.inc(p.ads_expanded)
        self.metrics.eligible.inc(p.ads_eligible)
        # the ads as wire bytes from C++, then one parse: building ~1,000 Python `Ad`
        # messages per reply would cost the event loop ~1 ms per request
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
        # concatenated messages merge: the ads (field 1) and the rest form one reply
        return retrieval_pb2.RetrieveResponse.FromString(ads + rest.SerializeToString())
