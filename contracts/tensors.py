"""The index's trie tables and a batch's encoded targeting as torch tensors: what the
CD+GTM mask (`kernels/gtm_mask.py`) reads at every decode step (docs/ARCHITECTURE.md §3,
§7). `GtmTables` is built once per loaded index version on the compute device,
`RequestTensors` once per batch at stage 1. uint64 arrays become int64 views: torch's
bitwise ops and comparisons are complete for int64, and the bits are identical. A Bloom
row holds K >= 0 families (one per `set` attribute of the index's targeting schema) side
by side: `GtmTables.bloom_families` says where each lives, `RequestTensors.n_blooms` how
many rows of each a request has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from contracts.index_arrays import PartitionArrays, TrieArrays

if TYPE_CHECKING:  # `from_encoded` reads the codec's three arrays
    from contracts import targeting_codec

COPY_CHUNK = 64 << 20  # bytes per piece of a tensor's copy to a GPU (`to_device`)


def to_device(
    t: torch.Tensor, device: torch.device | str, pace: Callable[[], None] | None = None
) -> torch.Tensor:
    """`t` on `device`; to a CUDA device COPY_CHUNK bytes at a time through a pinned
    staging buffer, `pace` called after each piece: one pageable copy of a large tensor
    holds the serving threads' CUDA calls until it is done, pinned pieces let them in
    between (docs/PERFORMANCE.md "Model rollout")."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    src = t.contiguous().view(-1)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    if src.numel() == 0:
        return out
    flat, size = out.view(-1), t.element_size()
    per = COPY_CHUNK // size
    staging = torch.empty(min(COPY_CHUNK, src.numel() * size), dtype=torch.uint8,
                          pin_memory=True)  # fmt: skip
    stream = torch.cuda.current_stream(device)
    for a in range(0, src.numel(), per):
        n = min(per, src.numel() - a)
        stage = staging[: n * size].view(t.dtype)
        stage.copy_(src[a : a + n])
        flat[a : a + n].copy_(stage, non_blocking=True)
        stream.synchronize()  # the staging buffer is refilled next
        if pace is not None:
            pace()
    return out


def _t(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    a = np.array(a, copy=True, order="C")  # index arrays are read-only memory maps
    if a.dtype == np.uint64:
        a = a.view(np.int64)
    return to_device(torch.from_numpy(a), device)


@dataclass(frozen=True)
class GtmTables:
    """The trie's lookup arrays as tensors on one device (int64 views of uint64 tables).
    Per-entry arrays keep the index's own 32-bit widths (tokens widened from int16, which
    torch cannot index with): half the GPU memory of int64 (docs/ARCHITECTURE.md §9)."""

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
    # (first word, words) of each Bloom family, in order, tiling the W_bl words of a Bloom
    # row (`TargetingSchema.family_words`); None: one family over the whole row (the
    # locations of an index from before the schema), none at all when W_bl is 0
    bloom_families: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        words = self.bloom_table.shape[1]
        families = self.bloom_families
        if families is None:
            families = ((0, words),) if words else ()
        families = tuple((int(at), int(w)) for at, w in families)
        at = 0
        for first, w in families:
            if first != at or w < 1:
                raise ValueError(f"Bloom families {families} must tile the row's words in order")
            at += w
        if at != words:
            raise ValueError(f"Bloom families {families} cover {at} words, the rows hold {words}")
        object.__setattr__(self, "bloom_families", families)

    @property
    def families(self) -> tuple[tuple[int, int], ...]:
        """`bloom_families`, resolved: (first word, words) of each family."""
        assert self.bloom_families is not None  # __post_init__ resolved it
        return self.bloom_families

    @classmethod
    def from_arrays(
        cls,
        trie: TrieArrays,
        kway: PartitionArrays | None = None,
        device: str = "cpu",
        families: tuple[tuple[int, int], ...] | None = None,  # schema.family_words
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
            bloom_families=families,
            **extra,
        )


@dataclass(frozen=True)
class RequestTensors:
    """A batch's `EncodedRequests` as tensors (int64 views)."""

    bitmask: torch.Tensor  # int64 [B, W_bm]
    # int64 [B, L, W_bl]: row l of family f in the words `GtmTables.bloom_families[f]`;
    # rows at and past n_blooms[b, f] repeat the family's row 0
    blooms: torch.Tensor
    # int32 [B, K]: rows of each family (>= 1), so the mask reads no padding row; None:
    # every request reads all L rows of every family (the same answer, more reads)
    n_blooms: torch.Tensor | None = None

    def rows(self, at: slice | torch.Tensor) -> RequestTensors:
        """The requests `at` (a slice: views; an index tensor: copies)."""
        n = None if self.n_blooms is None else self.n_blooms[at]
        return RequestTensors(self.bitmask[at], self.blooms[at], n)

    @classmethod
    def from_encoded(
        cls,
        enc: targeting_codec.EncodedRequests,
        device: str = "cpu",
    ) -> RequestTensors:
        """The codec's encoding (n_blooms [B, K]; a [B] vector is read as one family)."""
        n = np.asarray(enc.n_blooms, dtype=np.int32)
        n = n[:, None] if n.ndim == 1 else n
        return cls(_t(enc.bitmask, device), _t(enc.blooms, device), _t(n, device))
