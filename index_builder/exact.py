"""Reference post stage: SID -> ads expansion and the exact per-ad targeting filter.

The decode engine hands over the leaves (full SIDs) it generated with their beam scores;
this expands each to its ads through the SID -> ad index, keeps only ads that are exactly
eligible for the request (`targeting.exact_eligible`: bitmask for low-cardinality rules,
actual location ids for locations — never Bloom bits), ranks by beam score and cuts to
`max_ads`. The C++ post stage (service issue) must return identical results; this is
its oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from index_builder.format import AdArrays
from index_builder.targeting import Targeting, exact_eligible, request_bitmask


class LocationVocabulary:
    """Location string -> id of an index's sorted vocabulary (built once per index load)."""

    def __init__(self, ads: AdArrays) -> None:
        self._ids = {s: i for i, s in enumerate(ads.location_strings())}

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self, locations: Sequence[str]) -> np.ndarray:
        """Sorted ids of the known strings; unknown strings match no rule and are dropped."""
        found = {self._ids[s] for s in locations if s in self._ids}
        return np.array(sorted(found), dtype=np.int32)


@dataclass(frozen=True)
class PostResult:
    ad_ids: np.ndarray  # int64 [K]: eligible ads, best first
    scores: np.ndarray  # float32 [K]: the beam score of each ad's SID
    sids: np.ndarray  # int16 [K, SID_LENGTH]
    ads_expanded: int  # ads behind the generated SIDs, before the filter
    ads_eligible: int  # of those, exactly eligible (before the max_ads cut)


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


def expand_leaves(ads: AdArrays, leaves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ad rows behind the given leaves, leaf by leaf: (rows int64 [K], owner int64 [K])
    where owner[i] is the position in `leaves` that row i came from."""
    lo, hi = ads.leaf_ad_offsets[leaves], ads.leaf_ad_offsets[leaves + 1]
    counts = hi - lo
    owner = np.repeat(np.arange(len(leaves)), counts)
    rows = lo[owner] + np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    return rows, owner


def location_rows(ads: AdArrays, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The location rules of ads `rows` (in that order) as their own (offsets, ids) CSR."""
    lo, hi = ads.ad_loc_offsets[rows], ads.ad_loc_offsets[rows + 1]
    counts = hi - lo
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    idx = np.repeat(lo - offsets[:-1], counts) + np.arange(offsets[-1])
    return offsets, ads.ad_loc_ids[idx]
