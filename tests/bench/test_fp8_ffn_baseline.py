"""The FP8 FFN baseline with 1 x 128 activation scales (`bench.baselines._triton_fp8_ffn`):
the up GEMM with its bias, GELU and quantisation in the epilogue, the down GEMM reading
those codes (in Triton, or cuBLASLt's block-scaled GEMM), against torch on the
dequantised operands.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at small, ragged
shapes with several tile configs, with torch's float32 -> e4m3 cast
(tests/helpers/triton_fp8.py); the `gpu` test runs the autotuned pair at the paper
decoder's FFN shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from bench.baselines._triton_fp8_ffn import (
    DEFAULTS,
    SCALE_BLOCK,
    block_fp8_down,
    block_fp8_reference,
    quantize_row_blocks,
    quantize_weight_blocks,
    triton_fp8_down,
    triton_fp8_up_gelu,
)
from kernels.fp8 import Fp8Weight, quantize_rows
from kernels.gelu_fp8 import gelu_fp8_reference
from tests.helpers.fp8_codes import assert_codes_close, e4m3_ordinals

UP_CONFIGS = [
    DEFAULTS["up"],
    triton.Config({"BLOCK_M": 16, "BLOCK_N": SCALE_BLOCK, "BLOCK_K": 32}, num_warps=4),
]
DOWN_CONFIGS = [
    DEFAULTS["down"],
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": SCALE_BLOCK}, num_warps=4),
]


def ffn_inputs(r: int, k: int, n: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(r, k, generator=g, device=device)
    w_up = torch.randn(n, k, generator=g, device=device) / k**0.5
    bias = (torch.randn(n, generator=g, device=device) * 0.5).to(torch.bfloat16)
    w_down = torch.randn(k, n, generator=g, device=device) / n**0.5
    return x, Fp8Weight.of(w_up), bias, Fp8Weight.of(w_down)


def up_reference(xq, xs, w: Fp8Weight, bias, tanh: bool):
    y = (xq.float() * xs) @ w.dequantized().t() + bias.float()
    return quantize_row_blocks(F.gelu(y, approximate="tanh" if tanh else "none"))


def down_reference(hq, hs, w: Fp8Weight) -> torch.Tensor:
    k = hq.shape[1]
    return (hq.float() * hs.repeat_interleave(SCALE_BLOCK, 1)[:, :k]) @ w.dequantized().t()


@pytest.mark.usefixtures("exact_fp8_casts")
@pytest.mark.parametrize("config", UP_CONFIGS, ids=["default", "small"])
@pytest.mark.parametrize(("r", "k", "n"), [(5, 64, 128), (37, 96, 200), (16, 160, 384)])
@pytest.mark.parametrize("tanh", [True, False])
@pytest.mark.parametrize("promote", [False, True], ids=["chained", "promoted"])
def test_up_epilogue_writes_the_block_quantised_gelu(config, r, k, n, tanh, promote) -> None:
    """Ragged rows, K and a last column block narrower than 128: the scales are each
    block's amax / 448 and the codes the reference's, but where the fp32 sums' order moves
    a value across an e4m3 rounding boundary (then one step apart); with the MMAs chained
    over K or each K step's product added in fp32."""
    x, w_up, bias, _ = ffn_inputs(r, k, n)
    xq, xs = quantize_rows(x)
    q, scales = triton_fp8_up_gelu(xq, xs, w_up, bias, tanh, config, promote=promote)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (r, n)
    assert scales.shape == (r, triton.cdiv(n, SCALE_BLOCK))
    assert_codes_close(q, scales, *up_reference(xq, xs, w_up, bias, tanh))


@pytest.mark.parametrize("config", DOWN_CONFIGS, ids=["default", "small"])
@pytest.mark.parametrize(("r", "k", "n"), [(5, 128, 64), (37, 200, 96), (16, 384, 160)])
def test_down_applies_each_k_blocks_scale(config, r, k, n) -> None:
    """Each 128-wide K block of the input at its own scale (scales spanning four decades,
    so a block read at another's scale would show), a ragged last block, bf16 out."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(r, k, generator=g)
    h *= 10.0 ** torch.randint(-2, 2, (1, triton.cdiv(k, SCALE_BLOCK)), generator=g).float(
    ).repeat_interleave(SCALE_BLOCK, 1)[:, :k]  # fmt: skip
    hq, hs = quantize_row_blocks(h)
    w = Fp8Weight.of(torch.randn(n, k, generator=g) / k**0.5)
    got = triton_fp8_down(hq, hs, w, config=config)
    assert got.dtype == torch.bfloat16 and got.shape == (r, n)
    want = down_reference(hq, hs, w)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))


@pytest.mark.usefixtures("exact_fp8_casts")
def test_the_up_kernel_writes_m_major_scales_for_the_block_scaled_down_gemm() -> None:
    """`m_major=True`: the same scales and codes, laid out with strides (1, R), the
    layout cuBLASLt's 1 x 128 GEMM takes its input scales in."""
    x, w_up, bias, _ = ffn_inputs(37, 128, 384)
    xq, xs = quantize_rows(x)
    q, scales = triton_fp8_up_gelu(xq, xs, w_up, bias, True)
    q_m, scales_m = triton_fp8_up_gelu(xq, xs, w_up, bias, True, m_major=True)
    assert scales_m.shape == scales.shape == (37, 3) and scales_m.stride() == (1, 37)
    assert torch.equal(q_m.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales_m, scales)


def test_block_scaled_down_gemm_on_cpu_is_the_dequantised_product() -> None:
    """The down GEMM with 128 x 128 weight scales (`block_fp8_down`; on a CPU the fp32
    product of the dequantised operands): within FP8's error of the exact product, each
    weight block at its own scale (blocks four decades apart)."""
    g = torch.Generator().manual_seed(3)
    r, k, n = 9, 384, 256
    h = torch.randn(r, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    w *= 10.0 ** torch.randint(-2, 2, (2, 3), generator=g).float().repeat_interleave(
        SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)  # fmt: skip
    hq, hs = quantize_row_blocks(h)
    wq, ws = quantize_weight_blocks(w)
    assert wq.shape == (n, k) and ws.shape == (2, 3)
    got = block_fp8_down(hq, hs, wq, ws, torch.float32)
    want = h @ w.t()
    assert float((got - want).norm() / want.norm()) < 2**-4


def test_weight_blocks_need_dims_of_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiples of 128, got 128 x 96"):
        quantize_weight_blocks(torch.randn(128, 96))


@pytest.mark.usefixtures("exact_fp8_casts")
def test_block_scales_keep_quiet_blocks_precise_next_to_an_outlier_feature() -> None:
    """Why the scales are per 128 columns: e4m3's normals span 448 / 2^-6 ≈ 28,700×, so
    next to one block of outlier activations (~1e5, the rest ~1) one scale per row puts
    the quiet blocks' codes among the subnormals; with one scale per block they keep
    their three mantissa bits."""
    r, k, n = 16, 128, 512
    x, w_up, _, _ = ffn_inputs(r, k, n, seed=2)
    bias = torch.zeros(n, dtype=torch.bfloat16)
    bias[:SCALE_BLOCK] = 1e5
    xq, xs = quantize_rows(x)
    before = (xq.float() * xs) @ w_up.dequantized().t()
    exact = F.gelu(before + bias.float(), approximate="tanh")
    hq, hs = triton_fp8_up_gelu(xq, xs, w_up, bias, True)
    block = hq.float() * hs.repeat_interleave(SCALE_BLOCK, 1)
    rq, rs = gelu_fp8_reference(before, bias, True)  # the served step's per-row codes
    row = rq.float() * rs
    quiet = slice(SCALE_BLOCK, n)

    def err(h: torch.Tensor) -> float:
        return float((h[:, quiet] - exact[:, quiet]).norm() / exact[:, quiet].norm())

    assert (rq.float()[:, quiet].abs() < 2.0**-6).float().mean() > 0.95  # subnormal codes
    assert err(block) < 2.0**-4 and err(block) < 0.2 * err(row), (err(block), err(row))


def test_a_config_whose_tile_is_not_one_scale_wide_is_refused() -> None:
    x, w_up, bias, _ = ffn_inputs(4, 64, 128)
    xq, xs = quantize_rows(x)
    wide = triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4)
    with pytest.raises(AssertionError, match="one scale per tile"):
        triton_fp8_up_gelu(xq, xs, w_up, bias, True, wide)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pair_at_the_paper_ffn() -> None:
    """The autotuned pair at 16,384 rows, d_model 1,024, d_ff 7,680 (compiled casts).
    On Hopper, Triton adds FP8 products in the tensor cores' own reduced precision,
    never promoting to fp32 (`max_num_imprecise_acc` 2³⁰ by default on sm90; cuBLASLt,
    the served GEMM, promotes: `use_fast_accum=False`). The H200 run measured it: block
    scales up to 0.34 % from the fp32 reference's and 0.13 % of the codes more than one
    e4m3 step away (values near zero, where one step is far finer than the sum's error),
    so the codes are held to a relative error here, not to one step each."""
    x, w_up, bias, w_down = ffn_inputs(16384, 1024, 7680, "cuda")
    xq, xs = quantize_rows(x)
    hq, hs = triton_fp8_up_gelu(xq, xs, w_up, bias, True)
    want_q, want_s = up_reference(xq, xs, w_up, bias, True)
    torch.testing.assert_close(hs, want_s, rtol=2**-7, atol=0)
    steps = (e4m3_ordinals(hq) - e4m3_ordinals(want_q)).abs()
    assert (steps > 1).float().mean() < 0.01 and (steps == 0).float().mean() > 0.9
    got_h = hq.float() * hs.repeat_interleave(SCALE_BLOCK, 1)
    want_h = want_q.float() * want_s.repeat_interleave(SCALE_BLOCK, 1)
    assert float((got_h - want_h).norm() / want_h.norm()) < 2**-6
    got = triton_fp8_down(hq, hs, w_down).float()
    want = down_reference(hq, hs, w_down)
    assert float((got - want).norm() / want.norm()) < 2**-7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_promoted_up_kernel_is_closer_to_the_fp32_reference() -> None:
    """Why `promote`: with each K step's product added in fp32, at most a third of the
    codes more than one e4m3 step from the fp32 reference's that the chained MMAs leave.
    On the H200: 161,256 chained (0.13 % of 126 M) against 32,969 promoted (4.9x fewer;
    the first bound tried, a tenth, was a guess the run refuted); what leaves the rest
    is not measured."""
    x, w_up, bias, _ = ffn_inputs(16384, 1024, 7680, "cuda")
    xq, xs = quantize_rows(x)
    want_q, _ = up_reference(xq, xs, w_up, bias, True)

    def far(promote: bool) -> int:
        hq, _ = triton_fp8_up_gelu(xq, xs, w_up, bias, True, promote=promote)
        return int(((e4m3_ordinals(hq) - e4m3_ordinals(want_q)).abs() > 1).sum())

    chained, promoted = far(False), far(True)
    assert chained > 0 and promoted <= chained / 3, (chained, promoted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_up_kernel_feeds_cublaslt_block_scaled_down_gemm() -> None:
    """The `block_lt` pair at the paper's FFN shape: the up kernel's M-major scales taken
    by cuBLASLt's block-scaled GEMM, whose product is the dequantised operands' fp32
    product to 2⁻⁷ (0.17 % measured by bench/bench_fp8_gemm.py --blockwise)."""
    x, w_up, bias, _ = ffn_inputs(16384, 1024, 7680, "cuda")
    w_down = torch.randn(1024, 7680, device="cuda") / 7680**0.5
    xq, xs = quantize_rows(x)
    hq, hs = triton_fp8_up_gelu(xq, xs, w_up, bias, True, m_major=True)
    wq, ws = quantize_weight_blocks(w_down)
    got = block_fp8_down(hq, hs, wq, ws).float()
    want = block_fp8_reference(hq, hs, wq, ws)
    assert float((got - want).norm() / want.norm()) < 2**-7
