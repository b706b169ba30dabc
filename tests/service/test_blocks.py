"""Per-request blocks over real gRPC (docs/FORMAT.md §1): the ads a request blocks by id
never come back, the reply and the metrics count what each rule kind removed, and blocks
the served index cannot apply are refused, never ignored."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest

from cli.query import request_for_user
from service.app import start
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.serving import make_serving_data, serving_settings


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("blocks"))


def test_blocked_ads_never_come_back_and_are_counted(data: Path) -> None:
    async def main() -> tuple:
        app = await start(serving_settings(data))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                req = request_for_user(data / "world", 3, 20, retrieval_pb2.CD_GTM)
                before = await stub.Retrieve(req)
                blocked = [ad.ad_id for ad in before.ads[:10]]
                req.targeting.exclude_ad_ids.extend(blocked)
                after = await stub.Retrieve(req)
                req.targeting.exclude_campaign_ids.append(7)  # this index has no campaigns
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Retrieve(req)
            url = f"http://127.0.0.1:{app.metrics_port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
            return before, blocked, after, refused.value, text
        finally:
            await app.drain()

    before, blocked, after, refused, metrics = asyncio.run(main())
    assert len(blocked) == 10 and len(after.ads) > 0
    assert not {ad.ad_id for ad in after.ads} & set(blocked)
    # the blocked ads were expanded again (the model and index are the same) and removed
    assert after.stats.ads_removed["block"] >= 10
    assert "block" not in before.stats.ads_removed
    s = after.stats
    assert s.ads_expanded == s.ads_eligible + sum(s.ads_removed.values())
    assert 'grace_ads_removed_total{rule="block"}' in metrics
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "targeting.exclude_campaign_ids: the served index cannot apply it" in refused.details()
