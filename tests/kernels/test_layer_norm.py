"""The shifted LayerNorm kernel, LN(x + shift), with the residual add the FP8 step hands
it, against the torch reference.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small,
awkward widths; the `gpu` test runs the autotuned dispatcher at the paper's shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._triton_layer_norm import triton_add_layer_norm_fp8, triton_layer_norm
from kernels.fp8 import quantize_rows
from kernels.layer_norm import (
    add_layer_norm_fp8,
    add_layer_norm_fp8_reference,
    layer_norm,
    layer_norm_reference,
)
from tests.helpers.fp8_codes import assert_codes_close

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("r", "d"), [(1, 16), (5, 48), (7, 100)])
@pytest.mark.parametrize("with_shift", [False, True])
@pytest.mark.usefixtures("exact_fp8_casts")
def test_add_then_fp8_writes_the_stream_and_its_quantised_norm(
    dtype: torch.dtype, r: int, d: int, with_shift: bool
) -> None:
    """`add_layer_norm_fp8`'s kernel writes the stream's next value exactly as `x +
    residual` would store it (bf16 rounding included), and `quantize_rows(LN(x + residual
    + shift))` of that rounded sum: e4m3 rows and their scales from the fp32 row it holds
    (never rounded to x's dtype first), as the reference does; x itself is left
    unchanged."""
    x, w, b, shift = inputs(r, d, dtype)
    s = shift if with_shift else None
    residual = inputs(r, d, dtype, seed=1)[0] * 0.5
    before = x.clone()
    total, q, scale = triton_add_layer_norm_fp8(x, residual, w, b, 1e-5, s)
    want_total, want_q, want_scale = add_layer_norm_fp8_reference(x, residual, w, b, 1e-5, s)
    assert torch.equal(x, before)
    assert total.dtype == dtype and torch.equal(total, want_total)
    assert torch.equal(want_total, x + residual)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (r, d) and scale.shape == (r, 1)
    # the same e4m3 codes, but where the fp32 sums' order moves a value across a rounding
    # boundary: then one e4m3 step apart
    assert_codes_close(q, scale, want_q, want_scale)
    assert (q.float().abs().amax(dim=1) == 448).all()


@pytest.mark.usefixtures("exact_fp8_casts")
def test_fp8_output_of_a_constant_row_is_its_bias() -> None:
    """A constant row normalises to zeros, so LN returns the bias: its scale is the
    bias's amax / 448; a zero bias as well gives scale 1 and zeros."""
    x, residual = torch.full((2, 32), 7.0), torch.full((2, 32), -2.0)
    w, b = torch.ones(32), torch.linspace(-2, 2, 32)
    _, q, scale = triton_add_layer_norm_fp8(x, residual, w, b, 1e-5)
    torch.testing.assert_close(scale, torch.full((2, 1), 2 / 448))
    assert ((q.float() * scale - b).abs() <= 2.0**-4 * b.abs() + 1e-6).all()
    _, q0, scale0 = triton_add_layer_norm_fp8(x, residual, w, torch.zeros(32), 1e-5)
    assert (scale0 == 1).all() and (q0.float() == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_residual_is_added_before_the_norm(dtype: torch.dtype) -> None:
    """`layer_norm(..., residual=r)` (the final norm of the FP8 step) normalises the
    stream's rounded sum: the kernel and the reference equal the norm of `x + r`, and a
    strided residual (a row-slice of a wider tensor) is read through its stride."""
    x, w, b, shift = inputs(6, 40, dtype)
    wide = inputs(6, 72, dtype, seed=2)[0]
    residual = wide[:, 16:56]
    want = layer_norm_reference(x + residual, w, b, 1e-5, shift)
    torch.testing.assert_close(layer_norm_reference(x, w, b, 1e-5, shift, residual), want)
    got = triton_layer_norm(x, w, b, 1e-5, shift, residual)
    torch.testing.assert_close(got, want, **TOL[dtype])
    # without the residual the result differs: the add is not silently dropped
    assert not torch.allclose(triton_layer_norm(x, w, b, 1e-5, shift), want, **TOL[dtype])


def test_add_layer_norm_fp8_dispatches_to_the_reference_off_cuda() -> None:
    x, w, b, shift = inputs(4, 24, torch.float32)
    residual = inputs(4, 24, torch.float32, seed=3)[0]
    total, q, scale = add_layer_norm_fp8(x, residual, w, b, 1e-5, shift)
    assert torch.equal(total, x + residual)
    want_q, want_scale = quantize_rows(F.layer_norm(x + residual + shift, (24,), w, b, 1e-5))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(scale, want_scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_add_then_fp8_at_the_paper_shape() -> None:
    """The autotuned kernel at 16,384 × 1,024 in bf16: the stream byte for byte, the
    scales to fp32 rounding, the codes within one e4m3 step (16.8 M of them: some lie on
    a rounding boundary, the subnormals near zero included)."""
    x, w, b, shift = inputs(16384, 1024, torch.bfloat16, "cuda")
    residual = inputs(16384, 1024, torch.bfloat16, "cuda", seed=1)[0]
    total, q, scale = add_layer_norm_fp8(x, residual, w, b, 1e-5, shift)
    want_total, want_q, want_scale = add_layer_norm_fp8_reference(x, residual, w, b, 1e-5, shift)
    assert torch.equal(total, want_total)
    assert_codes_close(q, scale, want_q, want_scale, same=0.999)
