"""The paged self-attention KV cache for the ≤ 4-token SID prefix of every beam row
(paper §4.3), owned by the decode engine (pipeline stage 3).

A block holds one beam row × one token × all heads; each layer has K and V pools
`[blocks, H, d_h]`, and step t's block table `[B · W_t, L_SID]` names the block of row r's
token j. Step t's new keys go to fresh blocks (column t of its table, planned once for
every layer and run), so children share their parent's blocks and beam reorder copies
block ids, never KV bytes. The cache owns "write + attend": `fused_self_attention` writes
the new key and value and attends over tokens 0..t in one kernel. Buffers are allocated
once, so the engine keeps one cache per (batch bucket, schedule) inside its CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.self_attention import fused_self_attention

BLOCK_DTYPE = torch.int32  # block ids: < 2^31 blocks (paper: 40,976 per layer)


class PagedKVCache:
    def __init__(
        self,
        layers: int,
        n_heads: int,
        d_head: int,
        rows_per_step: Sequence[int],  # beam rows entering each step (B * W_t)
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.h, self.d = n_heads, d_head
        self.rows = tuple(rows_per_step)
        steps = len(self.rows)
        self.base = [sum(self.rows[:t]) for t in range(steps)]  # step t's first fresh block
        blocks = sum(self.rows)  # one fresh block per row per step
        self.k = torch.empty(layers, blocks, n_heads, d_head, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        # step t's table: columns < t are copied from the parents' tables by `reorder`;
        # column t (the step's fresh blocks) is planned here once, for every layer and run
        self.tables = []
        for t, r in enumerate(self.rows):
            table = torch.zeros(r, steps, dtype=BLOCK_DTYPE, device=device)
            table[:, t] = self.base[t] + torch.arange(r, device=device)
            self.tables.append(table)

    def attend(
        self,
        layer: int,
        t: int,
        qkv: torch.Tensor,
        rows: torch.Tensor | None = None,
        fp8_out: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """qkv [R_t, 3·H·d_h] of the rows' token t (or, with `rows` int64 [R_t], row r's
        is qkv[rows[r]]) -> self-attention output [R_t, H, d_h]; with `fp8_out`, that
        output [R_t, H·d_h] quantised per row (e4m3, fp32 scale [R_t, 1]) for the FP8
        out projection (`kernels.self_attention.fused_self_attention`)."""
        r = qkv.shape[0] if rows is None else rows.shape[0]
        assert r == self.rows[t], f"step {t} has {self.rows[t]} rows, got {r}"
        # the last position's k/v are never read again: skip writing them
        store = t + 1 < len(self.rows)
        return fused_self_attention(qkv, self.k[layer], self.v[layer], t, self.tables[t],
                                    store=store, qkv_rows=rows, fp8_out=fp8_out)  # fmt: skip

    def reorder(self, t: int, parent: torch.Tensor) -> None:
        """Row i of step t+1 continues row parent[i] of step t: copy block ids only."""
        self.tables[t + 1][:, : t + 1] = self.tables[t][parent, : t + 1]
