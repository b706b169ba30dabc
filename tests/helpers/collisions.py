"""The SID tokenizer's `CollisionReport`, counted the plain way (Counters over SID rows):
the oracle of `index_builder/last_token.py`'s report in both last-token modes."""

from __future__ import annotations

from collections import Counter

import numpy as np

from index_builder.last_token import CollisionReport


def reference_report(sids: np.ndarray, k: int, *, code: bool = False) -> CollisionReport:
    """The report of full SIDs `sids` [N, levels + 1] with codebook size `k`; `code` adds
    what the "code" mode reports (distinct SIDs, the largest SID group)."""
    prefixes = Counter(map(tuple, sids[:, :-1].tolist()))
    full = Counter(map(tuple, sids.tolist()))
    extra = {"sids": len(full), "max_sid_group": max(full.values())} if code else {}
    return CollisionReport(
        prefixes=len(prefixes),
        overflow_prefixes=sum(c > k for c in prefixes.values()),
        ads_sharing_sid=sum(c for c in full.values() if c > 1),
        max_group=max(prefixes.values()),
        **extra,
    )
