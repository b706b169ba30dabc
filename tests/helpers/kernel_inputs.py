"""Inputs and tolerances shared by the kernel tests of the served path (tests/kernels/) and
of the benchmark baselines (tests/bench/)."""

from __future__ import annotations

import torch

from kernels.gelu_linear import gelu_linear_reference

# cross-attention — fp32: exact dots (ieee), so only summation order differs; 16-bit: P is
# rounded to the input dtype before P·V and the output is rounded once
ATTENTION_TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
GELU_TOL = {"atol": 3e-2, "rtol": 3e-2}  # bf16/fp16 output of an fp32 accumulation


def attention_inputs(
    b: int, m: int, h: int, t_ctx: int, d: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B·M, H, d_h], k and v [B, H, T_ctx, d_h], seeded by the shape."""
    g = torch.Generator().manual_seed(b * 1000 + m * 10 + t_ctx + d)
    q = torch.randn(b * m, h, d, generator=g)
    k = torch.randn(b, h, t_ctx, d, generator=g)
    v = torch.randn(b, h, t_ctx, d, generator=g)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))  # type: ignore[return-value]


def gelu_inputs(m: int, k: int, n: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """x [M, K], W [N, K] (scaled by 1/√K), b [N]."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device=device).to(dtype)
    return x, w, b


def gelu_want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fp32 reference of the up-projection."""
    return gelu_linear_reference(x.float(), w.float(), b.float())
