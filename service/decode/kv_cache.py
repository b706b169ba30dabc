"""Self-attention KV caches for the ≤ 4-token SID prefix of every beam row (paper §4.3).

`PagedKVCache` is what the decode engine uses: a block holds one beam row × one token ×
all heads; each layer has a K and a V pool of blocks, and a block table
`[rows, sid_length]` says which block holds row r's token-t key/value. Beam reorder after
top-k copies block ids (`block_table[parent]`), never KV bytes. Every step writes its new
keys into fresh blocks, so a parent's blocks are shared by all of its children.

`DenseKVCache` stores per-row KV and reorders by copying it: the test oracle only.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(
        self,
        layers: int,
        n_heads: int,
        d_head: int,
        rows_per_step: list[int],  # beam rows entering each step (B * M_t)
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        blocks = sum(rows_per_step)  # one fresh block per row per step
        self.k = torch.empty(layers, blocks, n_heads, d_head, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self._base = [sum(rows_per_step[:t]) for t in range(len(rows_per_step))]
        self.block_table = torch.zeros(
            rows_per_step[0], len(rows_per_step), dtype=torch.int64, device=device
        )

    def write(self, layer: int, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [R, H, d_h]: the step-t keys/values of the R current rows."""
        rows = k.shape[0]
        if layer == 0:  # the block table is shared by all layers: plan once per step
            self.block_table[:, t] = self._base[t] + torch.arange(rows, device=k.device)
        blocks = self.block_table[:, t]
        self.k[layer, blocks] = k
        self.v[layer, blocks] = v

    def gather(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of tokens 0..t of every row: [R, t+1, H, d_h] each."""
        blocks = self.block_table[:, : t + 1]
        return self.k[layer, blocks], self.v[layer, blocks]

    def reorder(self, parent: torch.Tensor) -> None:
        """New row i continues old row parent[i]: copy block ids only."""
        self.block_table = self.block_table[parent]


class DenseKVCache:
    """Per-row KV [layers, R, L, H, d_h]; reorder copies the bytes (test oracle)."""

    def __init__(
        self,
        layers: int,
        n_heads: int,
        d_head: int,
        rows_per_step: list[int],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (layers, rows_per_step[0], len(rows_per_step), n_heads, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, layer: int, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, :, t] = k
        self.v[layer, :, t] = v

    def gather(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :, : t + 1], self.v[layer, :, : t + 1]

    def reorder(self, parent: torch.Tensor) -> None:
        self.k = self.k[:, parent]
        self.v = self.v[:, parent]


KVCache = PagedKVCache | DenseKVCache
