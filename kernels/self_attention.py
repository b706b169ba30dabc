"""Self-attention of one new SID token over the row's ≤ 4 cached prefix tokens (paper §4.2).

`fused_self_attention` consumes the QKV projection output, writes the new key/value into
the cache (a paged pool `[N, H, d_h]` addressed by `block_table [R, L]`, or dense
`[R, L, H, d_h]`), gathers tokens 0..t and attends — one pass over the bytes: the Triton
kernel of `_triton_self_attention` on CUDA tensors, the torch reference otherwise and
whenever autograd is recording. On GPU the kernels autotune per (rows, H, d_h, t,
variant) on first use: run each step shape once before capturing a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from kernels.fp8 import quantize_rows

try:
    from kernels._triton_self_attention import fp8_out_supported, fused_self_attention_triton
except ImportError:  # no triton here: the references serve every call
    fused_self_attention_triton = None


def _use_triton(*xs: torch.Tensor | None) -> bool:
    ts = [x for x in xs if x is not None]
    if fused_self_attention_triton is None or not all(x.is_cuda for x in ts):
        return False
    # the kernels have no backward
    return not (torch.is_grad_enabled() and any(x.requires_grad for x in ts))


def prefix_self_attention_reference(
    q: torch.Tensor,  # [R, H, d_h]: the new token's query per row
    k: torch.Tensor,  # [R, t + 1, H, d_h]: keys of tokens 0..t (t included)
    v: torch.Tensor,  # [R, t + 1, H, d_h]
) -> torch.Tensor:  # [R, H, d_h]
    scores = torch.einsum("rhd,rthd->rht", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("rht,rthd->rhd", scores.softmax(dim=-1), v.float()).to(q.dtype)


def fused_self_attention_reference(
    qkv: torch.Tensor,  # [R, 3 * H * d_h]: the QKV projection of the rows' new token
    k_cache: torch.Tensor,  # dense [R, L, H, d_h], or paged pool [N, H, d_h]
    v_cache: torch.Tensor,  # same shape as k_cache
    t: int,  # position of the new token (0-based, < L)
    block_table: torch.Tensor | None = None,  # int [R, L]: block of row r's token j (paged)
    *,
    store: bool = True,  # False: skip the cache write (the last position: nothing reads it)
    qkv_rows: torch.Tensor | None = None,  # int64 [R]: row r's QKV is qkv[qkv_rows[r]]
) -> torch.Tensor:  # [R, H, d_h]
    """Write the new k/v at position t, then attend over positions 0..t."""
    if qkv_rows is not None:
        qkv = qkv[qkv_rows]
    r = qkv.shape[0]
    h, d = k_cache.shape[-2:]
    q, k, v = qkv.view(r, 3, h, d).unbind(1)
    if block_table is None:
        if store:
            k_cache[:, t] = k
            v_cache[:, t] = v
        k_prev, v_prev = k_cache[:, :t], v_cache[:, :t]  # [R, t, H, d_h]
    else:
        if store:
            blocks = block_table[:, t].long()
            k_cache[blocks] = k
            v_cache[blocks] = v
        prefix = block_table[:, :t].long()
        k_prev, v_prev = k_cache[prefix], v_cache[prefix]
    k_all = torch.cat([k_prev, k[:, None]], dim=1)  # [R, t + 1, H, d_h]
    v_all = torch.cat([v_prev, v[:, None]], dim=1)
    return prefix_self_attention_reference(q, k_all, v_all)


def fused_self_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    t: int,
    block_table: torch.Tensor | None = None,
    *,
    store: bool = True,
    qkv_rows: torch.Tensor | None = None,
    fp8_out: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`fused_self_attention_reference`'s work and arguments; paged, the step's blocks
    `block_table[:, t]` must be fresh (distinct, not among any row's blocks 0..t-1).
    `fp8_out`: the output [R, H·d_h] quantised per row for the FP8 out projection,
    (e4m3, fp32 scale [R, 1]) as `kernels.fp8.quantize_rows` gives; the kernel writes it so
    when a tile holds whole rows (`fp8_out_supported`), else it takes a pass of its own."""
    args = (qkv, k_cache, v_cache, t, block_table)
    if _use_triton(qkv, k_cache, v_cache, block_table, qkv_rows):
        if fp8_out and fp8_out_supported(k_cache.shape[-2]):
            return fused_self_attention_triton(*args, store=store, qkv_rows=qkv_rows, fp8_out=True)
        out = fused_self_attention_triton(*args, store=store, qkv_rows=qkv_rows)
    else:
        out = fused_self_attention_reference(*args, store=store, qkv_rows=qkv_rows)
    assert isinstance(out, torch.Tensor)
    return quantize_rows(out.reshape(out.shape[0], -1)) if fp8_out else out
