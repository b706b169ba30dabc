"""Self-attention of one new SID token over the row's ≤ 4 cached prefix tokens.

The torch reference: the decode step gathers each row's cached keys/values (paged block
table or dense) and attends with one query per row. The Triton kernels of #5 (coalesced,
fused, paged) replace it behind `prefix_self_attention`.
"""

from __future__ import annotations

import math

import torch


def prefix_self_attention(
    q: torch.Tensor,  # [R, H, d_h]: the new token's query per row
    k: torch.Tensor,  # [R, t + 1, H, d_h]: keys of tokens 0..t (t included)
    v: torch.Tensor,  # [R, t + 1, H, d_h]
) -> torch.Tensor:  # [R, H, d_h]
    scores = torch.einsum("rhd,rthd->rht", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("rht,rthd->rhd", scores.softmax(dim=-1), v)
