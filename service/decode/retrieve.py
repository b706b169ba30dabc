"""One batch end to end on the reference path: encode -> constrained beam search -> SID
-> ads expansion and exact filter. Used by training's held-out evaluation and `grace
eval`; the service's four-stage pipeline (#4) runs the same pieces on separate threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from index_builder.exact import LocationVocabulary, PostResult, expand_and_filter
from index_builder.format import IndexArrays
from index_builder.lookup import FilterMode, GtmTables, RequestTensors
from index_builder.targeting import Targeting, encode_requests
from service.decode.engine import BeamSearch, DecodeResult
from service.model.features import FeatureBatch, SidLookup
from service.model.retriever import GenerativeRetriever


@dataclass(frozen=True)
class RetrievalIndex:
    """Everything a batch reads from one index version, prepared once per load."""

    arrays: IndexArrays
    tables: GtmTables
    level_offsets: torch.Tensor  # int64 [sid_length + 2]
    vocabulary: LocationVocabulary
    lookup: SidLookup

    @classmethod
    def from_arrays(cls, arrays: IndexArrays, device: str = "cpu") -> RetrievalIndex:
        return cls(
            arrays=arrays,
            tables=GtmTables.from_arrays(arrays.trie, arrays.kway, device),
            level_offsets=torch.from_numpy(arrays.trie.level_offsets.copy()),
            vocabulary=LocationVocabulary(arrays.ads),
            lookup=SidLookup.from_ads(arrays.ads),
        )


@torch.no_grad()
def decode(
    model: GenerativeRetriever,
    index: RetrievalIndex,
    features: FeatureBatch,
    targeting: Sequence[Targeting],
    beams: tuple[int, ...],
    mode: FilterMode = FilterMode.CD_GTM,
) -> DecodeResult:
    """Encode and beam-search one batch: the generated SIDs, before any expansion."""
    device = index.tables.node_offsets.device
    ctx = model.encode(features.to(device))
    requests = None
    if mode != FilterMode.CD_ONLY:
        requests = RequestTensors.from_encoded(encode_requests(targeting), str(device))
    search = BeamSearch(model.decoder, index.tables, index.level_offsets)
    return search.run(ctx, requests, beams, mode)


def retrieve(
    model: GenerativeRetriever,
    index: RetrievalIndex,
    features: FeatureBatch,
    targeting: Sequence[Targeting],
    beams: tuple[int, ...],
    mode: FilterMode = FilterMode.CD_GTM,
    max_ads: int = 1000,
) -> list[PostResult]:
    """Retrieve up to `max_ads` exactly eligible ads per request, best first."""
    result = decode(model, index, features, targeting, beams, mode)
    generated = [tuple(x.cpu().numpy() for x in result.valid(b)) for b in range(len(targeting))]
    return reference_post(index, generated, targeting, [max_ads] * len(targeting))


def reference_post(
    index: RetrievalIndex,
    generated: Sequence[tuple[np.ndarray, np.ndarray]],  # per request: (leaves, scores)
    targeting: Sequence[Targeting],
    max_ads: Sequence[int],
) -> list[PostResult]:
    """The Python reference post stage (index_builder/exact.py), request by request."""
    return [
        expand_and_filter(index.arrays.ads, index.vocabulary, leaves, scores, t, k)
        for (leaves, scores), t, k in zip(generated, targeting, max_ads, strict=True)
    ]
