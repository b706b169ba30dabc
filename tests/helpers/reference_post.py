"""The reference post stage, the oracle of the C++ one (`service/post`): SID -> ads
expansion and the exact per-ad targeting filter, in numpy.

The decode engine hands over the leaves (full SIDs) it generated with their beam scores;
this expands each to its ads through the SID -> ad index, keeps only ads that are exactly
eligible for the request (`targeting.exact_eligible`: bitmask for low-cardinality rules,
actual location ids for locations — never Bloom bits), ranks by beam score and cuts to
`max_ads`. The C++ post stage must return identical results.
"""

from __future__ import annotations

import numpy as np

from contracts.index_format import AdArrays
from contracts.targeting import Targeting, exact_eligible, request_bitmask
from service.post import LocationVocabulary, PostResult
from service.post.expand import expand_leaves, location_rows


def expand_and_filter(
    ads: AdArrays,
    vocabulary: LocationVocabulary,
    leaves: np.ndarray,  # int64 [S]: leaf positions (leaf node id - level_offsets[SID_LENGTH])
    scores: np.ndarray,  # float [S]: beam log-probability of each leaf
    targeting: Targeting,
    max_ads: int,
    *,
    exact: bool = True,
) -> PostResult:
    """Expand generated SIDs to ads, keep the exactly eligible ones, rank and cut."""
    leaves = np.asarray(leaves, dtype=np.int64)
    rows, owner = expand_leaves(ads, leaves)
    expanded = len(rows)
    if exact and len(rows):
        keep = exact_eligible(
            ads.ad_bitmask[rows],
            *location_rows(ads, rows),
            request_bitmask(targeting),
            vocabulary.ids(targeting.locations),
        )
        rows, owner = rows[keep], owner[keep]
    ad_scores = np.asarray(scores, dtype=np.float32)[owner]
    order = np.argsort(-ad_scores, kind="stable")[:max_ads]
    return PostResult(
        ad_ids=ads.ad_ids[rows[order]],
        scores=ad_scores[order],
        sids=ads.leaf_sids[leaves[owner[order]]],
        ads_expanded=expanded,
        ads_eligible=len(rows),
    )
