"""CSR walks over an index's ad arrays: the ads behind generated SIDs and their location
rules, in numpy. The offline study (`training/study.py`) counts pass rates with them, and
the reference post stage (tests/helpers/reference_post.py) is built on them; the served
post stage does the same walks in C++ (`_post.cpp`).
"""

from __future__ import annotations

import numpy as np

from contracts.index_format import AdArrays


def expand_leaves(ads: AdArrays, leaves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ad rows behind the given leaves, leaf by leaf: (rows int64 [K], owner int64 [K])
    where owner[i] is the position in `leaves` that row i came from."""
    lo, hi = ads.leaf_ad_offsets[leaves], ads.leaf_ad_offsets[leaves + 1]
    counts = hi - lo
    owner = np.repeat(np.arange(len(leaves)), counts)
    rows = lo[owner] + np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    return rows, owner


def location_rows(ads: AdArrays, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The location rules of ads `rows` (in that order) as their own (offsets, ids) CSR
    (an index of the default schema)."""
    locations = ads.sets["locations"]
    lo, hi = locations.include_offsets[rows], locations.include_offsets[rows + 1]
    counts = hi - lo
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    idx = np.repeat(lo - offsets[:-1], counts) + np.arange(offsets[-1])
    return offsets, locations.include_ids[idx]
