"""Baseline (not served): Triton bias + GELU + per-row FP8 quantisation, one pass, behind
`bench.baselines.gelu_fp8.gelu_fp8`: the FP8 step's FFN middle as served until the up
GEMM took it into its epilogue (`kernels._triton_fp8_ffn`; DecodeOptions.fp8_ffn
"rowwise", docs/FP8.md).

In that FFN the up projection is one rowwise FP8 GEMM without its bias; this kernel
reads that [R, N] output once, adds the bias, applies the model's GELU (tanh or erf),
and writes what the down projection's FP8 GEMM reads: each row divided by its scale
(its amax / 448; 1 for a zero row, never below the smallest normal fp32), clamped to
±448 and cast to e4m3, with the scale beside it — no bias add, activation or quantise
pass of their own. One program holds `ROWS` rows (N ≤ MAX_N), whole or in column chunks
(then read twice: once for the amax, once to quantise).

Runs under `TRITON_INTERPRET=1` on CPU tensors (tests); that switch must be set before
this module is imported.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._triton_fp8 import empty_fp8_rows, fp8_row_scale, fp8_scaled, quantize_rows_fp8
from kernels._triton_fp8_ffn import _gelu
from kernels._tuning import AUTOTUNE, INTERPRET

MAX_N = 16384  # the widest row the launcher takes


def _configs(n: int) -> list[triton.Config]:
    """A whole row in one block (one read of h, the row held in registers) or column
    chunks of 1,024 / 2,048 (two reads, the second mostly from L2, but far fewer registers
    per thread, so more blocks per SM hide the memory latency): the autotuner picks."""
    whole = triton.next_power_of_2(n)
    if not AUTOTUNE:
        return [triton.Config({"ROWS": 1, "BLOCK_N": whole}, num_warps=8)]
    out = [triton.Config({"ROWS": rows, "BLOCK_N": whole}, num_warps=w)
           for rows in (1, 2, 4) for w in (4, 8, 16)]  # fmt: skip
    out += [triton.Config({"ROWS": rows, "BLOCK_N": block}, num_warps=w)
            for block in (1024, 2048) if block < whole
            for rows in (1, 2, 4) for w in (4, 8)]  # fmt: skip
    return out


@triton.jit
def _gelu_chunk(h_rows, bias_ptr, row_ok, c, N: tl.constexpr, BLOCK_N: tl.constexpr,
                TANH: tl.constexpr, HW_TANH: tl.constexpr):  # fmt: skip
    """GELU(h + bias) of the rows' columns [c, c + BLOCK_N): (y, the columns, the mask)."""
    cols = c + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    h = tl.load(h_rows + cols[None, :], mask=ok, other=0.0)
    return _gelu(h, tl.load(bias_ptr + cols, mask=col_ok, other=0.0), TANH, HW_TANH), cols, ok


@triton.jit
def _gelu_fp8_kernel(
    h_ptr,  # [R, N], last dim contiguous
    bias_ptr,  # [N]
    q_ptr,  # e4m3 [R, N], contiguous
    scale_ptr,  # fp32 [R]
    R,
    stride_h,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,  # >= N: the whole row at once; else column chunks, two passes
    ROWS: tl.constexpr,
    TANH: tl.constexpr,  # tanh-approximated GELU, else erf GELU
    HW_TANH: tl.constexpr,  # with TANH: the hardware's tanh.approx (served on a GPU)
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < R
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * N
    if BLOCK_N >= N:  # one pass: the row stays in registers between its amax and its codes
        y, cols, ok = _gelu_chunk(h_rows, bias_ptr, row_ok, 0, N, BLOCK_N, TANH, HW_TANH)
        q, scale = quantize_rows_fp8(y, ok)
        tl.store(q_rows + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    else:  # the row's amax over its chunks, then each chunk again, quantised
        amax = tl.zeros((ROWS,), tl.float32)
        for c in tl.range(0, N, BLOCK_N):
            y, cols, ok = _gelu_chunk(h_rows, bias_ptr, row_ok, c, N, BLOCK_N, TANH, HW_TANH)
            amax = tl.maximum(amax, tl.max(tl.where(ok, tl.abs(y), 0.0), axis=1))
        scale = fp8_row_scale(amax)
        for c in tl.range(0, N, BLOCK_N):
            y, cols, ok = _gelu_chunk(h_rows, bias_ptr, row_ok, c, N, BLOCK_N, TANH, HW_TANH)
            tl.store(q_rows + cols[None, :], fp8_scaled(y, scale).to(q_ptr.dtype.element_ty),
                     mask=ok)  # fmt: skip
    tl.store(scale_ptr + rows, scale, mask=row_ok)


@functools.cache
def _tuned(n: int) -> triton.runtime.Autotuner:
    """The kernel autotuned over `_configs(n)` (they depend on the row's width)."""
    return triton.autotune(configs=_configs(n), key=["N", "TANH", "HW_TANH"])(_gelu_fp8_kernel)


def triton_gelu_fp8(
    h: torch.Tensor,  # [R, N], last dim contiguous
    bias: torch.Tensor,  # [N]
    tanh: bool,
    config: triton.Config | None = None,  # tests: this config instead of the autotuner's
    hw_tanh: bool = False,  # with tanh: the hardware's tanh.approx (a GPU; served)
) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [R, N], fp32 scale [R, 1]
    """Launch the kernel: `quantize_rows(GELU(h + bias))`, one read of h or two."""
    r, n = h.shape
    if hw_tanh and (INTERPRET or not tanh):
        raise ValueError("hw_tanh is the tanh GELU's, on a GPU (the interpreter has no PTX)")
    assert h.stride(1) == 1 and n <= MAX_N, "rows must be contiguous and at most MAX_N wide"
    assert bias.shape == (n,)
    q, scale = empty_fp8_rows(r, n, h.device)
    if r == 0:
        return q, scale

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(r, meta["ROWS"]),)

    kernel = _tuned(n) if config is None else _gelu_fp8_kernel
    extra = {} if config is None else {**config.kwargs, "num_warps": config.num_warps}
    kernel[grid](h, bias, q, scale, r, h.stride(0), N=n, TANH=tanh, HW_TANH=hw_tanh, **extra)
    return q, scale
