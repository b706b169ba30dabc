"""Triton bias + GELU + FP8 quantisation, one pass: the GPU fast path behind
`kernels.gelu_fp8.gelu_fp8` (pipeline stage 3, the FP8 decoder step's FFN).

In the FP8 step the FFN up projection is one FP8 GEMM without its bias; this kernel
reads that [R, N] output once, adds the bias, applies the model's GELU (tanh or erf),
and writes what the down projection's FP8 GEMM reads: each row divided by its scale
(its amax / 448; 1 for a zero row, never below the smallest normal fp32), clamped to
±448 and cast to e4m3, with the scale beside it — no bias add, activation or quantise
pass of their own. One program holds `ROWS` whole rows (N ≤ MAX_N).

Runs under `TRITON_INTERPRET=1` on CPU tensors (tests); that switch must be set before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_fp8 import empty_fp8_rows, quantize_rows_fp8
from kernels._tuning import AUTOTUNE

MAX_N = 16384  # one row in one block
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # jit globals must be constexpr
SQRT_HALF = tl.constexpr(0.7071067811865476)


def _configs() -> list[triton.Config]:
    if not AUTOTUNE:
        return [triton.Config({"ROWS": 1}, num_warps=8)]
    return [triton.Config({"ROWS": rows}, num_warps=w) for rows in (1, 2, 4) for w in (4, 8, 16)]


@triton.autotune(configs=_configs(), key=["N", "TANH"])
@triton.jit
def _gelu_fp8_kernel(
    h_ptr,  # [R, N], last dim contiguous
    bias_ptr,  # [N]
    q_ptr,  # e4m3 [R, N], contiguous
    scale_ptr,  # fp32 [R]
    R,
    stride_h,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    TANH: tl.constexpr,  # tanh-approximated GELU, else erf GELU
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < R, cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :], mask=ok, other=0.0)
    x = h.to(tl.float32) + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if TANH:  # 0.5 x (1 + tanh(u)); tanh(|u| > 20) is ±1 in fp32, and exp never overflows
        u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.abs(u), 20.0)) + 1.0)
        y = 0.5 * x * (1.0 + tl.where(u < 0, -t, t))
    else:
        y = 0.5 * x * (1.0 + tl.erf(x * SQRT_HALF))
    q, scale = quantize_rows_fp8(y, ok)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=ok)  # fmt: skip
    tl.store(scale_ptr + rows, scale, mask=row_ok)


def triton_gelu_fp8(
    h: torch.Tensor,  # [R, N], last dim contiguous
    bias: torch.Tensor,  # [N]
    tanh: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [R, N], fp32 scale [R, 1]
    """Launch the kernel: `quantize_rows(GELU(h + bias))` in one pass."""
    r, n = h.shape
    assert h.stride(1) == 1 and n <= MAX_N, "rows must be contiguous and at most MAX_N wide"
    assert bias.shape == (n,)
    q, scale = empty_fp8_rows(r, n, h.device)
    if r == 0:
        return q, scale

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(r, meta["ROWS"]),)

    _gelu_fp8_kernel[grid](
        h, bias, q, scale, r, h.stride(0), N=n, BLOCK_N=triton.next_power_of_2(n), TANH=tanh
    )
    return q, scale
