"""GTM SID trie construction: sorted SIDs + per-ad matchers -> CSR trie with deduplicated
matcher tables (paper §3.5 and Appendix A; DESIGN.md §3).

Sits between the catalog (ads already sorted by SID) and `format.write_index_dir`. Nodes
are numbered breadth-first and lexicographically within a depth: the root is 0, then
every depth-1 prefix, … , then the leaves (full SIDs). Children of a node are therefore
contiguous and in token order, and child entry j always leads to node j + 1.

Each child entry's matcher is the OR over every ad in its subtree (paper eq. 4, 9):
leaf matchers are ORs over the ads of one SID, inner matchers ORs over leaf ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from index_builder.format import SID_LENGTH, VOCAB_SIZE, TrieArrays
from index_builder.targeting import BITMASK_BITS, BLOOM_BITS

_MIX = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection on uint64 with full avalanche."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def sid_keys(sids: np.ndarray) -> np.ndarray:
    """Pack SIDs [N, 4] into sortable int64 keys (9 bits a token)."""
    keys = np.zeros(len(sids), dtype=np.int64)
    for t in range(SID_LENGTH):
        keys = keys * VOCAB_SIZE + sids[:, t].astype(np.int64)
    return keys


def dedup_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique rows of a uint64 [n, W] table: (table [R, W], index int32 [n]), rows == table[index].

    Hashes each row to one uint64 and sorts the hashes (one unstable sort of n scalars
    instead of a row-wise sort); the result is verified, and a hash collision between
    distinct rows falls back to numpy's row-wise unique.
    """
    if len(rows) == 0:
        return rows.copy(), np.zeros(0, dtype=np.int32)
    h = np.zeros(len(rows), dtype=np.uint64)
    for w in range(rows.shape[1]):
        h = _splitmix64(h ^ rows[:, w] + _MIX)
    order = np.argsort(h)
    sorted_h = h[order]
    starts = np.empty(len(h), dtype=bool)
    starts[0] = True
    np.not_equal(sorted_h[1:], sorted_h[:-1], out=starts[1:])
    inverse = np.empty(len(h), dtype=np.int32)
    inverse[order] = np.cumsum(starts, dtype=np.int32) - 1
    table = rows[order[starts]]
    if not np.array_equal(table[inverse], rows):
        table, inverse = np.unique(rows, axis=0, return_inverse=True)
    return np.ascontiguousarray(table), inverse.reshape(-1).astype(np.int32)


def popcount_rows(rows: np.ndarray) -> np.ndarray:
    """Set bits per row of a uint64 [n, W] table -> int64 [n]."""
    return np.bitwise_count(rows).sum(axis=1, dtype=np.int64)


@dataclass(frozen=True)
class TrieBuild:
    """The trie plus what later build steps (k-way, stats, SID->ad index) need."""

    trie: TrieArrays
    leaf_ad_offsets: np.ndarray  # int64 [num_leaves + 1]: ads of leaf i (ads sorted by SID)
    leaf_sids: np.ndarray  # int16 [num_leaves, SID_LENGTH]
    leaf_bitmask: np.ndarray  # uint64 [num_leaves, BITMASK_WORDS]: OR over the leaf's ads
    leaf_bloom: np.ndarray  # uint64 [num_leaves, BLOOM_WORDS]
    node_first_leaf: np.ndarray  # int64 [num_nodes]: first leaf under node (root: 0)
    node_leaf_count: np.ndarray  # int64 [num_nodes]: leaves under node
    entry_bitmask: np.ndarray  # uint64 [E, BITMASK_WORDS] before dedup
    entry_bloom: np.ndarray  # uint64 [E, BLOOM_WORDS] before dedup

    def depth_entries(self, depth: int) -> slice:
        """Child entries leading to nodes of `depth` (1..SID_LENGTH): decode step `depth`."""
        lo = self.trie.level_offsets
        return slice(int(lo[depth]) - 1, int(lo[depth + 1]) - 1)


def build_trie(sids: np.ndarray, ad_bitmask: np.ndarray, ad_bloom: np.ndarray) -> TrieBuild:
    """Build the CSR trie from ads sorted by SID.

    sids: int [N, SID_LENGTH], sorted lexicographically (several ads may share a SID);
    ad_bitmask: uint64 [N, BITMASK_WORDS]; ad_bloom: uint64 [N, BLOOM_WORDS].
    """
    n = len(sids)
    if n == 0:
        raise ValueError("cannot build a trie from an empty catalog")
    keys = sid_keys(sids)
    if np.any(keys[1:] < keys[:-1]):
        raise ValueError("ads must be sorted by SID before building the trie")
    leaf_first_ad = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    leaf_keys = keys[leaf_first_ad]
    num_leaves = len(leaf_keys)
    # read N rows once per table; write one row per SID
    leaf_bm = np.bitwise_or.reduceat(ad_bitmask, leaf_first_ad, axis=0)
    leaf_bl = np.bitwise_or.reduceat(ad_bloom, leaf_first_ad, axis=0)

    level_offsets = [0, 1]
    parents, tokens, firsts, ent_bm, ent_bl = [], [], [], [], []
    node_of_leaf = np.zeros(num_leaves, dtype=np.int64)  # the root holds every leaf
    for depth in range(1, SID_LENGTH + 1):
        kd = leaf_keys // VOCAB_SIZE ** (SID_LENGTH - depth)
        starts = np.concatenate([[True], kd[1:] != kd[:-1]])
        first = np.flatnonzero(starts)
        base = level_offsets[-1]
        parents.append(node_of_leaf[first])
        tokens.append(kd[first] % VOCAB_SIZE)
        firsts.append(first)
        ent_bm.append(np.bitwise_or.reduceat(leaf_bm, first, axis=0))
        ent_bl.append(np.bitwise_or.reduceat(leaf_bl, first, axis=0))
        node_of_leaf = np.cumsum(starts) - 1 + base
        level_offsets.append(base + len(first))

    num_nodes = level_offsets[-1]
    parent = np.concatenate(parents)
    node_offsets = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(parent, minlength=num_nodes), out=node_offsets[1:])
    if num_nodes >= np.iinfo(np.int32).max:
        raise ValueError(f"{num_nodes} trie nodes exceed the int32 layout")
    entry_bm = np.concatenate(ent_bm)
    entry_bl = np.concatenate(ent_bl)
    bm_table, bm_index = dedup_rows(entry_bm)
    bl_table, bl_index = dedup_rows(entry_bl)

    first_leaf = np.concatenate([[0], *firsts]).astype(np.int64)
    leaf_count = np.empty(num_nodes, dtype=np.int64)
    leaf_count[0] = num_leaves
    for depth, first in enumerate(firsts, start=1):
        lo = level_offsets[depth]
        leaf_count[lo : lo + len(first)] = np.diff(np.append(first, num_leaves))

    trie = TrieArrays(
        node_offsets=node_offsets.astype(np.int32),
        csr_child_nodes=np.arange(1, num_nodes, dtype=np.int32),
        csr_tokens=np.concatenate(tokens).astype(np.int16),
        bitmask_index=bm_index,
        bloom_index=bl_index,
        bitmask_table=bm_table,
        bloom_table=bl_table,
        level_offsets=np.array(level_offsets, dtype=np.int64),
    )
    leaf_sids = np.stack(
        [(leaf_keys // VOCAB_SIZE ** (SID_LENGTH - 1 - t)) % VOCAB_SIZE for t in range(SID_LENGTH)],
        axis=1,
    ).astype(np.int16)
    return TrieBuild(
        trie=trie,
        leaf_ad_offsets=np.append(leaf_first_ad, n).astype(np.int64),
        leaf_sids=leaf_sids,
        leaf_bitmask=leaf_bm,
        leaf_bloom=leaf_bl,
        node_first_leaf=first_leaf,
        node_leaf_count=leaf_count,
        entry_bitmask=entry_bm,
        entry_bloom=entry_bl,
    )


def matcher_fill(bitmask_rows: np.ndarray, bloom_rows: np.ndarray) -> tuple[float, float]:
    """Mean fill rate (share of set bits) of bitmask and Bloom matcher rows (paper Table 2)."""
    if len(bitmask_rows) == 0:
        return 0.0, 0.0
    return (
        float(popcount_rows(bitmask_rows).mean() / BITMASK_BITS),
        float(popcount_rows(bloom_rows).mean() / BLOOM_BITS),
    )


def storage_stats(build: TrieBuild) -> list[dict[str, float | int]]:
    """Per decode step: entries, matcher bytes before/after dedup, fill (paper Tables 1–2).

    "After dedup" counts the distinct rows the step's entries use in the shared tables.
    """
    trie = build.trie
    out = []
    for depth in range(1, SID_LENGTH + 1):
        sl = build.depth_entries(depth)
        bm, bl = build.entry_bitmask[sl], build.entry_bloom[sl]
        bm_unique = np.count_nonzero(np.bincount(trie.bitmask_index[sl]))
        bl_unique = np.count_nonzero(np.bincount(trie.bloom_index[sl]))
        fill_bm, fill_bl = matcher_fill(bm, bl)
        out.append(
            {
                "step": depth,
                "entries": len(bm),
                "bitmask_bytes": bm.nbytes,
                "bitmask_bytes_dedup": int(bm_unique) * bm.shape[1] * 8,
                "bloom_bytes": bl.nbytes,
                "bloom_bytes_dedup": int(bl_unique) * bl.shape[1] * 8,
                "bitmask_fill": fill_bm,
                "bloom_fill": fill_bl,
            }
        )
    return out
