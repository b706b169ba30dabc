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
decoding (an ablation) reads no matcher and prunes nothing. The same sync writes the
matcher rows widened for upserts served in place (`Widened`, service/index/placed.py) and
points their entries at them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from contracts.index_arrays import AdArrays, PartitionArrays, TrieArrays
from contracts.index_format import SID_LENGTH
from contracts.tensors import GtmTables

NONE = np.zeros(0, dtype=np.int64)  # no entry barred


@dataclass(frozen=True)
class Widened:
    """The widened entries at one live state: never changed once made."""

    entries: np.ndarray = field(default_factory=lambda: NONE)  # int64 sorted: widened
    bitmask_rows: np.ndarray = field(default_factory=lambda: NONE)  # int64: each one's row
    bloom_rows: np.ndarray = field(default_factory=lambda: NONE)
    bitmask_new: np.ndarray | None = None  # uint64 [used, words]: the spare rows written
    bloom_new: np.ndarray | None = None

    def rows(self, entries: np.ndarray, built: tuple[np.ndarray, np.ndarray]) -> tuple[
            np.ndarray, np.ndarray]:  # fmt: skip
        """The (bitmask, bloom) table rows of `entries` at this state."""
        bm, bl = built[0][entries].astype(np.int64), built[1][entries].astype(np.int64)
        if len(self.entries) and len(entries):
            at = np.minimum(np.searchsorted(self.entries, entries), len(self.entries) - 1)
            hit = self.entries[at] == entries
            bm[hit], bl[hit] = self.bitmask_rows[at[hit]], self.bloom_rows[at[hit]]
        return bm, bl


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
        return self.leaf_path(int(np.searchsorted(self._leaf_ads, row, side="right")) - 1)

    def leaf_path(self, leaf: int) -> tuple[int, ...]:
        """The SID_LENGTH trie entries from the root to leaf `leaf`."""
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
    """Per trie entry, its ads that are not live and the placed ads (placed.py) live below
    it; the entries with none live. Changed by one applier at a time (`LiveEligibility`'s
    lock)."""

    def __init__(self, subtrees: Subtrees) -> None:
        self.subtrees = subtrees
        self._below: dict[int, int] = {}  # entry -> not-live ads below it (0: absent)
        self._placed: dict[int, int] = {}  # entry -> live placed ads below it (0: absent)

    def after(
        self,
        flips: list[tuple[int, int]],
        dead: np.ndarray,
        moved: list[tuple[int, int]] = [],  # noqa: B006 (never changed)
    ) -> np.ndarray:
        """The barred entries once ad rows flip (`(row, +1)`: no longer live, `-1`: live
        again) and placed ads come and go (`(leaf, +1)`: one live there, `-1`: gone), from
        the barred entries `dead` before them (sorted, never changed)."""
        if not flips and not moved:
            return dead
        touched: dict[int, int] = {}  # entry -> its depth
        for counts, changes, path in ((self._below, flips, self.subtrees.path),
                                      (self._placed, moved, self.subtrees.leaf_path)):  # fmt: skip
            for at, d in changes:
                for depth, e in enumerate(path(at), start=1):
                    touched[e] = depth
                    if n := counts.get(e, 0) + d:
                        counts[e] = n
                    else:
                        counts.pop(e, None)
        barred = set(dead.tolist())
        for e, depth in touched.items():
            if e not in self._placed and self._below.get(e, 0) == self.subtrees.size(e, depth):
                barred.add(e)
            else:
                barred.discard(e)
        return np.array(sorted(barred), dtype=np.int64) if barred else NONE


def with_spare_rows(trie: TrieArrays, spare: int) -> TrieArrays:
    """The trie with rows appended to each matcher table: one all-zero row, what `Pruning`
    points a barred entry at, then `spare` rows for the matcher rows placed ads widen
    (placed.py `Spare`)."""
    return dataclasses.replace(
        trie,
        bitmask_table=np.vstack([trie.bitmask_table, _zero_rows(trie.bitmask_table, 1 + spare)]),
        bloom_table=np.vstack([trie.bloom_table, _zero_rows(trie.bloom_table, 1 + spare)]),
    )


def _zero_rows(table: np.ndarray, n: int) -> np.ndarray:
    return np.zeros((n, table.shape[1]), dtype=table.dtype)


class Pruning:
    """The barred and widened entries of one version's GTM tables (made by
    `with_spare_rows`), brought to a live state's on the current stream; used by stage 3
    only."""

    def __init__(
        self, trie: TrieArrays, tables: GtmTables, kway: PartitionArrays | None = None
    ) -> None:
        self._tables, self._kway = tables, kway
        self._built = (trie.bitmask_index, trie.bloom_index)  # the built rows
        self._zero = (len(trie.bitmask_table), len(trie.bloom_table))
        self.applied, self.widened = NONE, Widened()

    def sync(self, dead: np.ndarray, widened: Widened | None = None) -> None:
        """Bar the entries `dead` (a `LiveState.dead_entries`) and no others; point the
        entries of `widened` (its `widened`) at their rows, its new rows written first."""
        widened = self.widened if widened is None else widened
        if dead is self.applied and widened is self.widened:
            return
        t, was = self._tables, self.widened
        for table, zero, new, old in (
            (t.bitmask_table, self._zero[0], widened.bitmask_new, was.bitmask_new),
            (t.bloom_table, self._zero[1], widened.bloom_new, was.bloom_new),
        ):
            done = 0 if old is None else len(old)
            if new is not None and len(new) > done:  # rows only ever appended
                at = self._to_device(np.arange(zero + 1 + done, zero + 1 + len(new)))
                table.index_copy_(0, at, self._to_device(new[done:].view(np.int64)))
        barred = np.setdiff1d(dead, self.applied, assume_unique=True)
        revived = np.setdiff1d(self.applied, dead, assume_unique=True)
        moved = _moved(widened, was)
        changed = np.union1d(np.union1d(barred, revived), moved)
        if len(changed):
            bm, bl = widened.rows(changed, self._built)
            off = np.isin(changed, dead, assume_unique=True)
            bm[off], bl[off] = self._zero
            at = self._to_device(changed)
            t.bitmask_index.index_copy_(0, at, self._to_device(bm, torch.int32))
            t.bloom_index.index_copy_(0, at, self._to_device(bl, torch.int32))
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
        self.applied, self.widened = dead, widened

    def _to_device(self, x: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Host -> the tables' device on the current stream, without blocking the thread
        on the batches ahead (pinned, as stage 1's copies)."""
        host = torch.from_numpy(np.ascontiguousarray(x)).to(dtype)
        device = self._tables.bitmask_index.device
        if device.type != "cuda":
            return host
        return host.pin_memory().to(device, non_blocking=True)


def _moved(new: Widened, old: Widened) -> np.ndarray:
    """The entries whose widened rows differ between two states (`new` from `old` on)."""
    if new is old or not len(new.entries):
        return NONE
    if not len(old.entries):
        return new.entries
    at = np.minimum(np.searchsorted(old.entries, new.entries), len(old.entries) - 1)
    same = ((old.entries[at] == new.entries) & (old.bitmask_rows[at] == new.bitmask_rows)
            & (old.bloom_rows[at] == new.bloom_rows))  # fmt: skip
    return new.entries[~same]


def _parts(offsets: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """The k-way partitions of `entries`: offsets[e] .. offsets[e + 1] each, in order."""
    lo, hi = offsets[entries].astype(np.int64), offsets[entries + 1].astype(np.int64)
    counts = hi - lo
    first = np.repeat(lo - np.cumsum(counts) + counts, counts)
    return first + np.arange(int(counts.sum()), dtype=np.int64)
