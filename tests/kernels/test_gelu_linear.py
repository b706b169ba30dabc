"""The served FFN up-projection dispatcher, `kernels.gelu_linear.gelu_linear`:
gelu_tanh(x @ W.T + b) through cuBLASLt's GELU epilogue on CUDA, the torch reference
elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gelu_linear import gelu_linear, gelu_linear_reference
from tests.helpers.kernel_inputs import GELU_TOL, gelu_inputs, gelu_want


def test_reference_is_tanh_gelu_of_the_linear_layer() -> None:
    x, w, b = gelu_inputs(7, 24, 40, torch.float32)
    want_ = F.gelu(x @ w.t() + b, approximate="tanh")
    torch.testing.assert_close(gelu_linear_reference(x, w, b), want_)
    assert not torch.allclose(gelu_linear_reference(x, w, b), F.gelu(x @ w.t() + b))


def test_dispatcher_on_cpu_is_the_reference() -> None:
    """CPU, any dtype, strided bias, broadcast rows and autograd: the reference's answer
    (bit for bit: it is the reference)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w, b = gelu_inputs(9, 24, 40, dtype)
        got = gelu_linear(x, w, b)
        assert got.dtype == dtype and got.shape == (9, 40)
        assert torch.equal(got, gelu_linear_reference(x, w, b))
    xb, wb, _ = gelu_inputs(9, 32, 48, torch.bfloat16)
    strided = torch.randn(96).to(torch.bfloat16)[::2]
    assert torch.equal(gelu_linear(xb, wb, strided), gelu_linear_reference(xb, wb, strided))
    broadcast = xb[:1].expand(9, 32)
    assert torch.equal(gelu_linear(broadcast, wb, strided),
                       gelu_linear_reference(broadcast, wb, strided))  # fmt: skip
    x, w, b = gelu_inputs(4, 16, 8, torch.float32)
    x.requires_grad_()
    y = gelu_linear(x, w, b)
    y.sum().backward()  # training goes through the differentiable reference
    assert x.grad is not None and x.grad.shape == x.shape


def test_empty_batch() -> None:
    x, w, b = gelu_inputs(0, 32, 48, torch.bfloat16)
    assert gelu_linear(x, w, b).shape == (0, 48)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [8, 4096, 8192])
def test_paper_shapes_on_gpu(m: int) -> None:
    """The decoder's up-projection (1 024 → 7 680) at a part's rows per step: cuBLASLt's
    epilogue agrees with the fp32 reference."""
    x, w, b = gelu_inputs(m, 1024, 7680, torch.bfloat16, device="cuda")
    torch.testing.assert_close(gelu_linear(x, w, b).float(), gelu_want(x, w, b), **GELU_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dispatcher_falls_back_to_the_reference() -> None:
    """Under autograd, or for inputs that are not a 2-D matrix, CUDA takes the reference."""
    x, w, b = gelu_inputs(64, 128, 256, torch.float32, device="cuda")
    torch.testing.assert_close(gelu_linear(x, w, b), gelu_linear_reference(x, w, b))
    x3 = x.view(4, 16, 128)
    assert torch.equal(gelu_linear(x3, w, b), gelu_linear_reference(x3, w, b))
    xg = x.clone().requires_grad_()
    y = gelu_linear(xg, w, b)
    y.sum().backward()
    assert xg.grad is not None
