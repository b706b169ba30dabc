"""GTM SID trie construction: sorted SIDs + per-ad matchers -> CSR trie with deduplicated
matcher tables (paper §3.5 and Appendix A; docs/ARCHITECTURE.md §3).

Sits between the catalog (ads sorted by SID) and `index_format.write_index_dir`. Nodes
are numbered breadth-first and lexicographically within a depth: the root is 0, then
every depth-1 prefix, … , then the leaves (full SIDs). Children of a node are therefore
contiguous and in token order, and child entry j always leads to node j + 1.

Each child entry's matcher is the OR over every ad in its subtree (paper eq. 4, 9):
leaf matchers are ORs over the ads of one SID, inner matchers ORs over leaf ranges.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from contracts.index_arrays import TrieArrays
from contracts.index_format import SID_LENGTH, VOCAB_SIZE
from contracts.targeting_schema import TargetingSchema
from index_builder import parallel

_MIX = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection on uint64 [n] with full avalanche."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _row_hash(rows: np.ndarray, workers: int) -> np.ndarray:
    """uint64 [n]: one splitmix64-chained hash per row of a uint64 [n, W] table."""
    h = np.empty(len(rows), dtype=np.uint64)

    def part(lo: int, hi: int) -> None:
        x = np.zeros(hi - lo, dtype=np.uint64)
        for w in range(rows.shape[1]):
            x = splitmix64(x ^ rows[lo:hi, w] + _MIX)
        h[lo:hi] = x

    parallel.run(part, parallel.ranges(len(rows), workers), workers)
    return h


def dedup_rows(rows: np.ndarray, workers: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Unique rows of a uint64 [n, W] table: (table [R, W], index int32 [n]), rows == table[index].

    Hashes each row to one uint64 and sorts scalars instead of rows: first the top hash
    bits packed with the row position (`parallel.stable_argsort`'s trick), then, if
    distinct rows share those bits, the full hashes; every result is verified, and a
    full-hash collision falls back to numpy's row-wise unique. The table is ordered by
    hash, whatever `workers` (threads hashing and verifying).
    """
    if len(rows) == 0:
        return rows.copy(), np.zeros(0, dtype=np.int32)
    h = _row_hash(rows, workers)
    pos_bits = max(1, (len(rows) - 1).bit_length())
    packed = (h >> np.uint64(pos_bits + 1)).astype(np.int64) << pos_bits
    packed |= np.arange(len(rows), dtype=np.int64)
    packed.sort()
    found = _groups(rows, packed & ((1 << pos_bits) - 1), packed >> pos_bits, workers)
    del packed
    if found is None:  # distinct rows share the top hash bits
        order = np.argsort(h)
        found = _groups(rows, order, h[order], workers)
    if found is None:
        table, inverse = np.unique(rows, axis=0, return_inverse=True)
        found = np.ascontiguousarray(table), inverse.reshape(-1).astype(np.int32)
    return found


def _groups(
    rows: np.ndarray, order: np.ndarray, sorted_hash: np.ndarray, workers: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(table, index) from rows sorted by hash; None if equal hashes hold unequal rows."""
    starts = np.empty(len(sorted_hash), dtype=bool)
    starts[0] = True
    np.not_equal(sorted_hash[1:], sorted_hash[:-1], out=starts[1:])
    inverse = np.empty(len(rows), dtype=np.int32)
    inverse[order] = np.cumsum(starts, dtype=np.int32) - 1
    table = np.ascontiguousarray(rows[order[starts]])

    def same(lo: int, hi: int) -> bool:
        cuts = [*range(lo, hi, parallel.MIN_ROWS_PER_TASK), hi]  # no gather of the whole table
        return all(
            np.array_equal(table[inverse[a:b]], rows[a:b]) for a, b in itertools.pairwise(cuts)
        )

    if all(parallel.run(same, parallel.ranges(len(rows), workers), workers)):
        return table, inverse
    return None


def popcount_total(rows: np.ndarray, workers: int = 1) -> int:
    """Set bits in a whole uint64 [n, W] table."""

    def part(lo: int, hi: int) -> int:
        return int(np.bitwise_count(rows[lo:hi]).sum(dtype=np.int64))

    return sum(parallel.run(part, parallel.ranges(len(rows), workers), workers))


@dataclass(frozen=True)
class TrieBuild:
    """The trie plus what later build steps (k-way, stats, SID->ad index) need."""

    trie: TrieArrays
    leaf_ad_offsets: np.ndarray  # int64 [num_leaves + 1]: ads of leaf i (ads sorted by SID)
    leaf_sids: np.ndarray  # int16 [num_leaves, SID_LENGTH]
    leaf_bitmask: np.ndarray  # uint64 [num_leaves, bitmask_words]: OR over the leaf's ads
    leaf_bloom: np.ndarray  # uint64 [num_leaves, bloom_words]
    node_first_leaf: np.ndarray  # int64 [num_nodes]: first leaf under node (root: 0)
    node_leaf_count: np.ndarray  # int64 [num_nodes]: leaves under node
    entry_bitmask: np.ndarray  # uint64 [E, bitmask_words] before dedup
    entry_bloom: np.ndarray  # uint64 [E, bloom_words] before dedup

    def depth_entries(self, depth: int) -> slice:
        """Child entries leading to nodes of `depth` (1..SID_LENGTH): decode step `depth`."""
        lo = self.trie.level_offsets
        return slice(int(lo[depth]) - 1, int(lo[depth + 1]) - 1)


def build_trie(
    sids: np.ndarray,  # int [N, SID_LENGTH], sorted (several ads may share a SID)
    ad_bitmask: np.ndarray,  # uint64 [N, bitmask_words]
    ad_bloom: np.ndarray,  # uint64 [N, bloom_words]
    workers: int = 1,  # threads for the subtree ORs, hashing and checks: same arrays for any
) -> TrieBuild:
    """The CSR trie of ads sorted by SID."""
    leaf_first_ad, leaf_keys = leaf_runs(sids)
    # read N rows once per table; write one row per SID
    leaf_bm = parallel.or_reduceat(ad_bitmask, leaf_first_ad, workers)
    leaf_bl = parallel.or_reduceat(ad_bloom, leaf_first_ad, workers)
    return trie_of_leaves(leaf_first_ad, leaf_keys, len(sids), leaf_bm, leaf_bl, workers)


def leaf_runs(sids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The leaves of ads sorted by SID (int [N, SID_LENGTH]): each leaf's first ad int64
    [L] and its SID as a base-VOCAB_SIZE key int64 [L]."""
    if len(sids) == 0:
        raise ValueError("cannot build a trie from an empty catalog")
    keys = parallel.digit_keys(sids, VOCAB_SIZE)
    if np.any(keys[1:] < keys[:-1]):
        raise ValueError("ads must be sorted by SID before building the trie")
    starts = np.empty(len(keys), dtype=bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    leaf_first_ad = np.flatnonzero(starts)
    return leaf_first_ad, keys[leaf_first_ad]


def trie_of_leaves(
    leaf_first_ad: np.ndarray,  # int64 [L]: `leaf_runs`
    leaf_keys: np.ndarray,  # int64 [L]: `leaf_runs`
    n: int,  # ads
    leaf_bm: np.ndarray,  # uint64 [L, bitmask_words]: OR over each leaf's ads
    leaf_bl: np.ndarray,  # uint64 [L, bloom_words]
    workers: int = 1,
) -> TrieBuild:
    """`build_trie` from its leaves: the ads' matchers already ORed per SID (what lets
    the build hash Blooms leaf range by leaf range, never holding one row per ad)."""
    num_leaves = len(leaf_keys)
    level_offsets = [0, 1]
    parents, tokens, firsts = [], [], []
    node_of_leaf = np.zeros(num_leaves, dtype=np.int64)  # the root holds every leaf
    for depth in range(1, SID_LENGTH + 1):
        kd = leaf_keys // VOCAB_SIZE ** (SID_LENGTH - depth)
        starts = np.concatenate([[True], kd[1:] != kd[:-1]])
        first = np.flatnonzero(starts)
        base = level_offsets[-1]
        parents.append(node_of_leaf[first])
        tokens.append((kd[first] % VOCAB_SIZE).astype(np.int16))
        firsts.append(first)
        node_of_leaf = np.cumsum(starts) - 1 + base
        level_offsets.append(base + len(first))
    del node_of_leaf, kd, starts

    num_nodes = level_offsets[-1]
    parent = np.concatenate(parents)
    del parents
    node_offsets = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(parent, minlength=num_nodes), out=node_offsets[1:])
    del parent
    if num_nodes >= np.iinfo(np.int32).max:
        raise ValueError(f"{num_nodes} trie nodes exceed the int32 layout")
    # each depth's subtree ORs written in place: one copy of the ~2.6 GB (30 M ads) tables
    entry_bm = np.empty((num_nodes - 1, leaf_bm.shape[1]), dtype=leaf_bm.dtype)
    entry_bl = np.empty((num_nodes - 1, leaf_bl.shape[1]), dtype=leaf_bl.dtype)
    for depth, first in enumerate(firsts, 1):
        at = slice(level_offsets[depth] - 1, level_offsets[depth + 1] - 1)
        parallel.or_reduceat(leaf_bm, first, workers, out=entry_bm[at])
        parallel.or_reduceat(leaf_bl, first, workers, out=entry_bl[at])
    bm_table, bm_index = dedup_rows(entry_bm, workers)
    bl_table, bl_index = dedup_rows(entry_bl, workers)

    first_leaf = np.concatenate([[0], *firsts]).astype(np.int64)
    # nodes are numbered depth by depth, so the per-depth counts concatenate in order
    counts = [np.diff(np.append(first, num_leaves)) for first in firsts]
    del firsts
    leaf_count = np.concatenate([[num_leaves], *counts]).astype(np.int64)
    del counts

    trie = TrieArrays(
        node_offsets=node_offsets.astype(np.int32),
        csr_child_nodes=np.arange(1, num_nodes, dtype=np.int32),
        csr_tokens=np.concatenate(tokens),
        bitmask_index=bm_index,
        bloom_index=bl_index,
        bitmask_table=bm_table,
        bloom_table=bl_table,
        level_offsets=np.array(level_offsets, dtype=np.int64),
    )
    del node_offsets, tokens
    leaf_sids = np.empty((num_leaves, SID_LENGTH), dtype=np.int16)
    for pos in range(SID_LENGTH):  # each token's place in a key, one column at a time
        leaf_sids[:, pos] = leaf_keys // VOCAB_SIZE ** (SID_LENGTH - 1 - pos) % VOCAB_SIZE
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


def matcher_fill(
    bitmask_rows: np.ndarray, bloom_rows: np.ndarray, schema: TargetingSchema, workers: int = 1
) -> tuple[float, float]:
    """Mean fill rate (share of set bits) of bitmask and Bloom matcher rows (paper Table 2)."""
    if len(bitmask_rows) == 0:
        return 0.0, 0.0
    n = len(bitmask_rows)
    return (
        popcount_total(bitmask_rows, workers) / n / max(1, schema.bitmask_bits),
        popcount_total(bloom_rows, workers) / n / max(1, 64 * schema.bloom_words),
    )


def storage_stats(
    build: TrieBuild, schema: TargetingSchema, workers: int = 1
) -> list[dict[str, float | int]]:
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
        fill_bm, fill_bl = matcher_fill(bm, bl, schema, workers)
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
