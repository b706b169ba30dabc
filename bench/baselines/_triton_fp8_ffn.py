"""Baseline (not served): the FP8 step's FFN as two Triton GEMMs with 1 x 128 activation
scales, the next step docs/FP8.md names for the FP8 loop's largest extra pass.

The served FP8 FFN runs the up projection as a cuBLASLt GEMM writing bf16, then one
kernel over that [R, N] output for the bias, the GELU and the per-row quantisation
(`kernels/_triton_gelu_fp8.py`): a row's scale spans all N columns, which many GEMM tiles
write, so it cannot be taken inside the GEMM. With one scale per 128 columns of a row it
can:

- `triton_fp8_up_gelu`: GELU((xq · sx) @ (wq · sw).T + bias), with the dequantisation,
  the bias, the GELU (on a GPU its tanh by `tanh.approx.f32`, as served) and the
  quantisation in the GEMM's epilogue. A program's tile is 128
  columns wide, so each row of the tile gets its own scale (its amax / 448, as
  `kernels._triton_fp8.quantize_rows_fp8`): e4m3 [R, N] and fp32 scales [R, ceil(N/128)],
  and the activation never reaches memory in bf16.
- `triton_fp8_down`: (hq · sh) @ (wq · sw).T for those codes: the product of each
  128-wide K block scaled by its input scale, summed in fp32, times the weight's
  per-output-channel scale; out in bf16.
- `block_fp8_down`: the same product through cuBLASLt's block-scaled GEMM
  (`torch._scaled_mm` with 1 x 128 input scales and 128 x 128 weight scales,
  `quantize_weight_blocks`), which runs at the rowwise GEMM's speed on the H200 where
  the Triton down GEMM takes 1.8x its time (docs/FP8.md); the up kernel then writes its
  scales M-major, the layout cuBLASLt takes. On a CPU: the fp32 product of the
  dequantised operands.

Triton's FP8 dots on sm90 accumulate in the tensor cores' reduced precision (its
default `max_num_imprecise_acc`), unlike the served cuBLASLt GEMMs (docs/FP8.md): the
down GEMM adds each 128-wide K block's product in fp32 (it scales each anyway), the up
GEMM does with `promote=True`.

Tested under `TRITON_INTERPRET=1` against torch (tests/bench/test_fp8_ffn_baseline.py);
`bench/bench_fp8_gemm.py` times the pair against the served one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._triton_fp8 import quantize_rows_fp8
from kernels._triton_gelu_fp8 import _gelu
from kernels._tuning import AUTOTUNE, INTERPRET
from kernels.fp8 import Fp8Weight, quantize_rows

SCALE_BLOCK = 128  # columns per activation scale: the up GEMM's tile width, the down's K step
DEFAULTS = {  # BLOCK_N (up) and BLOCK_K (down) are SCALE_BLOCK: the scales' width fixes them
    "up": triton.Config({"BLOCK_M": 64, "BLOCK_N": SCALE_BLOCK, "BLOCK_K": 64}, num_warps=4),
    "down": triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": SCALE_BLOCK}, num_warps=4),
}


def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 128 x 128 block of w [N, K] quantised on its own (`kernels.fp8.quantize_rows`
    of the block's 16,384 values) -> e4m3 [N, K], fp32 [N/128, K/128] row-major; N and K
    multiples of 128."""
    n, k = w.shape
    if n % SCALE_BLOCK or k % SCALE_BLOCK:
        raise ValueError(f"128 x 128 weight blocks need both dims multiples of 128, got {n} x {k}")
    nb, kb = n // SCALE_BLOCK, k // SCALE_BLOCK
    blocks = w.reshape(nb, SCALE_BLOCK, kb, SCALE_BLOCK).transpose(1, 2)
    q, s = quantize_rows(blocks.reshape(nb * kb, SCALE_BLOCK * SCALE_BLOCK))
    q = q.view(torch.uint8).reshape(nb, kb, SCALE_BLOCK, SCALE_BLOCK).transpose(1, 2)
    return q.reshape(n, k).view(torch.float8_e4m3fn), s.reshape(nb, kb)


def block_fp8_down(
    hq: torch.Tensor,  # e4m3 [R, K]
    hs: torch.Tensor,  # fp32 [R, K/128], M-major on CUDA (strides (1, R))
    wq: torch.Tensor,  # e4m3 [N, K]
    ws: torch.Tensor,  # fp32 [N/128, K/128] row-major
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [R, N]
    """(hq · hs per 1 x 128) @ (wq · ws per 128 x 128).T: cuBLASLt's block-scaled GEMM on
    CUDA (scale_b: the transpose of the row-major [N/128, K/128], as ATen's check asks),
    `block_fp8_reference` elsewhere."""
    if hq.is_cuda:
        return torch._scaled_mm(hq, wq.t(), scale_a=hs, scale_b=ws.t(), out_dtype=out_dtype)
    return block_fp8_reference(hq, hs, wq, ws).to(out_dtype)


def block_fp8_reference(
    hq: torch.Tensor, hs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor
) -> torch.Tensor:  # fp32 [R, N]
    """What `block_fp8_down` computes, in fp32 from the dequantised operands."""
    k = wq.shape[1]
    h = hq.float() * hs.repeat_interleave(SCALE_BLOCK, 1)[:, :k]
    w = wq.float() * ws.repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)
    return h @ w.t()


def quantize_row_blocks(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout the up kernel writes, in torch: `kernels.fp8.quantize_rows` of each
    row's 128-column blocks (the last one may be short) -> e4m3 [R, N], fp32 [R, NB]."""
    r, n = y.shape
    nb = triton.cdiv(n, SCALE_BLOCK)
    padded = F.pad(y, (0, nb * SCALE_BLOCK - n)).reshape(r * nb, SCALE_BLOCK)
    q, s = quantize_rows(padded)
    return q.reshape(r, nb * SCALE_BLOCK)[:, :n].contiguous(), s.reshape(r, nb)


def _configs(tile: str) -> list[triton.Config]:
    if not AUTOTUNE:
        return [DEFAULTS[tile]]
    if tile == "up":
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": SCALE_BLOCK, "BLOCK_K": k},
                              num_warps=w, num_stages=s)
                for m in (64, 128) for k in (64, 128) for w in (4, 8) for s in (3, 4)]  # fmt: skip
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": SCALE_BLOCK},
                          num_warps=w, num_stages=s)
            for m in (64, 128) for n in (64, 128) for w in (4, 8) for s in (3, 4)]  # fmt: skip


@triton.jit
def _fp8_up_gelu_kernel(
    x_ptr,  # e4m3 [R, K], last dim contiguous
    sx_ptr,  # fp32 [R]: the rows' scales
    w_ptr,  # e4m3 [N, K], contiguous
    sw_ptr,  # fp32 [N]: the output channels' scales
    b_ptr,  # [N]
    q_ptr,  # out: e4m3 [R, N], contiguous
    sq_ptr,  # out: fp32 [R, NB]: one scale per row and 128 columns
    R,
    stride_x,
    stride_sr,  # sq's strides: (NB, 1) row-major, (1, R) M-major
    stride_sb,
    N: tl.constexpr,
    K: tl.constexpr,
    NB: tl.constexpr,
    TANH: tl.constexpr,
    HW_TANH: tl.constexpr,  # with TANH: the hardware's tanh.approx, as the served kernel
    PROMOTE: tl.constexpr,  # each K step's product added in fp32 (else one MMA chain)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # SCALE_BLOCK
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < R, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
        if PROMOTE:  # sm90's FP8 MMA adds in reduced precision: promote every BLOCK_K
            acc += tl.dot(a, w)
        else:
            acc = tl.dot(a, w, acc)
    sx = tl.load(sx_ptr + rows, mask=row_ok, other=1.0)
    sw = tl.load(sw_ptr + cols, mask=col_ok, other=1.0)
    bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    y = _gelu(acc * sx[:, None] * sw[None, :], bias, TANH, HW_TANH)
    ok = row_ok[:, None] & col_ok[None, :]
    codes, scale = quantize_rows_fp8(y, ok)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
             codes.to(q_ptr.dtype.element_ty), mask=ok)  # fmt: skip
    tl.store(sq_ptr + rows.to(tl.int64) * stride_sr + pid_n * stride_sb, scale, mask=row_ok)


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


_TUNED = {
    "up": triton.autotune(
        configs=_configs("up"), key=["R", "N", "K", "TANH", "HW_TANH", "PROMOTE"]
    )(_fp8_up_gelu_kernel),
    "down": triton.autotune(configs=_configs("down"), key=["R", "N", "K"])(_fp8_down_kernel),
}
_KERNELS = {"up": _fp8_up_gelu_kernel, "down": _fp8_down_kernel}


def _launch(tile: str, r: int, n: int, config: triton.Config | None, *args, **meta) -> None:
    """The autotuned kernel, or one config (tests sweep them)."""

    def grid(m: dict) -> tuple[int, int]:
        return (triton.cdiv(r, m["BLOCK_M"]), triton.cdiv(n, m["BLOCK_N"]))

    if config is None:
        _TUNED[tile][grid](*args, **meta)
    else:
        kw = config.kwargs
        assert kw["BLOCK_N" if tile == "up" else "BLOCK_K"] == SCALE_BLOCK, "one scale per tile"
        _KERNELS[tile][grid(kw)](*args, **meta, **kw, num_warps=config.num_warps,
                                 num_stages=config.num_stages)  # fmt: skip


def triton_fp8_up_gelu(
    xq: torch.Tensor,  # e4m3 [R, K], last dim contiguous
    xs: torch.Tensor,  # fp32 [R, 1]
    w: Fp8Weight,  # [N, K]
    bias: torch.Tensor,  # [N]
    tanh: bool,
    config: triton.Config | None = None,
    m_major: bool = False,  # the scales with strides (1, R): cuBLASLt's 1 x 128 layout
    promote: bool = False,  # add each BLOCK_K step's product in fp32 (the down GEMM does)
) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [R, N], fp32 [R, ceil(N / 128)]
    """GELU(xq·xs @ (w.q·w.scale).T + bias), quantised per row and 128 columns. On sm90
    Triton chains the FP8 MMAs over all of K in the tensor cores' reduced precision;
    `promote` adds each K step's product to an fp32 accumulator instead, as cuBLASLt
    (`use_fast_accum=False`) and the down GEMM here do. On a GPU the tanh GELU takes its
    tanh from the hardware's `tanh.approx.f32`, as the served bias + GELU kernel does."""
    r, k = xq.shape
    n = w.q.shape[0]
    assert xq.stride(1) == 1 and w.q.shape[1] == k and w.q.is_contiguous()
    assert xs.numel() == r and bias.shape == (n,), "a scale per row, a bias per output"
    nb = triton.cdiv(n, SCALE_BLOCK)
    q = torch.empty((r, n), dtype=torch.float8_e4m3fn, device=xq.device)
    scales = torch.empty((nb, r) if m_major else (r, nb), dtype=torch.float32, device=xq.device)
    scales = scales.t() if m_major else scales
    if r:
        _launch("up", r, n, config, xq, xs.reshape(-1).contiguous(), w.q, w.scale.reshape(-1),
                bias, q, scales, r, xq.stride(0), scales.stride(0), scales.stride(1),
                N=n, K=k, NB=nb, TANH=tanh, HW_TANH=tanh and not INTERPRET,
                PROMOTE=promote)  # fmt: skip
    return q, scales


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
        _launch("down", r, n, config, hq, hs.contiguous(), w.q, w.scale.reshape(-1), out, r,
                N=n, K=k, KB=kb)  # fmt: skip
    return out
