"""An upsert served in place (docs/DATA.md "Live changes"): the builder's form of an upsert
whose SID is a leaf of the version and whose values are all in its vocabularies, encoded
once by the builder (`index_builder/as_built.py`) and read by every server
(`service/index/placed.py`) without a catalog reader.

A segment record `{"seq", "op": "place", "ad_id", ...}` carries the ad's new row as the
version reads it: its leaf (and SID, checked against the leaf), the enum/bucket bitmask
(exclusions folded in) and the bits the exclusions cleared, its Bloom row (the GTM bits
the matcher rows on its trie path must cover), each set attribute's include and exclude
lists as ids into the version's vocabularies, and its campaign and advertiser (0: none).
uint64 words are written as JSON integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PLACE = "place"


@dataclass(frozen=True)
class PlacedAd:
    """One ad's row served in place, in the ids of the version it was encoded for."""

    ad_id: int
    leaf: int  # the version's leaf (SID) it is served at
    sid: tuple[int, ...]
    bitmask: np.ndarray  # uint64 [bitmask_words], exclusions folded in
    exclude_bitmask: np.ndarray  # uint64 [bitmask_words]: the bits exclusions cleared
    bloom: np.ndarray  # uint64 [bloom_words]: the ad's GTM Bloom row
    include: dict[str, np.ndarray]  # per set attribute: int32 sorted vocabulary ids
    exclude: dict[str, np.ndarray]
    campaign: int = 0
    advertiser: int = 0

    def to_row(self) -> dict[str, Any]:
        """The record's fields after seq, op and ad_id."""
        return {
            "leaf": self.leaf,
            "sid": list(self.sid),
            "bitmask": [int(w) for w in self.bitmask],
            "exclude_bitmask": [int(w) for w in self.exclude_bitmask],
            "bloom": [int(w) for w in self.bloom],
            "include": {k: v.tolist() for k, v in self.include.items()},
            "exclude": {k: v.tolist() for k, v in self.exclude.items()},
            "campaign": self.campaign,
            "advertiser": self.advertiser,
        }

    @classmethod
    def from_row(
        cls,
        ad_id: int,
        row: dict[str, Any],
        *,
        leaf_sids: np.ndarray,
        bitmask_words: int,
        bloom_words: int,
        vocab_sizes: dict[str, int],
    ) -> PlacedAd:
        """A `place` record's fields read for the version they name (its leaves' SIDs,
        matcher widths and vocabulary sizes); ValueError naming the field on damage."""
        leaf = row.get("leaf")
        if type(leaf) is not int or not 0 <= leaf < len(leaf_sids):
            raise ValueError(f"place of ad {ad_id}: field 'leaf': {leaf!r} is no leaf")
        sid = row.get("sid")
        if not isinstance(sid, list) or sid != leaf_sids[leaf].tolist():
            raise ValueError(f"place of ad {ad_id}: field 'sid': {sid!r} is not leaf {leaf}'s")
        words = {k: _words(ad_id, row, k, n) for k, n in
                 (("bitmask", bitmask_words), ("exclude_bitmask", bitmask_words),
                  ("bloom", bloom_words))}  # fmt: skip
        lists = {kind: _lists(ad_id, row, kind, vocab_sizes) for kind in ("include", "exclude")}
        owners = [row.get(k, 0) for k in ("campaign", "advertiser")]
        if any(type(o) is not int for o in owners):
            raise ValueError(f"place of ad {ad_id}: campaign and advertiser are integers")
        return cls(ad_id, leaf, tuple(sid), words["bitmask"], words["exclude_bitmask"],
                   words["bloom"], lists["include"], lists["exclude"], *owners)  # fmt: skip


def _words(ad_id: int, row: dict[str, Any], key: str, n: int) -> np.ndarray:
    value = row.get(key)
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"place of ad {ad_id}: field {key!r}: expected {n} uint64 words")
    try:
        return np.array(value, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        raise ValueError(f"place of ad {ad_id}: field {key!r}: not uint64 words") from None


def _lists(
    ad_id: int, row: dict[str, Any], kind: str, sizes: dict[str, int]
) -> dict[str, np.ndarray]:
    value = row.get(kind, {})
    if not isinstance(value, dict) or set(value) - set(sizes):
        raise ValueError(f"place of ad {ad_id}: field {kind!r}: names no set attribute")
    out = {}
    for name, ids in value.items():
        arr = np.array(ids, dtype=np.int64) if isinstance(ids, list) else None
        if arr is None or arr.ndim != 1 or ((arr < 0) | (arr >= sizes[name])).any():
            raise ValueError(f"place of ad {ad_id}: field {kind!r}[{name!r}]: not ids of "
                             f"its vocabulary")  # fmt: skip
        out[name] = np.unique(arr).astype(np.int32)
    return out
