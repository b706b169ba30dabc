"""The FP8 decoder step's FFN (`service/decode/step.py`, pipeline stage 3; docs/FP8.md):

    LN kernel ─► e4m3 x + row scales ─► `fp8_up_gelu` ─► e4m3 h + 1 x 128 scales
              ─► `kernels.fp8.block_fp8_gemm` (128 x 128 weight scales) ─► bf16 out

`fp8_up_gelu` is one kernel on CUDA where K and N are multiples of 16 (`_triton_fp8_ffn`);
elsewhere (CPU serving, other shapes, the tests' oracle) `fp8_up_gelu_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import Fp8Weight, quantize_row_blocks

try:
    from kernels._triton_fp8_ffn import tma_loadable, triton_fp8_up_gelu
except ImportError:  # no triton on this machine: the reference serves every call
    tma_loadable = triton_fp8_up_gelu = None


def fp8_up_gelu(
    xq: torch.Tensor,  # e4m3 [R, K]: the LayerNorm kernel's output
    xs: torch.Tensor,  # fp32 [R, 1]
    w: Fp8Weight,  # the up projection's weight [N, K]
    bias: torch.Tensor,  # [N]
    tanh: bool,  # the model's activation: tanh-approximated GELU, else erf GELU
) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [R, N], fp32 [R, ceil(N / 128)]
    """GELU((xq · xs) @ w.T + bias), quantised per row and 128 columns (on a GPU in the
    tensor cores' precision and with a hardware tanh: `_triton_fp8_ffn`)."""
    if triton_fp8_up_gelu is not None and xq.is_cuda and tma_loadable(xq.shape[1], w.q.shape[0]):
        return triton_fp8_up_gelu(xq, xs, w, bias, tanh)
    return fp8_up_gelu_reference(xq, xs, w, bias, tanh)


def fp8_up_gelu_reference(
    xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, bias: torch.Tensor, tanh: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `fp8_up_gelu` computes, in fp32 from the dequantised operands."""
    y = (xq.float() * xs) @ w.dequantized().t() + bias.float()
    return quantize_row_blocks(F.gelu(y, approximate="tanh" if tanh else "none"))
