"""The FP8 FFN's Triton down GEMM baseline (`bench.baselines._triton_fp8_down`): the
1 x 128 codes of the served up kernel, each K block at its own scale, against torch on the
dequantised operands (TRITON_INTERPRET=1 on CPU at small, ragged shapes with two tile
configs; the `gpu` test at the paper decoder's FFN shape).
"""

from __future__ import annotations

import pytest
import torch
import triton

from bench.baselines._triton_fp8_down import DEFAULT, triton_fp8_down
from kernels._triton_fp8_ffn import triton_fp8_up_gelu
from kernels.fp8 import SCALE_BLOCK, Fp8Weight, quantize_row_blocks, quantize_rows

DOWN_CONFIGS = [
    DEFAULT,
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": SCALE_BLOCK}, num_warps=4),
]


def down_reference(hq, hs, w: Fp8Weight) -> torch.Tensor:
    k = hq.shape[1]
    return (hq.float() * hs.repeat_interleave(SCALE_BLOCK, 1)[:, :k]) @ w.dequantized().t()


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


def test_a_config_whose_k_step_is_not_one_scale_wide_is_refused() -> None:
    hq, hs = quantize_row_blocks(torch.randn(4, 256))
    w = Fp8Weight.of(torch.randn(64, 256))
    narrow = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}, num_warps=4)
    with pytest.raises(AssertionError, match="one scale per tile"):
        triton_fp8_down(hq, hs, w, config=narrow)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_down_at_the_paper_ffn() -> None:
    """The autotuned Triton down GEMM at 16,384 rows on the served up kernel's codes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16384, 1024, generator=g, device="cuda")
    w_up = Fp8Weight.of(torch.randn(7680, 1024, generator=g, device="cuda") / 1024**0.5)
    bias = torch.zeros(7680, device="cuda", dtype=torch.bfloat16)
    w_down = Fp8Weight.of(torch.randn(1024, 7680, generator=g, device="cuda") / 7680**0.5)
    hq, hs = triton_fp8_up_gelu(*quantize_rows(x), w_up, bias, True)
    got = triton_fp8_down(hq, hs, w_down).float()
    want = down_reference(hq, hs, w_down)
    assert float((got - want).norm() / want.norm()) < 2**-7
