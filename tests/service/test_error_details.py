"""Rich errors over real gRPC: a `google.rpc.Status` in the trailers besides the plain
message — INVALID_ARGUMENT with a BadRequest naming every bad field, RESOURCE_EXHAUSTED
from admission and UNAVAILABLE with a RetryInfo."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from cli.query import request_for_user
from service.admission import RETRY_MAX_SECONDS, RETRY_MIN_SECONDS
from service.app import start
from service.grpc_server import add_retrieval
from service.metrics import Metrics
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.server import RETRY_DRAINING_SECONDS, RETRY_LOADING_SECONDS, RetrievalServicer
from service.validation import Limits
from tests.helpers.serving import make_serving_data, serving_settings


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("errors"))


async def refusal(port: int, req: retrieval_pb2.RetrieveRequest) -> grpc.aio.AioRpcError:
    """The error a Retrieve of `req` on `port` fails with (it must fail)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await retrieval_pb2_grpc.AdRetrievalStub(ch).Retrieve(req)
    return err.value


def rich_status(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    [raw] = [v for k, v in err.trailing_metadata() or () if k == "grpc-status-details-bin"]
    status = status_pb2.Status.FromString(raw)
    assert status.code == err.code().value[0] and status.message == err.details()
    return status


def detail(status: status_pb2.Status, kind: type):
    [found] = [d for d in status.details if d.Is(kind.DESCRIPTOR)]
    out = kind()
    found.Unpack(out)
    return out


def retry_seconds(err: grpc.aio.AioRpcError) -> float:
    return detail(rich_status(err), error_details_pb2.RetryInfo).retry_delay.ToNanoseconds() / 1e9


def test_bad_request_names_every_bad_field_and_the_message_the_first(data: Path) -> None:
    async def main() -> grpc.aio.AioRpcError:
        app = await start(serving_settings(data))
        req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        req.targeting.gender = "robot"
        req.targeting.age = 400
        req.targeting.locations.extend(["ok", ""])
        req.user.history[1].type = 9
        req.options.max_ads = -5
        del req.options.beam_widths[:]
        req.options.beam_widths.extend([2, 8, 8, 8])
        try:
            err = await refusal(app.port, req)
        finally:
            await app.drain()
        return err

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = detail(rich_status(err), error_details_pb2.BadRequest)
    n = len(request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM).targeting.locations)
    fields = [v.field for v in bad.field_violations]
    assert fields == [
        "user.history[1].type",
        "targeting.age",
        "targeting.gender",
        f"targeting.locations[{n + 1}]",
        "options.max_ads",
        "options.beam_widths[0]",
    ]
    assert all(v.description for v in bad.field_violations)
    # simple clients read the text: the first field in full, then the others' paths
    assert err.details().startswith("user.history[1].type: expected VIEW, CLICK or CONVERSION")
    assert err.details().endswith(f"(and 5 more: {', '.join(fields[1:])})")


def test_a_full_queue_is_refused_with_retry_info(data: Path) -> None:
    """The pipeline held at stage 1, the queue (2) fills: the next calls are refused
    RESOURCE_EXHAUSTED with a RetryInfo; once released, the admitted ones are answered."""
    release = threading.Event()

    async def main() -> tuple[list, list]:
        app = await start(serving_settings(data, queue_capacity=2, max_batch=1, stall_seconds=0))
        stages, original = app.pipeline.stages, app.pipeline.stages.input

        def held_input(batch):
            release.wait(120)
            return original(batch)

        stages.input = held_input  # type: ignore[method-assign]
        req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                calls = [asyncio.ensure_future(stub.Retrieve(req)) for _ in range(24)]
                refused: list[grpc.aio.AioRpcError] = []
                pending = set(calls)
                while not refused:  # only refusals finish while the pipeline is held
                    done, pending = await asyncio.wait(pending, return_when="FIRST_COMPLETED")
                    refused += [c.exception() for c in done]  # type: ignore[misc]
                release.set()
                replies = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            release.set()
            await app.drain()
        ok = [r for r in replies if isinstance(r, retrieval_pb2.RetrieveResponse)]
        return ok, [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]

    ok, refused = asyncio.run(main())
    assert ok and refused and len(ok) + len(refused) == 24
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    for e in refused:
        assert e.details() == "request queue full (2)"
        assert RETRY_MIN_SECONDS <= retry_seconds(e) <= RETRY_MAX_SECONDS


def test_unavailable_while_draining_or_loading_carries_retry_info(data: Path) -> None:
    async def main() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError]:
        app = await start(serving_settings(data))
        req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        app.servicer.draining = True  # what App.drain sets before the port closes
        try:
            draining = await refusal(app.port, req)
        finally:
            await app.drain()
        # a server whose first model and index are still loading
        limits = Limits(1000, 10_000, (1, 4, 8, 8), (1, 8, 16, 16))
        loading = RetrievalServicer(SimpleNamespace(), limits, SimpleNamespace(ready=False),  # type: ignore[arg-type]
                                    Metrics())  # fmt: skip
        server = grpc.aio.server()
        add_retrieval(server, loading.Retrieve)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            not_loaded = await refusal(port, req)
        finally:
            await server.stop(0)
        return draining, not_loaded

    draining, not_loaded = asyncio.run(main())
    assert draining.code() == not_loaded.code() == grpc.StatusCode.UNAVAILABLE
    assert draining.details() == "server is draining"
    assert retry_seconds(draining) == RETRY_DRAINING_SECONDS
    assert not_loaded.details() == "no model and index loaded yet"
    assert retry_seconds(not_loaded) == RETRY_LOADING_SECONDS


def test_errors_without_details_keep_a_plain_status(data: Path) -> None:
    """Undecodable bytes (no field to name) carry no google.rpc.Status: the text is the
    whole answer."""

    async def main() -> grpc.aio.AioRpcError:
        app = await start(serving_settings(data))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await ch.unary_unary("/grace.v1.AdRetrieval/Retrieve")(b"\xff\xff")
        finally:
            await app.drain()
        return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc-status-details-bin" not in dict(err.trailing_metadata() or ())
