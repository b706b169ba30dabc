"""The generative retriever: embedder + encoder + SID decoder as one module, which training,
checkpoints and the serving runtime hold; its parameter names are the checkpoint's tensor
names (`embedder.*`, `encoder.*`, `decoder.*`). docs/ARCHITECTURE.md §6.
"""

from __future__ import annotations

import torch
from torch import nn

from service.model.config import ModelConfig
from service.model.embeddings import EmbeddedFeatures, FeatureEmbedder
from service.model.encoder import ContextEncoder
from service.model.features import FeatureBatch


class GenerativeRetriever(nn.Module):
    """FeatureEmbedder + ContextEncoder + SIDDecoder (`decoder` overrides the default)."""

    def __init__(self, config: ModelConfig, decoder: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.embedder = FeatureEmbedder(config)
        self.encoder = ContextEncoder(config)
        if decoder is None:
            from service.model.decoder import SIDDecoder  # lazy: keeps the encoder importable

            decoder = SIDDecoder(config)
        self.decoder = decoder

    def embed(self, features: FeatureBatch) -> EmbeddedFeatures:  # stage 2
        return self.embedder(features)

    def encode(self, features: FeatureBatch) -> torch.Tensor:  # [B, t_ctx, d_model]
        """Stages 2 and 3 together (training, evaluation)."""
        return self.encoder(self.embedder(features))

    def forward_train(
        self,
        features: FeatureBatch,
        target_sid: torch.Tensor,  # int64 [B, sid_length]
    ) -> torch.Tensor:  # [B, sid_length, vocab_size]: logits of token t given tokens < t
        return self.decoder.forward_train(self.encode(features), target_sid)

    def forward(self, features: FeatureBatch, target_sid: torch.Tensor) -> torch.Tensor:
        return self.forward_train(features, target_sid)
