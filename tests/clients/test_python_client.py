"""The light Python client (clients/python, `grace_client`) against the real server
(service/app.py `start`) on a small served world: health, a Retrieve built from typed
fields, a request message from `grace query`'s builder, and an INVALID_ARGUMENT that is
not retried — sync and asyncio clients both. The client's own tests (retries, backoff,
deadlines against a scripted server) are clients/python/tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from grace_client import AsyncGraceClient, GraceClient, GraceError, ServingStatus, retrieval_pb2
from service.app import start
from service.client import request_for_user
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
