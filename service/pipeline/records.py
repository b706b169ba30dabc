"""Typed hand-offs between pipeline stages.

    list[Pending] (batcher) ─► stage 1 input ─► stage 2 features ─► stage 3 compute
    ─► stage 4 post ─► RetrievalResult per request (Pending.resolve)

One `BatchState` travels through all four stages; each stage fills its own fields and
adds its wall time to `stage_ms`. On GPU each stage records `event` on its stream and
the next stage's stream waits on it, so hand-offs are ordered without host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from index_builder.exact import PostResult
from index_builder.lookup import FilterMode, RequestTensors
from index_builder.targeting import Targeting
from service.batcher import Pending
from service.decode.engine import DecodeResult
from service.model.embeddings import EmbeddedFeatures
from service.model.features import FeatureBatch
from service.serving_index import ServingIndex


class RetrievalRequest(Protocol):
    """What the pipeline reads from a validated request (service/validation.py)."""

    user_id: int
    targeting: Targeting
    history_ad_ids: np.ndarray  # int64 [n]
    history_types: np.ndarray  # int [n]
    history_ts_ms: np.ndarray  # int64 [n]
    max_ads: int
    beams: tuple[int, ...]
    filter_mode: FilterMode


@dataclass(frozen=True)
class RetrievalResult:
    """The answer to one request, before it becomes a RetrieveResponse."""

    post: PostResult  # eligible ads, best first, with scores and SIDs
    sids_generated: int  # live SIDs the decoder produced
    index_version: str
    model_version: str
    stage_ms: dict[str, float]  # per stage, for this request's batch


@dataclass(frozen=True)
class DecodeGroup:
    """Requests of a batch that share a beam schedule and filter mode (one decode run);
    built at stage 1, so stage 3 does no host -> device copies of its own."""

    beams: tuple[int, ...]
    mode: FilterMode
    rows: list[int]  # positions in the batch
    index: torch.Tensor | None  # int64 [len(rows)] on the device; None: the whole batch
    requests: RequestTensors | None  # targeting on the device; None for CD_ONLY


@dataclass
class BatchState:
    pending: list[Pending]
    index: ServingIndex  # taken once at stage 1 and used by every stage
    stage_ms: dict[str, float] = field(default_factory=dict)
    features: FeatureBatch | None = None  # stage 1 -> 2, on the compute device
    groups: list[DecodeGroup] = field(default_factory=list)  # stage 1 -> 3
    embedded: EmbeddedFeatures | None = None  # stage 2 -> 3
    decoded: list[tuple[list[int], DecodeResult]] = field(default_factory=list)  # 3 -> 4
    event: torch.cuda.Event | None = None  # recorded by the stage that produced the data

    @property
    def requests(self) -> list[RetrievalRequest]:
        return [p.payload for p in self.pending]
