"""Campaigns and per-request block lists (docs/SYNTH.md "Richer targeting").

`campaign_ids` names each ad's campaign for the catalog's `campaign_id` column (the ads
stage: an advertiser's ads of one targeting form one campaign). `draw_blocks` runs after
the histories: some users' requests block ads they were shown (frequency caps), the
campaigns or the advertisers of them, drawn from their own logged history, each kind on
a stream of its own — never the held-out ad's own id, campaign or advertiser, so the next
interaction stays eligible for the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from contracts.targeting_codec import Ragged
from index_builder.synth.ads import AdState, EncodedAds
from index_builder.synth.campaigns import targeting_keys
from index_builder.synth.histories import Histories
from index_builder.synth.profiles import WorldProfile, stream
from index_builder.trie import splitmix64

KINDS = ("exclude_ad_ids", "exclude_campaign_ids", "exclude_advertiser_ids")
MAX_BLOCK_IDS = 4096  # per block list of a request (docs/FORMAT.md §1)
_SALT = np.uint64(0xC2B2AE3D27D4EB4F)


def campaign_ids(advertiser: np.ndarray, bitmask: np.ndarray, locations: Ragged) -> np.ndarray:
    """int64 [n] in [1, 2^53]: equal for ads of one advertiser with equal targeting (the
    world's bitmask rows, exclusions folded in, and location lists; its other set rules
    are the advertiser's)."""
    with np.errstate(over="ignore"):
        key = targeting_keys(bitmask, locations) ^ splitmix64(advertiser.astype(np.uint64) + _SALT)
        return (splitmix64(key) >> np.uint64(11)).astype(np.int64) + 1


@dataclass(frozen=True)
class Blocks:
    """The kept users' block lists, per `KINDS`: (offsets int64 [U' + 1], ids int64)."""

    lists: tuple[tuple[np.ndarray, np.ndarray], ...]

    def columns(self) -> dict[str, pa.Array]:
        """users.parquet columns, one list<int64> per kind."""
        return {kind: pa.ListArray.from_arrays(pa.array(off.astype(np.int32)),
                                               pa.array(ids, pa.int64()))
                for kind, (off, ids) in zip(KINDS, self.lists, strict=True)}  # fmt: skip

    def summary(self) -> dict[str, float]:
        """world.json: per kind, the share of requests blocking and their mean ids."""
        out = {}
        for kind, (off, _) in zip(KINDS, self.lists, strict=True):
            n = np.diff(off)
            out[f"{kind}_share"] = float((n > 0).mean()) if len(n) else 0.0
            out[f"{kind}_mean"] = float(n[n > 0].mean()) if (n > 0).any() else 0.0
        return out


def _pick(
    user: np.ndarray, values: np.ndarray, count: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Up to count[u] distinct `values` of each user u (an event's user and value), drawn
    uniformly: (offsets int64 [U + 1], ids sorted per user)."""
    order = np.lexsort((values, user))
    u, v = user[order], values[order]
    first = np.r_[True, (u[1:] != u[:-1]) | (v[1:] != v[:-1])]
    u, v = u[first], v[first]
    order = np.lexsort((rng.random(len(u)), u))  # a random order inside each user
    u, v = u[order], v[order]
    rank = np.arange(len(u)) - np.searchsorted(u, u, side="left")
    take = rank < count[u]
    u, v = u[take], v[take]
    order = np.lexsort((v, u))
    offsets = np.zeros(len(count) + 1, dtype=np.int64)
    np.cumsum(np.bincount(u, minlength=len(count)), out=offsets[1:])
    return offsets, v[order]


def draw_blocks(
    p: WorldProfile, hist: Histories, ads: AdState, enc: EncodedAds, seed: int
) -> Blocks | None:
    """Block lists of the kept users (None when no request carries one): per kind, a
    request carries one with its share (`block_ad_share`, ...), 1 + Poisson
    (`blocks_per_request` - 1) ids, as many as its history offers."""
    if not p.blocks:
        return None
    n = len(hist.user)
    user = np.repeat(np.arange(n), np.diff(hist.offsets))
    last = hist.offsets[1:] - 1
    logged = np.ones(len(hist.ad), dtype=bool)
    logged[last] = False
    shown, where = np.unique(hist.ad, return_inverse=True)
    bitmask, loc_offsets, loc_ids = enc.take(shown)
    campaign = campaign_ids(ads.advertiser[shown], bitmask, Ragged(loc_offsets, loc_ids))
    values = (ads.ad_id[hist.ad], campaign[where], ads.advertiser[hist.ad].astype(np.int64))
    shares = (p.block_ad_share, p.block_campaign_share, p.block_advertiser_share)
    lists = []
    for k, (v, share) in enumerate(zip(values, shares, strict=True)):
        rng = stream(seed, "blocks", k)
        on = rng.random(n) < share
        count = np.where(on, 1 + rng.poisson(p.blocks_per_request - 1, size=n), 0)
        # advertiser 0 is no advertiser to the catalog (its advertiser_id 0 reads as none)
        ok = logged & (v != v[last][user]) & (v != 0)
        lists.append(_pick(user[ok], v[ok], np.minimum(count, MAX_BLOCK_IDS), rng))
    return Blocks(tuple(lists))
