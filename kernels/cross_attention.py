"""Cross-attention of beam rows to their request's context (paper §4.1, eq. 11–12), for the
decoder step of pipeline stage 3. Beam-as-query keeps K/V per request `[B, H, T_ctx, d_h]`
and views the beam rows of one request as its query sequence, so every K/V tile load
serves all M beams of the request.

Backends (`BACKENDS`) of `cross_attention`:
- "sdpa_cudnn": SDPA pinned to cuDNN on the `[B, H, M, d_h]` view — the CUDA path for
  bf16/fp16, the fastest measured (docs/PERFORMANCE.md);
- "sdpa_efficient": SDPA's memory-efficient kernel, the CUDA path for fp32 (no cuDNN);
- "reference": SDPA in fp32 on the same view — the CPU path and the tests' oracle.
The per-beam layout the benchmark compares is `bench/baselines/cross_attention.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("sdpa_cudnn", "sdpa_efficient", "reference")
_SDPA = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
_HALF = (torch.bfloat16, torch.float16)


def default_backend(q: torch.Tensor, k: torch.Tensor) -> str:
    """The backend `cross_attention` takes for these tensors when none is given."""
    if not q.is_cuda:
        return "reference"
    return "sdpa_cudnn" if k.dtype in _HALF else "sdpa_efficient"


def cross_attention(
    q: torch.Tensor,  # [B * M, H, d_h], request-major rows: row b * M + m
    k: torch.Tensor,  # [B, H, T_ctx, d_h]
    v: torch.Tensor,  # [B, H, T_ctx, d_h]
    backend: str | None = None,  # one of BACKENDS; None: `default_backend`
) -> torch.Tensor:  # [B * M, H, d_h], q's dtype, contiguous
    """Beam-as-query: one attention call of M queries per request against shared K/V."""
    backend = backend or default_backend(q, k)
    if backend == "reference":
        return cross_attention_reference(q, k, v)
    assert backend in _SDPA, f"unknown backend {backend!r}; one of {BACKENDS}"
    with sdpa_kernel(_SDPA[backend]):
        return sdpa_beam_as_query(q, k, v)


def sdpa_beam_as_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Beam-as-query through `F.scaled_dot_product_attention` with its own backend choice."""
    b, h, _, d = k.shape
    m = q.shape[0] // b
    qb = q.view(b, m, h, d).transpose(1, 2)  # [B, H, M, d_h]: a view, no copy (eq. 11)
    out = F.scaled_dot_product_attention(qb, k, v)  # [B, H, M, d_h]
    # flash writes [B, M, H, d_h] memory, so this is free there; other backends copy
    return out.transpose(1, 2).reshape(b * m, h, d).contiguous()


def cross_attention_reference(
    q: torch.Tensor,  # [B * M, H, d_h]
    k: torch.Tensor,  # [B, H, T_ctx, d_h]
    v: torch.Tensor,  # [B, H, T_ctx, d_h]
) -> torch.Tensor:  # [B * M, H, d_h], q's dtype
    """Beam-as-query through SDPA, computed in fp32 whatever the input dtype."""
    if not q.is_cuda:  # CPU: SDPA's own choice is fp32-exact and the fastest here
        return sdpa_beam_as_query(q.float(), k.float(), v.float()).to(q.dtype)
    # CUDA: the math backend (plain fp32 matmuls), not a fused kernel's tf32 tricks
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa_beam_as_query(q.float(), k.float(), v.float()).to(q.dtype)
