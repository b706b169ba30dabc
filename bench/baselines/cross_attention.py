"""Cross-attention forms the benchmarks compare with the served dispatcher
(`kernels/cross_attention.py`); none of them is served.

- `cross_attention_per_beam`: the naive layout, K/V materialised per beam row (eq. 10) —
  the paper's baseline and the equivalence oracle of beam-as-query (Appendix B);
- `beam_as_query(q, k, v, backend)`: beam-as-query (eq. 11–12) through SDPA pinned to one
  of `SDPA_BACKENDS`, no fallback: flash (not served), cuDNN (served for bf16/fp16),
  memory-efficient (served for fp32).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.cross_attention import sdpa_beam_as_query

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def beam_as_query(
    q: torch.Tensor,  # [B * M, H, d_h], request-major rows
    k: torch.Tensor,  # [B, H, T_ctx, d_h]
    v: torch.Tensor,  # [B, H, T_ctx, d_h]
    backend: str,  # one of SDPA_BACKENDS
) -> torch.Tensor:  # [B * M, H, d_h]
    """Beam-as-query through SDPA pinned to `backend`; raises if it cannot run here."""
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return sdpa_beam_as_query(q, k, v)


def cross_attention_per_beam(
    q: torch.Tensor,  # [B * M, H, d_h]
    k: torch.Tensor,  # [B, H, T_ctx, d_h]
    v: torch.Tensor,  # [B, H, T_ctx, d_h]
    backend: str | None = None,  # one of SDPA_BACKENDS; None: SDPA's own choice
) -> torch.Tensor:  # [B * M, H, d_h]
    """Naive layout: every beam row gets its own copy of its request's K/V (eq. 10)."""
    m = q.shape[0] // k.shape[0]
    k_rows = k.repeat_interleave(m, dim=0)  # [B * M, H, T_ctx, d_h]: M copies per request
    v_rows = v.repeat_interleave(m, dim=0)
    pin = sdpa_kernel(SDPA_BACKENDS[backend]) if backend else contextlib.nullcontext()
    with pin:  # one query per row: [B * M, H, 1, d_h]
        return F.scaled_dot_product_attention(q.unsqueeze(2), k_rows, v_rows).squeeze(2)
