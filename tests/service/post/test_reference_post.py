"""The reference post stage (`tests.helpers.reference_post.expand_and_filter`, the oracle of
the C++ post stage in tests/service/post/test_post.py): SID -> ads expansion and the
per-ad targeting filter, against brute-force eligibility."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.index_arrays import IndexArrays
from contracts.targeting import Targeting
from index_builder.build import build_arrays
from service.post import LocationVocabulary
from tests.helpers.catalogs import ads_strategy, catalog_from_ads, requests_strategy
from tests.helpers.oracle import Ad, eligible
from tests.helpers.reference_post import expand_and_filter


def build(ads: list[Ad]) -> IndexArrays:
    cat = catalog_from_ads(ads)
    return build_arrays(cat, cat.sid.astype(np.int64))


@settings(max_examples=80, deadline=None)
@given(ads=ads_strategy(max_ads=60), req=requests_strategy)
def test_exact_filter_equals_brute_force_eligibility(ads: list[Ad], req: Targeting) -> None:
    index = build(ads)
    leaves = np.arange(len(index.ads.leaf_sids))
    out = expand_and_filter(
        index.ads, LocationVocabulary(index.ads), leaves, np.zeros(len(leaves)), req, 10**6
    )
    assert sorted(out.ad_ids.tolist()) == sorted(a.ad_id for a in ads if eligible(a, req))
    assert out.ads_expanded == len(ads)
    by_id = {a.ad_id: a for a in ads}
    for ad_id, sid in zip(out.ad_ids.tolist(), out.sids.tolist(), strict=True):
        assert tuple(sid) == by_id[ad_id].sid


@settings(max_examples=30, deadline=None)
@given(ads=ads_strategy(max_ads=30), data=st.data())
def test_ranked_by_beam_score_and_cut_to_max_ads(ads: list[Ad], data: st.DataObject) -> None:
    index = build(ads)
    n = len(index.ads.leaf_sids)
    leaves = np.array(data.draw(st.permutations(range(n))))
    scores = -np.arange(n, dtype=np.float32)  # first leaf scores best
    max_ads = data.draw(st.integers(1, len(ads)))
    out = expand_and_filter(
        index.ads,
        LocationVocabulary(index.ads),
        leaves,
        scores,
        Targeting(),
        max_ads,
        exact=False,
    )
    assert len(out.ad_ids) == min(max_ads, len(ads))
    assert np.all(np.diff(out.scores) <= 0)
    # ads come in the order of their SID's score: the best SID's ads first
    rank = {tuple(index.ads.leaf_sids[leaf].tolist()): r for r, leaf in enumerate(leaves)}
    by_id = {a.ad_id: a for a in ads}
    ranks = [rank[by_id[i].sid] for i in out.ad_ids.tolist()]
    assert ranks == sorted(ranks)


def test_locations_are_compared_exactly_not_by_bloom_bits() -> None:
    """Two strings whose Bloom bits collide are still told apart by the exact stage."""
    from contracts.targeting_codec import Ragged, blooms_pass, codec, value_bits, value_blooms
    from contracts.targeting_schema import DEFAULT

    family = DEFAULT.attribute("locations")
    seen: dict[frozenset[int], str] = {}
    pair = None
    for i in range(200_000):  # 3 of 256 bits: a superset collision turns up quickly
        s = f"loc{i}"
        bits = frozenset(value_bits(s, family.bloom_bits, family.bloom_hashes))
        for other_bits, other in seen.items():
            if bits <= other_bits:
                pair = (other, s)
                break
        if pair:
            break
        seen[bits] = s
        if len(seen) > 3000:
            seen.pop(next(iter(seen)))
    assert pair is not None
    ad_loc, req_loc = pair
    c = codec(DEFAULT)  # GTM's Bloom test passes the ad's matcher for the request
    vocab = {"locations": value_blooms([ad_loc], family.bloom_bits, family.bloom_hashes)}
    ad_bloom = c.ad_blooms({"locations": Ragged.from_lists([[0]])}, vocab, 1)
    assert blooms_pass(DEFAULT, ad_bloom, c.request_blooms({"locations": (req_loc,)}))[0]
    index = build([Ad(1, (0, 0, 0, 0), locations=(ad_loc,))])
    out = expand_and_filter(
        index.ads,
        LocationVocabulary(index.ads),
        np.array([0]),
        np.array([0.0]),
        Targeting(locations=(req_loc,)),
        10,
    )
    assert out.ad_ids.tolist() == []
    assert out.ads_expanded == 1
