"""The served decode engine and C++ post stage (pipeline stages 3 and 4) without the
service around them, run in one thread over whole batches: what training's held-out
evaluation (`training/evaluate.py`) and the effectiveness study (`training/study.py`) use.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from contracts.request import FilterMode, Scoring
from contracts.targeting import Targeting
from contracts.targeting_codec import codec
from contracts.tensors import RequestTensors
from service.decode.engine import DecodeEngine
from service.decode.plans import DecodeResult
from service.index.loaded import LoadedIndex
from service.model.features import FeatureBatch
from service.model.retriever import GenerativeRetriever
from service.post import PostResult


class OfflineRetriever:
    """One model over one index, batches of up to `max_batch` requests, the decode steps
    scored by `scoring` (`contracts.request.Scoring`)."""

    def __init__(
        self,
        model: GenerativeRetriever,
        index: LoadedIndex,
        max_batch: int = 64,
        *,
        scoring: Scoring = "masked",
    ) -> None:
        self.model, self.index = model.eval(), index
        buckets = tuple(range(1, max_batch + 1))
        self.engine = DecodeEngine(model.decoder, batch_buckets=buckets, scoring=scoring)
        self.plans = self.engine.plan(index.tables, index.level_offsets)

    @torch.no_grad()
    def decode(
        self,
        features: FeatureBatch,
        targeting: Sequence[Targeting],
        beams: tuple[int, ...],
        mode: FilterMode = FilterMode.CD_GTM,
    ) -> DecodeResult:
        """Encode and beam-search one batch: the generated SIDs, before any expansion."""
        device = self.index.tables.node_offsets.device
        ctx = self.model.encode(features.to(device))
        requests = None
        if mode != FilterMode.CD_ONLY:
            enc = codec(self.index.schema).encode_requests([t.values() for t in targeting])
            requests = RequestTensors.from_encoded(enc, str(device))
        return self.engine.run(self.plans, ctx, requests, beams, mode)

    def post(
        self,
        generated: Sequence[tuple[np.ndarray, np.ndarray]],  # per request: (leaves, scores)
        targeting: Sequence[Targeting],
        max_ads: int,
    ) -> list[PostResult]:
        """The C++ post stage: each request's eligible ads, best first, cut to max_ads."""
        return self.index.post.run([
            self.index.post_request(leaves, scores, t, max_ads)
            for (leaves, scores), t in zip(generated, targeting, strict=True)
        ])  # fmt: skip

    def retrieve(
        self,
        features: FeatureBatch,
        targeting: Sequence[Targeting],
        beams: tuple[int, ...],
        mode: FilterMode = FilterMode.CD_GTM,
        max_ads: int = 1000,
    ) -> list[PostResult]:
        """Up to `max_ads` exactly eligible ads per request, best first."""
        result = self.decode(features, targeting, beams, mode)
        generated = [tuple(x.cpu().numpy() for x in result.valid(b)) for b in range(len(targeting))]
        return self.post(generated, targeting, max_ads)
