"""Feature preparation: pipeline stage 1 (docs/MODEL.md "Architecture"), before the embedder.

    [UserFeatures] x B ──prepare_features──► FeatureBatch ──► FeatureEmbedder (stage 2)

History events whose ad is not in the served index (`SidLookup`) are dropped here. Training
calls the same function with large batches, so all but the per-request unpacking is
vectorised over the batch.

Definitions (shared by training and serving; changing one changes the model's inputs):

- user hash: `splitmix64(user_id mod 2**64) mod user_hash_buckets` (`user_hash`), stable
  across processes and machines, unlike Python's salted `hash`.
- country, age bucket, gender: as `FeatureBatch` says; age 0 or below 13 is unknown.
- time gap of an event: `gap_s = (ref_ms - timestamp_ms) / 1000`, clipped at 0, where
  `ref_ms` is the request's `now_ms` or, without one, its newest history timestamp;
  bucket `min(G-1, floor((G-1) * log2(1 + gap_s) / log2(1 + GAP_HORIZON_S)))` with
  `G = time_gap_buckets`: log-scale from 1 s to 90 days, older events share the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from contracts.index_arrays import AdArrays
from contracts.targeting import (
    AGE_BUCKETS,
    GENDERS,
    Targeting,
    age_bucket_index,
    country_index,
    gender_value_index,
)
from contracts.targeting_schema import COUNTRIES
from service.model.config import ModelConfig

# Vocabulary sizes of the non-sequence features; the last index of each is "unknown".
NUM_COUNTRIES = len(COUNTRIES) + 1
NUM_AGE_BUCKETS = len(AGE_BUCKETS) + 1
NUM_GENDERS = len(GENDERS) + 1
# Event types: 0 padding, then the RPC's EventType values.
PAD, VIEW, CLICK, CONVERSION = 0, 1, 2, 3
NUM_EVENT_TYPES = 4
GAP_HORIZON_S = 90 * 86_400

_U64 = np.uint64
_MASK64 = (1 << 64) - 1


def user_hash(user_ids: np.ndarray, buckets: int) -> np.ndarray:
    """splitmix64(user_id mod 2**64) mod buckets, vectorised: int64 [N] -> int64 [N]."""
    z = np.asarray(user_ids, dtype=np.int64).astype(_U64)  # two's complement view
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64 by design
        z = z + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        z = z ^ (z >> _U64(31))
    return (z % _U64(buckets)).astype(np.int64)


def gap_bucket(gap_ms: np.ndarray, buckets: int) -> np.ndarray:
    """Log-scale time-gap bucket (module docstring): int64 [N] ms -> int64 [N] in [0, G)."""
    gap_s = np.maximum(np.asarray(gap_ms, dtype=np.float64), 0.0) / 1000.0
    scale = (buckets - 1) / np.log2(1.0 + GAP_HORIZON_S)
    return np.minimum(np.floor(np.log2(1.0 + gap_s) * scale), buckets - 1).astype(np.int64)


@dataclass(frozen=True)
class SidLookup:
    """ad_id -> SID tokens of one index, by binary search over the sorted ad ids."""

    ad_ids: np.ndarray  # int64 [N], sorted ascending
    sids: np.ndarray  # int64 [N, sid_length], row i is the SID of ad_ids[i]

    @classmethod
    def from_ads(cls, ads: AdArrays, order: np.ndarray | None = None) -> SidLookup:
        """`order`: the rows by ad id (`np.argsort(ads.ad_ids)`), when already made."""
        per_leaf = np.diff(ads.leaf_ad_offsets)  # ads under each leaf SID
        sids = np.repeat(ads.leaf_sids.astype(np.int64), per_leaf, axis=0)  # [N, L_SID]
        if order is None:  # unique ids (validated): no need for a stable sort
            order = np.argsort(ads.ad_ids)
        return cls(np.ascontiguousarray(ads.ad_ids[order], dtype=np.int64), sids[order])

    def __len__(self) -> int:
        return len(self.ad_ids)

    def lookup(self, ad_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """SIDs int64 [n, sid_length] (zeros where not found) and found bool [n]."""
        q = np.asarray(ad_ids, dtype=np.int64)
        if len(self.ad_ids) == 0:
            return np.zeros((len(q), self.sids.shape[1]), np.int64), np.zeros(len(q), bool)
        pos = np.minimum(np.searchsorted(self.ad_ids, q), len(self.ad_ids) - 1)
        found = self.ad_ids[pos] == q
        return np.where(found[:, None], self.sids[pos], 0), found


@dataclass(frozen=True)
class UserFeatures:
    """One request's raw model inputs (RPC `User` + `Targeting`)."""

    user_id: int
    targeting: Targeting
    history_ad_ids: np.ndarray  # int64 [n]
    history_types: np.ndarray  # int [n], values VIEW / CLICK / CONVERSION
    history_ts_ms: np.ndarray  # int64 [n], any order (sorted here, oldest first)
    now_ms: int | None = None  # request time; None = the newest history timestamp


@dataclass(frozen=True)
class FeatureBatch:
    """Stage 1 -> stage 2 hand-off: B requests as int tensors, L = longest kept history."""

    user_hash: torch.Tensor  # int64 [B]: user_hash(user_id) in [0, user_hash_buckets)
    country: torch.Tensor  # int64 [B]: index into COUNTRIES, len(COUNTRIES) = unknown
    age_bucket: torch.Tensor  # int64 [B]: 0..6, 7 = unknown
    gender: torch.Tensor  # int64 [B]: 0 female, 1 male, 2 unknown
    hist_sid: torch.Tensor  # int64 [B, L, sid_length]: SID tokens of each event, 0 at padding
    hist_type: torch.Tensor  # int64 [B, L]: 0 padding, 1 view, 2 click, 3 conversion
    hist_gap: torch.Tensor  # int64 [B, L]: time-gap bucket, 0 at padding
    hist_mask: torch.Tensor  # bool [B, L]: True = real event; rows are left-aligned

    @property
    def batch_size(self) -> int:
        return int(self.user_hash.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> FeatureBatch:
        return FeatureBatch(
            **{
                f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                for f in fields(self)
            }
        )

    def pin_memory(self) -> FeatureBatch:
        """Page-locked copy, so that `.to(cuda, non_blocking=True)` overlaps compute."""
        return FeatureBatch(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})


def _categoricals(users: Sequence[UserFeatures]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    unknown_c, unknown_a, unknown_g = len(COUNTRIES), len(AGE_BUCKETS), len(GENDERS)
    country = np.empty(len(users), np.int64)
    age = np.empty(len(users), np.int64)
    gender = np.empty(len(users), np.int64)
    for b, u in enumerate(users):
        t = u.targeting
        c = country_index(t.country) if t.country else None
        a = age_bucket_index(t.age)
        g = gender_value_index(t.gender) if t.gender else None
        country[b] = unknown_c if c is None else c
        age[b] = unknown_a if a is None else a
        gender[b] = unknown_g if g is None else g
    return country, age, gender


def prepare_features(
    users: Sequence[UserFeatures],
    lookup: SidLookup,
    config: ModelConfig,
    *,
    width: int | None = None,
) -> FeatureBatch:
    """B requests as a FeatureBatch (CPU tensors): per request the newest
    `config.max_history` events whose ad is in `lookup`, oldest first, left-aligned, the
    tail all zeros. `width` fixes L (>= every kept history; None: the longest kept one).
    Raises ValueError for an event type outside {1, 2, 3}."""
    b_size, max_len, sid_len = len(users), config.max_history, config.sid_length
    lengths = np.fromiter((len(u.history_ad_ids) for u in users), np.int64, b_size)
    user_of = np.repeat(np.arange(b_size), lengths)  # [E] request of each event
    ad = _concat([u.history_ad_ids for u in users])
    typ = _concat([u.history_types for u in users])
    ts = _concat([u.history_ts_ms for u in users])
    if not (len(ad) == len(typ) == len(ts) == len(user_of)):
        raise ValueError("history ad ids, types and timestamps must have equal lengths")
    bad = (typ < VIEW) | (typ > CONVERSION)
    if bad.any():
        raise ValueError(f"history type {int(typ[bad][0])} is not one of 1 view, 2 click, 3 conv")

    # reference time per request: now_ms, else the newest event
    ref = np.full(b_size, np.iinfo(np.int64).min, np.int64)
    np.maximum.at(ref, user_of, ts)
    for b, u in enumerate(users):
        if u.now_ms is not None:
            ref[b] = u.now_ms

    order = np.lexsort((ts, user_of))  # by request, then time; stable for equal timestamps
    user_of, ad, typ, ts = user_of[order], ad[order], typ[order], ts[order]
    sids, known = lookup.lookup(ad)  # [E, L_SID], [E]

    # rank of each known event among its request's known events, oldest = 0
    n_known = np.bincount(user_of[known], minlength=b_size)  # [B]
    first_known = np.cumsum(n_known) - n_known  # [B] global known-rank of each row's first
    rank = np.cumsum(known) - 1 - first_known[user_of]  # [E]
    skip = np.maximum(n_known - max_len, 0)  # [B] oldest known events that do not fit
    keep = known & (rank >= skip[user_of])
    row, col = user_of[keep], (rank - skip[user_of])[keep]

    longest = int(min(max_len, n_known.max(initial=0)))
    if width is None:
        width = longest
    elif width < longest:
        raise ValueError(f"width {width} is shorter than the longest kept history ({longest})")
    hist_sid = np.zeros((b_size, width, sid_len), np.int64)
    hist_type = np.zeros((b_size, width), np.int64)
    hist_gap = np.zeros((b_size, width), np.int64)
    hist_mask = np.zeros((b_size, width), bool)
    hist_sid[row, col] = sids[keep]
    hist_type[row, col] = typ[keep]
    hist_gap[row, col] = gap_bucket(ref[row] - ts[keep], config.time_gap_buckets)
    hist_mask[row, col] = True

    country, age, gender = _categoricals(users)
    ids = np.fromiter((u.user_id for u in users), np.int64, b_size)
    t = torch.from_numpy
    return FeatureBatch(
        user_hash=t(user_hash(ids, config.user_hash_buckets)),
        country=t(country),
        age_bucket=t(age),
        gender=t(gender),
        hist_sid=t(hist_sid),
        hist_type=t(hist_type),
        hist_gap=t(hist_gap),
        hist_mask=t(hist_mask),
    )


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros(0, np.int64)
    return np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])
