"""Context encoder: the first half of pipeline stage 3 (docs/MODEL.md "Architecture").

    EmbeddedFeatures (stage 2) ──ContextEncoder──► ctx [B, t_ctx, d_model] ──► SID decoder

InterFormer-style: the non-sequence tokens and the behaviour-sequence tokens keep their own
streams; each pre-norm `_InteractionLayer` exchanges summaries both ways (sequence mean ->
non-sequence tokens; non-sequence mean -> a FiLM scale/shift of the sequence, zero-init so
it starts as the identity), then runs joint self-attention and an FFN. `t_ctx` learned
queries read out the context. Non-sequence tokens are never masked, so every attention
row has a valid key and an empty history gives finite outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from service.model.config import ModelConfig
from service.model.embeddings import EmbeddedFeatures


class _Attention(nn.Module):
    """Multi-head attention of queries `xq` over keys/values `xkv`, with a key mask."""

    def __init__(self, d_model: int, n_heads: int, d_head: int) -> None:
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_head
        self.q = nn.Linear(d_model, n_heads * d_head)
        self.kv = nn.Linear(d_model, 2 * n_heads * d_head)
        self.out = nn.Linear(n_heads * d_head, d_model)

    def forward(
        self,
        xq: torch.Tensor,  # [B, Q, d_model]
        xkv: torch.Tensor,  # [B, S, d_model]
        key_mask: torch.Tensor,  # bool [B, S], True = attend; >= 1 True per row
    ) -> torch.Tensor:  # [B, Q, d_model]
        b, q_len, _ = xq.shape
        s_len = xkv.shape[1]
        q = self.q(xq).view(b, q_len, self.n_heads, self.d_head).transpose(1, 2)  # [B,H,Q,dh]
        kv = self.kv(xkv).view(b, s_len, 2, self.n_heads, self.d_head)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, S, dh] each
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(b, q_len, self.n_heads * self.d_head))


class _FFN(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff)
        self.down = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B, L, d], mask bool [B, L] -> [B, d]; zeros for a row without real events."""
    w = mask.to(x.dtype).unsqueeze(-1)  # [B, L, 1]
    return (x * w).sum(1) / w.sum(1).clamp(min=1.0)


class _InteractionLayer(nn.Module):
    """Summary cross-talk, then a joint pre-norm transformer block (module docstring)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        d = c.d_model
        self.seq_summary_norm = nn.LayerNorm(d)
        self.nonseq_summary_norm = nn.LayerNorm(d)
        self.seq_to_nonseq = nn.Linear(d, d)
        self.nonseq_to_seq = nn.Linear(d, 2 * d)  # FiLM scale and shift
        nn.init.zeros_(self.nonseq_to_seq.weight)
        nn.init.zeros_(self.nonseq_to_seq.bias)
        self.attn_norm = nn.LayerNorm(d)
        self.attn = _Attention(d, c.n_heads, c.d_head)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = _FFN(d, c.encoder_d_ff)

    def forward(
        self,
        nonseq: torch.Tensor,  # [B, N, d]
        seq: torch.Tensor,  # [B, L, d]
        mask: torch.Tensor,  # bool [B, N + L]: keys that take part (non-seq always True)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = nonseq.shape[1]
        seq_summary = _masked_mean(self.seq_summary_norm(seq), mask[:, n:])  # [B, d]
        nonseq_summary = self.nonseq_summary_norm(nonseq).mean(1)  # [B, d]
        nonseq = nonseq + self.seq_to_nonseq(seq_summary).unsqueeze(1)
        scale, shift = self.nonseq_to_seq(nonseq_summary).unsqueeze(1).chunk(2, dim=-1)
        seq = seq * (1.0 + scale) + shift
        x = torch.cat([nonseq, seq], dim=1)  # [B, N + L, d]
        h = self.attn_norm(x)
        x = x + self.attn(h, h, mask)
        x = x + self.ffn(self.ffn_norm(x))
        return x[:, :n], x[:, n:]


class ContextEncoder(nn.Module):
    """EmbeddedFeatures (stage 2) -> context tokens [B, t_ctx, d_model] (module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, d = config, config.d_model
        self.config = config
        self.layers = nn.ModuleList(_InteractionLayer(c) for _ in range(c.encoder_layers))
        self.queries = nn.Parameter(torch.empty(c.t_ctx, d))  # [t_ctx, d]
        self.readout_q_norm = nn.LayerNorm(d)
        self.readout_kv_norm = nn.LayerNorm(d)
        self.readout = _Attention(d, c.n_heads, c.d_head)
        self.readout_ffn_norm = nn.LayerNorm(d)
        self.readout_ffn = _FFN(d, c.encoder_d_ff)
        self.out_norm = nn.LayerNorm(d)
        nn.init.normal_(self.queries, std=0.02)

    def forward(self, x: EmbeddedFeatures) -> torch.Tensor:  # [B, t_ctx, d_model]
        nonseq, seq, keys = x.nonseq, x.seq, x.keys
        for layer in self.layers:
            nonseq, seq = layer(nonseq, seq, keys)
        kv = self.readout_kv_norm(torch.cat([nonseq, seq], dim=1))  # [B, N + L, d]
        q = self.queries.unsqueeze(0).expand(nonseq.shape[0], -1, -1)  # [B, t_ctx, d]
        q = q + self.readout(self.readout_q_norm(q), kv, keys)
        q = q + self.readout_ffn(self.readout_ffn_norm(q))
        return self.out_norm(q)
