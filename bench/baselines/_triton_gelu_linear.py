"""Persistent Triton GEMM with a bias + tanh-GELU epilogue, `gelu_tanh(x @ W.T + b)`: the
"triton" backend of `kernels.gelu_linear.gelu_linear` (the FFN up-projection of the fused
decoder step, pipeline stage 3).

Why it exists: cuBLASLt's GELU_BIAS epilogue (`torch._addmm_activation`) runs the
decoder's up-projections (1 024 → 7 680, 4 096–8 192 rows) at about 650 TFLOP/s on an
H200, against about 800 for the same shapes with a plain bias epilogue
(docs/PERFORMANCE.md). The tile loop here is the one of Triton's persistent-matmul
tutorial: a grid of one program per SM walks output tiles in grouped order, operand tiles
arrive through TMA tensor descriptors (software-pipelined over `num_stages`), and the
epilogue adds the bias and applies the GELU in fp32 on the accumulator, optionally in two
column halves (`SUBTILE`) so fewer registers are live while it stores.

TMA boxes clip at the tensor's edges (loads fill zeros, stores drop what falls outside),
so M, N and K need not be multiples of the tiles. Runs under `TRITON_INTERPRET=1` on CPU
tensors (tests), which emulates the descriptors; that switch must be set before this
module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._tuning import AUTOTUNE, BLOCK_SMEM_BYTES, INTERPRET, programs_per_wave

# without autotuning (GPU tests, the interpreter): small tiles, so test shapes get ragged
# edge tiles and several tiles per program
DEFAULT_CONFIG = {
    "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "SUBTILE": True,
    "num_warps": 4, "num_stages": 2,
}  # fmt: skip


def _set_block_shape(nargs: dict) -> None:
    """Autotune pre-hook: each config's tiles are the descriptors' boxes (as in Triton's
    persistent-matmul tutorial)."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["y_desc"].block_shape = [bm, bn // 2 if nargs["SUBTILE"] else bn]


def _smem_bytes(bm: int, bn: int, bk: int, stages: int, subtile: bool, es: int = 2) -> int:
    """Operand ring (`stages` x and W tiles) plus the store's staging tile."""
    return stages * (bm + bn) * bk * es + bm * (bn // 2 if subtile else bn) * es


def _gpu_configs() -> list[triton.Config]:
    return [
        triton.Config(
            {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SUBTILE": sub},
            num_warps=w,
            num_stages=s,
            pre_hook=_set_block_shape,
        )
        for bn in (128, 256)
        for bk in (64, 128)
        for s in (3, 4, 5)
        for w in (4, 8)
        for sub in (True, False)
        # the fp32 accumulator of a 128 × 256 tile is 256 registers a thread on 4 warps
        if not (bn == 256 and w == 4) and _smem_bytes(128, bn, bk, s, sub) <= BLOCK_SMEM_BYTES
    ]


@triton.jit
def _tile(tile_id, num_in_group, num_pid_m, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles share each column band, so W tiles are reused
    from L2 while they are hot."""
    group = tile_id // num_in_group
    first_m = group * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % group_m), (tile_id % num_in_group) // group_m


@triton.jit
def _bias_gelu(acc, b_ptr, col0, N):
    """tanh-GELU(acc + b) in fp32; 0.5·(1 + tanh(u)) = sigmoid(2u)."""
    cols = col0 + tl.arange(0, acc.shape[1])
    z = acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    u = 0.7978845608028654 * (z + 0.044715 * z * z * z)  # sqrt(2 / π)·(z + 0.044715 z³)
    return z * tl.sigmoid(2.0 * u)


@triton.jit
def _gelu_linear_kernel(
    x_desc,  # [M, K]
    w_desc,  # [N, K]: nn.Linear's weight, row-major
    y_desc,  # [M, N]
    b_ptr,  # [N]
    M,
    N,
    K,
    M_BUCKET,  # M rounded up to a power of two: the autotune key (a plain int, so the
    # compiled kernels are shared by every bucket)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SUBTILE: tl.constexpr,  # the epilogue stores two BLOCK_N / 2 halves
    NUM_PROGRAMS: tl.constexpr,  # the grid: one program per SM
    WIDEN: tl.constexpr,  # interpreter + bf16: widen dot operands to fp32 (see launcher)
):
    dtype = y_desc.dtype
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_in_group = GROUP_M * num_pid_n
    start = tl.program_id(0)
    # the epilogue's tile counter runs separately from the loop's (as in the tutorial:
    # the flattened, pipelined loop must not see one value used in both prologue and
    # epilogue)
    tile_c = start - NUM_PROGRAMS
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile(tile, num_in_group, num_pid_m, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([off_m, ki * BLOCK_K])
            b = w_desc.load([off_n, ki * BLOCK_K])
            if WIDEN:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        tile_c += NUM_PROGRAMS
        pid_m, pid_n = _tile(tile_c, num_in_group, num_pid_m, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            lo, hi = tl.split(halves)
            y_desc.store([off_m, off_n], _bias_gelu(lo, b_ptr, off_n, N).to(dtype))
            hi = _bias_gelu(hi, b_ptr, off_n + BLOCK_N // 2, N)
            y_desc.store([off_m, off_n + BLOCK_N // 2], hi.to(dtype))
        else:
            y_desc.store([off_m, off_n], _bias_gelu(acc, b_ptr, off_n, N).to(dtype))


_gelu_linear_tuned = triton.autotune(
    configs=_gpu_configs(),
    # M rounded up to a power of two: the row counts of a server's buckets and their parts
    # tune a handful of shapes, not every row count
    key=["M_BUCKET", "N", "K"],
)(_gelu_linear_kernel)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """TMA's rules: 2-byte dtypes, unit last stride, real (not broadcast) rows, 16-byte
    aligned bases and rows; a unit-stride float bias; one device for all three."""
    es = x.element_size()
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and bias.is_floating_point()
        and x.device == weight.device == bias.device
        and x.dim() == 2
        and weight.dim() == 2
        and bias.shape == (weight.shape[0],)
        and x.shape[1] == weight.shape[1]
        and x.stride(1) == 1
        and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1])
        and weight.is_contiguous()
        and bias.stride(0) == 1
        and all(t.data_ptr() % 16 == 0 for t in (x, weight))
        and (x.stride(0) * es) % 16 == 0
        and (weight.shape[0] * es) % 16 == 0  # the output's rows
        and (weight.shape[1] * es) % 16 == 0
    )


def triton_gelu_linear(
    x: torch.Tensor,  # [M, K], bf16/fp16, unit last stride
    weight: torch.Tensor,  # [N, K], contiguous
    bias: torch.Tensor,  # [N]
    config: dict | None = None,  # fixed tiles ({**DEFAULT_CONFIG}-shaped); None: autotuned
    # on CUDA, DEFAULT_CONFIG elsewhere
) -> torch.Tensor:  # [M, N], x's dtype, contiguous
    """`gelu_tanh(x @ weight.T + bias)` in one persistent launch."""
    assert supports(x, weight, bias), "use kernels.gelu_linear.gelu_linear: it checks supports()"
    assert x.is_cuda or INTERPRET, x.device
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tuned = config is None and x.is_cuda and AUTOTUNE
    config = DEFAULT_CONFIG if config is None else config
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [1, 1])
    w_desc = TensorDescriptor(weight, [n, k], [k, 1], [1, 1])
    y_desc = TensorDescriptor(y, [m, n], [n, 1], [1, 1])
    if not tuned:
        _set_block_shape({"x_desc": x_desc, "w_desc": w_desc, "y_desc": y_desc, **config})
    programs = programs_per_wave(x.device)

    def grid(meta: dict) -> tuple[int]:
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
        return (min(tiles, programs),)

    kernel = _gelu_linear_tuned if tuned else _gelu_linear_kernel
    kernel[grid](
        x_desc, w_desc, y_desc, bias, m, n, k, triton.next_power_of_2(m),
        NUM_PROGRAMS=programs,
        # the interpreter multiplies bf16 bit patterns as integers (triton#11584); bf16
        # values widened to fp32 give the same products the tensor cores form
        WIDEN=INTERPRET and x.dtype == torch.bfloat16,
        **({} if tuned else config),
    )  # fmt: skip
    return y
