"""`gelu_tanh(x @ W.T + b)`: the FFN up-projection of the fused decoder step
(`service/decode/fused_step.py`, pipeline stage 3), behind one call with three backends.

- "cublaslt": one cuBLASLt matmul with the bias + tanh-GELU epilogue
  (`torch._addmm_activation`); CUDA only.
- "triton": the persistent TMA GEMM of `kernels/_triton_gelu_linear.py`, same epilogue
  in fp32; CUDA tensors its TMA rules accept (`supports`), and CPU tensors under
  `TRITON_INTERPRET=1` (tests).
- "reference": `F.gelu(F.linear(x, W, b), approximate="tanh")`, anywhere.
A call the Triton kernel cannot take goes to cuBLASLt on CUDA, and anything cuBLASLt
cannot take (CPU, autograd) to the reference, so CPU serving and odd layouts stay
correct. The decode loop's backend is `DecodeOptions.ffn_up` (served: cuBLASLt).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._tuning import INTERPRET

try:
    from kernels._triton_gelu_linear import supports, triton_gelu_linear
except ImportError:  # no triton on this machine: the reference serves every call
    supports = triton_gelu_linear = None  # type: ignore[assignment]

BACKENDS = ("cublaslt", "triton", "reference")


def gelu_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor,  # [N]
    backend: str = "cublaslt",
) -> torch.Tensor:  # [M, N], x's dtype
    """tanh-GELU of the linear layer's output, through `backend` where it applies."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if backend == "triton" and triton_gelu_linear is not None and (x.is_cuda or INTERPRET):
        if not grad and supports(x, weight, bias):
            return triton_gelu_linear(x, weight, bias)
        backend = "cublaslt"  # what the kernel cannot take (fp32, odd layouts)
    if backend == "cublaslt" and x.is_cuda and not grad and x.dim() == 2:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return gelu_linear_reference(x, weight, bias)


def gelu_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")
