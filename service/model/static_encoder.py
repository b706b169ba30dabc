"""The context encoder at fixed shapes, one CUDA graph per batch bucket: the first half of
pipeline stage 3 on GPU. Eager, it launches ~150 small kernels per batch whose Python
dispatch competes for the GIL with the other threads; a replay is one launch. Inputs are
padded to (bucket, max_history); requests never interact and masked positions never reach
unmasked ones, so padding changes nothing. On CPU the same padded body runs eagerly;
inputs larger than the plans take the eager encoder.
"""

from __future__ import annotations

import torch

from service.capture import BucketGraphs
from service.model.embeddings import NUM_NONSEQ_TOKENS, EmbeddedFeatures
from service.model.encoder import ContextEncoder


class StaticEncoder(BucketGraphs[EmbeddedFeatures, EmbeddedFeatures, torch.Tensor]):
    """`ContextEncoder` over fixed-shape buffers; call it like the encoder."""

    def __init__(
        self,
        encoder: ContextEncoder,
        batch_buckets: tuple[int, ...] = (4, 16),
        warmup_runs: int = 2,
    ) -> None:
        param = next(encoder.parameters())
        super().__init__(batch_buckets, param.device, warmup_runs)
        self.encoder = encoder
        self.width = encoder.config.max_history
        self.dtype = param.dtype

    @torch.no_grad()
    def __call__(self, x: EmbeddedFeatures) -> torch.Tensor:  # [b, t_ctx, d_model]
        b, w = x.seq.shape[:2]
        if b > self.buckets[-1] or w > self.width:
            return self.encoder(x)
        return self._run(x, b)

    def _inputs(self, bucket: int) -> EmbeddedFeatures:
        c, n = self.encoder.config, NUM_NONSEQ_TOKENS
        kw = {"device": self.device}
        inputs = EmbeddedFeatures(
            torch.zeros(bucket, n, c.d_model, dtype=self.dtype, **kw),
            torch.zeros(bucket, self.width, c.d_model, dtype=self.dtype, **kw),
            torch.zeros(bucket, n + self.width, dtype=torch.bool, **kw),
        )
        inputs.keys[:, :n] = True  # what a padding request looks like: no history
        return inputs

    def _load(self, inputs: EmbeddedFeatures, batch: EmbeddedFeatures) -> None:
        """Rows past the batch become padding requests and positions past its width
        masked padding (stale rows of earlier batches are wiped)."""
        b, w = batch.seq.shape[:2]
        n = NUM_NONSEQ_TOKENS
        inputs.nonseq.zero_()
        inputs.seq.zero_()
        inputs.keys[:, n:] = False
        inputs.nonseq[:b].copy_(batch.nonseq, non_blocking=True)
        inputs.seq[:b, :w].copy_(batch.seq, non_blocking=True)
        inputs.keys[:b, : n + w].copy_(batch.keys, non_blocking=True)

    def _body(self, inputs: EmbeddedFeatures) -> torch.Tensor:
        return self.encoder(inputs)

    def _take(self, out: torch.Tensor, size: int) -> torch.Tensor:
        return out[:size].clone()  # before the next replay overwrites it
