"""Triton: the FP8 decoder step's FFN up projection with its bias, GELU and e4m3
quantisation in the GEMM's epilogue, the GPU path behind `kernels.fp8_ffn.fp8_up_gelu`.
A program's tile is 128 columns wide (`SCALE_BLOCK`), so each row of the tile gets its
own scale (its amax / 448, `_triton_fp8.quantize_rows_fp8`) and the activation never
reaches memory in bf16: no bias + GELU + quantise pass of its own. The down projection
reads these codes with cuBLASLt's block-scaled GEMM (`kernels.fp8.block_fp8_gemm`), so
the scales can be written M-major (strides (1, R)), the layout it takes.

The kernel is persistent: one or two programs per SM walk the tiles, loading them by
TMA and storing the codes by TMA, the next tile's loads issued under this one's
epilogue; so K and N must be multiples of 16 (`tma_loadable`). On sm90 Triton chains the
FP8 MMAs over all of K in the tensor cores' reduced precision (its default
`max_num_imprecise_acc`), where cuBLASLt adds in fp32: docs/FP8.md measures the quality.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._triton_fp8 import quantize_rows_fp8
from kernels._tuning import AUTOTUNE, INTERPRET, programs_per_wave
from kernels.fp8 import SCALE_BLOCK, Fp8Weight

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # jit globals must be constexpr
SQRT_HALF = tl.constexpr(0.7071067811865476)


@triton.jit
def _gelu(h, bias, TANH: tl.constexpr, HW_TANH: tl.constexpr):
    """The model's GELU of h + bias in fp32. HW_TANH (with TANH, on a GPU; the interpreter
    has no PTX and takes exp and a division): tanh by the hardware's `tanh.approx.f32`,
    one instruction for an exp and a division, relative error about 2^-11, below bf16's
    own rounding (2^-9) and far below the e4m3 step of 2^-3 the result is rounded to."""
    x = h.to(tl.float32) + bias.to(tl.float32)[None, :]
    if TANH:  # 0.5 x (1 + tanh(u)); tanh(|u| > 20) is ±1 in fp32, and exp never overflows
        u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        if HW_TANH:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u],
                                          dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
            return 0.5 * x * (1.0 + t)
        t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.abs(u), 20.0)) + 1.0)
        return 0.5 * x * (1.0 + tl.where(u < 0, -t, t))
    return 0.5 * x * (1.0 + tl.erf(x * SQRT_HALF))


@triton.jit
def _epilogue(acc, rows, cols, R, sx_ptr, sw_ptr, b_ptr, N: tl.constexpr, TANH: tl.constexpr,
              HW_TANH: tl.constexpr):  # fmt: skip
    """A tile's fp32 sums [BLOCK_M, 128] -> (its e4m3-ready codes, one scale per row):
    dequantise by the row and channel scales, add the bias, GELU, quantise."""
    row_ok, col_ok = rows < R, cols < N
    sx = tl.load(sx_ptr + rows, mask=row_ok, other=1.0)
    sw = tl.load(sw_ptr + cols, mask=col_ok, other=1.0)
    bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    y = _gelu(acc * sx[:, None] * sw[None, :], bias, TANH, HW_TANH)
    return quantize_rows_fp8(y, row_ok[:, None] & col_ok[None, :])


# BLOCK_N is SCALE_BLOCK (one scale per tile row); OCC: the programs each SM holds (two let
# one program's epilogue run beside the other's MMAs); the default is the untuned launch's
TMA_DEFAULT = triton.Config({"BLOCK_M": 128, "BLOCK_N": SCALE_BLOCK, "BLOCK_K": 128, "OCC": 1},
                            num_warps=8, num_stages=3)  # fmt: skip


def tma_loadable(k: int, n: int) -> bool:
    """Whether the kernel takes this shape: TMA wants every row stride a multiple of 16
    bytes, so K (x's and w's rows) and N (the codes' rows) of e4m3."""
    return k % 16 == 0 and n % 16 == 0


def _set_blocks(nargs: dict) -> None:
    """Autotuner pre-hook: the descriptors' tiles follow the config's."""
    m, n, k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [m, k]
    nargs["w_desc"].block_shape = [n, k]
    nargs["q_desc"].block_shape = [m, n]


def _tma_configs() -> list[triton.Config]:
    if not AUTOTUNE:
        return [TMA_DEFAULT]
    shapes = [
        (128, 128, 8, 3, 1),
        (128, 128, 8, 4, 1),
        (128, 64, 8, 4, 1),
        (128, 128, 8, 3, 2),
        (128, 64, 8, 3, 2),
        (64, 128, 4, 3, 2),
        (64, 128, 4, 4, 2),
        (64, 64, 4, 4, 3),
    ]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": SCALE_BLOCK, "BLOCK_K": k, "OCC": o},
                          num_warps=w, num_stages=st, pre_hook=_set_blocks)
            for m, k, w, st, o in shapes]  # fmt: skip


@triton.jit
def _fp8_up_gelu_tma_kernel(
    x_desc,  # TMA descriptor of e4m3 [R, K], tiles [BLOCK_M, BLOCK_K]
    sx_ptr,  # fp32 [R]
    w_desc,  # TMA descriptor of e4m3 [N, K], tiles [BLOCK_N, BLOCK_K]
    sw_ptr,  # fp32 [N]
    b_ptr,  # [N]
    q_desc,  # out: TMA descriptor of e4m3 [R, N], tiles [BLOCK_M, BLOCK_N]
    sq_ptr,  # out: fp32 [R, NB]
    R,
    stride_sr,
    stride_sb,
    N: tl.constexpr,
    K: tl.constexpr,
    TANH: tl.constexpr,
    HW_TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # SCALE_BLOCK
    BLOCK_K: tl.constexpr,
    OCC: tl.constexpr,  # programs per SM: read by the grid only
):
    """Persistent: each program walks tiles tile, tile + programs, ... in row-major tile
    order (the programs of a wave share their rows of x; all of w stays in L2). The loads
    are TMA's: out-of-range rows read as zeros and their stores are dropped."""
    n_tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    tiles = tl.cdiv(R, BLOCK_M) * n_tiles_n
    step = tl.num_programs(0)
    # flatten: one software pipeline over tiles and K steps, so the pipeliner may issue
    # the next tile's first loads under this tile's epilogue
    for tile in tl.range(tl.program_id(0), tiles, step, flatten=True):
        off_m = (tile // n_tiles_n) * BLOCK_M
        pid_n = tile % n_tiles_n
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([off_m, k0])
            w = w_desc.load([off_n, k0])
            acc = tl.dot(a, w.T, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        codes, scale = _epilogue(acc, rows, cols, R, sx_ptr, sw_ptr, b_ptr, N, TANH, HW_TANH)
        q_desc.store([off_m, off_n], codes.to(tl.float8e4nv))
        tl.store(sq_ptr + rows.to(tl.int64) * stride_sr + pid_n * stride_sb, scale,
                 mask=rows < R)  # fmt: skip


_TUNED_TMA = triton.autotune(configs=_tma_configs(), key=["R", "N", "K", "TANH", "HW_TANH"])(
    _fp8_up_gelu_tma_kernel
)


def _launch_tma(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor,
    q: torch.Tensor,  # out
    scales: torch.Tensor,  # out
    config: triton.Config | None,
    tanh: bool,
    hw_tanh: bool,
) -> None:
    """The persistent TMA kernel, autotuned or at one config (tests sweep them)."""
    (r, k), n = xq.shape, w.q.shape[0]
    tiles_n = triton.cdiv(n, SCALE_BLOCK)
    sms = programs_per_wave(xq.device)
    kw = (config or TMA_DEFAULT).kwargs  # the descriptors' tiles; the autotuner resets them
    descs = (TensorDescriptor.from_tensor(xq, [kw["BLOCK_M"], kw["BLOCK_K"]]),
             TensorDescriptor.from_tensor(w.q, [kw["BLOCK_N"], kw["BLOCK_K"]]),
             TensorDescriptor.from_tensor(q, [kw["BLOCK_M"], kw["BLOCK_N"]]))  # fmt: skip

    def grid(m: dict) -> tuple[int]:
        return (min(triton.cdiv(r, m["BLOCK_M"]) * tiles_n, sms * m["OCC"]),)

    args = (descs[0], xs.reshape(-1).contiguous(), descs[1], w.scale.reshape(-1), bias,
            descs[2], scales, r, scales.stride(0), scales.stride(1))  # fmt: skip
    meta = {"N": n, "K": k, "TANH": tanh, "HW_TANH": hw_tanh}
    if config is None:
        _TUNED_TMA[grid](*args, **meta)
    else:
        assert kw["BLOCK_N"] == SCALE_BLOCK, "one scale per tile"
        _fp8_up_gelu_tma_kernel[grid(kw)](*args, **meta, **kw, num_warps=config.num_warps,
                                          num_stages=config.num_stages)  # fmt: skip


def triton_fp8_up_gelu(
    xq: torch.Tensor,  # e4m3 [R, K], last dim contiguous
    xs: torch.Tensor,  # fp32 [R, 1]
    w: Fp8Weight,  # [N, K]
    bias: torch.Tensor,  # [N]
    tanh: bool,
    config: triton.Config | None = None,  # one config (tests sweep them); None: autotuned
) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [R, N], fp32 [R, ceil(N / 128)] M-major
    """GELU(xq·xs @ (w.q·w.scale).T + bias), quantised per row and 128 columns, the
    scales M-major (strides (1, R): cuBLASLt's 1 x 128 layout)."""
    r, k = xq.shape
    n = w.q.shape[0]
    assert xq.stride(1) == 1 and w.q.shape[1] == k and w.q.is_contiguous()
    assert xs.numel() == r and bias.shape == (n,), "a scale per row, a bias per output"
    if not tma_loadable(k, n):
        raise ValueError(f"K and N must be multiples of 16 (TMA strides); got K={k}, N={n}")
    q = torch.empty((r, n), dtype=torch.float8_e4m3fn, device=xq.device)
    nb = triton.cdiv(n, SCALE_BLOCK)
    scales = torch.empty((nb, r), dtype=torch.float32, device=xq.device).t()
    if r:
        _launch_tma(xq, xs, w, bias, q, scales, config, tanh, tanh and not INTERPRET)
    return q, scales
