"""Persistent beam-as-query cross-attention: the H200 variant of
`kernels/_triton_cross_attention.py`, behind the "triton_persistent" backend of
`kernels.cross_attention.cross_attention`.

The op is bound by HBM: at the paper's shape it reads 67 MB of Q and writes 67 MB of O
around 17 MB of K/V. So the kernel is built to keep Q bytes in flight all the time:
- persistent grid: about SMs × OCCUPANCY programs, no waves and no tail of late blocks;
- work tile = BLOCK_M beam rows of one (request b, head h), in (b, h, m-tile) order; each
  program walks one contiguous run of tiles, so its run crosses only a couple of (b, h)
  pairs and it reloads K/V (from L2 mostly) only there;
- the m-tile loop is software-pipelined (the config's num_stages): the Q loads of the
  next tiles are issued while the current one computes;
- on sm90 (and under the interpreter, which emulates them) Q loads and O stores may go
  through TMA tensor descriptors over the 2-D `[B·M, H·d_h]` view (USE_TMA, autotuned):
  Q lands in shared memory without passing through registers.
The tile maths (`_load_kv`, `_attend`: exp2 single-pass softmax over the whole context,
"ieee" dots for fp32) is the base kernel's.

Runs under `TRITON_INTERPRET=1` on CPU tensors (tests), on a few programs so each walks
several (b, h) pairs; that switch must be set before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._triton_cross_attention import (
    _DTYPES,
    _INTERPRET,
    MAX_T_CTX,
    _attend,
    _load_kv,
    _smem,
)
from kernels._tuning import (
    AUTOTUNE,
    BLOCK_SMEM_BYTES,
    SM_SMEM_BYTES,
    programs_per_wave,
)

SM_REGS = 64 * 1024  # 32-bit registers of one H100/H200 SM
# ptxas (sm_90, triton 3.6) gives this kernel 176-255 registers a thread at d_h = 128,
# 255 at 4 warps (the K/V reload in the outer loop is the peak): size occupancy as if
# every thread took 255
REGS_PER_THREAD = 255
# off CUDA, and on CUDA without autotuning (GPU tests): small tiles, so the interpreter's
# shapes (M = 17) get a ragged tile and several tiles per (b, h)
DEFAULT_CONFIG = {
    "BLOCK_M": 16, "OCCUPANCY": 1, "USE_TMA": False, "WS": False, "num_warps": 4, "num_stages": 2,
}  # fmt: skip


def _smem_bytes(block_m: int, stages: int, block_t: int, block_d: int, es: int) -> int:
    """K/V, `stages` Q tiles and one O tile: the TMA store's staging buffer, or the
    shared-memory layout conversion before a coalesced pointer store (ptxas-measured:
    exact with TMA, ≤ 8 KiB over without)."""
    return _smem(block_m, stages + 1, block_t, block_d, es)


def supports(t_ctx: int, d: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this shape: its smallest GPU config must fit shared memory."""
    block_t, block_d = max(16, triton.next_power_of_2(t_ctx)), max(16, triton.next_power_of_2(d))
    smem = _smem_bytes(64, 2, block_t, block_d, dtype.itemsize)
    return 1 <= t_ctx <= MAX_T_CTX and smem <= BLOCK_SMEM_BYTES


def _set_block_shape(nargs: dict) -> None:
    """Autotune pre-hook: the TMA boxes follow the config's BLOCK_M (as in Triton's
    persistent-matmul tutorial); without descriptors (q_desc None) nothing to do."""
    if nargs["q_desc"] is not None:
        block = [nargs["BLOCK_M"], nargs["BLOCK_D"]]
        nargs["q_desc"].block_shape = block
        nargs["o_desc"].block_shape = block


def _keep(block_m: int, warps: int, occupancy: int) -> bool:
    """Static pruning: 128 rows on 4 warps hold 256 fp32 registers a thread of S and O
    alone; OCCUPANCY programs of 255-register threads must share one register file."""
    return block_m // warps <= 16 and occupancy * warps * 32 * REGS_PER_THREAD <= SM_REGS


def _gpu_configs() -> list[triton.Config]:
    return [
        triton.Config(
            {"BLOCK_M": bm, "OCCUPANCY": occ, "USE_TMA": tma, "WS": False},
            num_warps=w,
            num_stages=s,
            pre_hook=_set_block_shape,
        )
        for bm in (64, 128)
        for w in (4, 8)
        for s in (2, 3, 4)
        for occ in (1, 2)
        for tma in (False, True)
        if _keep(bm, w, occ)
    ]


def _prune(configs: list[triton.Config], nargs: dict, **kwargs: object) -> list[triton.Config]:
    """Shape pruning: S and O must fit registers; OCCUPANCY programs must fit one SM's
    shared memory together, or the persistent grid runs in two waves; TMA needs
    descriptors and whole tiles."""
    m, block_t, block_d = nargs["M"], kwargs["BLOCK_T"], kwargs["BLOCK_D"]
    es = nargs["q_ptr"].element_size()
    m_pow2 = max(64, triton.next_power_of_2(m))

    def fits(c: triton.Config) -> bool:
        bm, occ, tma = c.kwargs["BLOCK_M"], c.kwargs["OCCUPANCY"], c.kwargs["USE_TMA"]
        # fp32 registers per thread for the score tile S and the output tile O
        regs = bm * (block_t + block_d) // (32 * c.num_warps)
        smem = _smem_bytes(bm, c.num_stages, block_t, block_d, es)
        return (
            bm <= m_pow2
            and regs <= 192
            and smem <= BLOCK_SMEM_BYTES
            and occ * (smem + 1024) <= SM_SMEM_BYTES
            # a TMA box spans BLOCK_M rows of the 2-D view: a ragged last tile would store
            # into the next request's rows
            and (not tma or (kwargs["TMA_OK"] and m % bm == 0))
        )

    kept = [c for c in configs if fits(c)]
    smallest = min(configs, key=lambda c: (*c.kwargs.values(), c.num_stages, c.num_warps))
    return kept or [smallest]


@triton.jit
def _cross_attn_persistent_kernel(
    q_ptr,  # [B * M, H, D], request-major rows, last dim contiguous
    q_desc,  # TMA descriptor over q as [B * M, H * D] (USE_TMA), else None
    k_ptr,  # [B, H, T_ctx, D], last dim contiguous
    v_ptr,  # [B, H, T_ctx, D], last dim contiguous
    o_ptr,  # [B * M, H, D], contiguous
    o_desc,  # TMA descriptor over out as [B * M, H * D] (USE_TMA), else None
    B,
    M,
    H,
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
    OCCUPANCY: tl.constexpr,  # programs per SM: sizes the grid, not read here
    USE_TMA: tl.constexpr,  # Q loads and O stores through q_desc / o_desc
    WS: tl.constexpr,  # warp-specialised m-tile loop (Triton's automatic producer/consumers)
    TMA_OK: tl.constexpr,  # descriptors passed (an autotune key: prunes USE_TMA configs)
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    tl.static_assert(TMA_OK or not USE_TMA, "USE_TMA without descriptors")
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = B * H * m_tiles
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    # a contiguous run of tiles [first, last) in (b, h, m-tile) order: runs differ by at
    # most one tile, and one run crosses few (b, h) pairs, so K/V are reloaded rarely
    first = pid * n_tiles // n_prog
    last = (pid + 1) * n_tiles // n_prog
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    # not pipelined (Triton pipelines innermost loops only): K/V load once per (b, h)
    for bh in range(first // m_tiles, tl.cdiv(last, m_tiles)):
        b = bh // H
        h = bh % H
        # K (transposed) and V of this (b, h): in SRAM for all its tiles in the run
        kt, v = _load_kv(
            k_ptr, v_ptr, b, h, T_ctx,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            D, BLOCK_T, BLOCK_D,
        )  # fmt: skip
        q_base = q_ptr + b.to(tl.int64) * M * stride_qr + h * stride_qh
        o_base = o_ptr + b.to(tl.int64) * M * stride_or + h * stride_oh
        # pipelined (num_stages): the Q tiles of the next iterations load during this one
        for mt in tl.range(
            tl.maximum(first - bh * m_tiles, 0),
            tl.minimum(last - bh * m_tiles, m_tiles),
            warp_specialize=WS,
        ):
            if USE_TMA:
                # one TMA box per tile: BLOCK_M rows of D elements, H·D apart, into SRAM
                # with no register round trip; M % BLOCK_M == 0 (pruned), so no ragged tile
                row0 = b * M + mt * BLOCK_M
                q = q_desc.load([row0, h * D])  # [BLOCK_M, BLOCK_D]
                o = _attend(q, kt, v, T_ctx, qk_scale, BLOCK_T, PRECISION, WIDEN)
                o_desc.store([row0, h * D], o.to(o_ptr.dtype.element_ty))
            else:
                m = mt * BLOCK_M + offs_m
                io_mask = (m < M)[:, None] & d_ok[None, :]
                # read each Q element once: BLOCK_M contiguous runs of D elements, H·D apart
                q = tl.load(
                    q_base + m[:, None] * stride_qr + offs_d[None, :], mask=io_mask, other=0.0
                )  # [BLOCK_M, BLOCK_D]
                o = _attend(q, kt, v, T_ctx, qk_scale, BLOCK_T, PRECISION, WIDEN)
                tl.store(
                    o_base + m[:, None] * stride_or + offs_d[None, :],
                    o.to(o_ptr.dtype.element_ty),
                    mask=io_mask,
                )


_cross_attn_persistent_tuned = triton.autotune(
    configs=_gpu_configs(),
    key=["M", "T_ctx", "D", "TMA_OK"],
    prune_configs_by={"early_config_prune": _prune},
)(_cross_attn_persistent_kernel)


def _tma_ok(q: torch.Tensor, out: torch.Tensor, d: int) -> bool:
    """Whether q and out view as 2-D `[B·M, H·d_h]` tensors TMA can address: heads packed,
    d_h a whole box width, 16-byte aligned base and row stride; sm90+ (or interpreted)."""
    if q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    es = q.element_size()
    return (
        d >= 16
        and d & (d - 1) == 0
        and (q.shape[1] == 1 or q.stride(1) == d)
        and all(x.data_ptr() % 16 == 0 and x.stride(0) * es % 16 == 0 for x in (q, out))
    )


def _descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """x [B·M, H, d_h] seen as 2-D [B·M, H·d_h]: a head's tile is a box at column h·d_h."""
    rows, h, d = x.shape
    return TensorDescriptor(x, [rows, h * d], [x.stride(0), 1], block)


def triton_cross_attention_persistent(
    q: torch.Tensor,  # [B * M, H, d_h], request-major rows: row b * M + m
    k: torch.Tensor,  # [B, H, T_ctx, d_h]
    v: torch.Tensor,  # [B, H, T_ctx, d_h]
    out: torch.Tensor | None = None,  # [B * M, H, d_h], contiguous; allocated if None
    config: dict | None = None,  # fixed {"BLOCK_M", "OCCUPANCY", "USE_TMA", "WS",
    # "num_warps", "num_stages"}; None: autotuned on CUDA, DEFAULT_CONFIG elsewhere
) -> torch.Tensor:  # [B * M, H, d_h], q's dtype, contiguous
    """Beam-as-query cross-attention in one persistent Triton launch."""
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

    block_d = max(16, triton.next_power_of_2(d))  # tl.dot wants every dim ≥ 16
    tuned = config is None and q.is_cuda and AUTOTUNE
    config = DEFAULT_CONFIG if config is None else config
    tma_ok = _tma_ok(q, out, d)
    q_desc = o_desc = None
    if tuned and tma_ok:  # the pre-hook sets each config's box
        q_desc, o_desc = _descriptor(q, [1, 1]), _descriptor(out, [1, 1])
    elif not tuned and config["USE_TMA"]:
        assert tma_ok and m % config["BLOCK_M"] == 0, "USE_TMA: whole tiles of a 2-D view"
        box = [config["BLOCK_M"], block_d]
        q_desc, o_desc = _descriptor(q, box), _descriptor(out, box)
    sms = programs_per_wave(q.device)

    def grid(meta: dict) -> tuple[int]:
        tiles = b * h * triton.cdiv(m, meta["BLOCK_M"])
        return (min(tiles, sms * meta["OCCUPANCY"]),)

    kernel = _cross_attn_persistent_tuned if tuned else _cross_attn_persistent_kernel
    kernel[grid](
        q, q_desc, k, v, out, o_desc,
        b, m, h, t_ctx,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1),
        d**-0.5 * 1.4426950408889634,  # 1 / sqrt(d_h) · log2(e)
        D=d,
        BLOCK_D=block_d,
        BLOCK_T=max(16, triton.next_power_of_2(t_ctx)),
        TMA_OK=q_desc is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN=_INTERPRET and q.dtype == torch.bfloat16,  # see the base kernel's launcher
        **({} if tuned else {"WS": False, **config}),  # WS off unless asked for
    )  # fmt: skip
    return out
