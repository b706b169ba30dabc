"""GTM SID trie construction: sorted SIDs + per-ad matchers -> CSR trie with deduplicated
matcher tables (paper §3.5 and Appendix A; docs/ARCHITECTURE.md §3).

Sits between the catalog (ads sorted by SID) and `index_format.write_index_dir`. Nodes
are numbered breadth-first and lexicographically within a depth: the root is 0, then
every depth-1 prefix, … , then the leaves (full SIDs). Children of a node are therefore
contiguous and in token order, and child entry j always leads to node j + 1.

Each child entry's matcher is the OR over every ad in its subtree (paper eq. 4, 9):
leaf matchers are ORs over the ads of one SID, inner matchers ORs over leaf ranges.
The trie, its per-depth matcher dedup and the storage figures share the row hashing and
the per-depth layout, so they stay in this one module, a little past the house's ~300
lines.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

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
    hash (by its rows, after a full-hash collision), whatever `workers` (threads hashing
    and verifying) and whatever the rows' order or repeats: the dedup of tables already
    deduplicated, concatenated, is the dedup of all their rows (`_dedup_by_depth`). Holds
    ~25 bytes per row besides the rows and the index.
    """
    if len(rows) == 0:
        return rows.copy(), np.zeros(0, dtype=np.int32)
    pos_bits = max(1, (len(rows) - 1).bit_length())
    packed = _packed_hashes(rows, pos_bits, workers)
    packed.sort()
    order = packed & ((1 << pos_bits) - 1)
    packed >>= pos_bits  # now the sorted top hash bits
    found = _groups(rows, order, packed, workers)
    del packed, order
    if found is None:  # distinct rows share the top hash bits
        h = _row_hash(rows, workers)
        order = np.argsort(h)
        found = _groups(rows, order, h[order], workers)
    if found is None:
        table, inverse = np.unique(rows, axis=0, return_inverse=True)
        found = np.ascontiguousarray(table), inverse.reshape(-1).astype(np.int32)
    return found


def _packed_hashes(rows: np.ndarray, pos_bits: int, workers: int) -> np.ndarray:
    """int64 [n]: each row's top hash bits, then its position in the low `pos_bits` bits
    (made in place in the hashes' own array)."""
    packed = _row_hash(rows, workers)
    packed >>= np.uint64(pos_bits + 1)
    packed <<= np.uint64(pos_bits)
    packed = packed.view(np.int64)  # the top bit is clear

    def number(lo: int, hi: int) -> None:
        packed[lo:hi] |= np.arange(lo, hi, dtype=np.int64)

    parallel.run(number, parallel.blocks(len(rows)), workers)
    return packed


def _groups(
    rows: np.ndarray, order: np.ndarray, sorted_hash: np.ndarray, workers: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(table, index) from rows sorted by hash; None if equal hashes hold unequal rows."""
    starts = np.empty(len(sorted_hash), dtype=bool)
    starts[0] = True
    np.not_equal(sorted_hash[1:], sorted_hash[:-1], out=starts[1:])
    inverse = np.empty(len(rows), dtype=np.int32)
    group = np.cumsum(starts, dtype=np.int32)
    group -= 1
    inverse[order] = group
    del group
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

    def depth_entries(self, depth: int) -> slice:
        """Child entries leading to nodes of `depth` (1..SID_LENGTH): decode step `depth`."""
        lo = self.trie.level_offsets
        return slice(int(lo[depth]) - 1, int(lo[depth + 1]) - 1)

    @cached_property
    def node_first_leaf(self) -> np.ndarray:
        """int64 [num_nodes]: the first leaf under each node (root: 0), its first child's
        (made on first use, by k-way: one int64 per node the plain build never holds)."""
        lo = [int(x) for x in self.trie.level_offsets]
        out = np.empty(lo[-1], dtype=np.int64)
        out[lo[SID_LENGTH] :] = np.arange(lo[-1] - lo[SID_LENGTH])
        for depth in range(SID_LENGTH - 1, -1, -1):  # entry j leads to node j + 1
            out[lo[depth] : lo[depth + 1]] = out[
                self.trie.node_offsets[lo[depth] : lo[depth + 1]] + 1
            ]
        return out

    @cached_property
    def node_leaf_count(self) -> np.ndarray:
        """int64 [num_nodes]: the leaves under each node (made on first use)."""
        lo = [int(x) for x in self.trie.level_offsets]
        first, num_leaves = self.node_first_leaf, len(self.leaf_sids)
        out = np.empty(lo[-1], dtype=np.int64)
        for depth in range(SID_LENGTH + 1):  # a node's leaves run to the next node's first
            a, b = lo[depth], lo[depth + 1]
            np.subtract(first[a + 1 : b], first[a : b - 1], out=out[a : b - 1])
            out[b - 1] = num_leaves - first[b - 1]
        return out

    @property
    def entry_bitmask(self) -> np.ndarray:
        """uint64 [E, bitmask_words]: every child entry's bitmask matcher before dedup,
        gathered from the table (for tests and studies: the build never holds E rows)."""
        return self.trie.bitmask_table[self.trie.bitmask_index]

    @property
    def entry_bloom(self) -> np.ndarray:
        """uint64 [E, bloom_words]: every child entry's Bloom matcher before dedup."""
        return self.trie.bloom_table[self.trie.bloom_index]


def build_trie(
    sids: np.ndarray,  # int [N, SID_LENGTH], sorted (several ads may share a SID)
    ad_bitmask: np.ndarray,  # uint64 [N, bitmask_words]
    ad_bloom: np.ndarray,  # uint64 [N, bloom_words]
    workers: int = 1,  # threads for the subtree ORs, hashing and checks: same arrays for any
) -> TrieBuild:
    """The CSR trie of ads sorted by SID."""
    leaf_ad_offsets, leaf_sids = leaf_runs(sids)
    # read N rows once per table; write one row per SID
    leaf_bm = parallel.or_reduceat(ad_bitmask, leaf_ad_offsets[:-1], workers)
    leaf_bl = parallel.or_reduceat(ad_bloom, leaf_ad_offsets[:-1], workers)
    return trie_of_leaves(leaf_ad_offsets, leaf_sids, leaf_bm, leaf_bl, workers)


def leaf_runs(sids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The leaves of ads sorted by SID (int [N, SID_LENGTH]): their ads' offsets int64
    [L + 1] (leaf i: ads [off[i], off[i+1])) and their SIDs int16 [L, SID_LENGTH]."""
    if len(sids) == 0:
        raise ValueError("cannot build a trie from an empty catalog")
    keys = parallel.digit_keys(sids, VOCAB_SIZE)
    if np.any(keys[1:] < keys[:-1]):
        raise ValueError("ads must be sorted by SID before building the trie")
    starts = np.empty(len(keys), dtype=bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    del keys
    first = np.flatnonzero(starts)
    del starts
    leaf_ad_offsets = np.empty(len(first) + 1, dtype=np.int64)
    leaf_ad_offsets[:-1] = first
    leaf_ad_offsets[-1] = len(sids)
    leaf_sids = np.empty((len(first), SID_LENGTH), dtype=np.int16)
    for pos in range(SID_LENGTH):
        leaf_sids[:, pos] = sids[first, pos]
    return leaf_ad_offsets, leaf_sids


def trie_of_leaves(
    leaf_ad_offsets: np.ndarray,  # int64 [L + 1]: `leaf_runs`
    leaf_sids: np.ndarray,  # int16 [L, SID_LENGTH]: `leaf_runs` (sorted, distinct)
    leaf_bm: np.ndarray,  # uint64 [L, bitmask_words]: OR over each leaf's ads
    leaf_bl: np.ndarray,  # uint64 [L, bloom_words]
    workers: int = 1,
) -> TrieBuild:
    """`build_trie` from its leaves: the ads' matchers already ORed per SID (what lets
    the build hash Blooms leaf range by leaf range, never holding one row per ad).

    The matchers are deduplicated depth by depth (`_dedup_by_depth`): the entries of the
    deepest depth are the leaves themselves, whose rows are used as they are, and one
    inner depth's subtree ORs exist at a time — at 30 M ads ~11 M rows of the 38 M
    entries' (72 bytes each), never all of them."""
    num_leaves = len(leaf_sids)
    level_offsets = [0, 1]
    tokens, firsts = [], []  # per depth: its nodes' tokens and first leaves
    for depth in range(1, SID_LENGTH):
        kd = parallel.digit_keys(leaf_sids[:, :depth], VOCAB_SIZE)
        starts = np.empty(num_leaves, dtype=bool)
        starts[0] = True
        np.not_equal(kd[1:], kd[:-1], out=starts[1:])
        del kd
        first = np.flatnonzero(starts)
        del starts
        tokens.append(leaf_sids[first, depth - 1])
        firsts.append(first)
        level_offsets.append(level_offsets[-1] + len(first))
    tokens.append(leaf_sids[:, SID_LENGTH - 1].copy())  # the deepest nodes: the leaves
    level_offsets.append(level_offsets[-1] + num_leaves)
    num_nodes = level_offsets[-1]
    if num_nodes >= np.iinfo(np.int32).max:
        raise ValueError(f"{num_nodes} trie nodes exceed the int32 layout")
    node_offsets = _child_offsets(firsts, level_offsets)
    bm_table, bm_index = _dedup_by_depth(leaf_bm, firsts, workers)
    bl_table, bl_index = _dedup_by_depth(leaf_bl, firsts, workers)
    del firsts
    trie = TrieArrays(
        node_offsets=node_offsets,
        csr_child_nodes=np.arange(1, num_nodes, dtype=np.int32),
        csr_tokens=np.concatenate(tokens),
        bitmask_index=bm_index,
        bloom_index=bl_index,
        bitmask_table=bm_table,
        bloom_table=bl_table,
        level_offsets=np.array(level_offsets, dtype=np.int64),
    )
    return TrieBuild(trie, leaf_ad_offsets, leaf_sids, leaf_bm, leaf_bl)


def _child_offsets(firsts: list[np.ndarray], level_offsets: list[int]) -> np.ndarray:
    """The CSR `node_offsets` (int32 [num_nodes + 1]) from the first leaf of each node of
    depths 1..SID_LENGTH - 1 (`firsts`; the deepest nodes are the leaves). A node's
    children are the next depth's nodes from the one starting at its first leaf (every
    prefix starts a longer one there), and entry j leads to node j + 1; leaves have none."""
    num_nodes = level_offsets[-1]
    out = np.empty(num_nodes + 1, dtype=np.int32)
    out[0] = 0  # the root: entries from 0
    for depth in range(1, SID_LENGTH):
        at = out[level_offsets[depth] : level_offsets[depth + 1]]
        first = firsts[depth - 1]
        # the next depth's nodes starting before this node's first leaf
        at[:] = first if depth == SID_LENGTH - 1 else np.searchsorted(firsts[depth], first)
        at += level_offsets[depth + 1] - 1
    out[level_offsets[SID_LENGTH] :] = num_nodes - 1
    return out


def _dedup_by_depth(
    leaf_rows: np.ndarray, firsts: list[np.ndarray], workers: int
) -> tuple[np.ndarray, np.ndarray]:
    """`dedup_rows` of every child entry's matcher, entries in order (depth 1 first): the
    OR of `leaf_rows` (uint64 [L, W]) over each node's leaves (`firsts`: the first leaf of
    each node of depths 1..SID_LENGTH - 1; the deepest depth's rows are `leaf_rows`).

    Each depth's rows are made and deduplicated on their own, then the depths' small
    tables together: the same table and index as one `dedup_rows` of all the rows (its
    table is ordered by hash, whatever the rows' order and repeats), holding one depth's
    rows at a time."""
    index = np.empty(sum(len(f) for f in firsts) + len(leaf_rows), dtype=np.int32)
    tables, at = [], 0
    for first in [*firsts, None]:
        rows = leaf_rows if first is None else parallel.or_reduceat(leaf_rows, first, workers)
        table, index[at : at + len(rows)] = dedup_rows(rows, workers)
        at += len(rows)
        del rows
        tables.append(table)
    table, merged = dedup_rows(np.concatenate(tables), workers)
    at = base = 0  # each depth's own index -> the merged table's
    for first, own in zip([*firsts, None], tables, strict=True):
        count = len(leaf_rows) if first is None else len(first)
        for lo, hi in parallel.blocks(count, 1 << 20):
            part = index[at + lo : at + hi]
            part[:] = merged[part + base]
        at, base = at + count, base + len(own)
    return table, index


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
    Counted from the tables and each row's uses (a row's set bits times its entries), the
    same figures as `matcher_fill` of the entries' rows, which the build never holds.
    """
    del workers  # one bincount per step and table: nothing to share out
    trie = build.trie
    bm_bits = np.bitwise_count(trie.bitmask_table).sum(axis=1, dtype=np.int64)
    bl_bits = np.bitwise_count(trie.bloom_table).sum(axis=1, dtype=np.int64)
    bm_words, bl_words = trie.bitmask_table.shape[1], trie.bloom_table.shape[1]
    out = []
    for depth in range(1, SID_LENGTH + 1):
        sl = build.depth_entries(depth)
        entries = sl.stop - sl.start
        bm_uses = np.bincount(trie.bitmask_index[sl], minlength=len(bm_bits))
        bl_uses = np.bincount(trie.bloom_index[sl], minlength=len(bl_bits))
        set_bm, set_bl = int(bm_uses @ bm_bits), int(bl_uses @ bl_bits)
        out.append(
            {
                "step": depth,
                "entries": entries,
                "bitmask_bytes": entries * bm_words * 8,
                "bitmask_bytes_dedup": int(np.count_nonzero(bm_uses)) * bm_words * 8,
                "bloom_bytes": entries * bl_words * 8,
                "bloom_bytes_dedup": int(np.count_nonzero(bl_uses)) * bl_words * 8,
                "bitmask_fill": set_bm / entries / max(1, schema.bitmask_bits),
                "bloom_fill": set_bl / entries / max(1, 64 * schema.bloom_words),
            }
        )
    return out
