"""Baseline (not served): the FP8 FFN's down GEMM in Triton, for the codes the served up
GEMM writes (`kernels._triton_fp8_ffn`: one scale per row and 128 columns; the served
down GEMM is cuBLASLt's block-scaled one, `kernels.fp8.block_fp8_gemm`).

`triton_fp8_down`: (hq · sh) @ (wq · sw).T, the product of each 128-wide K block scaled
by its input scale and added in fp32 (it scales each anyway), times the weight's
per-output-channel scale; out in bf16. On the H200 it takes 1.8x cuBLASLt's time
(docs/FP8.md): DecodeOptions.fp8_ffn "triton_down" is the row that measures it in the
loop.

Tested under `TRITON_INTERPRET=1` against torch (tests/bench/test_fp8_ffn_baseline.py);
`bench/bench_fp8_gemm.py` times it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tuning import AUTOTUNE
from kernels.fp8 import SCALE_BLOCK, Fp8Weight

# BLOCK_K is SCALE_BLOCK: the input scales' width fixes it
DEFAULT = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": SCALE_BLOCK}, num_warps=4)


def _configs() -> list[triton.Config]:
    if not AUTOTUNE:
        return [DEFAULT]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": SCALE_BLOCK},
                          num_warps=w, num_stages=s)
            for m in (64, 128) for n in (64, 128) for w in (4, 8) for s in (3, 4)]  # fmt: skip


@triton.jit
def _fp8_down_kernel(
    h_ptr,  # e4m3 [R, K], contiguous
    sh_ptr,  # fp32 [R, KB]: one scale per row and 128 columns of h
    w_ptr,  # e4m3 [N, K], contiguous
    sw_ptr,  # fp32 [N]
    out_ptr,  # out: [R, N] bf16, contiguous
    R,
    N: tl.constexpr,
    K: tl.constexpr,
    KB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # SCALE_BLOCK
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < R, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(h_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
        s = tl.load(sh_ptr + rows.to(tl.int64) * KB + kb, mask=row_ok, other=0.0)
        acc += tl.dot(a, w) * s[:, None]  # each K block's product at its own scale
    sw = tl.load(sw_ptr + cols, mask=col_ok, other=1.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
             (acc * sw[None, :]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


_TUNED = triton.autotune(configs=_configs(), key=["R", "N", "K"])(_fp8_down_kernel)


def triton_fp8_down(
    hq: torch.Tensor,  # e4m3 [R, K], contiguous
    hs: torch.Tensor,  # fp32 [R, ceil(K / 128)]
    w: Fp8Weight,  # [N, K]
    out_dtype: torch.dtype = torch.bfloat16,
    config: triton.Config | None = None,
) -> torch.Tensor:  # [R, N]
    """(hq · hs per 128 columns) @ (w.q · w.scale).T in `out_dtype`."""
    r, k = hq.shape
    n = w.q.shape[0]
    kb = triton.cdiv(k, SCALE_BLOCK)
    assert hq.is_contiguous() and hs.shape == (r, kb) and w.q.shape[1] == k
    out = torch.empty((r, n), dtype=out_dtype, device=hq.device)
    if r:
        args = (hq, hs.contiguous(), w.q, w.scale.reshape(-1), out, r)

        def grid(m: dict) -> tuple[int, int]:
            return (triton.cdiv(r, m["BLOCK_M"]), triton.cdiv(n, m["BLOCK_N"]))

        if config is None:
            _TUNED[grid](*args, N=n, K=k, KB=kb)
        else:
            kw = config.kwargs
            assert kw["BLOCK_K"] == SCALE_BLOCK, "one scale per tile"
            _fp8_down_kernel[grid(kw)](*args, N=n, K=k, KB=kb, **kw, num_warps=config.num_warps,
                                       num_stages=config.num_stages)  # fmt: skip
    return out
