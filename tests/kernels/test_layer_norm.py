"""The shifted LayerNorm kernel, LN(x + shift), against the torch reference.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small,
awkward widths; the `gpu` test runs the autotuned dispatcher at the paper's shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._triton_layer_norm import triton_layer_norm
from kernels.layer_norm import layer_norm, layer_norm_reference

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def inputs(r: int, d: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(r, d, generator=g, device=device) * 3 + 1).to(dtype)
    w = torch.randn(d, generator=g, device=device).to(dtype)
    b = torch.randn(d, generator=g, device=device).to(dtype)
    shift = torch.randn(d, generator=g, device=device) * 2
    return x, w, b, shift


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("r", "d"), [(1, 16), (5, 48), (7, 100)])
@pytest.mark.parametrize("with_shift", [False, True])
def test_kernel_equals_reference(dtype: torch.dtype, r: int, d: int, with_shift: bool) -> None:
    """Odd row counts (a partial block of rows) and widths that are not powers of two."""
    x, w, b, shift = inputs(r, d, dtype)
    s = shift if with_shift else None
    got = triton_layer_norm(x, w, b, 1e-5, s)
    assert got.dtype == dtype and got.shape == (r, d)
    torch.testing.assert_close(got, layer_norm_reference(x, w, b, 1e-5, s), **TOL[dtype])


def test_reference_is_layer_norm_of_the_shifted_rows() -> None:
    x, w, b, shift = inputs(4, 24, torch.float32)
    want = F.layer_norm(x + shift, (24,), w, b, 1e-5)
    torch.testing.assert_close(layer_norm_reference(x, w, b, 1e-5, shift), want)
    torch.testing.assert_close(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (24,), w, b, 1e-5))


def test_strided_rows_are_read_through_their_stride() -> None:
    """A row-slice of a wider tensor (row stride > D) normalises only its own columns."""
    wide, w, b, shift = inputs(6, 80, torch.float32)
    x = wide[:, 8:40]
    got = triton_layer_norm(x, w[:32], b[:32], 1e-5, shift[:32])
    torch.testing.assert_close(got, layer_norm_reference(x, w[:32], b[:32], 1e-5, shift[:32]))


def test_large_shift_keeps_fp32_precision() -> None:
    """The shift is added in fp32 before the mean is taken: a constant offset far larger
    than the rows' spread must not destroy them (bf16 rows, fp32 shift)."""
    x, w, b, _ = inputs(3, 32, torch.bfloat16)
    shift = torch.full((32,), 300.0)
    got = triton_layer_norm(x, w, b, 1e-5, shift)
    torch.testing.assert_close(
        got, layer_norm_reference(x, w, b, 1e-5, None), **TOL[torch.bfloat16]
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_paper_shape(dtype: torch.dtype) -> None:
    x, w, b, shift = inputs(16384, 1024, dtype, "cuda")
    got = layer_norm(x, w, b, 1e-5, shift)  # the dispatcher takes the kernel on CUDA
    torch.testing.assert_close(got, layer_norm_reference(x, w, b, 1e-5, shift), **TOL[dtype])
