"""Tracing over real gRPC (service/tracing.py): a span per Retrieve RPC in the caller's
trace (W3C traceparent metadata), a batch span linked to the RPC spans of its requests,
a span per pipeline stage under it; off by default; sampling follows the caller; OTLP
export to a real collector."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from cli.query import request_for_user
from service import tracing as tracing_module
from service.app import start
from service.errors import StartupError
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.tracing import Tracing, TracingError, exporter_for
from tests.helpers.serving import make_serving_data, serving_settings

STAGES = ["input", "features", "compute", "post"]
RETRIEVE = "grace.v1.AdRetrieval/Retrieve"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("tracing"))


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """Every span the server exports, in memory (whatever exporter the setting names)."""
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(tracing_module, "exporter_for", lambda kind: exporter)
    return exporter


def traceparent(i: int, sampled: bool = True) -> tuple[str, int, int]:
    """A caller's W3C traceparent header and its trace and span ids."""
    trace_id, span_id = 0xABC0 + i, 0x1230 + i
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}", trace_id, span_id


async def call(app, data: Path, n: int, metadata=lambda i: ()) -> list:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
        reqs = [request_for_user(data / "world", i, 10, retrieval_pb2.CD_GTM) for i in range(n)]
        return await asyncio.gather(
            *(stub.Retrieve(r, metadata=metadata(i), timeout=30) for i, r in enumerate(reqs)),
            return_exceptions=True,
        )


def test_each_rpc_joins_its_callers_trace_and_links_to_its_batch(data: Path, spans) -> None:
    async def main() -> list:
        app = await start(serving_settings(data, tracing="console", max_wait_ms=20.0))
        try:
            return await call(app, data, 6, lambda i: (("traceparent", traceparent(i)[0]),))
        finally:
            await app.drain()  # the drain exports what is left

    replies = asyncio.run(main())
    assert all(isinstance(r, retrieval_pb2.RetrieveResponse) for r in replies)
    finished = spans.get_finished_spans()
    rpcs = [s for s in finished if s.name == RETRIEVE]
    assert len(rpcs) == 6
    callers = {traceparent(i)[1:] for i in range(6)}
    assert {(s.context.trace_id, s.parent.span_id) for s in rpcs} == callers  # callers' traces
    assert all(s.kind == SpanKind.SERVER and s.attributes["rpc.system"] == "grpc" for s in rpcs)
    assert all(s.attributes["rpc.grpc.status_code"] == 0 for s in rpcs)
    batches = [s for s in finished if s.name == "batch"]  # the start-up warm-up has none
    linked = [(link.context.trace_id, link.context.span_id) for b in batches for link in b.links]
    ids = {(s.context.trace_id, s.context.span_id) for s in rpcs}
    assert sorted(linked) == sorted(ids)  # every request, once
    assert sum(b.attributes["grace.batch.size"] for b in batches) == 6
    assert {(b.context.trace_id, b.parent.span_id) for b in batches} <= ids  # under its first
    for b in batches:
        children = [s for s in finished if s.parent is not None
                    and s.parent.span_id == b.context.span_id]  # fmt: skip
        assert sorted(s.name for s in children) == sorted(STAGES)
        assert all(s.context.trace_id == b.context.trace_id for s in children)
        assert all(b.start_time <= s.start_time and s.end_time <= b.end_time for s in children)


def test_a_traced_request_gets_its_rpc_span_and_four_stage_spans_in_its_trace(
    data: Path, spans
) -> None:
    header, trace_id, caller = traceparent(7)

    async def main() -> list:
        app = await start(serving_settings(data, tracing="console"))
        try:
            return await call(app, data, 1, lambda i: (("traceparent", header),))
        finally:
            await app.drain()

    [reply] = asyncio.run(main())
    assert isinstance(reply, retrieval_pb2.RetrieveResponse)
    finished = spans.get_finished_spans()
    [rpc] = [s for s in finished if s.name == RETRIEVE]
    [batch] = [s for s in finished if s.name == "batch"]
    stages = [s for s in finished if s.name in STAGES]
    assert rpc.parent.span_id == caller and batch.parent.span_id == rpc.context.span_id
    assert sorted(s.name for s in stages) == sorted(STAGES)
    assert {s.context.trace_id for s in (rpc, batch, *stages)} == {trace_id}
    assert rpc.attributes["grace.request_id"] == reply.request_id
    assert rpc.attributes["grace.ads_returned"] == len(reply.ads)


def test_a_refused_rpc_is_a_failed_span(data: Path, spans) -> None:
    async def main() -> list:
        app = await start(serving_settings(data, tracing="console"))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                bad = retrieval_pb2.RetrieveRequest(targeting=retrieval_pb2.Targeting(age=999))
                return await asyncio.gather(stub.Retrieve(bad, timeout=30), return_exceptions=True)
        finally:
            await app.drain()

    [error] = asyncio.run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    [rpc] = [s for s in spans.get_finished_spans() if s.name == RETRIEVE]
    assert rpc.status.status_code == StatusCode.ERROR
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not [s for s in spans.get_finished_spans() if s.name == "batch"]  # never batched


def test_sampling_follows_the_caller_and_the_ratio_for_new_traces(data: Path, spans) -> None:
    async def main() -> None:
        app = await start(serving_settings(data, tracing="console", tracing_sample_ratio=0.0))
        try:
            await call(app, data, 2)  # new traces, ratio 0: none kept
            await call(app, data, 2, lambda i: (("traceparent", traceparent(i, sampled=False)[0]),))
            await call(app, data, 2, lambda i: (("traceparent", traceparent(i, sampled=True)[0]),))
        finally:
            await app.drain()

    asyncio.run(main())
    finished = spans.get_finished_spans()
    kept = {traceparent(i)[1] for i in range(2)}  # the sampled callers' traces, whole
    assert sorted(s.context.trace_id for s in finished if s.name == RETRIEVE) == sorted(kept)
    batches = [s for s in finished if s.name == "batch"]
    assert batches and {s.context.trace_id for s in finished} == kept


def test_tracing_is_off_by_default(
    data: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[str] = []
    monkeypatch.setattr(tracing_module, "exporter_for", lambda kind: made.append(kind))
    caplog.set_level(logging.INFO, logger="grace.tracing")

    async def main() -> list:
        app = await start(serving_settings(data))
        try:
            assert not app.tracing.enabled
            return await call(app, data, 2, lambda i: (("traceparent", traceparent(i)[0]),))
        finally:
            await app.drain()

    assert all(isinstance(r, retrieval_pb2.RetrieveResponse) for r in asyncio.run(main()))
    assert made == []
    assert not [r for r in caplog.records if r.name == "grace.tracing"]  # says nothing at INFO


def test_a_bad_tracing_setting_is_one_line() -> None:
    with pytest.raises(TracingError, match="tracing must be one of off, console, otlp"):
        exporter_for("jaeger")
    with pytest.raises(ValueError, match="tracing"):
        serving_settings(Path("/nonexistent"), tracing="jaeger")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        serving_settings(Path("/nonexistent"), tracing_sample_ratio=1.5)
    assert not Tracing().enabled and Tracing().flush()


def test_otlp_exports_to_a_collector(
    data: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`tracing = "otlp"` sends the spans over OTLP/gRPC to the collector that the
    standard OTEL_EXPORTER_OTLP_ENDPOINT names (a real gRPC collector here), and the start
    says so in one INFO line."""
    trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    trace_grpc = pytest.importorskip(
        "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc"
    )
    received: list[str] = []
    got = threading.Event()

    class Collector(trace_grpc.TraceServiceServicer):
        def Export(self, request, context):
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    received.extend(s.name for s in scope.spans)
            got.set()
            return trace_service.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(2))
    trace_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    monkeypatch.setitem(os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setitem(os.environ, "OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.delitem(os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    caplog.set_level(logging.INFO, logger="grace.tracing")

    async def main() -> list:
        app = await start(serving_settings(data, tracing="otlp", tracing_sample_ratio=0.5))
        try:
            # sampled callers: their traces are kept whatever the ratio
            return await call(app, data, 3, lambda i: (("traceparent", traceparent(i)[0]),))
        finally:
            await app.drain()  # shuts the exporter down: everything is sent

    try:
        assert all(isinstance(r, retrieval_pb2.RetrieveResponse) for r in asyncio.run(main()))
        assert got.wait(30)
    finally:
        collector.stop(0)
    said = [r.getMessage() for r in caplog.records if r.name == "grace.tracing"]
    assert said == [f"tracing on: otlp exporter to http://127.0.0.1:{port}, sample ratio 0.5"]
    assert received.count(RETRIEVE) == 3
    assert set(STAGES) <= set(received) and "batch" in received


def test_a_tracing_setting_that_cannot_work_fails_before_anything_loads(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing OTLP exporter is a one-line StartupError at once (the CLI prints it), not
    a traceback after the model and index have loaded."""
    import service.app

    def missing(kind: str):
        raise TracingError("tracing = 'otlp' needs the OTLP exporter: pip install 'x[otlp]'")

    def never(*args, **kwargs):
        raise AssertionError("the rollout was made: loading began before tracing was checked")

    monkeypatch.setattr(tracing_module, "exporter_for", missing)
    monkeypatch.setattr(service.app, "build_rollout", never)
    with pytest.raises(StartupError, match="needs the OTLP exporter"):
        asyncio.run(start(serving_settings(data, tracing="otlp")))


def test_the_last_flush_to_a_collector_that_does_not_answer_is_bounded() -> None:
    """A drain's `shutdown` returns within its timeout when the exporter hangs (False:
    spans may be lost), so SIGTERM still exits cleanly."""
    release = threading.Event()

    class Hanging(InMemorySpanExporter):
        def export(self, spans):
            release.wait(60)
            return super().export(spans)

    original = tracing_module.exporter_for
    tracing_module.exporter_for = lambda kind: Hanging()
    try:
        tr = Tracing.from_settings("console")
    finally:
        tracing_module.exporter_for = original
    with tr.rpc("/grace.v1.AdRetrieval/Retrieve", ()):
        pass
    try:
        assert tr.shutdown(timeout_s=0.2) is False
    finally:
        release.set()


def test_console_spans_are_one_json_object_per_line_on_stderr(capsys) -> None:
    import json

    tr = Tracing.from_settings("console")
    for _ in range(2):
        with tr.rpc("/grace.v1.AdRetrieval/Retrieve", ()):
            pass
    assert tr.shutdown(timeout_s=10)
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 2 and all(json.loads(x)["name"] == RETRIEVE for x in lines)
