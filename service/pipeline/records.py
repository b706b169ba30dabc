"""Typed hand-offs between the pipeline's stages (docs/ARCHITECTURE.md §2).

    list[Pending] (batcher) ─► Batch ─stage 1─► Packed ─stage 2─► Embedded ─stage 3─►
    Decoded ─stage 4─► RetrievalResult per live request (Pending.resolve)

A `Batch` is fixed at dispatch: its requests, its (model, index) pair and its decode
groups. Each stage returns a frozen record carrying, on GPU, the CUDA event its stage
recorded, which the next stage's stream waits on (no host syncs). Which requests are still
live is the runner's to track; a stage that needs it gets the live rows as an argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.tensors import RequestTensors
from service.batcher import Pending
from service.decode.plans import DecodeResult
from service.index.live import LiveState
from service.model.embeddings import EmbeddedFeatures
from service.model.features import FeatureBatch
from service.pipeline.runtime import Serving
from service.post import PostResult


class RetrievalRequest(Protocol):
    """What the pipeline reads from a validated request (service/validation.py)."""

    request_id: str  # the call's (service/request_id.py): on the log lines about it
    user_id: int
    targeting: Targeting
    history_ad_ids: np.ndarray  # int64 [n]
    history_types: np.ndarray  # int [n]
    history_ts_ms: np.ndarray  # int64 [n]
    max_ads: int
    beams: tuple[int, ...]
    filter_mode: FilterMode
    adaptive: bool  # no beam_widths of its own: its batch's ladder rung decides


# (beam schedule, filter mode); the schedule None: the server's, the batch's ladder rung
GroupKey = tuple[tuple[int, ...] | None, FilterMode]


def group_key(request: RetrievalRequest) -> GroupKey:
    """Requests with the same key share one decode run (the batcher caps a batch's keys)."""
    return (None if request.adaptive else request.beams), request.filter_mode


@dataclass(frozen=True)
class DecodeGroup:
    """Requests of a batch that share a beam schedule and filter mode: one decode run."""

    beams: tuple[int, ...]
    mode: FilterMode
    rows: tuple[int, ...]  # positions in the batch


def schedule_of(request: RetrievalRequest, rung: tuple[int, ...] | None) -> tuple[int, ...]:
    """The beam schedule `request` decodes at in a batch given ladder rung `rung`: the
    rung's without beam_widths of its own (None: the server's schedule it holds)."""
    return rung if request.adaptive and rung is not None else request.beams


def decode_groups(
    requests: Sequence[RetrievalRequest], rung: tuple[int, ...] | None = None
) -> tuple[DecodeGroup, ...]:
    """The batch's decode groups, in order of first appearance (`schedule_of` each)."""
    rows_of: dict[tuple[tuple[int, ...], FilterMode], list[int]] = {}
    for i, r in enumerate(requests):
        rows_of.setdefault((schedule_of(r, rung), r.filter_mode), []).append(i)
    return tuple(DecodeGroup(beams, mode, tuple(rows)) for (beams, mode), rows in rows_of.items())


@dataclass(frozen=True)
class Batch:
    """What the batcher dispatched; the same object reaches every stage."""

    pending: tuple[Pending[RetrievalRequest], ...]
    serving: Serving  # the (model, index) pair: taken once at dispatch, used by every stage
    dispatched: float  # time.monotonic() when the batcher handed it over
    groups: tuple[DecodeGroup, ...]
    rung: int = 0  # the ladder rung its requests without beam_widths decode at
    rung_beams: tuple[int, ...] | None = None  # that rung's schedule (None: no ladder)

    @classmethod
    def of(
        cls,
        pending: Sequence[Pending[RetrievalRequest]],
        serving: Serving,
        dispatched: float,
        rung: int = 0,
        rung_beams: tuple[int, ...] | None = None,
    ) -> Batch:
        groups = decode_groups([p.payload for p in pending], rung_beams)
        return cls(tuple(pending), serving, dispatched, groups, rung, rung_beams)

    @property
    def adaptive(self) -> bool:
        """Whether any request of it decodes at the ladder's rung."""
        return any(p.payload.adaptive for p in self.pending)

    @property
    def requests(self) -> list[RetrievalRequest]:
        return [p.payload for p in self.pending]


@dataclass(frozen=True)
class DeviceGroup:
    """A decode group's inputs on the compute device (made at stage 1: stage 3 copies none)."""

    group: DecodeGroup
    index: torch.Tensor | None  # int64 [len(rows)]: the rows in the batch; None: all of it
    requests: RequestTensors | None  # targeting; None for CD_ONLY


@dataclass(frozen=True)
class Packed:
    """Stage 1 (input) -> 2: the batch's features and groups on the compute device."""

    features: FeatureBatch
    groups: tuple[DeviceGroup, ...]
    event: torch.cuda.Event | None  # recorded on stage 1's stream (GPU)


@dataclass(frozen=True)
class Embedded:
    """Stage 2 (features) -> 3: the embedded features, and stage 1's groups."""

    embedded: EmbeddedFeatures
    groups: tuple[DeviceGroup, ...]
    event: torch.cuda.Event | None


@dataclass(frozen=True)
class Decoded:
    """Stage 3 (compute) -> 4: per decode run, the batch rows live at stage 3 and the result."""

    runs: tuple[tuple[tuple[int, ...], DecodeResult], ...]
    event: torch.cuda.Event | None
    live: LiveState  # the live state the batch was decoded for, which it is answered at


@dataclass(frozen=True)
class RetrievalResult:
    """Stage 4's answer to one request, before it becomes a RetrieveResponse."""

    post: PostResult  # eligible ads, best first, with scores and SIDs
    sids_generated: int  # live SIDs the decoder produced
    index_version: str
    model_version: str
    stage_ms: dict[str, float]  # per stage, for this request's batch
    batch_size: int = 0  # requests in this request's batch as dispatched (the access log's)
    catalog_seq: int = 0  # the live changes it was answered at (service/index/live.py)
    beams: tuple[int, ...] = ()  # the schedule that answered it
    rung: int = -1  # its ladder rung (service/beam_ladder.py); -1: its own beam_widths
