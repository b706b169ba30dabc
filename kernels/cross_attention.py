"""Cross-attention of beam rows to their request's context (paper §4.1, eq. 11–12).

Beam-as-query keeps K/V per request `[B, H, T_ctx, d_h]` and views the beam rows of one
request as its query sequence, so every K/V tile load serves all M beams of the request.
`cross_attention_per_beam` is the naive layout (K/V materialised per beam row), kept as
the equivalence oracle and the ablation baseline.

`cross_attention` is the dispatcher the decoder calls. Backends (`BACKENDS`):
- "triton": our kernel (`kernels/_triton_cross_attention.py`), one program per (b, h, run
  of beam tiles), T_ctx ≤ 256 (less for fp32 at large d_h: `supports`);
- "triton_persistent": the same tile maths on a persistent grid (about one program per
  SM) with pipelined Q loads and, on sm90, TMA for Q and O
  (`kernels/_triton_cross_attention_persistent.py`); same limits, its own `supports`;
- "sdpa_flash" / "sdpa_cudnn" / "sdpa_efficient": PyTorch SDPA pinned to one backend on
  the `[B, H, M, d_h]` view;
- "reference": SDPA in fp32 on the same view — the CPU path and the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from kernels import _triton_cross_attention as _tca
    from kernels import _triton_cross_attention_persistent as _tcap

    # backend -> (supports(T_ctx, d_h, dtype), launcher(q, k, v))
    TRITON_KERNELS = {
        "triton": (_tca.supports, _tca.triton_cross_attention),
        "triton_persistent": (_tcap.supports, _tcap.triton_cross_attention_persistent),
    }
except ImportError:  # no triton on this machine: SDPA and the reference still work
    TRITON_KERNELS = {}

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
TRITON_BACKENDS = ("triton", "triton_persistent")
BACKENDS = (*TRITON_BACKENDS, *SDPA_BACKENDS, "reference")

# The backend for CUDA tensors, by measurement (bench/results/cross_attention.json, H200,
# B 16, M 1024, H 16, d_h 128, T_ctx 128, bf16): cuDNN 0.052 ms, our Triton kernel
# 0.071 ms, flash 0.093 ms ("triton_persistent" not measured yet). cuDNN has no fp32:
# those calls take the Triton kernel. Read at call time, so the bench may switch it.
GPU_BACKEND = "sdpa_cudnn"
_HALF = (torch.bfloat16, torch.float16)


def cross_attention(
    q: torch.Tensor,  # [B * M, H, d_h], request-major rows: row b * M + m
    k: torch.Tensor,  # [B, H, T_ctx, d_h]
    v: torch.Tensor,  # [B, H, T_ctx, d_h]
    backend: str | None = None,  # one of BACKENDS; None: GPU_BACKEND on CUDA, else reference
) -> torch.Tensor:  # [B * M, H, d_h], q's dtype, contiguous
    """Beam-as-query: one attention call of M queries per request against shared K/V."""
    if backend is None:
        backend = GPU_BACKEND if q.is_cuda else "reference"
        if backend in ("sdpa_cudnn", "sdpa_flash") and k.dtype not in _HALF:
            backend = "triton"
        if backend in TRITON_BACKENDS and (
            backend not in TRITON_KERNELS or not TRITON_KERNELS[backend][0](*k.shape[2:], k.dtype)
        ):
            # the kernels hold the whole context in one block; flash has no fp32
            backend = "sdpa_efficient" if k.dtype == torch.float32 else "sdpa_flash"
    if backend in TRITON_BACKENDS:
        assert backend in TRITON_KERNELS, "triton is not installed"
        return TRITON_KERNELS[backend][1](q, k, v)
    if backend == "reference":
        return cross_attention_reference(q, k, v)
    assert backend in SDPA_BACKENDS, f"unknown backend {backend!r}; one of {BACKENDS}"
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return _sdpa_beam_as_query(q, k, v)


def _sdpa_beam_as_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
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
        return _sdpa_beam_as_query(q.float(), k.float(), v.float()).to(q.dtype)
    # CUDA: the math backend (plain fp32 matmuls), not a fused kernel's tf32 tricks
    with sdpa_kernel(SDPBackend.MATH):
        return _sdpa_beam_as_query(q.float(), k.float(), v.float()).to(q.dtype)


def cross_attention_per_beam(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Naive layout: every beam row gets its own copy of its request's K/V (eq. 10)."""
    b = k.shape[0]
    m = q.shape[0] // b
    k_rows = k.repeat_interleave(m, dim=0)  # [B * M, H, T_ctx, d_h]: M copies per request
    v_rows = v.repeat_interleave(m, dim=0)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k_rows, v_rows)  # [B*M, H, 1, d_h]
    return out.squeeze(2)
