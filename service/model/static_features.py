"""The feature embedder at fixed shapes, one CUDA graph per batch bucket: pipeline stage 2
on GPU. Eager, `FeatureEmbedder` launches ~20 small kernels per batch competing for the
GIL; here a batch costs one copy into its bucket's packed buffer (`feature_packing.py`),
one replay and the copies out. Zeros past a batch's width are masked padding events and
all-zero rows past the batch padding requests, which the encoder ignores. On CPU the same
body runs eagerly; inputs larger than the plans take the eager embedder.
"""

from __future__ import annotations

import torch

from service.capture import BucketGraphs
from service.model.config import ModelConfig
from service.model.embeddings import EmbeddedFeatures, FeatureEmbedder
from service.model.feature_packing import (
    PackedFeatureBatch,
    pack_features,
    packed_columns,
    unpack_features,
)
from service.model.features import FeatureBatch


class StaticFeatures(BucketGraphs[torch.Tensor, torch.Tensor, EmbeddedFeatures]):
    """`FeatureEmbedder` over fixed-shape buffers; call it like the embedder. A bucket's
    static input is one packed int64 [bucket, K] buffer at width max_history."""

    def __init__(
        self,
        embedder: FeatureEmbedder,
        config: ModelConfig,
        batch_buckets: tuple[int, ...] = (4, 16),
        warmup_runs: int = 2,
    ) -> None:
        super().__init__(batch_buckets, next(embedder.parameters()).device, warmup_runs)
        self.embedder = embedder
        self.width, self.sid_length = config.max_history, config.sid_length

    @torch.no_grad()
    def __call__(self, f: FeatureBatch) -> EmbeddedFeatures:
        b, w = f.hist_mask.shape
        if b > self.buckets[-1] or w > self.width:
            return self.embedder(f)
        # stage 1's batches come packed; others (tests, callers off the pipeline) pack here
        packed = f.packed if isinstance(f, PackedFeatureBatch) else pack_features(f)
        return self._run(packed, b)

    def _inputs(self, bucket: int) -> torch.Tensor:
        k = packed_columns(self.width, self.sid_length)
        return torch.zeros(bucket, k, dtype=torch.int64, device=self.device)

    def _load(self, inputs: torch.Tensor, batch: torch.Tensor) -> None:
        inputs.zero_()  # padding requests and events; wipes the previous batch
        inputs[: batch.shape[0], : batch.shape[1]].copy_(batch)

    def _body(self, inputs: torch.Tensor) -> EmbeddedFeatures:
        return self.embedder(unpack_features(inputs, self.sid_length))

    def _take(self, out: EmbeddedFeatures, size: int) -> EmbeddedFeatures:
        # copies, before the next replay overwrites the outputs
        return EmbeddedFeatures(
            out.nonseq[:size].clone(), out.seq[:size].clone(), out.keys[:size].clone()
        )
