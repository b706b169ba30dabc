"""An index version's arrays in memory: the GTM trie, the SID -> ad index and the exact
targeting index (each set attribute's lists and vocabulary), and the optional k-way
matchers. `contracts/index_format.py` writes and reads them as one `.npy` file each
(docs/FORMAT.md §3); the builder makes them (`index_builder/build.py`), the server serves
them (`service/index/loaded.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from contracts.targeting_codec import AdRules, Ragged


@dataclass(frozen=True)
class TrieArrays:
    """The GTM SID trie in CSR form (paper Appendix A). Entry j leads to node j + 1."""

    node_offsets: np.ndarray  # int32 [num_nodes + 1]: node i's entries [off[i], off[i+1])
    csr_child_nodes: np.ndarray  # int32 [E]
    csr_tokens: np.ndarray  # int16 [E]
    bitmask_index: np.ndarray  # int32 [E]
    bloom_index: np.ndarray  # int32 [E]
    bitmask_table: np.ndarray  # uint64 [R_bm, bitmask_words], deduplicated
    bloom_table: np.ndarray  # uint64 [R_bl, bloom_words], deduplicated
    level_offsets: np.ndarray  # int64 [SID_LENGTH + 2]: depth d's nodes [lo[d], lo[d+1])

    @property
    def num_nodes(self) -> int:
        return len(self.node_offsets) - 1

    @property
    def num_entries(self) -> int:
        return len(self.csr_tokens)


@dataclass(frozen=True)
class SetArrays:
    """One set attribute's exact rules over N ads: its include and exclude lists as sorted
    ids into its vocabulary (empty = no rule), and the vocabulary, every value either
    list names (sorted, unique, UTF-8)."""

    include_offsets: np.ndarray  # int64 [N + 1]
    include_ids: np.ndarray  # int32 [nnz]
    vocab_offsets: np.ndarray  # int64 [V + 1]
    vocab_bytes: np.ndarray  # uint8 [total bytes]
    exclude_offsets: np.ndarray | None = None  # int64 [N + 1]; None: no ad excludes
    exclude_ids: np.ndarray | None = None  # int32 [nnz]

    @property
    def include(self) -> Ragged:
        return Ragged(self.include_offsets, self.include_ids)

    @property
    def exclude(self) -> Ragged | None:
        if self.exclude_offsets is None or self.exclude_ids is None:
            return None
        return Ragged(self.exclude_offsets, self.exclude_ids)

    def strings(self) -> list[str]:
        """The vocabulary, decoded (sorted, unique)."""
        raw = self.vocab_bytes.tobytes()
        off = self.vocab_offsets
        return [raw[off[i] : off[i + 1]].decode("utf-8") for i in range(len(off) - 1)]

    @classmethod
    def from_strings(
        cls, include: Ragged, exclude: Ragged | None, vocabulary: list[str]
    ) -> SetArrays:
        """Lists of ids into `vocabulary` (sorted, unique strings)."""
        raw = [s.encode("utf-8") for s in vocabulary]
        offsets = np.zeros(len(raw) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in raw], out=offsets[1:])
        return cls(
            include_offsets=include.offsets.astype(np.int64),
            include_ids=include.values.astype(np.int32),
            vocab_offsets=offsets,
            vocab_bytes=np.frombuffer(b"".join(raw), dtype=np.uint8),
            exclude_offsets=None if exclude is None else exclude.offsets.astype(np.int64),
            exclude_ids=None if exclude is None else exclude.values.astype(np.int32),
        )


@dataclass(frozen=True)
class AdArrays:
    """SID -> ad index and the exact ad targeting index, both in leaf (SID) order."""

    leaf_sids: np.ndarray  # int16 [num_leaves, SID_LENGTH]: SID of leaf node lo[-2] + i
    leaf_ad_offsets: np.ndarray  # int64 [num_leaves + 1]: leaf i's ads [off[i], off[i+1])
    ad_ids: np.ndarray  # int64 [N]
    ad_bitmask: np.ndarray  # uint64 [N, bitmask_words]: enum/bucket rules, exclusions folded
    sets: Mapping[str, SetArrays] = field(default_factory=dict)  # per set attribute, by name
    # each ad's campaign and advertiser, 0 = none (None: the catalog named none, and a
    # request's block on them cannot be applied)
    ad_campaign_ids: np.ndarray | None = None  # int64 [N]
    ad_advertiser_ids: np.ndarray | None = None  # int64 [N]
    # uint64 [N, bitmask_words]: the bits each ad's enum/bucket exclusions cleared (what
    # tells an exclusion from an include failure in the post stage's counts); None: none
    ad_exclude_bitmask: np.ndarray | None = None

    @property
    def num_ads(self) -> int:
        return len(self.ad_ids)

    def rules(self) -> AdRules:
        """The ads' exact targeting, as `targeting_codec.exact_eligible` reads it."""
        return AdRules(
            bitmask=self.ad_bitmask,
            include={name: s.include for name, s in self.sets.items()},
            exclude={name: x for name, s in self.sets.items() if (x := s.exclude) is not None},
            campaign=self.ad_campaign_ids,
            advertiser=self.ad_advertiser_ids,
        )


@dataclass(frozen=True)
class PartitionArrays:
    """k-way partitioned matchers, jagged: entry j has partitions [offsets[j], offsets[j+1])."""

    offsets: np.ndarray  # int64 [E + 1]
    bitmask_index: np.ndarray  # int32 [P]
    bloom_index: np.ndarray  # int32 [P]
    bitmask_table: np.ndarray  # uint64 [R, bitmask_words]
    bloom_table: np.ndarray  # uint64 [R, bloom_words]


@dataclass(frozen=True)
class IndexArrays:
    trie: TrieArrays
    ads: AdArrays
    kway: PartitionArrays | None = None
