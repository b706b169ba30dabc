"""Cross-attention variants the benchmarks compare against the served dispatcher
(`kernels/cross_attention.py`), none of them served.

- `cross_attention_per_beam`: the naive layout, K/V materialised per beam row (eq. 10) —
  the equivalence oracle of beam-as-query and the ablation baseline;
- `cross_attention_variant(q, k, v, backend)`: beam-as-query through one of `BACKENDS` —
  the served ones, SDPA pinned to flash, and our persistent Triton kernel
  (`_triton_cross_attention_persistent.py`: about one program per SM, pipelined Q loads,
  TMA for Q and O on sm90).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import cross_attention as served

try:
    from bench.baselines import _triton_cross_attention_persistent as _tcap
except ImportError:  # no triton on this machine
    _tcap = None  # type: ignore[assignment]

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
TRITON_BACKENDS = ("triton", "triton_persistent")
BACKENDS = (*TRITON_BACKENDS, *SDPA_BACKENDS, "reference")


def cross_attention_variant(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str
) -> torch.Tensor:
    """Beam-as-query through `backend` (one of BACKENDS), no fallback."""
    if backend == "triton_persistent":
        assert _tcap is not None, "triton is not installed"
        return _tcap.triton_cross_attention_persistent(q, k, v)
    if backend == "sdpa_flash":
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return served.sdpa_beam_as_query(q, k, v)
    return served.cross_attention(q, k, v, backend=backend)


def cross_attention_per_beam(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Naive layout: every beam row gets its own copy of its request's K/V (eq. 10)."""
    b = k.shape[0]
    m = q.shape[0] // b
    k_rows = k.repeat_interleave(m, dim=0)  # [B * M, H, T_ctx, d_h]: M copies per request
    v_rows = v.repeat_interleave(m, dim=0)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k_rows, v_rows)  # [B*M, H, 1, d_h]
    return out.squeeze(2)
