"""KV-cache variants the decode ladder (bench/bench_decoder_loop.py) compares with the served
paged cache (`service/decode/kv_cache.py`); none of them is served.

`attention` picks how a layer attends:
- "fused": `fused_self_attention` (one kernel writes the new K/V, gathers 0..t, attends);
- "gather": write, gather the prefix, the coalesced variant of the served self-attention
  kernel (`prefix_self_attention_triton`, below; its reference on a CPU);
- "sdpa": write, gather, torch's `scaled_dot_product_attention` with one query per row
  (the naive baseline: a batch of R tiny attentions).

`GatherPagedKVCache` is the paged layout with the unfused attention paths; `DenseKVCache`
keeps per-row KV `[layers, rows, L_SID, H, d_h]`, whose reorder copies the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.self_attention import fused_self_attention, prefix_self_attention_reference
from service.decode.kv_cache import PagedKVCache

try:
    from kernels import _triton_self_attention as tsa
except ImportError:  # no triton here
    tsa = None  # type: ignore[assignment]

ATTENTION_MODES = ("fused", "gather", "sdpa")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [R, H, d_h], k/v [R, t+1, H, d_h] -> [R, H, d_h] through torch's SDPA."""
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2))
    return out.squeeze(2)


def coalesced_self_attention(
    q: torch.Tensor,  # [R, H, d_h]: the new token's query per row
    k: torch.Tensor,  # [R, t + 1, H, d_h]: keys of tokens 0..t, gathered already
    v: torch.Tensor,  # [R, t + 1, H, d_h]
) -> torch.Tensor:  # [R, H, d_h]
    """The coalesced kernel on CUDA, its torch reference elsewhere."""
    if q.is_cuda and tsa is not None:
        return prefix_self_attention_triton(q, k, v)
    return prefix_self_attention_reference(q, k, v)


def prefix_self_attention_triton(
    q: torch.Tensor,  # [R, H, d_h]: the new token's query per row
    k: torch.Tensor,  # [R, t + 1, H, d_h]: keys of tokens 0..t; any row/token strides
    v: torch.Tensor,  # [R, t + 1, H, d_h]
    *,
    out: torch.Tensor | None = None,  # [R, H, d_h] contiguous, written in full
    config: dict | None = None,  # a fixed {"BLOCK_N", "MASKED_DOT"[, "num_warps"]}; None: tuned
) -> torch.Tensor:  # [R, H, d_h]
    """The coalesced kernel: read 2·(t+1)·H·d_h + H·d_h elements a row, write H·d_h."""
    r, h, d = q.shape
    assert k.dim() == 4 and k.shape[0] == r and k.shape[2:] == (h, d), (q.shape, k.shape)
    assert v.shape == k.shape and k.shape[1] >= 1, (k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
    assert tsa._packed(q) and tsa._packed(k) and tsa._packed(v), "heads and d_h must be contiguous"
    strides = (k.stride(1), v.stride(1))
    result = tsa._launch(q, q, q, k, v, None, out, k.shape[1], strides, False, False, config)
    assert isinstance(result, torch.Tensor)
    return result


_UNFUSED = {"gather": coalesced_self_attention, "sdpa": _sdpa}


def _split(qkv: torch.Tensor, rows: torch.Tensor | None, h: int, d: int):
    qkv = qkv if rows is None else qkv[rows]
    return qkv.view(qkv.shape[0], 3, h, d).unbind(1)  # q, k, v: [R, H, d_h] each


def _check(attention: str) -> None:
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")


class GatherPagedKVCache(PagedKVCache):
    """The paged cache attending through `attention` ("gather" or "sdpa"; "fused" is the
    served cache itself)."""

    def __init__(self, *args, attention: str = "gather", **kwargs) -> None:
        _check(attention)
        super().__init__(*args, **kwargs)
        self.attention = attention

    def attend(self, layer, t, qkv, rows=None, fp8_out=False):
        if self.attention == "fused":
            return super().attend(layer, t, qkv, rows, fp8_out)
        assert not fp8_out, "the unfused baselines serve the bf16 step only"
        q, k, v = _split(qkv, rows, self.h, self.d)
        r = q.shape[0]
        fresh = slice(self.base[t], self.base[t] + r)  # = table[:, t]: contiguous blocks
        self.k[layer, fresh] = k
        self.v[layer, fresh] = v
        blocks = self.tables[t][:, : t + 1].long()  # [R_t, t + 1]
        return _UNFUSED[self.attention](q, self.k[layer][blocks], self.v[layer][blocks])


class DenseKVCache:
    """Per-row KV [layers, max rows, L_SID, H, d_h]; reorder copies the bytes."""

    def __init__(
        self,
        layers: int,
        n_heads: int,
        d_head: int,
        rows_per_step: Sequence[int],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        attention: str = "gather",
    ) -> None:
        _check(attention)
        self.h, self.d, self.attention = n_heads, d_head, attention
        self.rows = tuple(rows_per_step)
        shape = (layers, max(self.rows), len(self.rows), n_heads, d_head)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    def attend(self, layer: int, t: int, qkv: torch.Tensor, rows: torch.Tensor | None = None,
               fp8_out: bool = False) -> torch.Tensor:  # fmt: skip
        assert not fp8_out, "the dense baseline serves the bf16 step only"
        r = qkv.shape[0] if rows is None else rows.shape[0]
        assert r == self.rows[t], f"step {t} has {self.rows[t]} rows, got {r}"
        k_rows, v_rows = self.k[layer, :r], self.v[layer, :r]  # [R_t, L, H, d_h], contiguous
        if self.attention == "fused":
            store = t + 1 < len(self.rows)
            return fused_self_attention(qkv, k_rows, v_rows, t, store=store, qkv_rows=rows)
        q, k, v = _split(qkv, rows, self.h, self.d)
        k_rows[:, t] = k
        v_rows[:, t] = v
        return _UNFUSED[self.attention](q, k_rows[:, : t + 1], v_rows[:, : t + 1])

    def reorder(self, t: int, parent: torch.Tensor) -> None:
        """Copy tokens 0..t of every parent row into its child's row (all layers)."""
        n = parent.shape[0]
        self.k[:, :n, : t + 1] = self.k[:, parent, : t + 1]  # gather to a temporary, then copy
        self.v[:, :n, : t + 1] = self.v[:, parent, : t + 1]
