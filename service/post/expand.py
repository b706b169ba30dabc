"""CSR walks over an index's ad arrays: the ads behind generated SIDs and their exact
targeting rules, in numpy. The offline study (`training/study.py`) counts pass rates with them, and
the reference post stage (tests/helpers/reference_post.py) is built on them; the served
post stage does the same walks in C++ (`_post.cpp`).
"""

from __future__ import annotations

import numpy as np

from contracts.index_arrays import AdArrays
from contracts.targeting_codec import AdRules, Ragged


def expand_leaves(ads: AdArrays, leaves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ad rows behind the given leaves, leaf by leaf: (rows int64 [K], owner int64 [K])
    where owner[i] is the position in `leaves` that row i came from."""
    lo, hi = ads.leaf_ad_offsets[leaves], ads.leaf_ad_offsets[leaves + 1]
    counts = hi - lo
    owner = np.repeat(np.arange(len(leaves)), counts)
    rows = lo[owner] + np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    return rows, owner


def lists_of(lists: Ragged, rows: np.ndarray) -> Ragged:
    """The lists of ads `rows` (in that order) as their own CSR."""
    lo, hi = lists.offsets[rows], lists.offsets[rows + 1]
    counts = hi - lo
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    idx = np.repeat(lo - offsets[:-1], counts) + np.arange(offsets[-1])
    return Ragged(offsets, lists.values[idx])


def rules_of(rules: AdRules, rows: np.ndarray) -> AdRules:
    """The exact targeting of ads `rows` (in that order), as `exact_eligible` reads it."""

    def owners(ids: np.ndarray | None) -> np.ndarray | None:
        return None if ids is None else ids[rows]

    return AdRules(
        bitmask=rules.bitmask[rows],
        include={name: lists_of(x, rows) for name, x in rules.include.items()},
        exclude={name: lists_of(x, rows) for name, x in rules.exclude.items()},
        campaign=owners(rules.campaign),
        advertiser=owners(rules.advertiser),
    )
