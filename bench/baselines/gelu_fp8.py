"""Baseline (not served): `quantize_rows(GELU(h + bias))`, the rowwise FP8 FFN's middle
between its two rowwise GEMMs, as served until the up GEMM took the bias, the GELU and a
1 x 128 quantisation into its epilogue (`kernels.fp8_ffn`; DecodeOptions.fp8_ffn
"rowwise", docs/FP8.md).

Dispatcher: the Triton kernel (`_triton_gelu_fp8`: bias, activation and quantisation in
one pass; the tanh GELU's tanh by the hardware's `tanh.approx.f32`) on CUDA tensors, the
torch reference elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.baselines._triton_gelu_fp8 import MAX_N, triton_gelu_fp8
from kernels._tuning import INTERPRET
from kernels.fp8 import quantize_rows


def gelu_fp8(
    h: torch.Tensor,  # [R, N]: the up projection, without its bias
    bias: torch.Tensor,  # [N]
    tanh: bool,  # the model's activation: tanh-approximated GELU, else erf GELU
) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [R, N], fp32 scale [R, 1]
    """GELU(h + bias) in fp32, quantised per row (`kernels.fp8.quantize_rows`). On a GPU
    the tanh GELU takes tanh from `tanh.approx.f32` (relative error ~2^-11, below the
    2^-9 of the bf16 h it is applied to; docs/FP8.md has its cost and its tests)."""
    if h.is_cuda and h.shape[-1] <= MAX_N:
        h = h.contiguous() if h.stride(-1) != 1 else h
        return triton_gelu_fp8(h, bias, tanh, hw_tanh=tanh and not INTERPRET)
    return gelu_fp8_reference(h, bias, tanh)


def gelu_fp8_reference(
    h: torch.Tensor, bias: torch.Tensor, tanh: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of `gelu_fp8`: torch's GELU of h + bias in fp32, quantised by
    `kernels.fp8.quantize_rows`."""
    y = F.gelu(h.float() + bias.float(), approximate="tanh" if tanh else "none")
    return quantize_rows(y)
