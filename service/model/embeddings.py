"""Feature embeddings: pipeline stage 2 (docs/MODEL.md "Architecture"), on its own thread
and stream while stage 3 encodes the batch before.

    FeatureBatch (features.py) ──FeatureEmbedder──► EmbeddedFeatures ──► ContextEncoder

A history event's token sums its SID-token embeddings (one table per SID position), its
type, time-gap bucket and recency rank (0 = newest, counting real events only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from service.model.config import ModelConfig
from service.model.features import (
    NUM_AGE_BUCKETS,
    NUM_COUNTRIES,
    NUM_EVENT_TYPES,
    NUM_GENDERS,
    FeatureBatch,
)

NUM_NONSEQ_TOKENS = 4  # user hash, country, age bucket, gender


@dataclass(frozen=True)
class EmbeddedFeatures:
    """Stage 2 -> stage 3 hand-off: the token streams the encoder interacts."""

    nonseq: torch.Tensor  # [B, NUM_NONSEQ_TOKENS, d_model]
    seq: torch.Tensor  # [B, L, d_model]: one token per history event, zeros at padding
    keys: torch.Tensor  # bool [B, NUM_NONSEQ_TOKENS + L]: tokens that take part in attention


class FeatureEmbedder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, d = config, config.d_model
        self.user_emb = nn.Embedding(c.user_hash_buckets, d)
        self.country_emb = nn.Embedding(NUM_COUNTRIES, d)
        self.age_emb = nn.Embedding(NUM_AGE_BUCKETS, d)
        self.gender_emb = nn.Embedding(NUM_GENDERS, d)
        # position-specific SID tokens: row p * vocab_size + token
        self.sid_emb = nn.Embedding(c.sid_length * c.vocab_size, d)
        self.type_emb = nn.Embedding(NUM_EVENT_TYPES, d)
        self.gap_emb = nn.Embedding(c.time_gap_buckets, d)
        self.recency_emb = nn.Embedding(c.max_history, d)
        for m in self.modules():
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        self._sid_rows = (c.sid_length, c.vocab_size)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)make the buffers no checkpoint holds: `load_checkpoint` builds the model on
        the meta device and calls this once the stored weights are in."""
        length, vocab = self._sid_rows
        offsets = torch.arange(length) * vocab  # [sid_length]
        self.register_buffer("sid_offsets", offsets, persistent=False)

    def forward(self, f: FeatureBatch) -> EmbeddedFeatures:
        tables = (self.user_emb, self.country_emb, self.age_emb, self.gender_emb)
        ids = (f.user_hash, f.country, f.age_bucket, f.gender)
        nonseq = torch.stack([t(i) for t, i in zip(tables, ids, strict=True)], dim=1)  # [B, N, d]
        mask = f.hist_mask  # [B, L]
        n_real = mask.sum(1, keepdim=True)  # [B, 1]
        pos = torch.arange(mask.shape[1], device=mask.device)  # [L]
        recency = (n_real - 1 - pos).clamp(min=0)  # [B, L]; 0 = newest, padding -> 0
        seq = (
            self.sid_emb(f.hist_sid + self.sid_offsets).sum(2)  # [B, L, d]: the SID bag
            + self.type_emb(f.hist_type)
            + self.gap_emb(f.hist_gap)
            + self.recency_emb(recency)
        )
        seq = seq * mask.unsqueeze(-1)  # padding carries no embedding
        keys = torch.cat([mask.new_ones(f.batch_size, NUM_NONSEQ_TOKENS), mask], dim=1)
        return EmbeddedFeatures(nonseq, seq, keys)
