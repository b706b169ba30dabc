"""Typed hand-offs between pipeline stages.

    list[Pending] (batcher) ─► stage 1 input ─► stage 2 features ─► stage 3 compute
    ─► stage 4 post ─► RetrievalResult per request (Pending.resolve)

One `BatchState` travels through all four stages; each stage fills its own fields and
adds its wall time to `stage_ms`. On GPU each stage records `event` on its stream and
the next stage's stream waits on it, so hand-offs are ordered without host syncs. At
every hand-off the runner calls `drop`: requests whose deadline has passed are answered
DEADLINE_EXCEEDED there and then, those whose client went away are forgotten, and the
later stages work on the `live` rows only (no decode run and no post work for the rest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from index_builder.exact import PostResult
from index_builder.lookup import FilterMode, RequestTensors
from index_builder.targeting import Targeting
from service.batcher import DeadlineExpired, Pending
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
    dispatched: float  # time.monotonic() when the batcher handed it over
    live: list[bool] = field(init=False)  # per request: still to be answered
    stage_ms: dict[str, float] = field(default_factory=dict)
    features: FeatureBatch | None = None  # stage 1 -> 2, on the compute device
    groups: list[DecodeGroup] = field(default_factory=list)  # stage 1 -> 3
    embedded: EmbeddedFeatures | None = None  # stage 2 -> 3
    decoded: list[tuple[list[int], DecodeResult]] = field(default_factory=list)  # 3 -> 4
    event: torch.cuda.Event | None = None  # recorded by the stage that produced the data

    def __post_init__(self) -> None:
        self.live = [True] * len(self.pending)

    @property
    def requests(self) -> list[RetrievalRequest]:
        return [p.payload for p in self.pending]

    @property
    def live_rows(self) -> list[int]:
        return [i for i, alive in enumerate(self.live) if alive]

    def drop(self, now: float) -> tuple[int, int]:
        """Stop working for requests whose deadline passed (answered DEADLINE_EXCEEDED)
        or whose client went away; returns how many of each were dropped now."""
        expired = abandoned = 0
        for i, p in enumerate(self.pending):
            if not self.live[i]:
                continue
            if p.abandoned:
                abandoned += 1
            elif p.expired(now):
                expired += 1
                p.fail(DeadlineExpired("deadline passed during processing"))
            else:
                continue
            self.live[i] = False
        return expired, abandoned
