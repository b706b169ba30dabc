"""k-way partitioned GTM matchers (paper §3.3): optional, built after the trie.

Instead of one OR over a child entry's whole subtree, the SIDs under the entry are split
into up to k groups, each with its own (bitmask, Bloom) union; the decoder keeps the
entry if any one group passes both tests. Every eligible ad sits in some group whose
union contains its bits, so no false negatives are introduced.

Static k-way fixes k per decode step; each SID, in SID order, joins the group whose union
grows least (smallest post-union popcount; ties to the lowest group). Dynamic k-way
doubles k per entry from 1 until every group's fill (mean of bitmask and Bloom fill) is
at most the target, or k reaches k_max. The greedy runs for all entries of one depth at
once, SID by SID, so its cost is the deepest subtree times the entries. Output:
`index_format.PartitionArrays`, with its own deduplicated tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contracts.index_arrays import PartitionArrays
from contracts.index_format import SID_LENGTH
from contracts.targeting_schema import DEFAULT, TargetingSchema
from index_builder.trie import TrieBuild, dedup_rows, matcher_fill


@dataclass(frozen=True)
class KwaySpec:
    """Which partitioning to build; stored in the manifest as `to_manifest()`."""

    mode: str  # "static" | "dynamic"
    k: tuple[int, ...] = (64, 64, 32, 8)  # static: k per decode step
    k_max: int = 32  # dynamic
    target_fill: float = 0.25  # dynamic

    def __post_init__(self) -> None:
        if self.mode not in ("static", "dynamic"):
            raise ValueError(f"k-way mode must be 'static' or 'dynamic', got {self.mode!r}")
        if self.mode == "static" and (len(self.k) != SID_LENGTH or any(k < 1 for k in self.k)):
            raise ValueError(f"static k-way needs {SID_LENGTH} positive k values, got {self.k}")
        if self.k_max < 1 or not 0 < self.target_fill <= 1:
            raise ValueError("dynamic k-way needs k_max >= 1 and 0 < target_fill <= 1")

    def to_manifest(self) -> dict[str, object]:
        if self.mode == "static":
            return {"mode": "static", "k": list(self.k)}
        return {"mode": "dynamic", "k_max": self.k_max, "target_fill": self.target_fill}

    @classmethod
    def parse(cls, text: str) -> KwaySpec:
        """CLI form: 'static', 'static:64,64,32,8', 'dynamic' or 'dynamic:32,0.25'."""
        mode, _, args = text.partition(":")
        if mode == "static":
            return cls("static", tuple(int(x) for x in args.split(","))) if args else cls("static")
        if mode == "dynamic" and args:
            k_max, fill = args.split(",")
            return cls("dynamic", k_max=int(k_max), target_fill=float(fill))
        return cls(mode)


def _greedy(
    first: np.ndarray,  # int64 [E]: first leaf of each entry's subtree
    count: np.ndarray,  # int64 [E]: leaves under each entry
    k: int,
    leaf_bm: np.ndarray,  # uint64 [num_leaves, W_bm]
    leaf_bl: np.ndarray,  # uint64 [num_leaves, W_bl]
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy min-growth partition of each entry's leaves into k groups: the unions
    bm [E, k, W_bm], bl [E, k, W_bl] (an unused group is all zeros)."""
    n = len(first)
    order = np.argsort(-count, kind="stable")  # entries with more leaves first: active prefix
    first, count = first[order], count[order]
    bm = np.zeros((n, k, leaf_bm.shape[1]), dtype=np.uint64)
    bl = np.zeros((n, k, leaf_bl.shape[1]), dtype=np.uint64)
    active = n
    for i in range(int(count.max(initial=0))):
        while active and count[active - 1] <= i:
            active -= 1
        item_bm = leaf_bm[first[:active] + i][:, None]  # [a, 1, W]
        item_bl = leaf_bl[first[:active] + i][:, None]
        grown = np.bitwise_count(bm[:active] | item_bm).sum(-1, dtype=np.int32)
        grown += np.bitwise_count(bl[:active] | item_bl).sum(-1, dtype=np.int32)
        group = np.argmin(grown, axis=1)
        rows = np.arange(active)
        bm[rows, group] |= item_bm[:, 0]
        bl[rows, group] |= item_bl[:, 0]
    inverse = np.empty_like(order)
    inverse[order] = np.arange(n)
    return bm[inverse], bl[inverse]


def _group_fill(bm: np.ndarray, bl: np.ndarray, schema: TargetingSchema) -> np.ndarray:
    """Worst group fill per entry: max over used groups of mean(bitmask fill, Bloom fill)."""
    fill = (np.bitwise_count(bm).sum(-1) / max(1, schema.bitmask_bits)
            + np.bitwise_count(bl).sum(-1) / max(1, 64 * schema.bloom_words)) / 2  # fmt: skip
    return fill.max(axis=1)


def _partition_depth(
    build: TrieBuild, depth: int, spec: KwaySpec, schema: TargetingSchema
) -> list[tuple]:
    """Per entry of one depth: (bitmask rows [g, W], bloom rows [g, W]) of its used groups."""
    lo, hi = (int(x) for x in build.trie.level_offsets[depth : depth + 2])
    first, count = build.node_first_leaf[lo:hi], build.node_leaf_count[lo:hi]
    n = hi - lo
    if spec.mode == "static":
        bm, bl = _greedy(first, count, spec.k[depth - 1], build.leaf_bitmask, build.leaf_bloom)
        return _used_groups(bm, bl)
    result: list[tuple | None] = [None] * n
    pending = np.arange(n)
    k = 1
    while len(pending):
        bm, bl = _greedy(first[pending], count[pending], k, build.leaf_bitmask, build.leaf_bloom)
        done = (
            (_group_fill(bm, bl, schema) <= spec.target_fill)
            | (k >= spec.k_max)
            | (count[pending] <= k)
        )
        for j, groups in zip(np.flatnonzero(done), _used_groups(bm[done], bl[done]), strict=True):
            result[pending[j]] = groups
        pending = pending[~done]
        k = min(2 * k, spec.k_max)
    return result  # type: ignore[return-value]


def _used_groups(bm: np.ndarray, bl: np.ndarray) -> list[tuple]:
    # a group holding a leaf has a bit set: the leaf's Bloom family rows are never zero,
    # nor its bitmask where an attribute's rules leave any value eligible
    used = bm.any(axis=2) | bl.any(axis=2)
    return [(bm[e, used[e]], bl[e, used[e]]) for e in range(len(bm))]


def build_partitions(
    build: TrieBuild, spec: KwaySpec, schema: TargetingSchema = DEFAULT
) -> tuple[PartitionArrays, list[dict]]:
    """Partitioned matchers for every child entry, plus per-step stats (groups, fill)."""
    per_entry: list[tuple] = []
    stats = []
    for depth in range(1, SID_LENGTH + 1):
        groups = _partition_depth(build, depth, spec, schema)
        per_entry.extend(groups)
        bm = np.concatenate([g[0] for g in groups])
        bl = np.concatenate([g[1] for g in groups])
        fill_bm, fill_bl = matcher_fill(bm, bl, schema)
        stats.append(
            {
                "step": depth,
                "groups": len(bm),
                "mean_k": len(bm) / max(len(groups), 1),
                "bitmask_fill": fill_bm,
                "bloom_fill": fill_bl,
            }
        )
    counts = np.array([len(g[0]) for g in per_entry], dtype=np.int64)
    offsets = np.zeros(len(per_entry) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    bm_table, bm_index = dedup_rows(np.concatenate([g[0] for g in per_entry]))
    bl_table, bl_index = dedup_rows(np.concatenate([g[1] for g in per_entry]))
    return PartitionArrays(offsets, bm_index, bl_index, bm_table, bl_table), stats
