"""`grace eval`: the paper's effectiveness study (§6, Table 3) on a synthetic world, plus
the retrieval quality the paper never reported.

For each filter variant — CD only, CD+GTM, CD+GTM with static and with dynamic k-way
partitions — every evaluated user's request is decoded with the same model, beams and
index; the generated SIDs are expanded to ads and each ad is checked exactly:
- bitmask pass rate: share of generated ads whose country/age/gender rules hold;
- Bloom pass rate: share whose per-ad Bloom row contains one of the request's locations
  (the paper's location test; conservative);
- location pass rate: share whose location rule holds exactly (our post stage's test);
- final pass rate: share exactly eligible (bitmask ∧ exact location) — what survives;
overall (pooled over ads) and bucketed by ads generated per request, with the share of
users in each bucket; plus eligible ads returned per request and recall@K of the user's
held-out next interaction among the returned (eligible, score-ranked) ads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from contracts.index_format import IndexArrays
from contracts.request import FilterMode
from contracts.targeting import (
    FULL_BITMASK,
    Ragged,
    ad_blooms,
    bitmask_match,
    bloom_match_any,
    exact_eligible,
    location_blooms,
    request_bitmask,
    request_blooms,
)
from service.index.loaded import LoadedIndex
from service.model.retriever import GenerativeRetriever
from service.post.expand import expand_leaves, location_rows
from training.data import Examples
from training.offline import OfflineRetriever

BUCKETS = (0, 100, 500, 1000, 2000, 5000)  # ads generated per request: [lo, next lo)


@dataclass
class _Tally:
    users: int = 0
    generated: int = 0
    bitmask: int = 0
    bloom: int = 0
    location: int = 0
    final: int = 0

    def add(self, bm: np.ndarray, bl: np.ndarray, loc: np.ndarray, fin: np.ndarray) -> None:
        self.users += 1
        self.generated += len(bm)
        self.bitmask += int(bm.sum())
        self.bloom += int(bl.sum())
        self.location += int(loc.sum())
        self.final += int(fin.sum())

    def rates(self, total_users: int) -> dict[str, float]:
        g = max(self.generated, 1)
        return {
            "users_share": self.users / max(total_users, 1),
            "ads_generated_per_user": self.generated / max(self.users, 1),
            "bitmask_pass": self.bitmask / g,
            "bloom_pass": self.bloom / g,
            "location_pass": self.location / g,
            "final_pass": self.final / g,
        }


@dataclass
class VariantResult:
    name: str
    overall: _Tally = field(default_factory=_Tally)
    buckets: dict[int, _Tally] = field(default_factory=dict)
    eligible_returned: list[int] = field(default_factory=list)
    hits: dict[int, int] = field(default_factory=dict)

    def summary(self, ks: Sequence[int]) -> dict[str, Any]:
        n = self.overall.users
        return {
            "variant": self.name,
            **self.overall.rates(n),
            "eligible_ads_per_user": float(np.mean(self.eligible_returned)) if n else 0.0,
            **{f"recall@{k}": self.hits.get(k, 0) / max(n, 1) for k in ks},
            "buckets": {
                f"{lo}+" if i == len(BUCKETS) - 1 else f"{lo}-{BUCKETS[i + 1] - 1}": (
                    self.buckets[lo].rates(n)
                )
                for i, lo in enumerate(BUCKETS)
                if lo in self.buckets
            },
        }


def run_study(
    model: GenerativeRetriever,
    examples: Examples,
    variants: Sequence[tuple[str, IndexArrays, FilterMode]],
    users: np.ndarray,
    beams: tuple[int, ...],
    ks: Sequence[int] = (10, 100, 1000),
    *,
    device: str = "cpu",
    batch_size: int = 16,
    progress: bool = True,
) -> list[dict[str, Any]]:
    out = []
    model.eval()
    bloom_rows: dict[int, np.ndarray] = {}  # per-ad Bloom rows, once per ad arrays
    for name, arrays, mode in variants:
        index = LoadedIndex.from_arrays(arrays, device)
        retriever = OfflineRetriever(model, index, batch_size)
        ads = arrays.ads
        if id(ads) not in bloom_rows:  # k-way variants share the plain index's ad arrays
            bloom_rows[id(ads)] = ad_blooms(
                Ragged(ads.ad_loc_offsets, ads.ad_loc_ids),
                location_blooms(ads.location_strings()),
            )
        ad_bloom = bloom_rows[id(ads)]
        result = VariantResult(name)
        bar = tqdm(total=len(users), desc=f"eval {name}", disable=not progress)
        for s in range(0, len(users), batch_size):
            batch = examples.heldout(users[s : s + batch_size])
            targeting = [examples.world.targeting[u] for u in batch.users.tolist()]
            res = retriever.decode(batch.features, targeting, beams, mode)
            for b, (t, target) in enumerate(zip(targeting, batch.target_ad.tolist(), strict=True)):
                leaves, scores = (x.cpu().numpy() for x in res.valid(b))
                rows, _ = expand_leaves(ads, leaves)
                req_bm, req_ids = request_bitmask(t), index.vocabulary.ids(t.locations)
                locs = location_rows(ads, rows)
                bm = bitmask_match(ads.ad_bitmask[rows], req_bm)
                bl = bloom_match_any(ad_bloom[rows], request_blooms(t))
                full = np.broadcast_to(FULL_BITMASK, (len(rows), len(FULL_BITMASK)))
                loc = exact_eligible(full, *locs, req_bm, req_ids)
                fin = exact_eligible(ads.ad_bitmask[rows], *locs, req_bm, req_ids)
                result.overall.add(bm, bl, loc, fin)
                bucket = max(lo_ for lo_ in BUCKETS if lo_ <= len(rows))
                result.buckets.setdefault(bucket, _Tally()).add(bm, bl, loc, fin)
                (post,) = retriever.post([(leaves, scores)], [t], max(ks))
                result.eligible_returned.append(post.ads_eligible)
                rank = np.flatnonzero(post.ad_ids == target)
                for k in ks:
                    result.hits[k] = result.hits.get(k, 0) + bool(len(rank) and rank[0] < k)
            bar.update(len(batch.users))
        bar.close()
        out.append(result.summary(ks))
    return out
