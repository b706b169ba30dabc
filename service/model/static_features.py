"""The feature embedder at fixed shapes, one CUDA graph per batch bucket: the rest of
pipeline stage 2 on GPU (DESIGN.md §2), ahead of the encoder's graphs (static_encoder.py).

    stage 1: FeatureBatch ──pack_features──► int64 [B, K]: one pinned buffer, one copy
    stage 2: PackedFeatureBatch ──StaticFeatures──► EmbeddedFeatures at width max_history
    stage 3: ──► StaticEncoder

Eager, `FeatureEmbedder` launches ~20 small kernels per batch from the features thread,
and under load that Python dispatch competes for the GIL with the other stage threads;
here a batch costs a copy into its bucket's packed buffer, one replay and the copies out.
The graph unpacks the buffer itself (`unpack_features`), so any batch loads with one
copy: packed rows are event-major, so the zeros past a batch's width are masked padding
events, and all-zero rows past the batch are padding requests (index 0 everywhere, no
history). For the batch's rows and history positions the outputs equal the eager
embedder's (recency ranks count real events only); past them `seq` is zero and `keys`
False, which the encoder ignores. On CPU the same padded body runs eagerly; batches
larger than the largest bucket or wider than max_history take the eager embedder.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from service.capture import capture
from service.model.config import ModelConfig
from service.model.embeddings import EmbeddedFeatures, FeatureEmbedder
from service.model.features import (
    FeatureBatch,
    PackedFeatureBatch,
    pack_features,
    packed_columns,
    unpack_features,
)


@dataclass
class _Plan:
    packed: torch.Tensor  # int64 [bucket, K]: the static input, width max_history
    graph: torch.cuda.CUDAGraph | None = None
    out: EmbeddedFeatures | None = None  # the graph's outputs [bucket, ...]


class StaticFeatures:
    """`FeatureEmbedder` over fixed-shape buffers; call it like the embedder."""

    def __init__(
        self,
        embedder: FeatureEmbedder,
        config: ModelConfig,
        batch_buckets: tuple[int, ...] = (4, 16),
        warmup_runs: int = 2,
    ) -> None:
        self.embedder = embedder
        self.buckets = tuple(sorted(batch_buckets))
        self.width, self.sid_length = config.max_history, config.sid_length
        self.warmup_runs = warmup_runs
        self.device = next(embedder.parameters()).device
        self._plans: dict[int, _Plan] = {}
        self._pool = None
        self._lock = threading.Lock()

    @property
    def graphs(self) -> int:
        return sum(p.graph is not None for p in self._plans.values())

    @torch.no_grad()
    def warm(self) -> None:
        """Build (on CUDA: capture) every bucket's plan; call before serving."""
        with self._lock:
            for b in self.buckets:
                self._plan(b)

    @torch.no_grad()
    def __call__(self, f: FeatureBatch) -> EmbeddedFeatures:
        b, w = f.hist_mask.shape
        if b > self.buckets[-1] or w > self.width:
            return self.embedder(f)
        # stage 1's batches come packed; others (tests, callers off the pipeline) pack here
        packed = f.packed if isinstance(f, PackedFeatureBatch) else pack_features(f)
        bucket = next(k for k in self.buckets if k >= b)
        with self._lock:
            plan = self._plan(bucket)
            plan.packed.zero_()  # padding requests and events; wipes the previous batch
            plan.packed[:b, : packed.shape[1]].copy_(packed)
            if plan.graph is not None:
                plan.graph.replay()
                out = plan.out
            else:
                out = self._body(plan)
            assert out is not None
            # copies, before the next replay overwrites the outputs
            return EmbeddedFeatures(
                out.nonseq[:b].clone(), out.seq[:b].clone(), out.keys[:b].clone()
            )

    def _body(self, plan: _Plan) -> EmbeddedFeatures:
        return self.embedder(unpack_features(plan.packed, self.sid_length))

    def _plan(self, bucket: int) -> _Plan:
        if bucket in self._plans:
            return self._plans[bucket]
        k = packed_columns(self.width, self.sid_length)
        plan = _Plan(torch.zeros(bucket, k, dtype=torch.int64, device=self.device))
        if self.device.type == "cuda":
            self._capture(plan)
        self._plans[bucket] = plan
        return plan

    def _capture(self, plan: _Plan) -> None:
        """Warm up, then capture one padded forward (`service/capture.py`)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        plan.out = capture(
            graph,
            lambda: self._body(plan),
            device=self.device,
            pool=self._pool,
            warmup_runs=self.warmup_runs,
        )
        plan.graph = graph
