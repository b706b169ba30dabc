"""The persistent Triton GEMM with a GELU epilogue (`bench.baselines._triton_gelu_linear`),
gelu_tanh(x @ W.T + b), and its dispatcher with fallback
(`bench.baselines.gelu_linear.gelu_linear_triton`), against the torch reference.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small,
ragged shapes with several tile configs; the `gpu` test runs the autotuned kernel at the
paper decoder's shapes. The served dispatcher (cuBLASLt): tests/kernels/test_gelu_linear.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.baselines._triton_gelu_linear import (
    DEFAULT_CONFIG,
    _bias_gelu,
    supports,
    triton_gelu_linear,
)
from bench.baselines.gelu_linear import gelu_linear_triton
from kernels.gelu_linear import gelu_linear_reference
from tests.helpers.kernel_inputs import GELU_TOL, gelu_inputs, gelu_want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 16, 32), (37, 48, 80), (64, 64, 96)])
def test_kernel_equals_reference(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    """Ragged M, N and K tiles (TMA boxes clip at the edges) and several tiles per program."""
    x, w, b = gelu_inputs(m, k, n, dtype)
    got = triton_gelu_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), gelu_want(x, w, b), **GELU_TOL)


@pytest.mark.parametrize("subtile", [False, True])
@pytest.mark.parametrize(("bm", "bn", "bk", "group"), [(16, 16, 16, 1), (32, 64, 32, 4)])
def test_every_tile_config_is_exact(subtile: bool, bm: int, bn: int, bk: int, group: int) -> None:
    """The epilogue's two column halves and the grouped tile order change nothing."""
    x, w, b = gelu_inputs(70, 80, 144, torch.bfloat16, seed=1)
    config = {**DEFAULT_CONFIG, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    config |= {"GROUP_M": group, "SUBTILE": subtile}
    got = triton_gelu_linear(x, w, b, config=config)
    torch.testing.assert_close(got.float(), gelu_want(x, w, b), **GELU_TOL)


def test_strided_rows_are_read_through_their_stride() -> None:
    """x as a column slice of a wider tensor: only its own K columns enter the product."""
    wide, w, b = gelu_inputs(20, 96, 48, torch.bfloat16, seed=2)
    x = wide[:, 16:80]
    w = w[:, :64].contiguous()
    assert supports(x, w, b)
    torch.testing.assert_close(triton_gelu_linear(x, w, b).float(), gelu_want(x, w, b), **GELU_TOL)


@triton.jit
def _epilogue_probe(z_ptr, b_ptr, y_ptr, N: tl.constexpr):
    """The kernel's epilogue on one fp32 row, so its maths is checked at fp32 precision."""
    cols = tl.arange(0, N)
    y = _bias_gelu(tl.load(z_ptr + cols)[None, :], b_ptr, 0, N)
    tl.store(y_ptr + cols[None, :], y)


def test_epilogue_is_tanh_gelu_with_the_bias_inside() -> None:
    """In fp32 the epilogue is gelu_tanh(z + b): tight enough to tell it from erf-GELU
    (they differ by up to ~5e-4 here), which a bf16 output could not."""
    z = torch.linspace(-6, 6, 64)
    b = torch.randn(64, generator=torch.Generator().manual_seed(3))
    y = torch.empty(64)
    _epilogue_probe[(1,)](z, b, y, N=64)
    want = F.gelu(z + b, approximate="tanh")
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert (F.gelu(z + b) - want).abs().max() > 1e-4  # the tolerance separates the two


def test_zero_weight_leaves_the_activated_bias() -> None:
    """A zero weight leaves gelu(b) in every row of the bf16 output."""
    x, _, _ = gelu_inputs(5, 32, 32, torch.float16)
    w = torch.zeros(32, 32, dtype=torch.float16)
    b = torch.linspace(-6, 6, 32).to(torch.float16)
    got = triton_gelu_linear(x, w, b).float()
    tanh = F.gelu(b.float(), approximate="tanh")
    torch.testing.assert_close(got, tanh.expand(5, 32), atol=2e-3, rtol=2e-3)


def test_dispatcher_falls_back_to_the_reference() -> None:
    """fp32 (TMA here takes 2-byte types), misaligned rows, a strided bias, broadcast rows
    and autograd all give the reference's answer; where the kernel takes the call, the
    kernel's."""
    x, w, b = gelu_inputs(9, 24, 40, torch.float32)
    assert not supports(x, w, b)
    torch.testing.assert_close(gelu_linear_triton(x, w, b), gelu_linear_reference(x, w, b))
    xb, wb, bb = gelu_inputs(9, 20, 40, torch.bfloat16)  # 40-byte rows: not 16-byte multiples
    assert not supports(xb, wb, bb)
    torch.testing.assert_close(gelu_linear_triton(xb, wb, bb), gelu_linear_reference(xb, wb, bb))
    xb, wb, bb = gelu_inputs(9, 32, 48, torch.bfloat16)
    assert supports(xb, wb, bb)
    assert torch.equal(gelu_linear_triton(xb, wb, bb), triton_gelu_linear(xb, wb, bb))
    strided = torch.randn(96).to(torch.bfloat16)[::2]  # the kernel reads the bias densely
    assert not supports(xb, wb, strided)
    got = gelu_linear_triton(xb, wb, strided)
    torch.testing.assert_close(got, gelu_linear_reference(xb, wb, strided))
    broadcast = xb[:1].expand(9, 32)  # every row the same memory: not a TMA tensor
    assert not supports(broadcast, wb, bb)
    torch.testing.assert_close(
        gelu_linear_triton(broadcast, wb, bb), gelu_linear_reference(broadcast, wb, bb)
    )
    xg = xb.clone().requires_grad_()  # the kernel has no backward
    got = gelu_linear_triton(xg, wb, bb)
    assert got.requires_grad
    torch.testing.assert_close(got, gelu_linear_reference(xg, wb, bb))


def test_empty_batch() -> None:
    x, w, b = gelu_inputs(0, 32, 48, torch.bfloat16)
    assert triton_gelu_linear(x, w, b).shape == (0, 48)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [8, 4096, 8192])
def test_paper_shapes_on_gpu(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's up-projection (1 024 → 7 680) at a part's rows per step: the Triton
    kernel (its default config, and autotuned) agrees with the fp32 reference."""
    x, w, b = gelu_inputs(m, 1024, 7680, torch.bfloat16, device="cuda")
    ref = gelu_want(x, w, b)
    torch.testing.assert_close(triton_gelu_linear(x, w, b).float(), ref, **GELU_TOL)
    torch.testing.assert_close(gelu_linear_triton(x, w, b).float(), ref, **GELU_TOL)
    import bench.baselines._triton_gelu_linear as mod

    monkeypatch.setattr(mod, "AUTOTUNE", True)
    torch.testing.assert_close(mod.triton_gelu_linear(x, w, b).float(), ref, **GELU_TOL)
