"""The SID tokenizer's `CollisionReport`, counted the plain way (Counters over SID rows):
the oracle of `index_builder/last_token.py`'s report in both last-token modes; and the
embedding a SID prefix names, for the tests of the tokenizer's codes."""

from __future__ import annotations

from collections import Counter

import numpy as np

from index_builder.last_token import CollisionReport
from index_builder.tokenizer import SIDTokenizer


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


def reconstruct(tok: SIDTokenizer, prefix: np.ndarray) -> np.ndarray:
    """float32 [N, dim]: the sum of the codes a SID prefix [N, l <= rq_levels] names (in
    "code" mode a full SID is such a prefix)."""
    return tok.codebooks[np.arange(prefix.shape[1]), prefix].sum(1, dtype=np.float32)
