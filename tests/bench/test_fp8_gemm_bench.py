"""The block-scaled operands of bench/bench_fp8_gemm.py's `fp8_blockwise` probe: one scale
per 1 x 128 block of the input and per 128 x 128 block of the weight, in the layouts
`kernels.fp8.block_fp8_gemm` hands `torch._scaled_mm` ([R, K/128] M-major, [N/128, K/128]
row-major)."""

from __future__ import annotations

import torch

from bench.bench_fp8_gemm import blockwise_operands


def test_each_block_has_its_own_scale_and_dequantises_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g)
    x[0, :128] *= 100  # one loud block: only its own scale grows
    w = torch.randn(384, 256, generator=g)
    w[128:256, 128:] *= 0.01  # one quiet block of the weight
    xq, xs, wb = blockwise_operands(x, w)
    wq, ws = wb.q, wb.scale
    assert xs.shape == (4, 2) and ws.shape == (3, 2)
    assert xs.stride() == (1, 4)  # ATen's 1 x 128 check: M-major
    assert ws.stride() == (2, 1)  # its 128 x 128 check (of ws.t()): row-major [N/128, K/128]
    assert xq.dtype == wq.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(xs, x.view(4, 2, 128).abs().amax(-1) / 448)
    assert xs[0, 0] > 50 * xs[0, 1]
    blocks = w.view(3, 128, 2, 128).abs().amax((1, 3)) / 448  # [N/128, K/128]
    torch.testing.assert_close(ws, blocks)
    assert ws[1, 1] < 0.05 * ws[0, 1]
    # every value back within half an e4m3 step (2^-4 relative; 2^-10 of the scale near 0)
    back_x = (xq.float().view(4, 2, 128) * xs[..., None]).view(4, 256)
    assert ((back_x - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * xs.repeat_interleave(128, 1)).all()
    back_w = (wq.float().view(3, 128, 2, 128) * ws[:, None, :, None]).view(384, 256)
    scale_w = ws.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((back_w - w).abs() <= 2.0**-4 * w.abs() + 2.0**-10 * scale_w).all()
