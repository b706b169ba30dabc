"""The SID decoder (docs/MODEL.md "Architecture"): its weights and `forward_train`, teacher
forcing over all positions at once (causal), for training and for scoring given SIDs.
Inference runs one token for R beam rows at a time through `service/decode/step.py`,
reading the per-request cross-attention K/V of `cross_kv` (never per beam).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from service.model.config import ModelConfig

CrossKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [B, H, T_ctx, d_h]


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.h, self.dh = c.n_heads, c.d_head
        self.norm_self = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_attn)
        self.self_out = nn.Linear(c.d_attn, c.d_model)
        self.norm_cross = nn.LayerNorm(c.d_model)
        self.cross_q = nn.Linear(c.d_model, c.d_attn)
        self.cross_kv = nn.Linear(c.d_model, 2 * c.d_attn)
        self.cross_out = nn.Linear(c.d_attn, c.d_model)
        self.norm_ffn = nn.LayerNorm(c.d_model)
        self.ffn = nn.Sequential(
            nn.Linear(c.d_model, c.d_ff),
            nn.GELU(approximate="tanh" if c.ffn_activation == "gelu_tanh" else "none"),
            nn.Linear(c.d_ff, c.d_model),
        )

    def context_kv(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, T, d_model] -> K, V [B, H, T, d_h], once per request."""
        b, t, _ = ctx.shape
        k, v = self.cross_kv(ctx).view(b, t, 2, self.h, self.dh).permute(2, 0, 3, 1, 4)
        return k, v

    def forward_train(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]):
        """x [B, L, d_model] over all SID positions (causal)."""
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm_self(x)).view(b, n, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, L, d_h]
        x = x + self.self_out(a.transpose(1, 2).reshape(b, n, -1))
        q = self.cross_q(self.norm_cross(x)).view(b, n, self.h, self.dh).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, *kv)  # [B, H, L, d_h]
        x = x + self.cross_out(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.ffn(self.norm_ffn(x))

    @property
    def ffn_up(self) -> nn.Linear:
        return self.ffn[0]

    @property
    def ffn_down(self) -> nn.Linear:
        return self.ffn[2]

    def ffn_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The FFN's activated up-projection of the normalised input h."""
        return self.ffn[1](self.ffn[0](h))


class SIDDecoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = self.config = config
        self.bos = c.vocab_size
        # position-specific token tables: row [t, tok] embeds token tok fed at position t
        self.tok_emb = nn.Parameter(torch.randn(c.sid_length, c.vocab_size + 1, c.d_model) * 0.02)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size)

    def cross_kv(self, ctx: torch.Tensor) -> CrossKV:
        return [layer.context_kv(ctx) for layer in self.layers]

    def forward_train(self, ctx: torch.Tensor, sid: torch.Tensor) -> torch.Tensor:
        """ctx [B, T, d_model], sid [B, L] -> logits [B, L, V] for every position."""
        inputs = torch.cat([torch.full_like(sid[:, :1], self.bos), sid[:, :-1]], dim=1)
        pos = torch.arange(sid.shape[1], device=sid.device)
        x = self.tok_emb[pos, inputs]  # [B, L, d_model]
        for layer, kv in zip(self.layers, self.cross_kv(ctx), strict=True):
            x = layer.forward_train(x, kv)
        return self.head(self.norm(x))
