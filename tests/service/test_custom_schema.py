"""A targeting schema of one's own, end to end, as a team adopts it: a schema file with a
`platform` enum (include and exclude lists), an `age` bucket filled by the request's age
field, and an `audiences` set (include and exclude lists); a JSON Lines catalog carrying
them and campaign and advertiser ids; `grace build-index --targeting-schema` and
`grace validate-index` run as commands; a real `grace serve` process. Under beams wider
than any level of the catalog every reply is exactly the ads the contract makes eligible
(docs/FORMAT.md §1, checked here on the raw strings), blocks included, with the removed
ads counted by kind, with GTM or without; requests are checked against the served
schema."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import status_pb2

from service.model.checkpoint import save_checkpoint
from service.model.config import PROFILES
from service.model.retriever import GenerativeRetriever
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.server_process import ServerProcess, serving

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SCHEMA = """
version: 1
attributes:
  - {name: platform, kind: enum, catalog_field: platforms, values: [ios, android, web]}
  - name: age
    kind: bucket
    catalog_field: age_groups
    buckets: {young: [13, 29], old: [30, null]}
  - {name: audiences, kind: set, catalog_field: audiences, max_request_values: 32,
     bloom_bits: 64, bloom_hashes: 2}
"""
PLATFORMS = ("ios", "android", "web")
AUDIENCES = tuple(f"seg-{i}" for i in range(24))  # few bits: the Bloom has false positives
WIDE = [1, 64, 64, 64]  # wider than any level of the catalog: every allowed SID comes out
SID_SPACE = "custom-v1"


def some(rng: random.Random, pool: tuple[str, ...], most: int, p: float) -> list[str]:
    """A random subset of `pool` (at most `most`), empty with probability 1 - p."""
    return rng.sample(pool, rng.randint(1, most)) if rng.random() < p else []


def catalog_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for ad_id in range(1, n + 1):
        row = {
            "ad_id": ad_id,
            # shared prefixes everywhere; at most 54 SIDs: fewer than the beams at each step
            "sid": [rng.randrange(3), rng.randrange(3), rng.randrange(3), rng.randrange(2)],
            "platforms": some(rng, PLATFORMS, 2, 0.4),
            "platforms_exclude": some(rng, PLATFORMS, 1, 0.25),
            "age_groups": some(rng, ("young", "old"), 1, 0.3),
            "age_groups_exclude": some(rng, ("young", "old"), 1, 0.1),
            "audiences": some(rng, AUDIENCES, 4, 0.5),
            "audiences_exclude": some(rng, AUDIENCES, 3, 0.3),
            "campaign_id": rng.randint(1, 12),
            "advertiser_id": rng.randint(1, 5),
        }
        rows.append({k: v for k, v in row.items() if v != [] or rng.random() < 0.5})
    return rows


def age_group(age: int) -> str | None:
    return None if age < 13 else "young" if age <= 29 else "old"


def eligible(row: dict, req: dict) -> bool:
    """docs/FORMAT.md §1 "Eligibility", on the strings: include lists empty or matched,
    exclude lists not matched (an unknown value matches none), no block."""
    for attr, field in (("platform", "platforms"), ("age", "age_groups")):
        value = req[attr]
        if row.get(field) and value not in row[field]:
            return False
        if value is not None and value in (row.get(f"{field}_exclude") or ()):
            return False
    audiences = set(req["audiences"])
    if row.get("audiences") and not audiences & set(row["audiences"]):
        return False
    if audiences & set(row.get("audiences_exclude") or ()):
        return False
    return not (row["ad_id"] in req["ads"] or row["campaign_id"] in req["campaigns"]
                or row["advertiser_id"] in req["advertisers"])  # fmt: skip


def grace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("custom_schema")
    (root / "schema.yaml").write_text(SCHEMA)
    rows = catalog_rows(300, seed=3)
    (root / "catalog.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    built = grace("build-index", "--catalog", str(root / "catalog.jsonl"), "--out",
                  str(root / "index"), "--sid-space", SID_SPACE, "--targeting-schema",
                  str(root / "schema.yaml"), "--no-progress")  # fmt: skip
    assert built.returncode == 0, built.stderr
    checked = grace("validate-index", str(root / "index"))
    assert checked.returncode == 0 and "format 3" in checked.stdout, checked.stderr
    torch.manual_seed(0)
    save_checkpoint(
        GenerativeRetriever(PROFILES["tiny"]), None, root / "model", sid_space=SID_SPACE
    )
    with serving(root, root / "server.log") as server:
        yield server, rows


def random_request(rng: random.Random, user: int) -> tuple[retrieval_pb2.RetrieveRequest, dict]:
    want = {
        "platform": rng.choice([*PLATFORMS, None]),
        "age": rng.choice([0, 9, 17, 29, 30, 64]),
        "audiences": some(rng, (*AUDIENCES, "seg-unknown"), 6, 0.8),
        "ads": set(rng.sample(range(1, 301), 20)) if rng.random() < 0.3 else set(),
        "campaigns": {rng.randint(1, 12)} if rng.random() < 0.3 else set(),
        "advertisers": {rng.randint(1, 5)} if rng.random() < 0.2 else set(),
    }
    req = retrieval_pb2.RetrieveRequest(request_id=f"custom-{user}")
    req.user.user_id = user
    req.targeting.age = want["age"]
    if want["platform"] is not None:
        req.targeting.attributes["platform"].values.append(want["platform"])
    req.targeting.attributes["audiences"].values.extend(want["audiences"])
    req.targeting.exclude_ad_ids.extend(sorted(want["ads"]))
    req.targeting.exclude_campaign_ids.extend(sorted(want["campaigns"]))
    req.targeting.exclude_advertiser_ids.extend(sorted(want["advertisers"]))
    req.options.max_ads = 1000
    req.options.beam_widths.extend(WIDE)
    if user % 3 == 0:  # without GTM the exact stage alone keeps the answer exact
        req.options.filter_mode = retrieval_pb2.CD_ONLY
    want["age"] = age_group(want["age"])
    return req, want


def test_every_reply_is_exactly_the_eligible_ads(world: tuple[ServerProcess, list[dict]]) -> None:
    server, rows = world
    rng = random.Random(11)
    removed = {"block": 0, "targeting": 0, "exclusion": 0}
    answered = 0
    with grpc.insecure_channel(server.target) as channel:
        stub = retrieval_pb2_grpc.AdRetrievalStub(channel)
        for user in range(60):
            req, want = random_request(rng, user)
            reply = stub.Retrieve(req, timeout=120)
            got = [a.ad_id for a in reply.ads]
            assert len(got) == len(set(got))
            expected = {r["ad_id"] for r in rows if eligible(r, want)}
            assert set(got) == expected, f"request {user}: {want}"  # 0 ineligible, 0 missed
            stats = reply.stats
            assert stats.ads_eligible == len(expected)
            assert stats.ads_expanded == stats.ads_eligible + sum(stats.ads_removed.values())
            for kind in removed:
                removed[kind] += stats.ads_removed[kind]
            answered += bool(got)
    # the requests exercised every kind of rule, and most found ads
    assert all(removed.values()), removed
    assert answered > 30


@pytest.mark.parametrize(
    ("edit", "field", "says"),
    [
        (
            lambda t: t.attributes["country"].values.append("US"),
            "targeting.attributes['country']",
            "has no such attribute",
        ),
        (
            lambda t: t.attributes["platform"].values.append("tv"),
            "targeting.attributes['platform']",
            "unknown value",
        ),
        (
            lambda t: t.attributes["platform"].values.extend(["ios", "web"]),
            "targeting.attributes['platform']",
            "takes one value",
        ),
        (
            lambda t: t.attributes["audiences"].values.extend(f"a{i}" for i in range(33)),
            "targeting.attributes['audiences']",
            "at most 32",
        ),
    ],
    ids=["not-in-schema", "unlisted-enum", "two-enum-values", "too-many-set-values"],
)
def test_requests_are_checked_against_the_served_schema(
    world: tuple[ServerProcess, list[dict]], edit, field: str, says: str
) -> None:
    server, _ = world
    req = retrieval_pb2.RetrieveRequest()
    req.user.user_id = 1
    edit(req.targeting)
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as raised:
        retrieval_pb2_grpc.AdRetrievalStub(channel).Retrieve(req, timeout=60)
    err = raised.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = status_pb2.Status.FromString(dict(err.trailing_metadata())["grpc-status-details-bin"])
    assert field in err.details() and says in err.details(), err.details()
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
