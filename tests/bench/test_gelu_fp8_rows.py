"""The rowwise FP8 FFN's middle (bench/baselines/gelu_fp8.py, served before the 1 x 128 FFN):
bias + GELU + per-row e4m3 quantisation in one Triton pass, against the torch reference. On
CPU the kernel runs under TRITON_INTERPRET=1 with torch's float32 -> e4m3 cast
(tests/helpers/triton_fp8.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from bench.baselines._triton_gelu_fp8 import triton_gelu_fp8
from bench.baselines.gelu_fp8 import gelu_fp8, gelu_fp8_reference
from kernels.fp8 import quantize_rows
from tests.helpers.fp8_codes import assert_codes_close, e4m3_ordinals

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def inputs(r: int, n: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(r, n, generator=g, device=device) * 2).to(dtype)
    bias = torch.randn(n, generator=g, device=device).to(dtype)
    return h, bias


@pytest.mark.usefixtures("exact_fp8_casts")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("r", "n"), [(1, 16), (5, 48), (7, 100)])
@pytest.mark.parametrize("tanh", [True, False])
def test_kernel_equals_reference(dtype: torch.dtype, r: int, n: int, tanh: bool) -> None:
    h, bias = inputs(r, n, dtype)
    q, scale = triton_gelu_fp8(h, bias, tanh)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (r, n) and scale.shape == (r, 1)
    assert_codes_close(q, scale, *gelu_fp8_reference(h, bias, tanh))
    assert (q.float().abs().amax(dim=1) == 448).all()


@pytest.mark.usefixtures("exact_fp8_casts")
@pytest.mark.parametrize(("rows", "block"), [(1, 32), (2, 16), (4, 64)])
@pytest.mark.parametrize("tanh", [True, False])
def test_column_chunks_give_the_one_pass_numbers(rows: int, block: int, tanh: bool) -> None:
    """The chunked config (the row read twice: amax, then codes) writes the same bytes and
    scales as a whole row in one block, ragged last chunk and last rows included."""
    h, bias = inputs(7, 100, torch.bfloat16)
    whole = triton_gelu_fp8(h, bias, tanh, triton.Config({"ROWS": 1, "BLOCK_N": 128}))
    chunked = triton_gelu_fp8(h, bias, tanh, triton.Config({"ROWS": rows, "BLOCK_N": block}))
    assert torch.equal(chunked[0].view(torch.uint8), whole[0].view(torch.uint8))
    assert torch.equal(chunked[1], whole[1])
    assert_codes_close(*chunked, *gelu_fp8_reference(h, bias, tanh))


@pytest.mark.usefixtures("exact_fp8_casts")
def test_the_activation_is_the_models() -> None:
    """tanh and erf GELU differ where |x| is moderate: the kernel follows the flag."""
    h, bias = inputs(4, 64, torch.float32)
    qt, st = triton_gelu_fp8(h, bias, True)
    qe, _ = triton_gelu_fp8(h, bias, False)
    exact_tanh = F.gelu(h + bias, approximate="tanh")
    assert ((qt.float() * st - exact_tanh).abs() <= 2.0**-4 * exact_tanh.abs() + 1e-3).all()
    assert not torch.equal(qt.view(torch.uint8), qe.view(torch.uint8))


@pytest.mark.usefixtures("exact_fp8_casts")
def test_a_row_the_activation_zeroes_gets_scale_one() -> None:
    """GELU of large negative values is 0: such a row quantises to zeros with scale 1."""
    h = torch.full((2, 32), -60.0)
    q, scale = triton_gelu_fp8(h, torch.zeros(32), True)
    assert (scale == 1).all() and (q.float() == 0).all()


def test_hw_tanh_is_refused_where_it_cannot_run() -> None:
    """tanh.approx is PTX: not under the interpreter, and not for the erf GELU."""
    h, bias = inputs(2, 16, torch.float32)
    with pytest.raises(ValueError, match="hw_tanh is the tanh GELU's, on a GPU"):
        triton_gelu_fp8(h, bias, True, hw_tanh=True)
    with pytest.raises(ValueError, match="hw_tanh"):
        triton_gelu_fp8(h, bias, False, hw_tanh=True)


def test_dispatcher_uses_the_reference_off_cuda() -> None:
    h, bias = inputs(3, 40, torch.float32)
    q, scale = gelu_fp8(h, bias, True)
    want_q, want_scale = quantize_rows(F.gelu(h + bias, approximate="tanh"))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(scale, want_scale)


@pytest.mark.gpu
@gpu
def test_gpu_kernel_equals_reference_at_the_paper_width() -> None:
    h, bias = inputs(4096, 7680, torch.bfloat16, "cuda")
    q, scale = triton_gelu_fp8(h, bias, True)  # tanh from exp and a division
    assert_codes_close(q, scale, *gelu_fp8_reference(h, bias, True))
    chunked = triton_gelu_fp8(h, bias, True, triton.Config({"ROWS": 2, "BLOCK_N": 1024}))
    assert torch.equal(chunked[0].view(torch.uint8), q.view(torch.uint8))  # compiled, too
    assert torch.equal(chunked[1], scale)
    served = gelu_fp8(h, bias, True)  # tanh.approx.f32, in every config alike
    config = triton.Config({"ROWS": 2, "BLOCK_N": 1024})
    chunked = triton_gelu_fp8(h, bias, True, config, hw_tanh=True)
    assert torch.equal(chunked[0].view(torch.uint8), served[0].view(torch.uint8))
    assert torch.equal(chunked[1], served[1])


@pytest.mark.gpu
@gpu
def test_gpu_hw_tanh_stays_within_one_step_of_the_reference() -> None:
    """The served kernel (`gelu_fp8` on a GPU: tanh.approx.f32): its error (~2^-11) moves
    a row's amax, so its scale, by about that, and a code only where it sits on a rounding
    boundary: every code at most one e4m3 step from the reference's, 95 % equal. The erf
    GELU is untouched: it keeps the kernel's codes without hw_tanh."""
    h, bias = inputs(4096, 7680, torch.bfloat16, "cuda")
    q, scale = gelu_fp8(h, bias, True)
    want_q, want_scale = gelu_fp8_reference(h, bias, True)
    torch.testing.assert_close(scale, want_scale, rtol=2.0**-9, atol=0)
    steps = (e4m3_ordinals(q) - e4m3_ordinals(want_q)).abs()
    assert int(steps.max()) <= 1 and (steps == 0).float().mean() > 0.95
    assert not torch.equal(q.view(torch.uint8), triton_gelu_fp8(h, bias, True)[0].view(torch.uint8))
    erf = gelu_fp8(h, bias, False)
    assert torch.equal(
        erf[0].view(torch.uint8), triton_gelu_fp8(h, bias, False)[0].view(torch.uint8)
    )
