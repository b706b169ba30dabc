"""`gelu_tanh(x @ W.T + b)`: the FFN up-projection of the decoder step
(`service/decode/step.py`, pipeline stage 3). On CUDA (no autograd, 2-D input) one
cuBLASLt matmul with the bias + tanh-GELU epilogue (`torch._addmm_activation`); anywhere
else the reference, `F.gelu(F.linear(x, W, b), approximate="tanh")`, so CPU serving and
odd layouts stay correct.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor,  # [N]
) -> torch.Tensor:  # [M, N], x's dtype
    """tanh-GELU of the linear layer's output: cuBLASLt's epilogue where it applies."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if x.is_cuda and not grad and x.dim() == 2:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return gelu_linear_reference(x, weight, bias)


def gelu_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")
