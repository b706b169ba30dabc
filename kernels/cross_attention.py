"""Cross-attention of beam rows to their request's context (paper §4.1, eq. 11–12).

Beam-as-query keeps K/V per request `[B, H, T_ctx, d_h]` and views the beam rows of one
request as its query sequence, so every K/V tile load serves all M beams of the request.
`cross_attention_per_beam` is the naive layout (K/V materialised per beam row), kept as
the equivalence oracle and the ablation baseline. The GPU kernel (#5) slots in behind
`cross_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_attention(
    q: torch.Tensor,  # [B * M, H, d_h], request-major rows: row b * M + m
    k: torch.Tensor,  # [B, H, T_ctx, d_h]
    v: torch.Tensor,  # [B, H, T_ctx, d_h]
) -> torch.Tensor:  # [B * M, H, d_h]
    """Beam-as-query: one attention call of M queries per request against shared K/V."""
    b, h, _, d = k.shape
    m = q.shape[0] // b
    qb = q.view(b, m, h, d).transpose(1, 2)  # [B, H, M, d_h]
    out = F.scaled_dot_product_attention(qb, k, v)  # [B, H, M, d_h]
    return out.transpose(1, 2).reshape(b * m, h, d)


def cross_attention_per_beam(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Naive layout: every beam row gets its own copy of its request's K/V (eq. 10)."""
    b = k.shape[0]
    m = q.shape[0] // b
    k_rows = k.repeat_interleave(m, dim=0)  # [B * M, H, T_ctx, d_h]: M copies per request
    v_rows = v.repeat_interleave(m, dim=0)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k_rows, v_rows)  # [B*M, H, 1, d_h]
    return out.squeeze(2)
