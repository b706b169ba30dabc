"""Triton kernels of the short-sequence self-attention (paper §4.2–4.3), private to
`kernels/self_attention.py`, which dispatches here for CUDA tensors. One jit body, three
variants by `tl.constexpr` flags:
- coalesced (FUSED=False): queries `[R, H, d_h]` against pre-gathered keys/values
  `[R, T, H, d_h]`;
- fused (FUSED=True): q, k, v read straight from the QKV projection output; the new k/v
  written into the dense cache at position T (unless STORE=False: the last SID position,
  which no later step reads) and attended from registers, tokens 0..T-1 from the cache;
- paged (FUSED=True, PAGED=True): the same, every token addressed through the block
  table (a block = one beam row × one token × all heads).
With FP8_OUT (fused variants) the output is written as e4m3 rows and one fp32 scale
per row, the FP8 out projection's input (`kernels/_triton_fp8.py`); a tile then holds
whole rows, so H must divide BLOCK_N (`fp8_out_supported`).
With GATHER (fused variants) row r's q/k/v come from row `q_rows[r]` of the QKV source:
the decoder's layer 0 reads its per-(position, token) QKV table this way (a few MB that
stay in L2) instead of having each row's 3·H·d_h copied out first.

The served path runs the paged variant (`fused_self_attention_triton`); the coalesced and
dense ones are the Table 5 forms the benchmark compares with it (bench/baselines/kv_cache.py
launches the coalesced one). One body for all of them is why this module runs past the
house's ~300 lines: the layout checks stay beside the kernel that relies on them.

Work split: a query is one (row, head) pair, flattened n = r * H + h, and a program
takes BLOCK_N consecutive ones, i.e. G = BLOCK_N / H whole beam rows when BLOCK_N ≥ H.
Why flattened rather than G rows of one head: a row's H heads are one contiguous H·d_h
span in q, qkv, out and in every cached token (dense row or paged block), so each load
of a tile is one contiguous BLOCK_N·d_h run rather than G pieces a row apart; one block
id serves all H heads of a row inside the tile (one-head tiles would read every id H
times); and tiles stay full whatever H is. The step is bound by HBM bytes (≈ 1 FLOP per
byte loaded), so the tile exists for wide, contiguous loads and enough bytes in flight
per SM, not for FLOPs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._triton_fp8 import empty_fp8_rows, quantize_rows_fp8
from kernels._tuning import AUTOTUNE

# Two ways to evaluate a tile, both in the autotune space:
# - MASKED_DOT (paper §4.2): one [BLOCK_N, T_PAD·BLOCK_N] score tile on tensor cores with a
#   block-diagonal mask — query n only keeps the ≤ T keys of its own (row, head); the
#   wasted FLOPs grow with BLOCK_N, hence the cap;
# - diagonal: the same block diagonal computed directly on CUDA cores, token by token
#   ([BLOCK_N, d_h] tiles, multiply and reduce over d_h, online softmax): no wasted FLOPs,
#   and fewer registers.


def _keep(block_n: int, masked_dot: bool, warps: int) -> bool:
    if masked_dot and block_n > 32:  # the score tile grows as BLOCK_N²: FLOPs stop being free
        return False
    # 4..16 elements of a [BLOCK_N, d_h = 128] tile per thread: more spills registers in
    # the fused step, fewer leaves threads without loads to keep in flight
    return 1 <= block_n // warps <= 4


CONFIGS = [
    triton.Config({"BLOCK_N": bn, "MASKED_DOT": dot}, num_warps=w, num_stages=1)
    for bn in (16, 32, 64, 128)
    for dot in (False, True)
    for w in (4, 8, 16)
    if _keep(bn, dot, w)
]
DEFAULT_CONFIG = {"BLOCK_N": 16, "MASKED_DOT": False}  # off CUDA (the interpreter)


@triton.jit
def _token_rows(row, j, ok, table_ptr, s_kr, s_kt, s_vr, s_vt, s_tr, s_tt, PAGED: tl.constexpr):
    """Element offsets of token j of `row` in k and v: dense row/token, or its paged block."""
    if PAGED:
        # the H queries of a row read one block id: the same cache line, one transaction
        blk = tl.load(table_ptr + row * s_tr + j * s_tt, mask=ok, other=0).to(tl.int64)
        k_rows = blk * s_kr
        v_rows = blk * s_vr
    else:
        k_rows = row * s_kr + j * s_kt
        v_rows = row * s_vr + j * s_vt
    return k_rows, v_rows


@triton.jit
def _softmax_step(m_i, l_i, acc, s, v):
    """Fold one key (base-2 score s [BLOCK_N], value v [BLOCK_N, D]) into the softmax."""
    m_new = tl.maximum(m_i, s)
    alpha = tl.math.exp2(m_i - m_new)  # 0 on the first key (m_i = -inf)
    p = tl.math.exp2(s - m_new)
    return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * v.to(tl.float32)


@triton.jit
def _self_attn_kernel(
    q_ptr,  # [R, H, D], row stride s_q (FUSED: the q third of qkv)
    kn_ptr,  # FUSED: [R, H, D] new token's key (the k third of qkv), row stride s_q
    vn_ptr,  # FUSED: [R, H, D] new token's value
    k_ptr,  # [R, T, H, D] gathered | dense cache [R, L, H, D] | PAGED pool [N, H, D]
    v_ptr,  # same layout as k_ptr, strides s_vr/s_vt
    table_ptr,  # PAGED: int32/int64 [R, L] block of row r's token j
    q_rows_ptr,  # GATHER: int64 [R]: the row of q/kn/vn that row r reads
    out_ptr,  # [R, H, D] contiguous (FP8_OUT: e4m3 [R, H·D])
    scale_ptr,  # FP8_OUT: fp32 [R], each row's e4m3 scale
    n_queries,  # R * H
    s_q,
    s_kr,  # k: row stride (block stride when PAGED)
    s_kt,  # k: token stride (dense layouts only)
    s_vr,
    s_vt,
    s_tr,  # table strides
    s_tt,
    qk_scale,  # log2(e) / sqrt(D): softmax in base 2
    N_BUCKET,  # n_queries rounded up to a power of two: the autotune key (part-sized
    # row counts reuse the next power's tuning)
    H: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,  # tokens read from memory; FUSED adds the new one at position T
    T_PAD: tl.constexpr,  # next power of two ≥ T
    FUSED: tl.constexpr,
    PAGED: tl.constexpr,
    STORE: tl.constexpr,  # FUSED: write the new k/v into the cache
    GATHER: tl.constexpr,  # q/kn/vn rows through q_rows_ptr
    FP8_OUT: tl.constexpr,  # write each row quantised for the FP8 out projection
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no tf32 rounding), else "tf32"
    BLOCK_N: tl.constexpr,
    MASKED_DOT: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_queries
    row = (offs_n // H).to(tl.int64)  # H is constexpr: a shift for H = 16
    # offset of (head, dim) inside a row's — or a block's — contiguous H·D span
    dd = tl.arange(0, D)
    hd = (offs_n % H)[:, None] * D + dd[None, :]  # [BLOCK_N, D]
    q_row = tl.load(q_rows_ptr + row, mask=n_ok, other=0).to(tl.int64) if GATHER else row
    q_off = q_row[:, None] * s_q + hd
    # load q once: it stays in registers for the whole (≤ 4-key) softmax
    q = tl.load(q_ptr + q_off, mask=n_ok[:, None], other=0.0)

    qf = q.to(tl.float32)
    m_i = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros((BLOCK_N,), tl.float32)  # running softmax denominator
    acc = tl.zeros((BLOCK_N, D), tl.float32)
    if T > 0:
        if MASKED_DOT:
            # paper §4.2: all T tokens of the tile at once, [T_PAD, BLOCK_N, D] each
            jj = tl.arange(0, T_PAD)
            tok_ok = (jj[:, None] < T) & n_ok[None, :]  # [T_PAD, BLOCK_N]
            k_rows, v_rows = _token_rows(
                row[None, :],
                jj[:, None],
                tok_ok,
                table_ptr,
                s_kr,
                s_kt,
                s_vr,
                s_vt,
                s_tr,
                s_tt,
                PAGED,
            )
            k = tl.load(
                k_ptr + k_rows[:, :, None] + hd[None, :, :], mask=tok_ok[:, :, None], other=0.0
            )
            v = tl.load(
                v_ptr + v_rows[:, :, None] + hd[None, :, :], mask=tok_ok[:, :, None], other=0.0
            )
            # key m = j * BLOCK_N + i is token j of query i: one [BLOCK_N, T_PAD·BLOCK_N]
            # score tile on tensor cores, masked to the block diagonal (i == own query, j < T)
            k2 = tl.reshape(k, (T_PAD * BLOCK_N, D))
            v2 = tl.reshape(v, (T_PAD * BLOCK_N, D))
            s = tl.dot(q, tl.trans(k2), input_precision=DOT_PRECISION) * qk_scale
            mm = tl.arange(0, T_PAD * BLOCK_N)
            own = (mm % BLOCK_N)[None, :] == tl.arange(0, BLOCK_N)[:, None]
            s = tl.where(own & (mm // BLOCK_N < T)[None, :], s, float("-inf"))
            m_i = tl.max(s, axis=1)
            p = tl.math.exp2(s - m_i[:, None])
            l_i = tl.sum(p, axis=1)
            acc = tl.dot(p.to(v2.dtype), v2, input_precision=DOT_PRECISION)  # [BLOCK_N, D]
        else:
            # the block diagonal directly, one token at a time: a [BLOCK_N, D] tile of k and
            # of v per token (each (token, row) a contiguous H·D span), online softmax
            for j in tl.static_range(T):
                k_rows, v_rows = _token_rows(
                    row, j, n_ok, table_ptr, s_kr, s_kt, s_vr, s_vt, s_tr, s_tt, PAGED
                )
                k_j = tl.load(k_ptr + k_rows[:, None] + hd, mask=n_ok[:, None], other=0.0)
                v_j = tl.load(v_ptr + v_rows[:, None] + hd, mask=n_ok[:, None], other=0.0)
                s_j = tl.sum(qf * k_j.to(tl.float32), axis=1) * qk_scale
                m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s_j, v_j)

    if FUSED:
        kn = tl.load(kn_ptr + q_off, mask=n_ok[:, None], other=0.0)
        vn = tl.load(vn_ptr + q_off, mask=n_ok[:, None], other=0.0)
        if STORE:
            k_rows, v_rows = _token_rows(
                row, T, n_ok, table_ptr, s_kr, s_kt, s_vr, s_vt, s_tr, s_tt, PAGED
            )
            # the cache write: read 2·H·D from qkv, write it once, never read it back
            tl.store(k_ptr + k_rows[:, None] + hd, kn, mask=n_ok[:, None])
            tl.store(v_ptr + v_rows[:, None] + hd, vn, mask=n_ok[:, None])
        # the new token's score and value come from registers (t = 0: its weight is 1)
        s_new = tl.sum(qf * kn.to(tl.float32), axis=1) * qk_scale
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s_new, vn)

    out = acc / l_i[:, None]
    if FP8_OUT:
        # the tile holds BLOCK_N // H whole rows (H divides BLOCK_N): each row's H·D values,
        # rounded to the model's dtype as the unfused path would store them, quantised with
        # one scale per row, the numbers `quantize_rows` gives on that stored output
        o = tl.reshape(out.to(q_ptr.dtype.element_ty).to(tl.float32), (BLOCK_N // H, H * D))
        rows = tl.program_id(0) * (BLOCK_N // H) + tl.arange(0, BLOCK_N // H)
        row_ok = rows < n_queries // H
        cols = tl.arange(0, H * D)
        codes, scale = quantize_rows_fp8(o, row_ok[:, None] & (cols < H * D)[None, :])
        dst = out_ptr + rows.to(tl.int64)[:, None] * (H * D) + cols[None, :]
        tl.store(dst, codes.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(scale_ptr + rows, scale, mask=row_ok)
    else:
        dst = out_ptr + offs_n[:, None].to(tl.int64) * D + dd[None, :]
        tl.store(dst, out, mask=n_ok[:, None])


_self_attn_tuned = triton.autotune(
    configs=CONFIGS,
    key=["N_BUCKET", "H", "D", "T", "FUSED", "PAGED", "STORE", "GATHER", "FP8_OUT"],
)(_self_attn_kernel)
# FP8_OUT needs whole rows in a tile: H must divide every config's BLOCK_N
FP8_MAX_HEADS = min(DEFAULT_CONFIG["BLOCK_N"], *(c.kwargs["BLOCK_N"] for c in CONFIGS))


def fp8_out_supported(h: int) -> bool:
    """Whether the kernel can write its output quantised for `h` heads (a power of two
    dividing every tile's BLOCK_N)."""
    return h & (h - 1) == 0 and h <= FP8_MAX_HEADS


def _packed(x: torch.Tensor) -> bool:
    """Heads and d_h of x [..., H, d_h] packed: each row/token is one contiguous H·d_h span."""
    h, d = x.shape[-2:]
    return x.stride(-1) == 1 and (h == 1 or x.stride(-2) == d)


def _launch(
    q: torch.Tensor,  # [R, H, D], or [N, H, D] read through q_rows
    kn: torch.Tensor,  # [R, H, D] (FUSED) or q (unused)
    vn: torch.Tensor,
    k: torch.Tensor,  # prefix source, see the kernel
    v: torch.Tensor,
    table: torch.Tensor | None,  # [R, L] (PAGED)
    out: torch.Tensor | None,  # [R, H, D] contiguous, or None to allocate
    tokens: int,  # T: tokens read from memory
    token_strides: tuple[int, int],  # k, v token strides (0 when PAGED)
    fused: bool,
    store: bool,
    config: dict | None,
    q_rows: torch.Tensor | None = None,  # int64 [R]: GATHER (fused only)
    fp8_out: bool = False,  # write (e4m3 [R, H·D], fp32 scale [R, 1]) instead (fused only)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h, d = q.shape[1:]
    r = q.shape[0] if q_rows is None else q_rows.shape[0]
    assert d >= 16 and d & (d - 1) == 0, "d_h must be a power of two ≥ 16"
    if fp8_out:
        assert out is None and fp8_out_supported(h), (h, "heads: no FP8 output")
        out, scale = empty_fp8_rows(r, h * d, q.device)
        result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (out, scale)
    else:
        if out is None:
            out = torch.empty(r, h, d, dtype=q.dtype, device=q.device)
        assert out.shape == (r, h, d) and out.dtype == q.dtype and out.is_contiguous()
        scale = out  # an unused pointer without FP8_OUT
        result = out
    n = r * h
    if n == 0:
        return result
    tab = table if table is not None else q  # an unused pointer when not PAGED
    rows = q_rows if q_rows is not None else q  # an unused pointer without GATHER
    args = (q, kn, vn, k, v, tab, rows, out, scale, n, q.stride(0), k.stride(0))
    args += (token_strides[0],)
    args += (v.stride(0), token_strides[1])
    args += (tab.stride(0), tab.stride(1)) if table is not None else (0, 0)
    consts = {
        "H": h,
        "D": d,
        "T": tokens,
        "T_PAD": triton.next_power_of_2(max(tokens, 1)),
        "FUSED": fused,
        "PAGED": table is not None,
        "STORE": store,
        "GATHER": q_rows is not None,
        "FP8_OUT": fp8_out,
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }
    qk_scale = math.log2(math.e) / math.sqrt(d)
    if config is None and q.is_cuda and AUTOTUNE:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _self_attn_tuned[grid](*args, qk_scale, triton.next_power_of_2(n), **consts)
    else:
        config = dict(DEFAULT_CONFIG if config is None else config)
        assert not fp8_out or config["BLOCK_N"] % h == 0, "FP8_OUT: whole rows per tile"
        grid = (triton.cdiv(n, config["BLOCK_N"]),)
        _self_attn_kernel[grid](*args, qk_scale, triton.next_power_of_2(n), **consts, **config)
    return result


def fused_self_attention_triton(
    qkv: torch.Tensor,  # [R, 3 * H * d_h]: the QKV projection of the rows' new token
    k_cache: torch.Tensor,  # dense [R, L, H, d_h], or paged pool [N, H, d_h]
    v_cache: torch.Tensor,  # same shape as k_cache
    t: int,  # position of the new token (0-based, < L)
    block_table: torch.Tensor | None = None,  # int32/int64 [R, L]: block of row r's token j
    *,
    store: bool = True,  # False: leave the cache alone (the last position: nothing reads it)
    out: torch.Tensor | None = None,  # [R, H, d_h] contiguous, written in full
    config: dict | None = None,
    qkv_rows: torch.Tensor | None = None,  # int64 [R]: row r's QKV is qkv[qkv_rows[r]]
    fp8_out: bool = False,  # return (e4m3 [R, H·d_h], fp32 scale [R, 1]) for an FP8 GEMM
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [R, H, d_h]
    """Write the new k/v at position t, attend over 0..t: one pass over the step's bytes.
    Read 3·H·d_h + 2·t·H·d_h elements a row, write 2·H·d_h (store) + H·d_h. Paged: the
    blocks `block_table[:, t]` must be distinct and not among any row's blocks 0..t-1
    (fresh blocks, as `PagedKVCache` allots); blocks 0..t-1 may be shared.
    """
    n_src = qkv.shape[0]
    r = n_src if qkv_rows is None else qkv_rows.shape[0]
    h, d = k_cache.shape[-2:]
    hd = h * d
    assert qkv.dim() == 2 and qkv.shape[1] == 3 * hd and qkv.stride(1) == 1, qkv.shape
    if qkv_rows is not None:
        assert qkv_rows.dim() == 1 and qkv_rows.dtype == torch.int64, qkv_rows.dtype
        assert qkv_rows.device == qkv.device and qkv_rows.is_contiguous()
    assert v_cache.shape == k_cache.shape and qkv.dtype == k_cache.dtype == v_cache.dtype
    assert qkv.device == k_cache.device == v_cache.device
    assert _packed(k_cache) and _packed(v_cache), "cache heads and d_h must be contiguous"
    if block_table is None:
        assert k_cache.dim() == 4 and k_cache.shape[0] == r, (k_cache.shape, r)
        length = k_cache.shape[1]
        strides = (k_cache.stride(1), v_cache.stride(1))
    else:
        assert k_cache.dim() == 3, k_cache.shape
        assert block_table.dim() == 2 and block_table.shape[0] == r, block_table.shape
        assert block_table.dtype in (torch.int32, torch.int64), block_table.dtype
        assert block_table.device == qkv.device
        length = block_table.shape[1]
        strides = (0, 0)
    assert 0 <= t < length, (t, length)
    q, kn, vn = (qkv[:, i * hd : (i + 1) * hd].view(n_src, h, d) for i in range(3))
    args = (q, kn, vn, k_cache, v_cache, block_table, out, t, strides, True, store, config)
    return _launch(*args, q_rows=qkv_rows, fp8_out=fp8_out)
