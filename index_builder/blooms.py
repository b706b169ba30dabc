"""Per-ad Bloom rows of the set attributes (docs/ARCHITECTURE.md §3): `build.py` hashes the
sorted catalog's include lists leaf by leaf (`leaf_blooms`) before the trie ORs them up
(`trie.trie_of_leaves`); studies rebuild them from a published index (`index_blooms`).
"""

from __future__ import annotations

import numpy as np

from contracts.index_arrays import AdArrays
from contracts.targeting_codec import Codec, Ragged, codec, value_blooms
from contracts.targeting_schema import TargetingSchema
from index_builder import parallel


def ad_blooms(
    schema: TargetingSchema, include: dict[str, Ragged], vocabularies: dict[str, list[str]],
    workers: int = 1,
) -> np.ndarray:  # fmt: skip
    """`Codec.ad_blooms` of N ads (each set attribute's include lists as ids into its
    vocabulary of strings): uint64 [N, bloom_words], rows split over `workers` threads."""
    n = next(iter(include.values())).n if include else 0
    by, vocab = _bloom_setup(schema, vocabularies)
    if not schema.families:  # no set attribute: rows of no words (one per ad)
        return np.zeros((n, 0), dtype=np.uint64)
    out = np.empty((n, schema.bloom_words), dtype=np.uint64)

    def part(lo: int, hi: int) -> None:
        out[lo:hi] = _range_blooms(by, vocab, include, lo, hi)

    parallel.run(part, parallel.ranges(n, workers), workers)
    return out


def leaf_blooms(
    schema: TargetingSchema, include: dict[str, Ragged], vocabularies: dict[str, list[str]],
    leaf_first_ad: np.ndarray, workers: int = 1,
) -> np.ndarray:  # fmt: skip
    """`ad_blooms` of ads sorted by SID, ORed over each leaf's ads (`leaf_first_ad` int64
    [L]: `trie.leaf_runs`): uint64 [L, bloom_words], the same as `or_reduceat` of the
    per-ad rows, hashed in blocks of whole leaves so that no row per ad is ever held."""
    n = next(iter(include.values())).n if include else 0
    by, vocab = _bloom_setup(schema, vocabularies)
    num_leaves = len(leaf_first_ad)
    if not schema.families:
        return np.zeros((num_leaves, 0), dtype=np.uint64)
    out = np.empty((num_leaves, schema.bloom_words), dtype=np.uint64)

    def part(lo: int, hi: int) -> None:
        a0 = int(leaf_first_ad[lo])
        a1 = int(leaf_first_ad[hi]) if hi < num_leaves else n
        rows = _range_blooms(by, vocab, include, a0, a1)
        np.bitwise_or.reduceat(rows, leaf_first_ad[lo:hi] - a0, axis=0, out=out[lo:hi])

    parallel.run(part, parallel.blocks(num_leaves), workers)  # a few MB of rows per task
    return out


def _bloom_setup(
    schema: TargetingSchema, vocabularies: dict[str, list[str]]
) -> tuple[Codec, dict[str, np.ndarray]]:
    """The schema's codec and each set attribute's vocabulary hashed (`value_blooms`)."""
    vocab = {a.name: value_blooms(vocabularies[a.name], a.bloom_bits, a.bloom_hashes)
             for a in schema.families}  # fmt: skip
    return codec(schema), vocab


def _range_blooms(
    by: Codec, vocab: dict[str, np.ndarray], include: dict[str, Ragged], lo: int, hi: int
) -> np.ndarray:
    """`Codec.ad_blooms` of ads [lo, hi)."""
    mine = {}
    for name, lists in include.items():
        off = lists.offsets[lo : hi + 1]
        mine[name] = Ragged(off - off[0], lists.values[off[0] : off[-1]])
    return by.ad_blooms(mine, vocab, hi - lo)


def index_blooms(ads: AdArrays, schema: TargetingSchema, workers: int = 1) -> np.ndarray:
    """`ad_blooms` of an index's ads, from its own arrays (no catalog at hand)."""
    include = {k: s.include for k, s in ads.sets.items()}
    return ad_blooms(schema, include, {k: s.strings() for k, s in ads.sets.items()}, workers)
