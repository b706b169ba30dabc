"""Self-attention KV caches for the ≤ 4-token SID prefix of every beam row (paper §4.3).

Both caches own "write + attend" (`attend(layer, t, qkv[, rows])`): the decoder hands each
layer's QKV projection (or, with `rows`, a shared source and each row's index into it —
layer 0's QKV table) to the cache, which writes the new key/value and attends over tokens 0..t
of every row. Every buffer is allocated once, for the rows of each step (`rows_per_step`,
B · M_t), and nothing is reallocated per step, so `StaticBeamSearch` keeps one cache per
(batch bucket, schedule) across runs and captures it in its CUDA graphs; `BeamSearch`
makes one per batch.

- `PagedKVCache`: a block holds one beam row × one token × all heads; each layer has a K
  and a V pool `[blocks, H, d_h]`, and step t's block table `[B · M_t, L_SID]` says which
  block holds row r's token-j key/value. Step t's new keys go to fresh blocks
  (`base_t + r`: column t of step t's table is fixed, planned once at allocation and
  shared by all layers), so a parent's blocks are shared by all of its children and beam
  reorder copies block ids (`table_t[parent]`), never KV bytes.
- `DenseKVCache`: per-row KV `[layers, rows, L_SID, H, d_h]`; reorder copies the bytes.
  The test oracle and the benchmark's ablation baseline.

`attention` picks how a layer attends (the benchmark's ablation switch):
- "fused": `fused_self_attention` (one kernel writes the new K/V, gathers 0..t, attends);
- "gather": write, gather the prefix, `prefix_self_attention` (the reference path);
- "sdpa": write, gather, torch's `scaled_dot_product_attention` with one query per row
  (the naive baseline: a batch of R tiny attentions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from kernels.self_attention import fused_self_attention, prefix_self_attention

SelfAttention = Literal["fused", "gather", "sdpa"]
ATTENTION_MODES: tuple[str, ...] = ("fused", "gather", "sdpa")
BLOCK_DTYPE = torch.int32  # block ids: < 2^31 blocks (paper: 40,976 per layer)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [R, H, d_h], k/v [R, t+1, H, d_h] -> [R, H, d_h] through torch's SDPA."""
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2))
    return out.squeeze(2)


_UNFUSED = {"gather": prefix_self_attention, "sdpa": _sdpa}


def _rows(qkv: torch.Tensor, rows: torch.Tensor | None) -> int:
    return qkv.shape[0] if rows is None else rows.shape[0]


def _split(qkv: torch.Tensor, h: int, d: int) -> tuple[torch.Tensor, ...]:
    return qkv.view(qkv.shape[0], 3, h, d).unbind(1)  # q, k, v: [R, H, d_h] each


class PagedKVCache:
    def __init__(
        self,
        layers: int,
        n_heads: int,
        d_head: int,
        rows_per_step: Sequence[int],  # beam rows entering each step (B * M_t)
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        attention: SelfAttention = "gather",
    ) -> None:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.h, self.d, self.attention = n_heads, d_head, attention
        self.rows = tuple(rows_per_step)
        steps = len(self.rows)
        self._base = [sum(self.rows[:t]) for t in range(steps)]
        blocks = sum(self.rows)  # one fresh block per row per step
        self.k = torch.empty(layers, blocks, n_heads, d_head, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        # step t's table: columns < t are copied from the parents' tables by `reorder`;
        # column t (the step's fresh blocks) is planned here once, for every layer and run
        self.tables = []
        for t, r in enumerate(self.rows):
            table = torch.zeros(r, steps, dtype=BLOCK_DTYPE, device=device)
            table[:, t] = self._base[t] + torch.arange(r, device=device)
            self.tables.append(table)

    def attend(
        self, layer: int, t: int, qkv: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """qkv [R_t, 3·H·d_h] of the rows' token t (or, with `rows` int64 [R_t], row r's
        is qkv[rows[r]]) -> self-attention output [R_t, H, d_h]."""
        r, table = _rows(qkv, rows), self.tables[t]
        assert r == self.rows[t], f"step {t} has {self.rows[t]} rows, got {r}"
        if self.attention == "fused":
            # the last position's k/v are never read again: skip writing them (1/6 of the
            # step's bytes at t = 3)
            store = t + 1 < len(self.rows)
            return fused_self_attention(
                qkv, self.k[layer], self.v[layer], t, table, store=store, qkv_rows=rows
            )
        q, k, v = _split(qkv if rows is None else qkv[rows], self.h, self.d)
        fresh = slice(self._base[t], self._base[t] + r)  # = table[:, t]: contiguous blocks
        self.k[layer, fresh] = k
        self.v[layer, fresh] = v
        blocks = table[:, : t + 1].long()  # [R_t, t + 1]
        return _UNFUSED[self.attention](q, self.k[layer][blocks], self.v[layer][blocks])

    def reorder(self, t: int, parent: torch.Tensor) -> None:
        """Row i of step t+1 continues row parent[i] of step t: copy block ids only."""
        self.tables[t + 1][:, : t + 1] = self.tables[t][parent, : t + 1]


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
        attention: SelfAttention = "gather",
    ) -> None:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.h, self.d, self.attention = n_heads, d_head, attention
        self.rows = tuple(rows_per_step)
        shape = (layers, max(self.rows), len(self.rows), n_heads, d_head)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    def attend(
        self, layer: int, t: int, qkv: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        r = _rows(qkv, rows)
        assert r == self.rows[t], f"step {t} has {self.rows[t]} rows, got {r}"
        k_rows, v_rows = self.k[layer, :r], self.v[layer, :r]  # [R_t, L, H, d_h], contiguous
        if self.attention == "fused":
            store = t + 1 < len(self.rows)
            return fused_self_attention(qkv, k_rows, v_rows, t, store=store, qkv_rows=rows)
        q, k, v = _split(qkv if rows is None else qkv[rows], self.h, self.d)
        k_rows[:, t] = k
        v_rows[:, t] = v
        return _UNFUSED[self.attention](q, k_rows[:, : t + 1], v_rows[:, : t + 1])

    def reorder(self, t: int, parent: torch.Tensor) -> None:
        """Copy tokens 0..t of every parent row into its child's row (all layers)."""
        n = parent.shape[0]
        self.k[:, :n, : t + 1] = self.k[:, parent, : t + 1]  # gather to a temporary, then copy
        self.v[:, :n, : t + 1] = self.v[:, parent, : t + 1]


KVCache = PagedKVCache | DenseKVCache
