"""Subtrees with no live ad, barred in decoding (docs/DATA.md "Live changes", issue #48).

Flow: `LiveEligibility.apply` (service/index/live.py) counts, on the trie path of each ad
whose state flips between live and not, the ads below each entry that are not live
(`Subtrees`); an entry below which every ad is paused, deleted or waiting is in its new
`LiveState.dead_entries` → stage 3 (compute), before a batch's decode and on the compute
stream, brings the version's GTM tables to the state the batch is answered at
(`Pruning.sync`) → the GTM mask reads a barred entry's matchers as all-zero rows, which
no request passes (its bitmask sets a bit per enum/bucket attribute, each of its Bloom
rows at least one bit), so no beam is spent below it; an entry revived gets its own rows
back; with k-way matchers (`CD_GTM_KWAY`) a barred entry's partition rows are zeroed
and restored the same way. Sound: an entry is barred only while no ad below it is live at
the batch's `catalog_seq`, the state the exact post stage drops not-live ads by. CD-only
decoding (an ablation) reads no matcher and prunes nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from contracts.index_arrays import AdArrays, PartitionArrays, TrieArrays
from contracts.index_format import SID_LENGTH
from contracts.tensors import GtmTables

NONE = np.zeros(0, dtype=np.int64)  # no entry barred


class Subtrees:
    """Trie paths and subtree sizes of one version, for the ads whose state changes: the
        leaves are the ads' runs in SID order and each node's leaves a contiguous range (the
        builder's breadth-first, token-ordered trie), so a size is two descents. Nothing is
    cached: a few µs an ad, and no memory that grows with the ads a version has seen change."""

    def __init__(self, trie: TrieArrays, ads: AdArrays) -> None:
        self._offsets, self._child = trie.node_offsets, trie.csr_child_nodes
        self._tokens, self._first_leaf = trie.csr_tokens, int(trie.level_offsets[SID_LENGTH])
        self._leaf_sids, self._leaf_ads = ads.leaf_sids, ads.leaf_ad_offsets

    def path(self, row: int) -> tuple[int, ...]:
        """The SID_LENGTH trie entries from the root to ad row `row`'s leaf."""
        leaf = int(np.searchsorted(self._leaf_ads, row, side="right")) - 1
        node, entries = 0, []
        for token in self._leaf_sids[leaf].tolist():
            lo, hi = int(self._offsets[node]), int(self._offsets[node + 1])
            (at,) = np.nonzero(self._tokens[lo:hi] == token)
            entries.append(lo + int(at[0]))
            node = int(self._child[entries[-1]])
        return tuple(entries)

    def size(self, entry: int, depth: int) -> int:
        """Ads below `entry`, the entry of a depth-`depth` node (1..SID_LENGTH)."""
        lo = hi = int(self._child[entry])
        for _ in range(SID_LENGTH - depth):
            lo = int(self._child[self._offsets[lo]])
            hi = int(self._child[self._offsets[hi + 1] - 1])
        first, last = lo - self._first_leaf, hi - self._first_leaf
        return int(self._leaf_ads[last + 1] - self._leaf_ads[first])


class DeadCounts:
    """Per trie entry, its ads that are not live; the entries with none live. Changed by
    one applier at a time (`LiveEligibility`'s lock)."""

    def __init__(self, subtrees: Subtrees) -> None:
        self.subtrees = subtrees
        self._below: dict[int, int] = {}  # entry -> not-live ads below it (0: absent)

    def after(self, flips: list[tuple[int, int]], dead: np.ndarray) -> np.ndarray:
        """The barred entries once ad rows flip (`(row, +1)`: no longer live, `-1`: live
        again), from the barred entries `dead` before them (sorted, never changed)."""
        if not flips:
            return dead
        counts: dict[int, tuple[int, int]] = {}  # entry -> (depth, not-live ads below)
        for row, d in flips:
            for depth, e in enumerate(self.subtrees.path(row), start=1):
                counts[e] = (depth, counts.get(e, (depth, self._below.get(e, 0)))[1] + d)
        barred = set(dead.tolist())
        for e, (depth, n) in counts.items():
            if n:
                self._below[e] = n
            else:
                self._below.pop(e, None)
            if n == self.subtrees.size(e, depth):
                barred.add(e)
            else:
                barred.discard(e)
        return np.array(sorted(barred), dtype=np.int64) if barred else NONE


def with_zero_rows(trie: TrieArrays) -> TrieArrays:
    """The trie with one all-zero row appended to each matcher table (the last row): what
    `Pruning` points a barred entry at."""
    return dataclasses.replace(
        trie,
        bitmask_table=np.vstack([trie.bitmask_table, _zero_row(trie.bitmask_table)]),
        bloom_table=np.vstack([trie.bloom_table, _zero_row(trie.bloom_table)]),
    )


def _zero_row(table: np.ndarray) -> np.ndarray:
    return np.zeros((1, table.shape[1]), dtype=table.dtype)


class Pruning:
    """The barred entries of one version's GTM tables (made by `with_zero_rows`), brought
    to a live state's on the current stream; used by stage 3 only."""

    def __init__(
        self, trie: TrieArrays, tables: GtmTables, kway: PartitionArrays | None = None
    ) -> None:
        self._tables, self._kway = tables, kway
        self._bitmask, self._bloom = trie.bitmask_index, trie.bloom_index  # the built rows
        self._zero = (tables.bitmask_table.shape[0] - 1, tables.bloom_table.shape[0] - 1)
        self.applied = NONE

    def sync(self, dead: np.ndarray) -> None:
        """Bar the entries `dead` (a `LiveState.dead_entries`) and no others."""
        if dead is self.applied:
            return
        barred = np.setdiff1d(dead, self.applied, assume_unique=True)
        revived = np.setdiff1d(self.applied, dead, assume_unique=True)
        t = self._tables
        if len(barred):
            at = self._to_device(barred)
            t.bitmask_index.index_fill_(0, at, self._zero[0])
            t.bloom_index.index_fill_(0, at, self._zero[1])
        if len(revived):
            at = self._to_device(revived)
            t.bitmask_index.index_copy_(0, at, self._to_device(self._bitmask[revived], torch.int32))
            t.bloom_index.index_copy_(0, at, self._to_device(self._bloom[revived], torch.int32))
        k = self._kway
        if k is not None and t.kway_bitmask is not None and t.kway_bloom is not None:
            if len(barred):  # every partition of the entry fails: zero rows
                at = self._to_device(_parts(k.offsets, barred))
                t.kway_bitmask.index_fill_(0, at, 0)
                t.kway_bloom.index_fill_(0, at, 0)
            if len(revived):  # the partitions' built rows (GtmTables' int64 views)
                parts = _parts(k.offsets, revived)
                at = self._to_device(parts)
                bm = k.bitmask_table[k.bitmask_index[parts]].view(np.int64)
                bl = k.bloom_table[k.bloom_index[parts]].view(np.int64)
                t.kway_bitmask.index_copy_(0, at, self._to_device(bm))
                t.kway_bloom.index_copy_(0, at, self._to_device(bl))
        self.applied = dead

    def _to_device(self, x: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Host -> the tables' device on the current stream, without blocking the thread
        on the batches ahead (pinned, as stage 1's copies)."""
        host = torch.from_numpy(np.ascontiguousarray(x)).to(dtype)
        device = self._tables.bitmask_index.device
        if device.type != "cuda":
            return host
        return host.pin_memory().to(device, non_blocking=True)


def _parts(offsets: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """The k-way partitions of `entries`: offsets[e] .. offsets[e + 1] each, in order."""
    lo, hi = offsets[entries].astype(np.int64), offsets[entries + 1].astype(np.int64)
    counts = hi - lo
    first = np.repeat(lo - np.cumsum(counts) + counts, counts)
    return first + np.arange(int(counts.sum()), dtype=np.int64)
