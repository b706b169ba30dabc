"""FP8 e4m3 numerics of the decoder's linear layers (kernels/fp8.py): per-row and
per-output-channel scales, round to nearest on the e4m3 grid without saturating to NaN,
and `torch._scaled_mm` (the call CUDA runs too) against the fp32 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kernels._triton_fp8 import triton_quantize_rows
from kernels.fp8 import (
    E4M3,
    E4M3_MAX,
    Fp8Weight,
    fp8_gemm,
    fp8_matmul,
    fp8_matmul_reference,
    quantize_rows,
    quantize_rows_reference,
)
from tests.helpers.fp8_codes import assert_codes_close, e4m3_ordinals

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
HALF_ULP = 2.0**-4  # e4m3: 3 mantissa bits, so rounding is within 2^-4 relative (normals)
SUBNORMAL_STEP = 2.0**-9  # e4m3's smallest step, in units of the scale

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)), elements=finite))
def test_every_value_comes_back_within_half_an_e4m3_step(x: np.ndarray) -> None:
    t = torch.from_numpy(x)
    q, scale = quantize_rows(t)
    assert q.dtype == E4M3 and scale.shape == (len(x), 1) and scale.dtype == torch.float32
    back = q.float() * scale
    assert torch.isfinite(back).all()  # nothing saturates to NaN
    bound = torch.maximum(HALF_ULP * t.abs(), SUBNORMAL_STEP / 2 * scale) * (1 + 1e-5) + 1e-30
    assert ((back - t).abs() <= bound).all()
    # each row's largest magnitude lands on e4m3's largest value (but rows of fp32
    # denormals, whose scale is held at the smallest normal fp32)
    scaled = t.abs().amax(dim=1) >= E4M3_MAX * torch.finfo(torch.float32).tiny
    assert (q.float().abs().amax(dim=1)[scaled] == E4M3_MAX).all()


@pytest.mark.usefixtures("exact_fp8_casts")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("r", "k"), [(1, 16), (5, 48), (7, 100)])
def test_the_one_pass_kernel_equals_the_reference(dtype: torch.dtype, r: int, k: int) -> None:
    """`triton_quantize_rows` (what CUDA runs, here under TRITON_INTERPRET=1) gives the
    reference's codes and scales exactly: a max and one division per value, in fp32."""
    g = torch.Generator().manual_seed(r * k)
    x = (torch.randn(r, k, generator=g) * torch.logspace(-3, 3, r)[:, None]).to(dtype)
    x[0, : k // 2] = 0  # a row partly zero
    q, scale = triton_quantize_rows(x)
    want_q, want_scale = quantize_rows_reference(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    zeros, denormal = torch.zeros(2, 32), torch.full((1, 32), 1e-44)
    for edge in (zeros, denormal):
        got, want = triton_quantize_rows(edge), quantize_rows_reference(edge)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1], want[1])


def test_e4m3_steps_are_counted_in_codes_through_zero_and_the_subnormals() -> None:
    """The kernels' tests allow one e4m3 step between a kernel's code and the
    reference's (tests/helpers/fp8_codes.py): ordered by value, the 253 finite e4m3fn
    values (±0 one) sit at consecutive ordinals, and a two-step gap fails the check."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~codes.float().isnan()]
    by_value = e4m3_ordinals(finite)[finite.float().argsort(stable=True)]
    assert (by_value.diff() >= 0).all()  # ordinals order the values
    assert torch.equal(by_value.unique_consecutive(), torch.arange(-126, 127))  # no gaps
    scale = torch.ones(1, 1)
    q = torch.tensor([[2.0**-9, 2.0**-6, 416.0, 448.0]]).to(torch.float8_e4m3fn)
    # one step: zero to the smallest subnormal, across the first binade, between normals
    near = torch.tensor([[0.0, 2.0**-6 - 2.0**-9, 384.0, 448.0]]).to(torch.float8_e4m3fn)
    assert_codes_close(q, scale, near, scale, same=0.2)
    far = torch.tensor([[-(2.0**-9), 2.0**-6, 416.0, 448.0]]).to(torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match="more than one step"):
        assert_codes_close(q, scale, far, scale, same=0.2)


def test_quantize_rows_is_the_reference_off_cuda() -> None:
    x = torch.randn(4, 24)
    got, want = quantize_rows(x), quantize_rows_reference(x)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def test_a_row_of_zeros_gets_scale_one_and_zeros() -> None:
    q, scale = quantize_rows(torch.zeros(3, 16))
    assert (scale == 1).all() and (q.float() == 0).all()


def test_weight_scales_are_per_output_channel() -> None:
    """One channel of huge weights does not cost the other channels any precision."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    loud = w.clone()
    loud[5] *= 1e4
    a, b = Fp8Weight.of(w), Fp8Weight.of(loud)
    assert a.scale.shape == (1, 32)
    others = torch.arange(32) != 5
    assert torch.equal(a.q.view(torch.uint8)[others], b.q.view(torch.uint8)[others])
    rel = (b.dequantized() - loud).abs() / loud.abs().clamp_min(1e-6)
    assert rel[5].max() <= HALF_ULP + 1e-6


@pytest.mark.parametrize("shape", [(32, 64, 48), (30, 64, 48), (16, 40, 32)])
def test_fp8_matmul_is_the_quantised_product(shape: tuple[int, int, int]) -> None:
    """Aligned shapes go through `torch._scaled_mm`, others through the reference: both
    are the product of the quantised operands, ~3 % from the exact one."""
    r, k, n = shape
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(r, k, generator=g), torch.randn(n, k, generator=g)
    weight = Fp8Weight.of(w)
    got = fp8_matmul(x, weight, torch.float32)
    want = fp8_matmul_reference(x, weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    exact = x @ w.t()
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 2 * HALF_ULP  # quantised for real, and no more than e4m3 costs
    assert fp8_matmul(x, weight).dtype == torch.bfloat16  # the default output


@pytest.mark.parametrize("shape", [(32, 64, 48), (16, 40, 32)])
def test_the_bias_is_added_in_the_gemm(shape: tuple[int, int, int]) -> None:
    """fp8_gemm(..., bias=b) is the quantised product plus b, through `_scaled_mm`'s
    epilogue (aligned) and the reference (unaligned) alike."""
    r, k, n = shape
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(r, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    weight = Fp8Weight.of(w)
    xq, xs = quantize_rows(x)
    got = fp8_gemm(xq, xs, weight, torch.float32, bias=b)
    want = fp8_matmul_reference(x, weight) + b
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, fp8_gemm(xq, xs, weight, torch.float32), atol=1e-2)


@pytest.mark.gpu
@gpu
def test_gpu_fp8_matmul_is_the_quantised_product() -> None:
    """cuBLASLt's FP8 GEMM (rowwise scales, bf16 out) at a decoder shape."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", generator=g, dtype=torch.bfloat16) / 32
    weight = Fp8Weight.of(w)
    got = fp8_matmul(x, weight).float()
    want = fp8_matmul_reference(x, weight)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2  # bf16 output rounding only
    assert math.isfinite(rel)


@pytest.mark.gpu
@gpu
def test_gpu_one_pass_quantiser_equals_the_reference_at_decoder_widths() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    for k in (1024, 2048, 7680):
        x = torch.randn(4096, k, device="cuda", generator=g, dtype=torch.bfloat16)
        q, scale = quantize_rows(x)  # the Triton pass on CUDA
        want_q, want_scale = quantize_rows_reference(x)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), k
        assert torch.equal(scale, want_scale), k
