"""The per-row e4m3 quantisation that FP8-emitting Triton kernels share
(`_triton_layer_norm` with FP8_OUT, `_triton_gelu_fp8`): the same numbers as
`kernels.fp8.quantize_rows`, computed on the fp32 rows a kernel already holds.

Runs under `TRITON_INTERPRET=1` on CPU tensors (tests); that switch must be set before
this module is imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

# globals a @triton.jit function reads must be constexpr (compiled kernels refuse others)
E4M3_MAX = tl.constexpr(448.0)  # torch.finfo(torch.float8_e4m3fn).max
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # the smallest normal fp32


@triton.jit
def quantize_rows_fp8(y, ok):
    """fp32 rows y [ROWS, BLOCK] (`ok`: the real elements) -> (y / scale clamped to ±448,
    ready to cast to e4m3; the fp32 scale [ROWS]: amax / 448, 1 for a zero row, never
    below the smallest normal fp32)."""
    amax = tl.max(tl.where(ok, tl.abs(y), 0.0), axis=1)
    scale = tl.where(amax > 0, tl.maximum(amax / E4M3_MAX, FP32_TINY), 1.0)
    q = tl.minimum(tl.maximum(y / scale[:, None], -E4M3_MAX), E4M3_MAX)
    return q, scale
