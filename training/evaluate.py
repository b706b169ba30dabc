"""Held-out retrieval quality: recall@K of the next interaction, model vs popularity. The
model retrieves with the served engine and post stage (`training/offline.py`); the
baseline ranks the ads eligible for the user by how often they occur in the training
histories, so both return only eligible ads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from contracts.request import FilterMode
from contracts.targeting_codec import exact_eligible
from index_builder.synth.reader import UserHistories
from service.index.loaded import LoadedIndex
from service.model.retriever import GenerativeRetriever
from service.post.expand import rules_of
from training.data import Examples
from training.offline import OfflineRetriever
from training.user_data import positions


def popularity_ranking(world: UserHistories, ad_ids: np.ndarray) -> np.ndarray:
    """Positions into `ad_ids`, most frequent in the histories first (ties: by ad id)."""
    pos = positions(ad_ids, world.history_ad_ids)
    counts = np.bincount(pos[pos >= 0], minlength=len(ad_ids))
    return np.lexsort((ad_ids, -counts))


def recall_at_k(
    model: GenerativeRetriever,
    examples: Examples,
    index: LoadedIndex,
    users: np.ndarray,
    ks: Sequence[int],
    beams: tuple[int, ...],
    batch_size: int = 16,
) -> dict[str, float]:
    """Recall@K of the model (CD+GTM) and of eligible-popularity on held-out events."""
    ads = index.arrays.ads
    ranking = popularity_ranking(examples.world, ads.ad_ids)
    ranked = rules_of(ads.rules(), ranking)
    hits_model, hits_pop = dict.fromkeys(ks, 0), dict.fromkeys(ks, 0)
    returned = 0
    retriever = OfflineRetriever(model, index, batch_size)
    for s in range(0, len(users), batch_size):
        batch = examples.heldout(users[s : s + batch_size])
        targeting = [examples.world.targeting[u] for u in batch.users.tolist()]
        results = retriever.retrieve(batch.features, targeting, beams, FilterMode.CD_GTM, max(ks))
        for res, t, target in zip(results, targeting, batch.target_ad.tolist(), strict=True):
            returned += len(res.ad_ids)
            rank = np.flatnonzero(res.ad_ids == target)
            request = index.request_rules(t)  # its blocks too: popularity returns none
            eligible = exact_eligible(index.schema, ads.ad_ids[ranking], ranked, request)
            pop = ads.ad_ids[ranking[eligible][: max(ks)]]
            pop_rank = np.flatnonzero(pop == target)
            for k in ks:
                hits_model[k] += bool(len(rank) and rank[0] < k)
                hits_pop[k] += bool(len(pop_rank) and pop_rank[0] < k)
    n = max(len(users), 1)
    out = {f"recall@{k}": hits_model[k] / n for k in ks}
    out |= {f"popularity_recall@{k}": hits_pop[k] / n for k in ks}
    out["mean_ads_returned"] = returned / n
    out["users"] = len(users)
    return out
