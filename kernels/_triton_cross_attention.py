"""Triton beam-as-query cross-attention (paper §4.1; docs/ARCHITECTURE.md §7): the GPU fast path
behind `kernels.cross_attention.cross_attention`.

One program owns one (request b, head h) pair and a run of `TILES` tiles of `BLOCK_M`
beam rows. It loads the request's K and V tile once (the whole context, T_ctx ≤ 256, in
one block) and reuses it for every beam row it owns, so K/V bytes are read from HBM
about once per request and head, not once per beam. With the whole context in one
block, the softmax is a plain single pass (row max, exp, sum), with no online rescaling.
The tile maths (`_load_kv`, `_attend`) is shared with the persistent variant,
`bench/baselines/_triton_cross_attention_persistent.py`.

Runs under `TRITON_INTERPRET=1` on CPU tensors (tests); that switch must be set before
this module is imported, and then the autotuner holds a single small config.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tuning import AUTOTUNE, INTERPRET

MAX_T_CTX = 256  # the whole context in one block; longer contexts go to SDPA
_INTERPRET = INTERPRET  # kernels._tuning: read once for every launcher
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMEM_BYTES = 200 * 1024  # of the H100/H200's 227 KiB per block; the rest for scratch


def _smem(block_m: int, stages: int, block_t: int, block_d: int, elsize: int) -> int:
    """Shared memory of one program: K and V for the whole run, `stages` Q tiles."""
    return (stages * block_m + 2 * block_t) * block_d * elsize


def supports(t_ctx: int, d: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this shape: the whole context must sit in one block."""
    block_t, block_d = max(16, triton.next_power_of_2(t_ctx)), max(16, triton.next_power_of_2(d))
    return 1 <= t_ctx <= MAX_T_CTX and _smem(32, 1, block_t, block_d, dtype.itemsize) <= SMEM_BYTES


def _keep(c: triton.Config) -> bool:
    """Static pruning: num_stages pipelines the loop over tiles; no loop, no stages."""
    tiles, stages = c.kwargs["TILES"], c.num_stages
    return (tiles == 1) == (stages == 1) and (stages < 3 or tiles == 4)


def _gpu_configs() -> list[triton.Config]:
    configs = [
        triton.Config({"BLOCK_M": bm, "TILES": tiles}, num_warps=w, num_stages=s)
        for bm in (32, 64, 128)
        for tiles in (1, 2, 4)
        for w in (4, 8)
        for s in (1, 2, 3)
    ]
    return [c for c in configs if _keep(c)]


def _prune(configs: list[triton.Config], nargs: dict, **kwargs: object) -> list[triton.Config]:
    """Shape pruning, keyed like the autotuner on (M, T_ctx, D) and the dtype."""
    m, block_t, block_d = nargs["M"], kwargs["BLOCK_T"], kwargs["BLOCK_D"]
    elsize = nargs["q_ptr"].element_size()
    m_pow2 = max(32, triton.next_power_of_2(m))

    def fits(c: triton.Config) -> bool:
        bm, tiles = c.kwargs["BLOCK_M"], c.kwargs["TILES"]
        # fp32 registers per thread for the score tile S and the output tile O
        regs = bm * (block_t + block_d) // (32 * c.num_warps)
        smem = _smem(bm, c.num_stages, block_t, block_d, elsize)
        return bm * tiles <= m_pow2 and regs <= 192 and smem <= SMEM_BYTES

    kept = [c for c in configs if fits(c)]
    smallest = min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["TILES"], -c.num_warps))
    return kept or [smallest]


# under the interpreter (or GRACE_AUTOTUNE=0): one config (no benchmarking) whose TILES = 2
# still runs the loop over tiles and, at M = 17, a tile with masked rows
_CONFIGS = (
    [triton.Config({"BLOCK_M": 16, "TILES": 2}, num_warps=4, num_stages=2)]
    if _INTERPRET or not AUTOTUNE
    else _gpu_configs()
)


@triton.jit
def _load_kv(
    k_ptr,  # [B, H, T_ctx, D], last dim contiguous
    v_ptr,  # [B, H, T_ctx, D], last dim contiguous
    b,
    h,
    T_ctx,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """K transposed [BLOCK_D, BLOCK_T] and V [BLOCK_T, BLOCK_D] of request b, head h;
    zero past T_ctx and D."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < T_ctx  # T_ctx need not be a power of two
    d_ok = offs_d < D
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh
    kt = tl.load(
        k_base + offs_d[:, None] + offs_t[None, :] * stride_kt,
        mask=t_ok[None, :] & d_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        v_base + offs_t[:, None] * stride_vt + offs_d[None, :],
        mask=t_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    return kt, v


@triton.jit
def _attend(
    q,  # [BLOCK_M, BLOCK_D], input dtype
    kt,  # [BLOCK_D, BLOCK_T], input dtype
    v,  # [BLOCK_T, BLOCK_D], input dtype
    T_ctx,
    qk_scale,  # softmax scale · log2(e): exp2 is the native instruction
    BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: exact, not the tf32 default
    WIDEN: tl.constexpr,  # interpreter + bf16: widen dot operands to fp32 (see launcher)
):
    """softmax(q·kᵀ)·v of one tile, fp32 [BLOCK_M, BLOCK_D]. The whole context is one
    block, so the softmax is a plain single pass: no online rescaling."""
    p_dtype = v.dtype
    if WIDEN:
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
    t_ok = tl.arange(0, BLOCK_T) < T_ctx
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_T] fp32
    s = tl.where(t_ok[None, :], s, float("-inf"))
    p = tl.exp2(s - tl.max(s, axis=1)[:, None])
    denom = tl.sum(p, axis=1)
    # P·V with unnormalised P, then one divide per output element, not per score
    # P in the input dtype (16-bit on the fast path, as in FlashAttention)
    p = p.to(p_dtype)
    if WIDEN:
        p = p.to(tl.float32)
    return tl.dot(p, v, input_precision=PRECISION) / denom[:, None]


@triton.autotune(
    configs=_CONFIGS,
    key=["M", "T_ctx", "D"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _cross_attn_kernel(
    q_ptr,  # [B * M, H, D], request-major rows, last dim contiguous
    k_ptr,  # [B, H, T_ctx, D], last dim contiguous
    v_ptr,  # [B, H, T_ctx, D], last dim contiguous
    o_ptr,  # [B * M, H, D], contiguous
    M,
    T_ctx,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_or,
    stride_oh,
    qk_scale,  # softmax scale · log2(e)
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILES: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    # axis 0 (m tiles) varies fastest, so the programs of one (b, h) run together and the
    # ones that miss SRAM find K/V in L2
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)

    # load K (transposed) and V once: they stay in SRAM/registers for all TILES · BLOCK_M
    # beam rows of this program — the whole point of beam-as-query
    kt, v = _load_kv(
        k_ptr, v_ptr, b, h, T_ctx,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        D, BLOCK_T, BLOCK_D,
    )  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    for i in range(TILES):
        offs_m = (pid_m * TILES + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        rows = b.to(tl.int64) * M + offs_m  # request-major: row b * M + m
        io_mask = m_ok[:, None] & d_ok[None, :]
        # read B·M·H·D Q elements once each; rows of one head are H·D apart, each row
        # one contiguous run of D elements
        q = tl.load(
            q_ptr + rows[:, None] * stride_qr + h * stride_qh + offs_d[None, :],
            mask=io_mask,
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        o = _attend(q, kt, v, T_ctx, qk_scale, BLOCK_T, PRECISION, WIDEN)
        tl.store(
            o_ptr + rows[:, None] * stride_or + h * stride_oh + offs_d[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=io_mask,
        )


def triton_cross_attention(
    q: torch.Tensor,  # [B * M, H, d_h], request-major rows: row b * M + m
    k: torch.Tensor,  # [B, H, T_ctx, d_h]
    v: torch.Tensor,  # [B, H, T_ctx, d_h]
    out: torch.Tensor | None = None,  # [B * M, H, d_h], contiguous; allocated if None
) -> torch.Tensor:  # [B * M, H, d_h], q's dtype, contiguous
    """Beam-as-query cross-attention in one Triton launch."""
    assert q.dim() == 3 and k.dim() == 4 and k.shape == v.shape, (q.shape, k.shape, v.shape)
    b, h, t_ctx, d = k.shape
    assert q.shape[0] % b == 0 and q.shape[1:] == (h, d), (q.shape, k.shape)
    assert supports(t_ctx, d, q.dtype), f"T_ctx={t_ctx}, d_h={d}, {q.dtype}: use SDPA"
    assert q.dtype in _DTYPES and k.dtype == v.dtype == q.dtype, (q.dtype, k.dtype, v.dtype)
    assert q.device == k.device == v.device and (q.is_cuda or _INTERPRET), q.device
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dim must be contiguous"
    m = q.shape[0] // b
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    if q.shape[0] == 0:
        return out

    def grid(meta: dict) -> tuple[int, int, int]:
        return (triton.cdiv(triton.cdiv(m, meta["BLOCK_M"]), meta["TILES"]), h, b)

    _cross_attn_kernel[grid](
        q, k, v, out,
        m, t_ctx,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1),
        d**-0.5 * 1.4426950408889634,  # 1 / sqrt(d_h) · log2(e)
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),  # tl.dot wants every dim ≥ 16
        BLOCK_T=max(16, triton.next_power_of_2(t_ctx)),
        # tf32 is Triton's default on NVIDIA and only affects fp32 operands
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # the interpreter multiplies bf16 bit patterns as integers (triton#11584); bf16
        # values widened to fp32 give the same products the tensor cores form
        WIDEN=_INTERPRET and q.dtype == torch.bfloat16,
    )  # fmt: skip
    return out
