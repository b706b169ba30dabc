"""The bodies of the four pipeline stages (docs/ARCHITECTURE.md §2): each reads the record
of the stage before it (`records.py`), works on its own CUDA stream on GPU and returns its
own record. 1 input: features and targeting tensors, host -> device without blocking;
2 features: the embedder; 3 compute: the encoder, then one decode run per decode group;
4 post: the index's C++ post stage, one `RetrievalResult` per live request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import numpy as np
import torch

from contracts.request import FilterMode, Scoring
from contracts.targeting import MAX_REQUEST_LOCATIONS
from contracts.targeting_codec import TargetingError, codec
from contracts.tensors import RequestTensors
from service.capture import bucket_of
from service.model.feature_packing import pack_features, unpack_features
from service.model.features import FeatureBatch, UserFeatures, prepare_features
from service.model.retriever import GenerativeRetriever
from service.pipeline.records import (
    Batch,
    Decoded,
    DecodeGroup,
    DeviceGroup,
    Embedded,
    Packed,
    RetrievalResult,
    schedule_of,
)
from service.pipeline.runtime import ModelRuntime

log = logging.getLogger("grace.pipeline")

_Movable = TypeVar("_Movable", torch.Tensor, FeatureBatch)
# Batch sizes the GPU graphs are captured for: a batch runs padded to the next one, at its
# bucket's cost, so every even size (padding ≤ 1 request) at the price of start-up and swap
# time (docs/OPERATIONS.md; setting `graph_buckets`). The CPU runs batches at their size.
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
    """The device, streams and graph buckets shared by the stage threads; the model and
    the index come with each batch (`Batch.serving`)."""

    def __init__(
        self,
        device: str,
        max_batch: int = GRAPH_BUCKETS[-1],
        buckets: Sequence[int] | None = None,  # GPU graph bucket sizes (default GRAPH_BUCKETS)
        *,
        scoring: Scoring = "masked",  # every runtime's decode engine (settings `scoring`)
    ) -> None:
        self.device = torch.device(device)
        self.scoring: Scoring = scoring
        self.cuda = self.device.type == "cuda"
        every_size = tuple(range(1, max_batch + 1))  # CPU: no padding
        self.buckets = (graph_buckets(max_batch, GRAPH_BUCKETS if buckets is None else buckets)
                        if self.cuda else every_size)  # fmt: skip
        self.streams = [torch.cuda.Stream(self.device) if self.cuda else None for _ in range(4)]
        # GPU: Bloom rows pad to 64, few plans keep start-up and swaps short (the mask
        # reads each request's own rows of each family, `n_blooms`, never the padding)
        every = (1, 4, 16, MAX_REQUEST_LOCATIONS)
        self.locations = (MAX_REQUEST_LOCATIONS,) if self.cuda else every

    def runtime(
        self,
        model: GenerativeRetriever,
        *,
        version: str,
        model_version: str | None = None,
        sid_space: str = "",
        meta: dict[str, Any] | None = None,
    ) -> ModelRuntime:
        """`model` made ready to run on these stages (engine, GPU graphs over the buckets)."""
        return ModelRuntime(
            model, version=version, model_version=model_version or version,
            sid_space=sid_space, device=self.device, buckets=self.buckets,
            locations=self.locations, meta=meta, scoring=self.scoring,
        )  # fmt: skip

    def padding(self, groups: Sequence[DecodeGroup]) -> int:
        """Requests' worth of padding the decode runs of these groups compute
        (`grace_batch_padding_total`): each runs padded to its own bucket."""
        return sum(bucket_of(self.buckets, len(g.rows)) - len(g.rows) for g in groups)

    def settle(self, record: Packed | Embedded | Decoded | None, failed: int | None = None) -> None:
        """Wait until the device has run the stage that made `record` (so every stage before
        it) and what a `failed` stage queued: then nothing reads the batch's buffers."""
        if record is not None and record.event is not None:
            record.event.synchronize()
        if failed is not None and (event := self._event(failed)) is not None:
            event.synchronize()

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
        features = prepare_features(users, batch.serving.index.lookup, batch.serving.model.config)
        groups = []
        with self._on(0, None):
            moved = self._to_device(features)
            for g in batch.groups:
                targeting = None
                if g.mode != FilterMode.CD_ONLY:
                    by = codec(batch.serving.index.schema)  # the served index's schema
                    values = [reqs[i].targeting.values() for i in g.rows]
                    try:
                        enc = by.encode_requests(values)
                    except TargetingError:  # checked against the index served before a
                        # swap to a schema that reads it no more: unknown here, no ads at 4
                        enc = by.encode_requests([v if by.fits(v) else {} for v in values])
                    host = RequestTensors.from_encoded(enc)
                    assert host.n_blooms is not None  # the codec counts each family's rows
                    targeting = RequestTensors(
                        self._to_device(host.bitmask), self._to_device(host.blooms),
                        self._to_device(host.n_blooms),
                    )  # fmt: skip
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
    def features(self, batch: Batch, packed: Packed) -> Embedded:
        with self._on(1, packed.event):
            embedded = batch.serving.model.embedder(packed.features)
        return Embedded(embedded, packed.groups, self._event(1))

    @torch.no_grad()
    def compute(self, batch: Batch, embedded: Embedded, live: Sequence[bool]) -> Decoded:
        model, index = batch.serving.model, batch.serving.index
        plans = model.plans(index)
        runs = []
        state = index.live.state  # one catalog_seq for the whole batch, taken here
        with self._on(2, embedded.event):
            # the subtrees with no live ad at that seq barred, in stream order before this
            # batch's decode and after the batches' ahead of it
            index.pruning.sync(state.dead_entries, state.widened)
            ctx = model.encoder(embedded.embedded)
            for dg in embedded.groups:
                dg = self._live(dg, live)
                if dg is None:  # every request of the group was dropped: no decode run
                    continue
                g = dg.group
                sub = ctx if dg.index is None else ctx[dg.index]
                runs.append((g.rows, model.engine.run(plans, sub, dg.requests, g.beams, g.mode)))
        return Decoded(tuple(runs), self._event(2), state)

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
            reqs = reqs.rows(at)
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
        index, reqs, live = batch.serving.index, batch.requests, decoded.live
        requests = [index.post_request(*generated[i], reqs[i].targeting, reqs[i].max_ads)
                    for i in rows]  # fmt: skip
        posts = index.answer(requests, live)
        return [
            RetrievalResult(
                post=p,
                sids_generated=len(generated[i][0]),
                index_version=index.version,
                model_version=batch.serving.model.model_version,
                catalog_seq=live.seq,
                stage_ms=dict(stage_ms),
                batch_size=len(batch.pending),
                beams=schedule_of(reqs[i], batch.rung_beams),
                rung=batch.rung if reqs[i].adaptive else -1,
            )
            for p, i in zip(posts, rows, strict=True)
        ]
