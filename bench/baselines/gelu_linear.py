"""The FFN up-projection through our persistent Triton GEMM with a bias + tanh-GELU
epilogue (`_triton_gelu_linear.py`), the alternative to the served cuBLASLt epilogue
(`kernels/gelu_linear.py`) that bench/bench_gelu_linear.py and the decode ladder time.

`gelu_linear_triton` takes CUDA tensors the kernel's TMA rules accept (`supports`) and CPU
tensors under `TRITON_INTERPRET=1` (tests); anything else goes to the served dispatcher.
"""

from __future__ import annotations

import torch

from kernels._tuning import INTERPRET
from kernels.gelu_linear import gelu_linear

try:
    from bench.baselines._triton_gelu_linear import supports, triton_gelu_linear
except ImportError:  # no triton on this machine
    supports = triton_gelu_linear = None  # type: ignore[assignment]


def gelu_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(x @ W.T + b) through the Triton kernel where it can take the call."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    usable = triton_gelu_linear is not None and (x.is_cuda or INTERPRET) and not grad
    if usable and supports(x, weight, bias):
        return triton_gelu_linear(x, weight, bias)
    return gelu_linear(x, weight, bias)
