"""The last SID token: RQ codes → full SIDs and their `CollisionReport` (docs/TOKENIZER.md,
"Last token: rank or code", says how each mode picks it and what it counts).

`SIDTokenizer.assign` (the RQ codes, the checked `reserved` SIDs) → **`complete_sids`**
("rank" mode: the rank inside the prefix, TIGER's) or **`code_sids`** ("code" mode: the
last of `levels + 1` RQ codes) → full SIDs for build.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from index_builder.parallel import digit_keys, float_sort_bits, stable_argsort


@dataclass(frozen=True)
class CollisionReport:
    """Collisions of the full catalog: the assigned ads plus the `reserved` rows."""

    prefixes: int  # distinct `levels`-token prefixes
    overflow_prefixes: int  # prefixes holding > codebook_size ads ("rank": their token wraps)
    ads_sharing_sid: int  # ads whose full SID is shared with another ad
    max_group: int  # most ads in one prefix
    # "code" mode only (sharing is by design there); None keeps "rank" mode's summary
    sids: int | None = None  # distinct full SIDs
    max_sid_group: int | None = None  # most ads on one full SID

    def summary(self) -> str:
        text = (
            f"{self.prefixes} prefixes, largest holds {self.max_group} ads; "
            f"{self.overflow_prefixes} prefixes overflow, {self.ads_sharing_sid} ads share a SID"
        )
        if self.sids is not None:
            text += f"; {self.sids} distinct SIDs, largest holds {self.max_sid_group} ads"
        return text


def complete_sids(
    prefix: np.ndarray,  # int32 [N, levels]: the RQ codes of the new ads
    residual_norm: np.ndarray,  # float32 [N]: squared norms of their final residuals
    taken: np.ndarray,  # int64 [M, levels + 1]: reserved SIDs, tokens checked in [0, k)
    k: int,  # codebook_size
) -> tuple[np.ndarray, CollisionReport]:
    """int32 [N, levels + 1] full SIDs, in input order, and the catalog's collisions."""
    levels = prefix.shape[1]
    key = digit_keys(prefix, k)  # [N] int64
    taken_key = digit_keys(taken[:, :levels], k)  # [M] int64
    taken_token = taken[:, levels]
    # Group by prefix; inside a group by residual norm, then input order.
    order = _rank_order(key, residual_norm, (k**levels - 1).bit_length())
    sorted_key = key[order]
    first = np.r_[True, sorted_key[1:] != sorted_key[:-1]]
    rank = np.arange(len(key)) - np.maximum.accumulate(np.where(first, np.arange(len(key)), 0))
    token = rank % k  # a prefix with more ads than codes wraps: its ads share SIDs
    if len(taken):
        token = _skip_taken(sorted_key, rank, taken_key, taken_token, k, token)
    sids = np.empty((len(key), levels + 1), np.int32)
    sids[:, :levels] = prefix
    sids[order, levels] = token
    if len(taken):
        report = _collisions(
            np.concatenate([key, taken_key]), np.concatenate([sids[:, levels], taken_token]), k
        )
    else:
        report = _collisions_unreserved(first[: len(key)], k)  # first: [1] when N = 0
    return sids, report


def code_sids(
    codes: np.ndarray,  # int32 [N, levels + 1]: the RQ codes of the new ads
    taken: np.ndarray,  # int64 [M, levels + 1]: reserved SIDs, tokens checked in [0, k)
    k: int,  # codebook_size
) -> tuple[np.ndarray, CollisionReport]:
    """SIDs of "code" mode: the codes as they are (int32 [N, levels + 1], input order);
    `taken` changes none of them and only enters the catalog's `CollisionReport`."""
    levels = codes.shape[1] - 1
    sid_key = np.concatenate([digit_keys(codes, k), digit_keys(taken, k)])
    last = np.concatenate([codes[:, levels], taken[:, levels]])
    report = _collisions(sid_key // k, last, k, count_sids=True)
    return np.ascontiguousarray(codes, dtype=np.int32), report


def _skip_taken(
    sorted_key: np.ndarray,  # [N] int64 prefix keys of the new ads, sorted
    rank: np.ndarray,  # [N] rank of each ad inside its prefix
    taken_key: np.ndarray,  # [M] prefix keys of the reserved SIDs
    taken_token: np.ndarray,  # [M] last tokens of the reserved SIDs
    k: int,
    token: np.ndarray,  # [N] last tokens without reservations (rank mod k), updated
) -> np.ndarray:
    """Last tokens of new ads in prefixes that hold reserved SIDs: free tokens first."""
    hit = np.isin(sorted_key, taken_key)
    if not hit.any():
        return token
    hit_key, row = np.unique(sorted_key[hit], return_inverse=True)  # row: nondecreasing
    sel = np.isin(taken_key, hit_key)
    taken_row = np.searchsorted(hit_key, taken_key[sel])
    by_row = np.argsort(taken_row, kind="stable")
    taken_row, tok = taken_row[by_row], taken_token[sel][by_row]
    slot = rank[hit] % k
    out = np.empty(len(row), np.int64)
    block = 4096  # prefixes per [block, k] table
    for g0 in range(0, len(hit_key), block):
        g1 = g0 + block
        t0, t1 = np.searchsorted(taken_row, [g0, g1])
        a0, a1 = np.searchsorted(row, [g0, g1])
        used = np.zeros((min(block, len(hit_key) - g0), k), bool)
        used[taken_row[t0:t1] - g0, tok[t0:t1]] = True
        # Each prefix's token order: free tokens ascending, then reserved ones; a new ad
        # shares a reserved SID only once its prefix is full.
        sequence = np.argsort(used, axis=1, kind="stable")
        out[a0:a1] = sequence[row[a0:a1] - g0, slot[a0:a1]]
    token = token.copy()
    token[hit] = out
    return token


def _rank_order(key: np.ndarray, residual_norm: np.ndarray, key_bits: int) -> np.ndarray:
    """np.lexsort((residual_norm, key)): by prefix key, then residual norm, then input order,
    as two stable packed-key sorts (norm, then key; several times faster than lexsort).
    NaN norms (never from finite input) fall back to lexsort."""
    if np.isnan(residual_norm).any():
        return np.lexsort((residual_norm, key))
    by_norm = stable_argsort(float_sort_bits(residual_norm), 32)
    return by_norm[stable_argsort(key[by_norm], key_bits)]


def _collisions_unreserved(first: np.ndarray, k: int) -> CollisionReport:
    """`_collisions` without reserved SIDs, from the group starts of the sorted prefix keys
    (bool [N]): a group of g ads takes tokens rank mod k, so with q, r = divmod(g, k) every
    ad shares its SID once q >= 2, and 2r ads do when q == 1 (tokens < r appear twice)."""
    starts = np.flatnonzero(first)
    size = np.diff(np.append(starts, len(first)))  # ads per prefix
    q, r = np.divmod(size, k)
    sharing = np.where(q >= 2, size, np.where(q == 1, 2 * r, 0))
    return CollisionReport(
        prefixes=len(size),
        overflow_prefixes=int((size > k).sum()),
        ads_sharing_sid=int(sharing.sum()),
        max_group=int(size.max(initial=0)),
    )


def _collisions(
    prefix_key: np.ndarray,  # int64 [N]: every ad's prefix as a base-k number
    last_token: np.ndarray,  # [N]: every ad's last token
    k: int,
    count_sids: bool = False,  # also fill `sids` and `max_sid_group` ("code" mode)
) -> CollisionReport:
    per_prefix = np.unique(prefix_key, return_counts=True)[1]
    per_sid = np.unique(prefix_key * k + last_token, return_counts=True)[1]
    return CollisionReport(
        prefixes=len(per_prefix),
        overflow_prefixes=int((per_prefix > k).sum()),
        ads_sharing_sid=int(per_sid[per_sid > 1].sum()),
        max_group=int(per_prefix.max(initial=0)),
        sids=len(per_sid) if count_sids else None,
        max_sid_group=int(per_sid.max(initial=0)) if count_sids else None,
    )
