"""Triton LayerNorm of `x + shift`, with an optional pending `residual` added to x first:
the GPU path behind `kernels.layer_norm` (which says why both ride here). One program
normalises `ROWS` rows of width D (the whole row in one block) in fp32 and writes them in
x's dtype or, with `FP8_OUT`, quantised per row for the FP8 GEMM that reads them
(`_triton_fp8.quantize_rows_fp8`). The row is in registers, so neither the adds nor the
quantisation cost a pass over the bytes of their own. With `STORE_SUM` it also writes
`x + residual` (rounded to x's dtype, as `x += residual` would store it) as the residual
stream's next value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_fp8 import empty_fp8_rows, quantize_rows_fp8, row_configs, row_grid

MAX_D = 16384  # one row in one block


@triton.autotune(configs=row_configs(), key=["D", "HAS_SHIFT", "HAS_RES", "STORE_SUM", "FP8_OUT"])
@triton.jit
def _layer_norm_kernel(
    x_ptr,  # [R, D], last dim contiguous
    res_ptr,  # [R, D] in x's dtype, last dim contiguous (unused without HAS_RES)
    sum_ptr,  # out: [R, D] in x's dtype, contiguous: x + res (unused without STORE_SUM)
    shift_ptr,  # fp32 [D] (unused without HAS_SHIFT)
    w_ptr,  # [D]
    b_ptr,  # [D]
    y_ptr,  # [R, D], contiguous (e4m3 with FP8_OUT)
    scale_ptr,  # fp32 [R] (unused without FP8_OUT)
    R,
    stride_x,
    stride_res,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_RES: tl.constexpr,
    STORE_SUM: tl.constexpr,
    FP8_OUT: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < R, cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if HAS_RES:  # the stream's add, rounded to its dtype as `x += res` would round it
        res = tl.load(
            res_ptr + rows.to(tl.int64)[:, None] * stride_res + cols[None, :], mask=ok, other=0.0
        )
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(sum_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], x, mask=ok)
    x = x.to(tl.float32)
    if HAS_SHIFT:
        x += tl.load(shift_ptr + cols, mask=col_ok, other=0.0)[None, :]
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
    if FP8_OUT:
        q, scale = quantize_rows_fp8(y, ok)
        tl.store(out, q.to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
    else:
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=ok)


def triton_layer_norm(
    x: torch.Tensor,  # [R, D], last dim contiguous
    weight: torch.Tensor,  # [D]
    bias: torch.Tensor,  # [D]
    eps: float,
    shift: torch.Tensor | None = None,  # fp32 [D]
    residual: torch.Tensor | None = None,  # [R, D] in x's dtype, last dim contiguous
) -> torch.Tensor:  # [R, D], x's dtype, contiguous
    """`LN(x + residual + shift)`, the first add rounded to x's dtype."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, eps, shift, y, None, residual, None)
    return y


def triton_add_layer_norm_fp8(
    x: torch.Tensor,  # [R, D], last dim contiguous: the residual stream
    residual: torch.Tensor,  # [R, D] in x's dtype, last dim contiguous: a pending add
    weight: torch.Tensor,  # [D]
    bias: torch.Tensor,  # [D]
    eps: float,
    shift: torch.Tensor | None = None,  # fp32 [D]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, e4m3 [R, D], fp32 scale [R, 1]): s = x + residual in x's dtype (contiguous), and
    `LN(s + shift)` quantised per row for an FP8 GEMM, in one pass."""
    y, scale = empty_fp8_rows(*x.shape, x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, eps, shift, y, scale, residual, total)
    return total, y, scale


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    shift: torch.Tensor | None,
    y: torch.Tensor,  # out: [R, D] in x's dtype, or e4m3 with `scale`
    scale: torch.Tensor | None,  # out: fp32 [R, 1] (FP8 output), or None
    residual: torch.Tensor | None,  # [R, D] in x's dtype, added to x first, or None
    total: torch.Tensor | None,  # out: [R, D] contiguous, x + residual (or None)
) -> None:
    r, d = x.shape
    assert x.stride(1) == 1 and d <= MAX_D, "rows must be contiguous and at most MAX_D wide"
    assert shift is None or (shift.dtype == torch.float32 and shift.shape == (d,))
    assert residual is None or (
        residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
    ), "the residual must match x's shape and dtype, rows contiguous"
    assert total is None or residual is not None
    if r == 0:
        return
    block_d = triton.next_power_of_2(d)
    _layer_norm_kernel[row_grid(r)](
        x, residual if residual is not None else x, total if total is not None else x,
        shift if shift is not None else weight, weight, bias, y,
        scale if scale is not None else weight, r, x.stride(0),
        residual.stride(0) if residual is not None else 0, eps,
        D=d, BLOCK_D=block_d, HAS_SHIFT=shift is not None, HAS_RES=residual is not None,
        STORE_SUM=total is not None, FP8_OUT=scale is not None,
    )  # fmt: skip
