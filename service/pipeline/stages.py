"""The bodies of the four pipeline stages (docs/ARCHITECTURE.md §2). Each takes the `BatchState`,
does its part on the compute device (on its own CUDA stream on GPU), and returns.

1. input: pack requests into a `FeatureBatch` (history -> SID tokens via the batch's
   index) and the decode groups' targeting tensors, pin them and copy them host ->
   device without blocking (on GPU the FeatureBatch as one packed buffer: one copy);
2. features: embedding tables and bags (`FeatureEmbedder`; on GPU `StaticFeatures`:
   CUDA graphs over padded buckets);
3. compute: encoder (on GPU `StaticEncoder`: CUDA graphs over padded buckets), then the
   constrained beam search — one run per (beams, filter mode) group of the batch, so
   requests with other options never share a schedule;
4. post: SIDs -> ads, exact filter, rank, cut (the C++ post stage of the batch's index)
   and one `RetrievalResult` per request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import numpy as np
import torch

from index_builder.exact import PostResult
from index_builder.lookup import FilterMode, RequestTensors
from index_builder.targeting import MAX_REQUEST_LOCATIONS, encode_requests
from service.capture import bucket_of
from service.decode.engine import BeamSearch
from service.decode.retrieve import reference_post
from service.decode.static_engine import StaticBeamSearch
from service.model.embeddings import FeatureEmbedder
from service.model.encoder import ContextEncoder
from service.model.features import (
    FeatureBatch,
    UserFeatures,
    pack_features,
    prepare_features,
    unpack_features,
)
from service.model.retriever import GenerativeRetriever
from service.model.static_encoder import StaticEncoder
from service.model.static_features import StaticFeatures
from service.pipeline.records import BatchState, DecodeGroup, RetrievalRequest, RetrievalResult
from service.post import PostRequest
from service.serving_index import ServingIndex

log = logging.getLogger("grace.pipeline")

_Movable = TypeVar("_Movable", torch.Tensor, FeatureBatch)
# Batch sizes the GPU graphs are captured for (embedder, encoder, decode loop): a batch runs
# padded to the next one. A graph's cost is its bucket's, not the batch's — the decode
# loop costs about 0.96 ms + 0.72 ms per request of its bucket on the H200 (3.84 / 6.72 /
# 12.48 ms at 4 / 8 / 16) — so every even size up to 16: padding costs at most one
# request. On the H200 (paper profile, two workers) these buckets with `busy_batches` 1
# served 795–841 req/s at P99 <= 100 ms where 4/8/12/16 failed at 800 (P99 270 ms) and
# 4/8/16 passed only at 691 (docs/OPERATIONS.md, bench/results/gpu_loadtest_workers.json).
# The price is start-up and every index swap: two decode plans (filter modes) per bucket,
# 16 plans captured in 96 s per worker against 8 in 70 s (the mask and self-attention
# kernels key their tuning on rows rounded up to a power of two, so most buckets reuse
# the 16- and 8-row tuning). The `graph_buckets` setting overrides them.
GRAPH_BUCKETS = (2, 4, 6, 8, 10, 12, 14, 16)


def graph_buckets(max_batch: int, buckets: Sequence[int] = GRAPH_BUCKETS) -> tuple[int, ...]:
    """The buckets for batches of up to `max_batch`: `buckets` below it, then itself (so a
    larger `max_batch` setting gets its own graphs instead of failing its batches)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"buckets must be increasing and >= 1, got {list(buckets)}")
    return (*(b for b in buckets if b < max_batch), max_batch)


def decode_groups(
    requests: Sequence[RetrievalRequest],
) -> dict[tuple[tuple[int, ...], FilterMode], list[int]]:
    """Rows of the batch by (beam schedule, filter mode): each group is one decode run."""
    rows_of: dict[tuple[tuple[int, ...], FilterMode], list[int]] = {}
    for i, r in enumerate(requests):
        rows_of.setdefault((r.beams, r.filter_mode), []).append(i)
    return rows_of


# (batch, its rows still live, their generated (leaves, scores)) -> one result per row
PostFn = Callable[
    [BatchState, Sequence[int], Sequence[tuple[np.ndarray, np.ndarray]]], list[PostResult]
]


class Stages:
    """The model, device and post-stage implementation shared by the stage threads."""

    def __init__(
        self,
        model: GenerativeRetriever,
        model_version: str,
        device: str,
        post: PostFn | None,
        max_batch: int = GRAPH_BUCKETS[-1],
        buckets: Sequence[int] | None = None,  # graph bucket sizes (default GRAPH_BUCKETS)
    ) -> None:
        self.model = model.eval()
        self.model_version = model_version
        self.device = torch.device(device)
        self.post_fn = post or default_post
        cuda = self.device.type == "cuda"
        self.buckets = graph_buckets(max_batch, GRAPH_BUCKETS if buckets is None else buckets)
        self.streams = [torch.cuda.Stream(self.device) if cuda else None for _ in range(4)]
        # GPU: the embedder and the encoder as CUDA graphs over padded buckets (a replay
        # instead of ~20 and ~150 launches from their threads); CPU: eager, on the batch
        # as it is
        self.embedder: StaticFeatures | FeatureEmbedder = self.model.embedder
        self.encoder: StaticEncoder | ContextEncoder = self.model.encoder
        if cuda:
            self.embedder, self.encoder = self.graphed()

    def padding(self, requests: Sequence[RetrievalRequest]) -> int:
        """Requests' worth of padding the GPU decodes for this batch
        (`grace_batch_padding_total`): each decode group — requests sharing a beam
        schedule and filter mode — runs padded to its own bucket. The CPU path runs every
        group at its own size."""
        if self.device.type != "cuda":
            return 0
        return sum(bucket_of(self.buckets, len(rows)) - len(rows)
                   for rows in decode_groups(requests).values())  # fmt: skip

    def graphed(self) -> tuple[StaticFeatures, StaticEncoder]:
        """The fixed-shape embedder and encoder over `self.buckets` (the decode engine's
        buckets too, `prepare`): what stages 2 and 3 run on GPU."""
        return (
            StaticFeatures(self.model.embedder, self.model.config, self.buckets),
            StaticEncoder(self.model.encoder, self.buckets),
        )

    def prepare(self, index: ServingIndex, beams: tuple[int, ...]) -> ServingIndex:
        """Before a version serves: on GPU, bind a fixed-shape decode engine to its tables
        and capture the CUDA graphs of the default schedule (both filter modes, every
        batch and location bucket). CPU keeps the dynamic reference engine: no padding."""
        if self.device.type != "cuda":
            return index
        self._warm_graphs()  # once: embedder and encoder do not depend on the index
        retrieval = index.retrieval
        # few plans keep start-up and swaps short: batches pad to `buckets`, locations
        # to 64 (the Bloom scan stops at a hit, so padding costs only children that fail
        # every location)
        engine = StaticBeamSearch(
            self.model.decoder,
            retrieval.tables,
            retrieval.level_offsets,
            batch_buckets=self.buckets,
            location_buckets=(MAX_REQUEST_LOCATIONS,),
        )
        t0 = time.perf_counter()
        plans = engine.warm(beams, modes=(FilterMode.CD_GTM, FilterMode.CD_ONLY))
        log.info("index %s: %d decode plans captured as CUDA graphs in %.1f s",
                 index.version, plans, time.perf_counter() - t0)  # fmt: skip
        return dataclasses.replace(index, engine=engine)

    def _warm_graphs(self) -> None:
        """Capture the embedder's and the encoder's graphs (no-ops once done); where that
        fails, serve with the eager module rather than not at all."""
        if isinstance(self.embedder, StaticFeatures) and not _warmed(self.embedder, "embedder"):
            self.embedder = self.model.embedder
        if isinstance(self.encoder, StaticEncoder) and not _warmed(self.encoder, "encoder"):
            self.encoder = self.model.encoder

    def _on(self, stage: int, batch: BatchState) -> AbstractContextManager[object]:
        stream = self.streams[stage]
        if stream is None:
            return nullcontext()
        if batch.event is not None:
            stream.wait_event(batch.event)  # ordered after the previous stage, no host sync
        return torch.cuda.stream(stream)

    def _done(self, stage: int, batch: BatchState) -> None:
        stream = self.streams[stage]
        if stream is not None:
            batch.event = torch.cuda.Event()
            batch.event.record(stream)

    def input(self, batch: BatchState) -> None:
        users = [
            UserFeatures(r.user_id, r.targeting, r.history_ad_ids, r.history_types, r.history_ts_ms)
            for r in batch.requests
        ]
        features = prepare_features(users, batch.index.retrieval.lookup, self.model.config)
        with self._on(0, batch):
            batch.features = self._to_device(features)
            for (beams, mode), rows in decode_groups(batch.requests).items():
                reqs = None
                if mode != FilterMode.CD_ONLY:
                    enc = encode_requests([batch.requests[i].targeting for i in rows])
                    host = RequestTensors.from_encoded(enc)
                    reqs = RequestTensors(
                        self._to_device(host.bitmask), self._to_device(host.blooms)
                    )
                whole = len(rows) == len(batch.requests)
                index = None if whole else self._to_device(torch.tensor(rows))
                batch.groups.append(DecodeGroup(beams, mode, rows, index, reqs))
        self._done(0, batch)

    def _to_device(self, x: _Movable) -> _Movable:
        """Host -> device on the current stream without blocking the thread: a pageable
        copy would wait for the stream (and so for the batches ahead of this one). A
        FeatureBatch moves packed: one pinned buffer and one copy instead of eight."""
        if self.device.type != "cuda":
            return x
        if isinstance(x, FeatureBatch):
            packed = pack_features(x, pin_memory=True).to(self.device, non_blocking=True)
            return unpack_features(packed, x.hist_sid.shape[2])
        return x.pin_memory().to(self.device, non_blocking=True)

    @torch.no_grad()
    def features(self, batch: BatchState) -> None:
        assert batch.features is not None
        with self._on(1, batch):
            batch.embedded = self.embedder(batch.features)
        self._done(1, batch)

    @torch.no_grad()
    def compute(self, batch: BatchState) -> None:
        assert batch.embedded is not None
        retrieval = batch.index.retrieval
        with self._on(2, batch):
            ctx = self.encoder(batch.embedded)
            search = batch.index.engine or BeamSearch(
                self.model.decoder, retrieval.tables, retrieval.level_offsets
            )
            for g in batch.groups:
                g = self._live(g, batch.live)
                if g is None:  # every request of the group was dropped: no decode run
                    continue
                sub = ctx if g.index is None else ctx[g.index]
                batch.decoded.append((g.rows, search.run(sub, g.requests, g.beams, g.mode)))
        self._done(2, batch)

    def _live(self, g: DecodeGroup, live: list[bool]) -> DecodeGroup | None:
        """The group narrowed to its live rows (requests dropped at the hand-off before
        this stage); None when none is left. On the current stage's stream."""
        keep = [j for j, row in enumerate(g.rows) if live[row]]
        if len(keep) == len(g.rows):
            return g
        if not keep:
            return None
        rows = [g.rows[j] for j in keep]
        at = self._to_device(torch.tensor(keep))
        reqs = g.requests
        if reqs is not None:
            reqs = RequestTensors(reqs.bitmask[at], reqs.blooms[at])
        index = self._to_device(torch.tensor(rows))
        return DecodeGroup(g.beams, g.mode, rows, index, reqs)

    def post(self, batch: BatchState) -> list[RetrievalResult]:
        if batch.event is not None:
            batch.event.synchronize()  # the decode results must be on the device
        decoded: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for rows, res in batch.decoded:
            leaves, scores = res.leaves.cpu().numpy(), res.scores.cpu().numpy()
            for j, i in enumerate(rows):
                live = leaves[j] >= 0
                decoded[i] = (leaves[j][live], scores[j][live])
        rows = batch.live_rows  # every live row was decoded: dead ones were dropped before
        generated = [decoded[i] for i in rows]
        posts = self.post_fn(batch, rows, generated)
        return [
            RetrievalResult(
                post=p,
                sids_generated=len(g[0]),
                index_version=batch.index.version,
                model_version=self.model_version,
                stage_ms=dict(batch.stage_ms),
            )
            for p, g in zip(posts, generated, strict=True)
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


def default_post(batch: BatchState, rows: Sequence[int], generated) -> list[PostResult]:
    """The C++ post stage of the batch's index (GIL released, requests in parallel) for
    the batch's `rows`; the Python reference when the index has none (e.g. one assembled
    in memory by tests)."""
    post = batch.index.post
    if post is None:
        return python_post(batch, rows, generated)
    vocabulary = batch.index.retrieval.vocabulary
    reqs = [batch.requests[i] for i in rows]
    return post.run(
        [
            PostRequest.from_targeting(leaves, scores, req.targeting, vocabulary, req.max_ads)
            for req, (leaves, scores) in zip(reqs, generated, strict=True)
        ]
    )


def python_post(batch: BatchState, rows: Sequence[int], generated) -> list[PostResult]:
    """The Python reference post stage, request by request."""
    reqs = [batch.requests[i] for i in rows]
    return reference_post(
        batch.index.retrieval, generated, [r.targeting for r in reqs], [r.max_ads for r in reqs]
    )
