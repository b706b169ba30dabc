"""The reference post stage, the oracle of the C++ one (`service/post`): SID -> ads
expansion and the exact per-ad targeting filter, in numpy.

The decode engine hands over the leaves (full SIDs) it generated with their beam scores;
this expands each to its ads through the SID -> ad index, keeps only ads that are exactly
eligible for the request — never by Bloom bits — ranks by beam score and cuts to
`max_ads`, counting the expanded ads each kind of rule removed. Two forms: by the
targeting of the default schema (`expand_and_filter`: the request's `Targeting`, its
include rules only: the bitmask for low-cardinality rules, actual location ids for
locations) and by a declared schema's rules (`expand_and_filter_rules`: each set
attribute's include and exclude lists, the request's blocks); both through
`targeting_codec.exact_eligible`. The C++ post stage must
return identical results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from contracts.index_arrays import AdArrays
from contracts.targeting import Targeting
from contracts.targeting_codec import (
    AdRules,
    Ragged,
    RequestRules,
    any_in,
    codec,
    contains,
    exact_eligible,
)
from contracts.targeting_schema import DEFAULT, TargetingSchema
from service.post import PostResult, Vocabulary
from service.post.expand import expand_leaves, lists_of


def expand_and_filter(
    ads: AdArrays,
    vocabulary: Vocabulary,
    leaves: np.ndarray,  # int64 [S]: leaf positions (leaf node id - level_offsets[SID_LENGTH])
    scores: np.ndarray,  # float [S]: beam log-probability of each leaf
    targeting: Targeting,
    max_ads: int,
    *,
    exact: bool = True,
) -> PostResult:
    """Expand generated SIDs to ads, keep the exactly eligible ones, rank and cut (the
    default schema: every ad it removes fails an include rule)."""
    leaves = np.asarray(leaves, dtype=np.int64)
    rows, owner = expand_leaves(ads, leaves)
    keep = np.ones(len(rows), dtype=bool)
    if exact and len(rows):
        locations = lists_of(ads.sets["locations"].include, rows)
        rules = AdRules(ads.ad_bitmask[rows], {"locations": locations}, {})
        request = RequestRules(
            codec(DEFAULT).request_bitmask(targeting.values()),
            {"locations": vocabulary.ids(targeting.locations)},
        )
        keep = exact_eligible(DEFAULT, ads.ad_ids[rows], rules, request)  # blocks: not here
    removed = len(rows) - int(keep.sum())
    return _rank_and_cut(
        ads, leaves, scores, rows[keep], owner[keep], max_ads, len(rows), targeting=removed
    )


def removal_kinds(
    schema: TargetingSchema,
    ad_ids: np.ndarray,  # int64 [N]
    rules: AdRules,
    req: RequestRules,
    ad_exclude_bitmask: np.ndarray | None = None,  # uint64 [N, words]
) -> dict[str, np.ndarray]:
    """Each ad's fate, bool [N] per kind, every ad in exactly one: "eligible"
    (`targeting_codec.exact_eligible`), else in the post stage's counting order "blocked"
    (a request block), "targeting" (an include rule: the bitmask with the ad's excluded
    enum/bucket bits restored, or a set's include list), "excluded" (the rest)."""
    eligible = exact_eligible(schema, ad_ids, rules, req)
    blocked = np.isin(ad_ids, req.exclude_ads)
    for owner, ids in ((rules.campaign, req.exclude_campaigns),
                       (rules.advertiser, req.exclude_advertisers)):  # fmt: skip
        if owner is not None:
            blocked |= np.isin(owner, ids)
    restored = rules.bitmask if ad_exclude_bitmask is None else rules.bitmask | ad_exclude_bitmask
    includes = contains(restored, req.bitmask)
    for a in schema.families:
        inc = rules.include.get(a.name)
        if inc is not None:
            ids = req.ids.get(a.name, np.zeros(0, dtype=np.int32))
            includes &= (np.diff(inc.offsets) == 0) | any_in(inc.offsets, inc.values, ids)
    # the contract's eligible ads pass every include rule and no block
    assert not (eligible & (blocked | ~includes)).any()
    return {
        "eligible": eligible,
        "blocked": blocked,
        "targeting": ~blocked & ~includes,
        "excluded": ~blocked & includes & ~eligible,
    }


def expand_and_filter_rules(
    ads: AdArrays,  # the SID -> ad index (leaf_sids, leaf_ad_offsets, ad_ids)
    schema: TargetingSchema,
    rules: AdRules,  # of the N ads of `ads`, in its row order
    leaves: np.ndarray,  # int64 [S]
    scores: np.ndarray,  # float [S]
    req: RequestRules,
    max_ads: int,
    *,
    ad_exclude_bitmask: np.ndarray | None = None,  # uint64 [N, words]
    not_live: np.ndarray | None = None,  # uint8 [N]: non-zero = not served
) -> PostResult:
    """Expand generated SIDs to ads, keep the live, exactly eligible ones by `schema`'s
    rules, rank and cut, counting the removed ads by kind (`removal_kinds`; an ad not live
    is counted as that alone)."""
    leaves = np.asarray(leaves, dtype=np.int64)
    rows, owner = expand_leaves(ads, leaves)
    fate = {k: v[rows] for k, v in removal_kinds(schema, ads.ad_ids, rules, req,
                                                 ad_exclude_bitmask).items()}  # fmt: skip
    live = np.ones(len(rows), bool) if not_live is None else not_live[rows] == 0
    fate = {k: v & live for k, v in fate.items()}
    keep = fate["eligible"]
    return _rank_and_cut(
        ads,
        leaves,
        scores,
        rows[keep],
        owner[keep],
        max_ads,
        len(rows),
        blocked=int(fate["blocked"].sum()),
        targeting=int(fate["targeting"].sum()),
        excluded=int(fate["excluded"].sum()),
        not_live=int((~live).sum()),
    )


def _rank_and_cut(
    ads: AdArrays,
    leaves: np.ndarray,  # int64 [S]
    scores: np.ndarray,  # float [S]
    rows: np.ndarray,  # int64 [E]: the eligible expanded ads' rows
    owner: np.ndarray,  # int64 [E]: the position in `leaves` each came from
    max_ads: int,
    expanded: int,
    *,
    blocked: int = 0,
    targeting: int = 0,
    excluded: int = 0,
    not_live: int = 0,
) -> PostResult:
    ad_scores = np.asarray(scores, dtype=np.float32)[owner]
    order = np.argsort(-ad_scores, kind="stable")[:max_ads]
    return PostResult(
        ad_ids=ads.ad_ids[rows[order]],
        scores=ad_scores[order],
        sids=ads.leaf_sids[leaves[owner[order]]],
        ads_expanded=expanded,
        ads_eligible=len(rows),
        ads_blocked=blocked,
        ads_targeting=targeting,
        ads_excluded=excluded,
        ads_not_live=not_live,
    )


def ad_exclude_bitmask(
    schema: TargetingSchema,
    include: Mapping[str, Sequence[Sequence[int]]],  # attribute -> per ad: value indices
    exclude: Mapping[str, Sequence[Sequence[int]]],
) -> np.ndarray:
    """uint64 [N, words]: the bits each ad's enum/bucket exclusions cleared from its
    bitmask (`Codec.ad_bitmasks` with and without them), what `PostStage` takes as
    `ad_exclude_bitmask`. Restoring them gives the include part alone, so a failing ad is
    told apart exactly: an excluded value the include list lacks anyway counts as an
    include failure."""
    c = codec(schema)
    n = len(next(iter(include.values()))) if include else 0
    masked = [a.name for a in c.masked]
    inc = {a: Ragged.from_lists(include[a]) for a in masked if a in include}
    exc = {a: Ragged.from_lists(exclude[a]) for a in masked if a in exclude}
    return c.ad_bitmasks(inc, {}, n) & ~c.ad_bitmasks(inc, exc, n)
