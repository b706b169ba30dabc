"""The per-row e4m3 quantisation of the FP8 decoder step on the GPU: `quantize_rows_fp8`,
which FP8-emitting kernels share (`_triton_layer_norm` and `_triton_self_attention` with
FP8_OUT, `_triton_fp8_ffn` per 128 columns) on the fp32 rows they hold, and
`triton_quantize_rows`, one pass over a tensor no kernel emits in FP8 (the cross-attention
output): the numbers of `kernels.fp8.quantize_rows_reference`. Its configs and grid, `ROWS`
whole rows a program, are the LayerNorm kernel's too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._tuning import AUTOTUNE

# globals a @triton.jit function reads must be constexpr (compiled kernels refuse others)
E4M3_MAX = tl.constexpr(448.0)  # torch.finfo(torch.float8_e4m3fn).max
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # the smallest normal fp32


@triton.jit
def quantize_rows_fp8(y, ok):
    """fp32 rows y [ROWS, BLOCK] (`ok`: the real elements) -> (y / scale clamped to ±448,
    ready to cast to e4m3; the fp32 scale [ROWS]), the numbers of
    `kernels.fp8.quantize_rows_reference`. IEEE divisions (div_rn), as torch divides:
    compiled Triton's `/` is the approximate one (2 ulp), which would move values across
    e4m3 rounding ties now and then."""
    amax = tl.max(tl.where(ok, tl.abs(y), 0.0), axis=1)
    scale = tl.where(amax > 0, tl.maximum(tl.math.div_rn(amax, E4M3_MAX), FP32_TINY), 1.0)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return tl.minimum(tl.maximum(y * inv[:, None], -E4M3_MAX), E4M3_MAX), scale


MAX_K = 16384  # one row in one block


def empty_fp8_rows(r: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs an FP8-emitting kernel writes: e4m3 [r, k] and fp32 scales [r, 1]."""
    q = torch.empty((r, k), dtype=torch.float8_e4m3fn, device=device)
    return q, torch.empty((r, 1), dtype=torch.float32, device=device)


def row_configs() -> list[triton.Config]:
    if not AUTOTUNE:
        return [triton.Config({"ROWS": 2}, num_warps=4)]
    return [triton.Config({"ROWS": rows}, num_warps=w) for rows in (1, 2, 4, 8) for w in (2, 4, 8)]


def row_grid(r: int) -> Callable[[dict], tuple[int]]:
    return lambda meta: (triton.cdiv(r, meta["ROWS"]),)


@triton.autotune(configs=row_configs(), key=["K"])
@triton.jit
def _quantize_kernel(
    x_ptr,  # [R, K], last dim contiguous
    q_ptr,  # e4m3 [R, K], contiguous
    scale_ptr,  # fp32 [R]
    R,
    stride_x,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < R, cols < K
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    q, scale = quantize_rows_fp8(x.to(tl.float32), ok)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=ok)  # fmt: skip
    tl.store(scale_ptr + rows, scale, mask=row_ok)


def triton_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (last dim contiguous) -> (e4m3 [R, K], fp32 scale [R, 1]) in one pass:
    what `kernels.fp8.quantize_rows` computes as several torch passes."""
    r, k = x.shape
    assert x.stride(1) == 1 and k <= MAX_K, "rows must be contiguous and at most MAX_K wide"
    q, scale = empty_fp8_rows(r, k, x.device)
    if r == 0:
        return q, scale
    block_k = triton.next_power_of_2(k)
    _quantize_kernel[row_grid(r)](x, q, scale, r, x.stride(0), K=k, BLOCK_K=block_k)
    return q, scale
