"""LayerNorm of a shifted input, `LN(x + shift)`, for the fused decoder step
(`service/decode/step.py`, pipeline stage 3). The fused step adds each linear layer's
output to the residual stream inside the matmul (cuBLAS `beta = 1`) but leaves the bias
out; the biases not yet added are one constant vector per LayerNorm, `shift`, added here
on the way in. The Triton kernel (`_triton_layer_norm`) on CUDA tensors, torch's
LayerNorm on the shifted fp32 input elsewhere.

The FP8 step's GEMMs cannot add into the residual stream (`torch._scaled_mm` has no
`beta = 1`), so it hands each projection to the next LayerNorm as a `residual`:
`add_layer_norm_fp8` adds it to the stream (rounded to the stream's dtype, as `x += r`
would) and returns the new stream and `LN(x + r + shift)` quantised per row, in one pass;
`layer_norm(..., residual=r)` does the add for the final norm, which needs no stream after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import quantize_rows

try:
    from kernels._triton_layer_norm import (
        MAX_D,
        triton_add_layer_norm_fp8,
        triton_layer_norm,
    )
except ImportError:  # no triton on this machine: the reference serves every call
    MAX_D, triton_layer_norm, triton_add_layer_norm_fp8 = 0, None, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous() if x.stride(-1) != 1 else x


def layer_norm(
    x: torch.Tensor,  # [R, D]
    weight: torch.Tensor,  # [D]
    bias: torch.Tensor,  # [D]
    eps: float,
    shift: torch.Tensor | None = None,  # fp32 [D], added to every row first
    residual: torch.Tensor | None = None,  # [R, D] in x's dtype, added to x before that
) -> torch.Tensor:  # [R, D], x's dtype
    """`F.layer_norm((x + residual) + shift)` computed in fp32, returned in x's dtype;
    `x + residual` is rounded to x's dtype first, as the residual stream would hold it."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if triton_layer_norm is not None and x.is_cuda and not grad and x.shape[-1] <= MAX_D:
        return triton_layer_norm(
            _rows(x), weight, bias, eps, shift, None if residual is None else _rows(residual)
        )
    return layer_norm_reference(x, weight, bias, eps, shift, residual)


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    shift: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    if residual is not None:
        x = x + residual  # in x's dtype: the residual stream's rounding
    if shift is None:
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    y = F.layer_norm(x.float() + shift, x.shape[-1:], weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def layer_norm_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`LN(x + shift)` in fp32 (torch's LayerNorm of the shifted fp32 rows), quantised
    per row by `kernels.fp8.quantize_rows`: what the FP8 kernels write."""
    y = F.layer_norm(x.float() + (0 if shift is None else shift), x.shape[-1:],
                     weight.float(), bias.float(), eps)  # fmt: skip
    return quantize_rows(y)


def add_layer_norm_fp8(
    x: torch.Tensor,  # [R, D]: the residual stream
    residual: torch.Tensor,  # [R, D] in x's dtype: a projection not yet added to it
    weight: torch.Tensor,  # [D]
    bias: torch.Tensor,  # [D]
    eps: float,
    shift: torch.Tensor | None = None,  # fp32 [D]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, q, scale): the stream's next value s = x + residual in x's dtype, and
    `layer_norm_fp8_reference(s, ...)`, in one pass on CUDA. x is left as it was."""
    if triton_add_layer_norm_fp8 is not None and x.is_cuda and x.shape[-1] <= MAX_D:
        return triton_add_layer_norm_fp8(_rows(x), _rows(residual), weight, bias, eps, shift)
    return add_layer_norm_fp8_reference(x, residual, weight, bias, eps, shift)


def add_layer_norm_fp8_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_layer_norm_fp8` in torch: `layer_norm_fp8_reference` of `x + residual`."""
    total = x + residual
    return (total, *layer_norm_fp8_reference(total, weight, bias, eps, shift))
