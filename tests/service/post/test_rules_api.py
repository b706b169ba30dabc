"""The post stage's schema API around the rules: the form before declared schemas is the
default schema's rules, blocks at their edges, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from contracts.targeting import Targeting
from contracts.targeting_codec import AdRules, Ragged, RequestRules
from contracts.targeting_schema import DEFAULT
from service.post import LocationVocabulary, PostRequest, PostStage
from service.post._post import AdIndex
from tests.helpers.catalogs import LOCATION_POOL
from tests.helpers.reference_post import expand_and_filter
from tests.service.post.test_post import build, random_ads
from tests.service.post.test_rules import make_world

INT64_MIN = np.iinfo(np.int64).min


def default_rules(ads) -> AdRules:
    """The targeting of an index built before declared schemas, as the default schema's."""
    return AdRules(ads.ad_bitmask, {"locations": ads.sets["locations"].include}, {})


def test_the_form_before_schemas_is_the_default_schema() -> None:
    ads = build(random_ads(2000, seed=11)).ads
    vocab = LocationVocabulary(ads)
    rng = np.random.default_rng(12)
    batch, want = [], []
    for b in range(8):
        leaves = rng.choice(len(ads.leaf_sids), size=200, replace=False)
        scores = np.round(rng.normal(size=200), 1)
        req = Targeting(
            country=str(rng.choice(["US", "CA", "GB"])),
            locations=tuple(rng.choice(LOCATION_POOL, size=b % 3, replace=False).tolist()),
        )
        batch.append(PostRequest.from_targeting(leaves, scores, req, vocab, 100))
        want.append(expand_and_filter(ads, vocab, leaves, scores, req, 100))
    before = PostStage(ads, threads=2)
    by_schema = PostStage(ads, threads=2, schema=DEFAULT, rules=default_rules(ads))
    assert before.attributes == by_schema.attributes == ("locations",)
    locations = ads.sets["locations"]
    raw = AdIndex(*(getattr(ads, f) for f in ("leaf_sids", "leaf_ad_offsets", "ad_ids",
                  "ad_bitmask")), locations.include_offsets, locations.include_ids, 2)  # fmt: skip
    legacy = raw.run(*zip(*((r.leaves, r.scores, r.req_bitmask, r.sets[0], r.max_ads)
                            for r in batch), strict=True))  # fmt: skip
    for g, s, w, row in zip(before.run(batch), by_schema.run(batch), want, legacy, strict=True):
        for out in (g, s):
            np.testing.assert_array_equal(out.ad_ids, w.ad_ids)
            np.testing.assert_array_equal(out.scores, w.scores)
            assert out.ads_removed == w.ads_removed
            assert out.ads_expanded == w.ads_expanded == out.ads_eligible + out.ads_targeting
        np.testing.assert_array_equal(row[0], w.ad_ids)
        assert row[3:] == (w.ads_expanded, w.ads_eligible, 0, w.ads_targeting, 0, 0)
    assert sum(w.ads_targeting for w in want) > 0


def test_blocks_of_thousands_of_ids_at_the_int64_edges() -> None:
    w = make_world(np.random.default_rng(5), 1, 400)
    ad_ids = w.ads.ad_ids.copy()
    ad_ids[:3] = [INT64_MIN, -1, 0]  # the hash set's empty slot value among them
    ads = type(w.ads)(**{**w.ads.__dict__, "ad_ids": ad_ids})
    rules = AdRules(np.full_like(w.rules.bitmask, ~np.uint64(0)), {}, {},
                    campaign=np.arange(400) % 7, advertiser=None)  # fmt: skip
    stage = PostStage(ads, schema=w.schema, rules=rules)
    leaves = np.arange(len(ads.leaf_sids))
    bitmask = np.zeros(w.schema.bitmask_words, dtype=np.uint64)
    noise = np.random.default_rng(6).integers(1, 2**62, size=3000)

    def run(**blocks: np.ndarray) -> set[int]:
        req = RequestRules(bitmask, {}, **blocks)
        (out,) = stage.run([PostRequest.from_rules(leaves, np.zeros(len(leaves)), req, w.schema,
                                                   10**6)])  # fmt: skip
        assert out.ads_expanded == 400 == out.ads_eligible + out.ads_blocked
        return set(out.ad_ids.tolist())

    assert len(run()) == 400
    blocked = np.concatenate([noise, ad_ids[:3], ad_ids[100:110]])
    assert run(exclude_ads=blocked) == set(ad_ids.tolist()) - set(blocked.tolist())
    # campaign 0 is "none", but the contract blocks what the request lists
    kept = run(exclude_campaigns=np.concatenate([noise, [0, 3]]))
    assert kept == {int(i) for i, c in zip(ad_ids, rules.campaign, strict=True) if c not in (0, 3)}
    # an index without advertisers has none to block
    assert len(run(exclude_advertisers=np.array([0, 1, 2]))) == 400


def test_bad_rules_and_requests_raise_clear_errors() -> None:
    w = make_world(np.random.default_rng(7), 3, 30)
    with pytest.raises(ValueError, match="come with the schema"):
        PostStage(w.ads, rules=w.rules)
    with pytest.raises(ValueError, match="no set attribute"):
        PostStage(w.ads, schema=w.schema, rules=AdRules(w.rules.bitmask, {"nope": None}, {}))
    with pytest.raises(TypeError, match="bitmask: expected uint64"):
        PostStage(w.ads, schema=w.schema, rules=AdRules(w.rules.bitmask.astype(np.int64), {}, {}))
    bad = Ragged(np.zeros(5, dtype=np.int64), np.ones(2, dtype=np.int32))
    with pytest.raises(ValueError, match="offsets"):
        PostStage(w.ads, schema=w.schema, rules=AdRules(w.rules.bitmask, {"s0": bad}, {}))
    with pytest.raises(ValueError, match="ad_exclude_bitmask"):
        PostStage(w.ads, schema=w.schema, rules=w.rules,
                  ad_exclude_bitmask=np.zeros((3, 2), dtype=np.uint64))  # fmt: skip
    stage = PostStage(w.ads, schema=w.schema, rules=w.rules)
    bitmask = np.zeros(w.schema.bitmask_words, dtype=np.uint64)
    two = (np.zeros(0, dtype=np.int32),) * 2
    with pytest.raises(ValueError, match="the stage has 3"):
        stage.run([PostRequest([0], [0.0], bitmask, [], 5, set_ids=two)])
    with pytest.raises(ValueError, match="words"):
        stage.run([PostRequest([0], [0.0], bitmask[:1], [], 5, set_ids=two + two[:1])])
    with pytest.raises(ValueError, match="not both"):
        PostRequest([0], [0.0], bitmask, [1], 5, set_ids=two)
    with pytest.raises(ValueError, match="sorted"):
        PostRequest([0], [0.0], bitmask, [], 5, set_ids=(np.array([2, 1]),))
    with pytest.raises(ValueError, match="no set attribute"):
        PostRequest.from_rules([0], [0.0], RequestRules(bitmask, {"x": [1]}), w.schema, 5)


def test_a_stage_says_which_blocks_its_index_can_apply() -> None:
    """`blockable` / `applies`: what the pipeline asks before it runs a request checked
    against another index (stages.py answers it no ads when this index cannot apply its
    blocks); an index with campaign ids applies a campaign block exactly."""
    import dataclasses

    ads = build(random_ads(2000, seed=3)).ads
    owned = dataclasses.replace(ads, ad_campaign_ids=np.ones(ads.num_ads, dtype=np.int64))
    vocab = LocationVocabulary(ads)
    rng = np.random.default_rng(4)
    leaves = rng.choice(len(ads.leaf_sids), size=300, replace=False)
    scores = np.round(rng.normal(size=300), 1)
    plain = PostRequest.from_targeting(leaves, scores, Targeting(), vocab, 100)
    blocking = {c: PostRequest.from_targeting(leaves, scores, Targeting(exclude_campaign_ids=(c,)),
                                              vocab, 100) for c in (1, 2)}  # fmt: skip
    without, with_ids = PostStage(ads, threads=1), PostStage(owned, threads=1)
    assert without.blockable == ("exclude_ad_ids",)
    assert with_ids.blockable == ("exclude_ad_ids", "exclude_campaign_ids")
    assert without.applies(plain) and not without.applies(blocking[2])
    assert with_ids.applies(blocking[2])
    answered = with_ids.run([plain])[0]
    assert len(answered.ad_ids) > 0
    # campaign 2 owns no ad: as without the block; campaign 1 owns every ad: none left
    np.testing.assert_array_equal(with_ids.run([blocking[2]])[0].ad_ids, answered.ad_ids)
    gone = with_ids.run([blocking[1]])[0]
    assert len(gone.ad_ids) == 0 and gone.ads_blocked == gone.ads_expanded > 0
