"""Request ids, structured logs and the access log of a real server over localhost gRPC:
the id comes from the request, else the caller's metadata, else the server, and comes
back in the reply, in the trailer and on every log line about the call."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import grpc
import pytest

from cli.query import request_for_user
from service.app import start
from service.logs import JsonFormatter, TextFormatter, _Context
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.server_process import serving
from tests.helpers.serving import make_serving_data, serving_settings


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("ids"))


def _trailer(metadata: object, key: str) -> list:
    return [v for k, v in metadata or () if k == key]  # type: ignore[attr-defined]


async def _call(stub, req, metadata=()) -> tuple[retrieval_pb2.RetrieveResponse | None, object]:
    """(reply or None, the trailing metadata), whether the call succeeded or failed."""
    call = stub.Retrieve(req, metadata=metadata)
    try:
        return await call, await call.trailing_metadata()
    except grpc.aio.AioRpcError as exc:
        return None, exc.trailing_metadata()


def test_request_id_from_field_metadata_or_made_is_echoed_in_reply_and_trailer(
    data: Path,
) -> None:
    async def main() -> None:
        app = await start(serving_settings(data))
        base = request_for_user(data / "world", 0, 5, retrieval_pb2.CD_GTM)
        own, bare, odd = (retrieval_pb2.RetrieveRequest() for _ in range(3))
        for r in (own, bare, odd):
            r.CopyFrom(base)
        own.request_id, bare.request_id, odd.request_id = "from-field", "", "ünï code\n"
        # written last on the wire: the field is found once the request is parsed
        late = retrieval_pb2.RetrieveRequest()
        late.CopyFrom(base)
        late.request_id = ""
        late_bytes = late.SerializeToString() + b"\x0a\x04late"
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                meta = (("x-request-id", "from-metadata"),)
                cases = {
                    "field": await _call(stub, own),
                    "field over metadata": await _call(stub, own, meta),
                    "metadata": await _call(stub, bare, meta),
                    "made": await _call(stub, bare),
                    "odd": await _call(stub, odd),
                }
                raw = ch.unary_unary("/grace.v1.AdRetrieval/Retrieve")
                late_call = raw(late_bytes)
                late_reply = retrieval_pb2.RetrieveResponse.FromString(await late_call)
                late_trailer = await late_call.trailing_metadata()
        finally:
            await app.drain()
        expected = {"field": "from-field", "field over metadata": "from-field",
                    "metadata": "from-metadata"}  # fmt: skip
        for name, (reply, call) in cases.items():
            assert reply is not None and len(reply.ads) > 0, name
            want = expected.get(name, reply.request_id)
            assert reply.request_id == want, name
            if name != "odd":
                assert _trailer(call, "x-request-id") == [want], name
        assert re.fullmatch(r"[0-9a-f]{32}", cases["made"][0].request_id)
        odd_reply, odd_call = cases["odd"]
        assert odd_reply.request_id == "ünï code\n"  # echoed exactly in the reply ...
        assert _trailer(odd_call, "x-request-id") == ["%C3%BCn%C3%AF%20code%0A"]  # ... encoded
        assert late_reply.request_id == "late"
        assert _trailer(late_trailer, "x-request-id") == ["late"]

    asyncio.run(main())


def test_refusals_carry_the_request_id_in_trailer_and_warning_line(
    data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    async def main() -> tuple:
        app = await start(serving_settings(data))
        bad = retrieval_pb2.RetrieveRequest(
            request_id="bad-1", targeting=retrieval_pb2.Targeting(gender="robot")
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                _, err = await _call(stub, bad)
                # undecodable bytes: the id is the caller's metadata
                raw = ch.unary_unary("/grace.v1.AdRetrieval/Retrieve")
                with pytest.raises(grpc.aio.AioRpcError) as garbage:
                    await raw(b"\xff\xff\xff", metadata=(("x-request-id", "meta-9"),))
        finally:
            await app.drain()
        return err, garbage.value

    trailer, garbage = asyncio.run(main())
    assert _trailer(trailer, "x-request-id") == ["bad-1"]
    assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _trailer(garbage.trailing_metadata(), "x-request-id") == ["meta-9"]
    warned = [r for r in caplog.records if r.name == "grace.server" and "INVALID" in r.message]
    assert warned and warned[0].request_id == "bad-1"  # the first; the next is held back


@pytest.mark.parametrize("sample", [0.0, 1.0])
def test_access_log_lines_follow_the_sample(
    data: Path, caplog: pytest.LogCaptureFixture, sample: float
) -> None:
    """0: no access line at all, not even for an error; 1: one line per call, with the
    call's id, code, latency, batch, versions, ads and peer."""
    caplog.set_level(logging.INFO)

    async def main() -> None:
        app = await start(serving_settings(data, access_log_sample=sample))
        good = request_for_user(data / "world", 1, 7, retrieval_pb2.CD_GTM)
        good.request_id = "ok-1"
        bad = retrieval_pb2.RetrieveRequest(request_id="bad-2")
        bad.options.max_ads = -1
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                for _ in range(3):
                    await _call(stub, good)
                await _call(stub, bad)
        finally:
            await app.drain()

    caplog.clear()
    asyncio.run(main())
    lines = [r for r in caplog.records if r.name == "grace.access"]
    if sample == 0.0:
        assert lines == []
        return
    assert [(r.request_id, r.grpc_code) for r in lines] == [("ok-1", "OK")] * 3 + [
        ("bad-2", "INVALID_ARGUMENT")
    ]
    ok, bad = lines[0], lines[-1]
    assert ok.ads == 7 and ok.batch_size >= 1 and ok.latency_ms > 0
    assert ok.index_version and ok.model_version.startswith("tiny-")
    assert ok.peer.startswith(("ipv4:127.0.0.1:", "ipv6:"))
    assert bad.ads is None and bad.batch_size is None


def test_a_failed_call_is_logged_however_small_the_sample(data: Path, caplog) -> None:
    caplog.set_level(logging.INFO)

    async def main() -> None:
        app = await start(serving_settings(data, access_log_sample=1e-9))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                await _call(stub, retrieval_pb2.RetrieveRequest(request_id="x" * 200))
        finally:
            await app.drain()

    asyncio.run(main())
    [line] = [r for r in caplog.records if r.name == "grace.access"]
    assert line.grpc_code == "INVALID_ARGUMENT" and re.fullmatch(r"[0-9a-f]{32}", line.request_id)


def test_json_logs_of_a_served_process_parse_and_carry_the_request_id(
    data: Path, tmp_path: Path
) -> None:
    """`grace serve` with GRACE_LOG_FORMAT=json: every line of its output is one JSON
    object; the access and warning lines about a call carry its request id."""
    env = {"GRACE_LOG_FORMAT": "json", "GRACE_ACCESS_LOG_SAMPLE": "1"}
    with serving(data, tmp_path / "serve.log", env=env) as server:
        with grpc.insecure_channel(server.target) as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            good = request_for_user(data / "world", 2, 3, retrieval_pb2.CD_GTM)
            good.request_id = "json-ok"
            stub.Retrieve(good, timeout=60)
            with pytest.raises(grpc.RpcError):
                stub.Retrieve(retrieval_pb2.RetrieveRequest(request_id="json-bad",
                              targeting=retrieval_pb2.Targeting(age=-1)), timeout=60)  # fmt: skip
        end = time.monotonic() + 60  # the lines are written before the replies; flushed soon
        while "json-bad" not in server.log_text() and time.monotonic() < end:
            server.check_alive()
            time.sleep(0.05)
    lines = [json.loads(line) for line in server.log_text().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "message"} <= set(obj) for obj in lines)
    access = {o["request_id"]: o for o in lines if o["logger"] == "grace.access"}
    assert access["json-ok"]["grpc_code"] == "OK" and access["json-ok"]["ads"] == 3
    assert access["json-bad"]["grpc_code"] == "INVALID_ARGUMENT"
    [warning] = [o for o in lines if o["logger"] == "grace.server" and o["level"] == "WARNING"]
    assert warning["request_id"] == "json-bad" and "targeting.age" in warning["message"]
    assert any("serving grace.v1.AdRetrieval" in o["message"] for o in lines)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", lines[0]["ts"])


def test_formatters_put_worker_request_id_fields_and_traceback_on_the_line() -> None:
    record = logging.LogRecord("grace.server", logging.ERROR, __file__, 1, "failed %d", (3,),
                               None)  # fmt: skip
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        record.exc_info = sys.exc_info()
    record.request_id = "r-7"
    record.grpc_code = "INTERNAL"
    _Context(worker=1).filter(record)
    obj = json.loads(JsonFormatter().format(record))
    assert obj["message"] == "failed 3" and obj["worker"] == 1 and obj["request_id"] == "r-7"
    assert obj["grpc_code"] == "INTERNAL" and "RuntimeError: boom" in obj["exc"]
    text = TextFormatter().format(record)
    first = text.splitlines()[0]
    tail = "ERROR grace.server[worker 1]: failed 3 request_id=r-7 grpc_code=INTERNAL"
    assert first.endswith(tail)
    assert "RuntimeError: boom" in text
