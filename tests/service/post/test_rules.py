"""The C++ post stage under a declared schema's rules (contracts/targeting_codec.py): K set
attributes with include and exclude lists, enum/bucket exclusions, the request's blocks
and the per-kind counts, against `targeting_codec.exact_eligible`, the reference post
stage and a naive per-ad count."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.index_arrays import AdArrays
from contracts.targeting_codec import AdRules, Ragged, RequestRules, codec, exact_eligible
from contracts.targeting_schema import Attribute, TargetingSchema
from service.post import PostRequest, PostResult, PostStage
from tests.helpers.reference_post import ad_exclude_bitmask, expand_and_filter_rules

COUNTRIES = tuple(f"C{i:02d}" for i in range(70))  # 70 values + unknown: two bitmask words
AGES = {"young": (13, 29), "old": (30, None)}
REQUEST_AGES = ("", "5", "15", "45")  # unknown, in no bucket (unknown), young, old
VOCAB = 6  # ids of each set attribute's vocabulary
SCORES = np.array([0.0, -0.0, -0.5, -1.0, -3.25, -np.inf], dtype=np.float32)


def schema_with(k: int) -> TargetingSchema:
    return TargetingSchema(
        attributes=(
            Attribute(name="country", kind="enum", catalog_field="countries", values=COUNTRIES),
            Attribute(name="age", kind="bucket", catalog_field="ages", buckets=AGES),
            *(Attribute(name=f"s{i}", kind="set", catalog_field=f"s{i}") for i in range(k)),
        )
    )


@dataclass(frozen=True)
class World:
    """Random ads under `schema`: their rules as the stage reads them and as plain lists."""

    schema: TargetingSchema
    ads: AdArrays  # the SID -> ad index (the default schema's targeting arrays empty)
    rules: AdRules
    include: dict[str, list[list[int]]]  # attribute -> per ad: value indices / vocab ids
    exclude: dict[str, list[list[int]]]


def lists(rng: np.random.Generator, n: int, size: int, p: float, most: int) -> list[list[int]]:
    """Per ad a sorted list (empty with probability 1 - p) of up to `most` of range(size)."""
    return [
        sorted(rng.choice(size, rng.integers(1, min(most, size) + 1), replace=False).tolist())
        if rng.random() < p
        else []
        for _ in range(n)
    ]


def make_world(rng: np.random.Generator, k: int, n: int) -> World:
    schema = schema_with(k)
    sizes = {"country": len(COUNTRIES), "age": len(AGES)} | {a.name: VOCAB for a in schema.families}
    include = {name: lists(rng, n, size, 0.5, 3) for name, size in sizes.items()}
    exclude = {name: lists(rng, n, size, 0.3, 2) for name, size in sizes.items()}
    for a in schema.families:  # some attributes without exclude lists at all
        if rng.random() < 0.3:
            exclude[a.name] = [[] for _ in range(n)]
    ragged = {kind: {name: Ragged.from_lists(v) for name, v in d.items()}
              for kind, d in (("include", include), ("exclude", exclude))}  # fmt: skip
    masked = ("country", "age")
    bitmask = codec(schema).ad_bitmasks(
        {a: ragged["include"][a] for a in masked}, {a: ragged["exclude"][a] for a in masked}, n
    )
    sets = [a.name for a in schema.families]
    rules = AdRules(
        bitmask=bitmask,
        include={a: ragged["include"][a] for a in sets},
        exclude={a: ragged["exclude"][a] for a in sets if rng.random() < 0.8},
        campaign=rng.integers(0, 5, n) if rng.random() < 0.7 else None,
        advertiser=rng.integers(0, 4, n) if rng.random() < 0.7 else None,
    )
    for a in sets:  # an exclude mapping left out means no exclude lists
        if a not in rules.exclude:
            exclude[a] = [[] for _ in range(n)]
    cuts = np.sort(rng.integers(0, n + 1, size=rng.integers(0, n + 1)))
    offsets = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    ads = AdArrays(
        leaf_sids=rng.integers(0, 512, size=(len(offsets) - 1, 4)).astype(np.int16),
        leaf_ad_offsets=offsets,
        ad_ids=rng.choice(10**12, size=n, replace=False).astype(np.int64) - 10**11,
        ad_bitmask=np.zeros((n, 5), dtype=np.uint64),
    )
    return World(schema, ads, rules, include, exclude)


def subset(rng: np.random.Generator, pool: np.ndarray, most: int) -> np.ndarray:
    pool = np.unique(pool)
    return rng.choice(pool, size=min(len(pool), rng.integers(0, most + 1)), replace=False)


def make_request(rng: np.random.Generator, w: World) -> tuple[RequestRules, dict[str, int | None]]:
    """A request's rules, and its enum/bucket values as value indices (None: unknown)."""
    c = int(rng.integers(0, len(COUNTRIES) + 1))
    age = str(rng.choice(REQUEST_AGES))
    values = {"country": [COUNTRIES[c]] if c < len(COUNTRIES) else [], "age": [age] if age else []}
    bucket = {"15": 0, "45": 1}.get(age)
    junk = rng.integers(-(2**63), 2**63 - 1, size=3)
    blocks = [
        np.concatenate([subset(rng, w.ads.ad_ids, 3), junk]) if rng.random() < 0.5 else [],
        subset(rng, np.arange(0, 6), 2) if rng.random() < 0.5 else [],
        subset(rng, np.arange(0, 5), 2) if rng.random() < 0.5 else [],
    ]
    req = RequestRules(
        bitmask=codec(w.schema).request_bitmask(values),
        ids={
            a.name: np.sort(subset(rng, np.arange(VOCAB), 3)).astype(np.int32)
            for a in w.schema.families
        },
        exclude_ads=np.asarray(blocks[0], dtype=np.int64),
        exclude_campaigns=np.asarray(blocks[1], dtype=np.int64),
        exclude_advertisers=np.asarray(blocks[2], dtype=np.int64),
    )
    return req, {"country": c if c < len(COUNTRIES) else None, "age": bucket}


def naive_kind(w: World, row: int, req: RequestRules, values: dict, exclusions_told: bool) -> str:
    """One ad's fate from its plain rule lists, in the stage's counting order."""
    r = w.rules
    if (
        int(w.ads.ad_ids[row]) in set(req.exclude_ads.tolist())
        or (r.campaign is not None and int(r.campaign[row]) in set(req.exclude_campaigns.tolist()))
        or (
            r.advertiser is not None
            and int(r.advertiser[row]) in set(req.exclude_advertisers.tolist())
        )
    ):
        return "blocked"
    ids = {a: set(req.ids[a].tolist()) for a in req.ids}
    inc, exc = {a: v[row] for a, v in w.include.items()}, {a: v[row] for a, v in w.exclude.items()}
    enum_out = any(v is not None and v in exc[a] for a, v in values.items())
    if (
        any(inc[a] and (v is None or v not in inc[a]) for a, v in values.items())
        or any(inc[a] and not ids[a] & set(inc[a]) for a in ids)
        or (enum_out and not exclusions_told)
    ):
        return "targeting"
    if enum_out or any(ids[a] & set(exc[a]) for a in ids):
        return "excluded"
    return "eligible"


def check(
    w: World, seed: int, batch: int, threads: int, exclusions_told: bool, dead: float = 0.0
) -> list[PostResult]:
    """`dead`: the share of ads not live (paused, deleted) in the batch's live state."""
    rng = np.random.default_rng(seed)
    not_live = (rng.random(w.ads.num_ads) < dead).astype(np.uint8) if dead else None
    xbits = ad_exclude_bitmask(w.schema, w.include, w.exclude) if exclusions_told else None
    stage = PostStage(w.ads, threads, schema=w.schema, rules=w.rules, ad_exclude_bitmask=xbits)
    n_leaves = len(w.ads.leaf_sids)
    requests, cases = [], []
    for _ in range(batch):
        req, values = make_request(rng, w)
        leaves = rng.integers(0, n_leaves, size=rng.integers(0, 2 * n_leaves + 1))
        scores = rng.choice(SCORES, size=len(leaves))
        max_ads = int(rng.integers(0, w.ads.num_ads + 3))
        requests.append(PostRequest.from_rules(leaves, scores, req, w.schema, max_ads))
        cases.append((req, values, leaves, scores, max_ads))
    got = stage.run(requests, not_live)
    row_of = {int(i): r for r, i in enumerate(w.ads.ad_ids)}
    for out, (req, values, leaves, scores, max_ads) in zip(got, cases, strict=True):
        want = expand_and_filter_rules(
            w.ads,
            w.schema,
            w.rules,
            leaves,
            scores,
            req,
            max_ads,
            ad_exclude_bitmask=xbits,
            not_live=not_live,
        )
        for name in ("ad_ids", "scores", "sids"):
            np.testing.assert_array_equal(getattr(out, name), getattr(want, name), err_msg=name)
        assert out.ads_removed == want.ads_removed
        # the contract: no ineligible ad out, no eligible one missed (best first, to the cut)
        ok = exact_eligible(w.schema, w.ads.ad_ids, w.rules, req)
        if not_live is not None:
            ok &= not_live == 0  # a paused or deleted ad is never out
        assert all(ok[row_of[int(i)]] for i in out.ad_ids)
        off = w.ads.leaf_ad_offsets
        rows = [(r, s) for leaf, s in zip(leaves, scores, strict=True)
                for r in range(off[leaf], off[leaf + 1])]  # fmt: skip
        best = sorted((s for r, s in rows if ok[r]), reverse=True)[:max_ads]
        np.testing.assert_array_equal(out.scores, np.array(best, dtype=np.float32))
        # every expanded ad counted once, as a naive walk over the plain lists counts it
        kinds = ["not_live" if not_live is not None and not_live[r] else
                 naive_kind(w, r, req, values, exclusions_told) for r, _ in rows]  # fmt: skip
        every = ("eligible", "blocked", "targeting", "excluded", "not_live")
        counts = {k: kinds.count(k) for k in every}
        assert out.ads_expanded == len(rows) == sum(counts.values())
        assert out.ads_not_live == counts["not_live"]
        assert (out.ads_eligible, out.ads_blocked, out.ads_targeting, out.ads_excluded) == (
            counts["eligible"], counts["blocked"], counts["targeting"], counts["excluded"]
        )  # fmt: skip
    return got


@settings(max_examples=150, deadline=None)
@given(
    k=st.sampled_from([0, 1, 3]),
    n=st.integers(1, 60),
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 5),
    threads=st.integers(1, 4),
    exclusions_told=st.booleans(),
    dead=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_exact_and_counted_on_random_ads(
    k: int, n: int, seed: int, batch: int, threads: int, exclusions_told: bool, dead: float
) -> None:
    world = make_world(np.random.default_rng(seed), k, n)
    check(world, seed + 1, batch, threads, exclusions_told, dead)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_batch_of_sixteen_on_a_larger_index(k: int) -> None:
    world = make_world(np.random.default_rng(k), k, 3000)
    got = check(world, 100 + k, 16, 3, exclusions_told=True, dead=0.2)
    assert {"block", "targeting", "exclusion", "not_live"} == set(got[0].ads_removed)
    assert sum(r.ads_eligible for r in got) > 0  # the property was not checked on nothing
    assert all(sum(r.ads_removed.values()) > 0 for r in got)
