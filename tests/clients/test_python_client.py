"""The light Python client (clients/python, `grace_client`) against the real server
(service/app.py `start`) on a small served world: health, a Retrieve built from typed
fields, a request message from `grace query`'s builder, an INVALID_ARGUMENT that is not
retried — sync and asyncio clients both — and the request id of a real error, the one on
the server's log line. The client's own tests (retries, backoff, deadlines against a
scripted server) are clients/python/tests."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import grpc
import pytest

from cli.query import request_for_user
from grace_client import AsyncGraceClient, GraceClient, GraceError, ServingStatus, retrieval_pb2
from service.app import start
from tests.helpers.serving import make_serving_data, serving_settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("python-client"))


def test_the_client_talks_to_the_real_server(data: Path) -> None:
    query = request_for_user(data / "world", 3, 20, retrieval_pb2.CD_GTM)
    request = retrieval_pb2.RetrieveRequest.FromString(query.SerializeToString())

    def sync_calls(target: str) -> tuple[ServingStatus, retrieval_pb2.RetrieveResponse]:
        with GraceClient(target, timeout=10.0) as client:
            return client.health("grace.v1.AdRetrieval"), client.retrieve(request)

    async def main() -> None:
        app = await start(serving_settings(data))
        target = f"127.0.0.1:{app.port}"
        try:
            status, reply = await asyncio.get_running_loop().run_in_executor(
                None, sync_calls, target
            )
            assert status is ServingStatus.SERVING
            assert 0 < len(reply.ads) <= 20 and reply.model_version.startswith("tiny-")
            async with AsyncGraceClient(target, timeout=10.0, retries=3) as client:
                assert await client.health() is ServingStatus.SERVING
                t = request.targeting
                typed = await client.retrieve(
                    user_id=request.user.user_id,
                    history=list(request.user.history),
                    country=t.country,
                    age=t.age,
                    gender=t.gender,
                    locations=list(t.locations),
                    max_ads=20,
                    filter_mode="CD_GTM",
                    include_sids=True,
                )
                assert [a.ad_id for a in typed.ads] == [a.ad_id for a in reply.ads]
                assert all(len(a.sid) > 0 for a in typed.ads)
                with pytest.raises(GraceError) as err:
                    await client.retrieve(user_id=1, age=-1, max_ads=-1)
                assert (err.value.code, err.value.attempts) == (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    1,
                )
                assert "age" in err.value.message
        finally:
            await app.drain()

    asyncio.run(main())


def test_a_real_error_names_the_call_as_the_servers_log_does(data: Path, caplog) -> None:
    """`GraceError.request_id` is the server's x-request-id trailer: the request's own id,
    else one the server made — the id on the server's access-log line of the call."""
    caplog.set_level(logging.INFO, logger="grace.access")

    def failed_calls(target: str) -> list[GraceError]:
        errors = []
        with GraceClient(target, timeout=10.0) as client:
            for request_id in ("py-bad-1", ""):
                with pytest.raises(GraceError) as err:
                    client.retrieve(request_id=request_id, user_id=1, age=-1)
                errors.append(err.value)
        return errors

    async def main() -> list[GraceError]:
        app = await start(serving_settings(data, access_log_sample=1.0))
        try:
            target = f"127.0.0.1:{app.port}"
            return await asyncio.get_running_loop().run_in_executor(None, failed_calls, target)
        finally:
            await app.drain()

    own, made = asyncio.run(main())
    assert own.request_id == "py-bad-1" and str(own).endswith(" (request_id=py-bad-1)")
    assert own.code == grpc.StatusCode.INVALID_ARGUMENT
    assert own.field_violations[0][0] == "targeting.age"
    assert re.fullmatch(r"[0-9a-f]{32}", made.request_id or ""), made.request_id
    logged = {r.request_id: r.grpc_code for r in caplog.records if r.name == "grace.access"}
    assert logged == {"py-bad-1": "INVALID_ARGUMENT", made.request_id: "INVALID_ARGUMENT"}
