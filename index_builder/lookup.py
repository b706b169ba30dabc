"""Reference CD+GTM lookup (paper §3.5 `Lookup`), in torch on any device.

The decode engine calls this once per step: for every beam row, which next tokens keep
the prefix in the catalog (CD) and — in `CD_GTM` mode — may still hold an ad eligible for
the row's request (GTM: bitmask first, then Bloom, ANY-of-many over the request's
locations; with k-way partitions, any one group passing both). It is the oracle the GPU
kernel (kernels/) is tested against, and the CPU path's implementation.

Tables live in `GtmTables` (int64 views of the uint64 arrays: torch's bitwise ops and
comparisons are complete for int64, and the bits are identical).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from index_builder.format import VOCAB_SIZE, PartitionArrays, TrieArrays
from index_builder.targeting import EncodedRequests


class FilterMode(enum.IntEnum):
    """Matches the RPC enum `grace.v1.FilterMode` (UNSPECIFIED means CD_GTM)."""

    CD_ONLY = 1
    CD_GTM = 2
    CD_GTM_KWAY = 3  # CD_GTM with the index's k-way partitioned matchers


def _t(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    a = np.array(a, copy=True, order="C")  # index arrays are read-only memory maps
    if a.dtype == np.uint64:
        a = a.view(np.int64)
    return torch.from_numpy(a).to(device)


@dataclass(frozen=True)
class GtmTables:
    """The trie's lookup arrays as tensors on one device (int64 views of uint64 tables).

    Per-entry arrays keep the index's own 32-bit widths (tokens widened from int16, which
    torch cannot index with): at 30 M SIDs that is 315 MB of matcher indexes + tables on
    the GPU instead of 620 MB as int64 (docs/ARCHITECTURE.md §9: ≤ 390 MB)."""

    node_offsets: torch.Tensor  # int32 [num_nodes + 1]
    child_nodes: torch.Tensor  # int32 [E]
    tokens: torch.Tensor  # int32 [E]
    bitmask_index: torch.Tensor  # int32 [E]
    bloom_index: torch.Tensor  # int32 [E]
    bitmask_table: torch.Tensor  # int64 [R_bm, W_bm]
    bloom_table: torch.Tensor  # int64 [R_bl, W_bl]
    kway_offsets: torch.Tensor | None = None  # int64 [E + 1]
    kway_bitmask: torch.Tensor | None = None  # int64 [P, W_bm]: rows, not ids
    kway_bloom: torch.Tensor | None = None  # int64 [P, W_bl]

    @classmethod
    def from_arrays(
        cls, trie: TrieArrays, kway: PartitionArrays | None = None, device: str = "cpu"
    ) -> GtmTables:
        extra = {}
        if kway is not None:
            extra = {
                "kway_offsets": _t(kway.offsets, device),
                "kway_bitmask": _t(kway.bitmask_table[kway.bitmask_index], device),
                "kway_bloom": _t(kway.bloom_table[kway.bloom_index], device),
            }
        return cls(
            node_offsets=_t(trie.node_offsets.astype(np.int32), device),
            child_nodes=_t(trie.csr_child_nodes.astype(np.int32), device),
            tokens=_t(trie.csr_tokens.astype(np.int32), device),
            bitmask_index=_t(trie.bitmask_index.astype(np.int32), device),
            bloom_index=_t(trie.bloom_index.astype(np.int32), device),
            bitmask_table=_t(trie.bitmask_table, device),
            bloom_table=_t(trie.bloom_table, device),
            **extra,
        )


@dataclass(frozen=True)
class RequestTensors:
    """`targeting.EncodedRequests` as tensors (int64 views)."""

    bitmask: torch.Tensor  # int64 [B, W_bm]
    blooms: torch.Tensor  # int64 [B, L, W_bl]; padding rows repeat row 0

    @classmethod
    def from_encoded(cls, enc: EncodedRequests, device: str = "cpu") -> RequestTensors:
        return cls(_t(enc.bitmask, device), _t(enc.blooms, device))


def _contains(matchers: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(matcher & query) == query over the last dim."""
    return ((matchers & query) == query).all(dim=-1)


def _passes(bm: torch.Tensor, bl: torch.Tensor, req: torch.Tensor, r: RequestTensors):
    """bm [T, W_bm], bl [T, W_bl] matchers of T candidates for requests req [T] -> bool [T]."""
    ok = _contains(bm, r.bitmask[req])
    idx = ok.nonzero().squeeze(1)  # Bloom only where the bitmask passed
    if len(idx):
        blooms = r.blooms[req[idx]]  # [t, L, W_bl]
        ok[idx] = _contains(bl[idx].unsqueeze(1), blooms).any(dim=1)
    return ok


def lookup(
    tables: GtmTables,
    node_ids: torch.Tensor,  # int64 [R]: the trie node of each beam row
    row_request: torch.Tensor,  # int64 [R]: the request (batch index) of each beam row
    requests: RequestTensors | None,
    mode: FilterMode = FilterMode.CD_GTM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allowed next tokens and their child nodes for every beam row.

    Returns (allowed bool [R, VOCAB_SIZE], child int32 [R, VOCAB_SIZE], -1 where not allowed).
    """
    dev = node_ids.device
    rows = node_ids.shape[0]
    start = tables.node_offsets[node_ids].long()
    count = tables.node_offsets[node_ids + 1].long() - start
    row_of = torch.repeat_interleave(torch.arange(rows, device=dev), count)
    first = torch.cumsum(count, 0) - count
    entry = start[row_of] + torch.arange(row_of.shape[0], device=dev) - first[row_of]
    ok = torch.ones(entry.shape[0], dtype=torch.bool, device=dev)
    if mode != FilterMode.CD_ONLY:
        if requests is None:
            raise ValueError(f"{mode.name} needs encoded requests")
        req = row_request[row_of]
        if mode == FilterMode.CD_GTM:
            ok = _passes(
                tables.bitmask_table[tables.bitmask_index[entry]],
                tables.bloom_table[tables.bloom_index[entry]],
                req,
                requests,
            )
        else:
            ok = _any_partition(tables, entry, req, requests)
    allowed = torch.zeros(rows, VOCAB_SIZE, dtype=torch.bool, device=dev)
    child = torch.full((rows, VOCAB_SIZE), -1, dtype=torch.int32, device=dev)
    keep_row, keep_tok = row_of[ok], tables.tokens[entry[ok]].long()
    allowed[keep_row, keep_tok] = True
    child[keep_row, keep_tok] = tables.child_nodes[entry[ok]]
    return allowed, child


def _any_partition(
    tables: GtmTables, entry: torch.Tensor, req: torch.Tensor, r: RequestTensors
) -> torch.Tensor:
    if tables.kway_offsets is None or tables.kway_bitmask is None or tables.kway_bloom is None:
        raise ValueError("this index has no k-way partitions (build it with --kway)")
    start = tables.kway_offsets[entry]
    count = tables.kway_offsets[entry + 1] - start
    owner = torch.repeat_interleave(torch.arange(entry.shape[0], device=entry.device), count)
    first = torch.cumsum(count, 0) - count
    part = start[owner] + torch.arange(owner.shape[0], device=entry.device) - first[owner]
    passed = _passes(tables.kway_bitmask[part], tables.kway_bloom[part], req[owner], r)
    ok = torch.zeros(entry.shape[0], dtype=torch.bool, device=entry.device)
    ok[owner[passed]] = True
    return ok
