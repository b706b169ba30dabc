"""The bodies of the four pipeline stages (docs/ARCHITECTURE.md §2). Each reads the record
of the stage before it, does its part on the compute device (on its own CUDA stream on
GPU) and returns its own record (`service/pipeline/records.py`).

1. input: pack requests into a `FeatureBatch` (history -> SID tokens via the batch's
   index) and the decode groups' targeting tensors, pin them and copy them host ->
   device without blocking (on GPU the FeatureBatch as one packed buffer: one copy);
2. features: embedding tables and bags (`FeatureEmbedder`; on GPU `StaticFeatures`:
   CUDA graphs over padded buckets);
3. compute: encoder (on GPU `StaticEncoder`: CUDA graphs over padded buckets), then the
   decode engine — one run per decode group of the batch, on the plans this stage keeps
   for the batch's index version (`prepare` makes them before a version serves);
4. post: SIDs -> ads, exact filter, rank, cut (the C++ post stage of the batch's index)
   and one `RetrievalResult` per live request.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import numpy as np
import torch

from contracts.request import FilterMode
from contracts.targeting import MAX_REQUEST_LOCATIONS, encode_requests
from contracts.tensors import RequestTensors
from service.capture import bucket_of
from service.decode.engine import DecodeEngine
from service.decode.plans import IndexPlans
from service.index.loaded import LoadedIndex
from service.model.embeddings import FeatureEmbedder
from service.model.encoder import ContextEncoder
from service.model.feature_packing import pack_features, unpack_features
from service.model.features import FeatureBatch, UserFeatures, prepare_features
from service.model.retriever import GenerativeRetriever
from service.model.static_encoder import StaticEncoder
from service.model.static_features import StaticFeatures
from service.pipeline.records import (
    Batch,
    Decoded,
    DecodeGroup,
    DeviceGroup,
    Embedded,
    Packed,
    RetrievalResult,
)
from service.post import PostRequest

log = logging.getLogger("grace.pipeline")

_Movable = TypeVar("_Movable", torch.Tensor, FeatureBatch)
# Batch sizes the GPU graphs are captured for (embedder, encoder, decode loop): a batch runs
# padded to the next one. A graph's cost is its bucket's, not the batch's (the decode loop:
# about 0.96 ms + 0.72 ms per request of its bucket on the H200), so every even size up to
# 16: padding costs at most one request. The price is start-up and every index swap: two
# decode plans (filter modes) per bucket. docs/OPERATIONS.md gives the measurements; the
# `graph_buckets` setting overrides them. The CPU runs every batch at its own size.
GRAPH_BUCKETS = (2, 4, 6, 8, 10, 12, 14, 16)


def graph_buckets(max_batch: int, buckets: Sequence[int] = GRAPH_BUCKETS) -> tuple[int, ...]:
    """The buckets for batches of up to `max_batch`: `buckets` below it, then itself (so a
    larger `max_batch` setting gets its own graphs instead of failing its batches)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"buckets must be increasing and >= 1, got {list(buckets)}")
    return (*(b for b in buckets if b < max_batch), max_batch)


class Stages:
    """The model, device, decode engine and per-index plans shared by the stage threads."""

    def __init__(
        self,
        model: GenerativeRetriever,
        model_version: str,
        device: str,
        max_batch: int = GRAPH_BUCKETS[-1],
        buckets: Sequence[int] | None = None,  # GPU graph bucket sizes (default GRAPH_BUCKETS)
    ) -> None:
        self.model = model.eval()
        self.model_version = model_version
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        every_size = tuple(range(1, max_batch + 1))  # CPU: no padding
        self.buckets = (graph_buckets(max_batch, GRAPH_BUCKETS if buckets is None else buckets)
                        if self.cuda else every_size)  # fmt: skip
        self.streams = [torch.cuda.Stream(self.device) if self.cuda else None for _ in range(4)]
        # GPU: locations pad to 64, few plans keep start-up and swaps short (the Bloom scan
        # stops at a hit, so padding costs only children that fail every location)
        locations = (MAX_REQUEST_LOCATIONS,) if self.cuda else (1, 4, 16, MAX_REQUEST_LOCATIONS)
        self.engine = DecodeEngine(
            self.model.decoder, batch_buckets=self.buckets, location_buckets=locations
        )
        self._plans: weakref.WeakKeyDictionary[LoadedIndex, IndexPlans] = (
            weakref.WeakKeyDictionary()
        )  # an index version's plans go with the version
        self._plans_lock = threading.Lock()
        # GPU: the embedder and the encoder as CUDA graphs over padded buckets (a replay
        # instead of ~20 and ~150 launches from their threads); CPU: eager, as they are
        self.embedder: StaticFeatures | FeatureEmbedder = self.model.embedder
        self.encoder: StaticEncoder | ContextEncoder = self.model.encoder
        if self.cuda:
            self.embedder = StaticFeatures(self.model.embedder, self.model.config, self.buckets)
            self.encoder = StaticEncoder(self.model.encoder, self.buckets)

    def padding(self, groups: Sequence[DecodeGroup]) -> int:
        """Requests' worth of padding the decode runs of these groups compute
        (`grace_batch_padding_total`): each runs padded to its own bucket."""
        return sum(bucket_of(self.buckets, len(g.rows)) - len(g.rows) for g in groups)

    def prepare(self, index: LoadedIndex, beams: tuple[int, ...]) -> None:
        """Before a version serves: make its decode plans; on GPU capture the CUDA graphs
        of the default schedule (both filter modes, every batch and location bucket)."""
        plans = self.plans(index)
        if not self.cuda:
            return
        self._warm_graphs()  # once: embedder and encoder do not depend on the index
        t0 = time.perf_counter()
        n = self.engine.warm(plans, beams, modes=(FilterMode.CD_GTM, FilterMode.CD_ONLY))
        log.info("index %s: %d decode plans captured as CUDA graphs in %.1f s",
                 index.version, n, time.perf_counter() - t0)  # fmt: skip

    def plans(self, index: LoadedIndex) -> IndexPlans:
        """The decode plans of `index` (made on first use)."""
        with self._plans_lock:
            plans = self._plans.get(index)
            if plans is None:
                plans = self._plans[index] = self.engine.plan(index.tables, index.level_offsets)
            return plans

    def _warm_graphs(self) -> None:
        """Capture the embedder's and the encoder's graphs (no-ops once done); where that
        fails, serve with the eager module rather than not at all."""
        if isinstance(self.embedder, StaticFeatures) and not _warmed(self.embedder, "embedder"):
            self.embedder = self.model.embedder
        if isinstance(self.encoder, StaticEncoder) and not _warmed(self.encoder, "encoder"):
            self.encoder = self.model.encoder

    def _on(self, stage: int, event: torch.cuda.Event | None) -> AbstractContextManager[object]:
        stream = self.streams[stage]
        if stream is None:
            return nullcontext()
        if event is not None:
            stream.wait_event(event)  # ordered after the previous stage, no host sync
        return torch.cuda.stream(stream)

    def _event(self, stage: int) -> torch.cuda.Event | None:
        stream = self.streams[stage]
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def input(self, batch: Batch) -> Packed:
        reqs = batch.requests
        users = [
            UserFeatures(r.user_id, r.targeting, r.history_ad_ids, r.history_types, r.history_ts_ms)
            for r in reqs
        ]
        features = prepare_features(users, batch.index.lookup, self.model.config)
        groups = []
        with self._on(0, None):
            moved = self._to_device(features)
            for g in batch.groups:
                targeting = None
                if g.mode != FilterMode.CD_ONLY:
                    enc = encode_requests([reqs[i].targeting for i in g.rows])
                    host = RequestTensors.from_encoded(enc)
                    targeting = RequestTensors(
                        self._to_device(host.bitmask), self._to_device(host.blooms)
                    )
                whole = len(g.rows) == len(reqs)
                index = None if whole else self._to_device(torch.tensor(g.rows))
                groups.append(DeviceGroup(g, index, targeting))
        return Packed(moved, tuple(groups), self._event(0))

    def _to_device(self, x: _Movable) -> _Movable:
        """Host -> device on the current stream without blocking the thread: a pageable
        copy would wait for the stream (and so for the batches ahead of this one). A
        FeatureBatch moves packed: one pinned buffer and one copy instead of eight."""
        if not self.cuda:
            return x
        if isinstance(x, FeatureBatch):
            packed = pack_features(x, pin_memory=True).to(self.device, non_blocking=True)
            return unpack_features(packed, x.hist_sid.shape[2])
        return x.pin_memory().to(self.device, non_blocking=True)

    @torch.no_grad()
    def features(self, packed: Packed) -> Embedded:
        with self._on(1, packed.event):
            embedded = self.embedder(packed.features)
        return Embedded(embedded, packed.groups, self._event(1))

    @torch.no_grad()
    def compute(self, batch: Batch, embedded: Embedded, live: Sequence[bool]) -> Decoded:
        plans = self.plans(batch.index)
        runs = []
        with self._on(2, embedded.event):
            ctx = self.encoder(embedded.embedded)
            for dg in embedded.groups:
                dg = self._live(dg, live)
                if dg is None:  # every request of the group was dropped: no decode run
                    continue
                g = dg.group
                sub = ctx if dg.index is None else ctx[dg.index]
                runs.append((g.rows, self.engine.run(plans, sub, dg.requests, g.beams, g.mode)))
        return Decoded(tuple(runs), self._event(2))

    def _live(self, dg: DeviceGroup, live: Sequence[bool]) -> DeviceGroup | None:
        """The group narrowed to its live rows (requests dropped at the hand-off before
        this stage); None when none is left. On the current stage's stream."""
        rows = dg.group.rows
        keep = [j for j, row in enumerate(rows) if live[row]]
        if len(keep) == len(rows):
            return dg
        if not keep:
            return None
        at = self._to_device(torch.tensor(keep))
        reqs = dg.requests
        if reqs is not None:
            reqs = RequestTensors(reqs.bitmask[at], reqs.blooms[at])
        kept = tuple(rows[j] for j in keep)
        group = DecodeGroup(dg.group.beams, dg.group.mode, kept)
        return DeviceGroup(group, self._to_device(torch.tensor(kept)), reqs)

    def post(
        self, batch: Batch, decoded: Decoded, rows: Sequence[int], stage_ms: dict[str, float]
    ) -> list[RetrievalResult]:
        """One result per row of `rows` (the live ones: every one was decoded)."""
        if decoded.event is not None:
            decoded.event.synchronize()  # the decode results must be on the device
        generated: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for group_rows, res in decoded.runs:
            leaves, scores = res.leaves.cpu().numpy(), res.scores.cpu().numpy()
            for j, i in enumerate(group_rows):
                keep = leaves[j] >= 0
                generated[i] = (leaves[j][keep], scores[j][keep])
        index, reqs = batch.index, batch.requests
        posts = index.post.run([
            PostRequest.from_targeting(*generated[i], reqs[i].targeting, index.vocabulary,
                                       reqs[i].max_ads)
            for i in rows
        ])  # fmt: skip
        return [
            RetrievalResult(
                post=p,
                sids_generated=len(generated[i][0]),
                index_version=index.version,
                model_version=self.model_version,
                stage_ms=dict(stage_ms),
            )
            for p, i in zip(posts, rows, strict=True)
        ]


def _warmed(static: StaticFeatures | StaticEncoder, name: str) -> bool:
    t0 = time.perf_counter()
    try:
        static.warm()
    except Exception:
        log.exception("capturing the %s's CUDA graphs failed: eager %s", name, name)
        return False
    log.info("%s: CUDA graphs for buckets %s captured in %.1f s", name, static.buckets,
             time.perf_counter() - t0)  # fmt: skip
    return True
