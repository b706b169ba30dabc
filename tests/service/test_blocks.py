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


def test_campaign_and_advertiser_blocks_follow_the_catalog(data: Path, tmp_path: Path) -> None:
    """A catalog with campaign_id and advertiser_id (the synthetic one names advertisers):
    the index keeps them beside each ad, and a request blocking a campaign and an
    advertiser gets none of their ads."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from index_builder.build import build_index

    table = pq.read_table(data / "world" / "catalog.parquet")
    table = table.append_column("campaign_id", pc.add(pc.bit_wise_and(table["ad_id"], 7), 1))
    pq.write_table(table, tmp_path / "catalog.parquet")
    build_index(tmp_path / "catalog.parquet", tmp_path / "index",
                tokenizer_path=data / "model" / "tokenizer", progress=False)  # fmt: skip
    owner = {r["ad_id"]: (r["campaign_id"], r["advertiser_id"]) for r in table.to_pylist()}

    async def main() -> tuple:
        app = await start(serving_settings(data, index_root=tmp_path / "index"))
        try:
            index = app.servicer.serving.current.index
            ads = index.arrays.ads  # every ad's owners, aligned with its id
            assert all(owner[int(a)] == (int(c), int(v)) for a, c, v in zip(
                ads.ad_ids, ads.ad_campaign_ids, ads.ad_advertiser_ids, strict=True))  # fmt: skip
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                req = request_for_user(data / "world", 5, 50, retrieval_pb2.CD_GTM)
                before = await stub.Retrieve(req)
                campaign = owner[before.ads[0].ad_id][0]
                advertiser = owner[before.ads[1].ad_id][1]
                req.targeting.exclude_campaign_ids.append(campaign)
                req.targeting.exclude_advertiser_ids.append(advertiser)
                return campaign, advertiser, await stub.Retrieve(req)
        finally:
            await app.drain()

    campaign, advertiser, after = asyncio.run(main())
    assert len(after.ads) > 0
    assert all(owner[ad.ad_id][0] != campaign and owner[ad.ad_id][1] != advertiser
               for ad in after.ads)  # fmt: skip
    assert after.stats.ads_removed["block"] > 0
