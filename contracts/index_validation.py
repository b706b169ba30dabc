"""Full validation of one index version: what `grace validate-index` and the server's
hot-swap run before an index may serve (docs/ARCHITECTURE.md §3). Beyond
`format.read_index_dir` (manifest, checksums, dtypes, shapes, schema) it checks the CSR
trie invariants, the SID -> ad index, the exact targeting index, and the GTM soundness
invariant: every matcher contains the OR of its subtree's ads, so no eligible prefix can
be masked. Every check is vectorised. The optional k-way groups are checked for structure
only (docs/FORMAT.md says why).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contracts.index_arrays import AdArrays, IndexArrays, PartitionArrays, SetArrays, TrieArrays
from contracts.index_format import SID_LENGTH, VOCAB_SIZE, read_index_dir
from contracts.index_manifest import IndexFormatError, manifest_schema
from contracts.targeting_codec import codec, value_blooms
from contracts.targeting_schema import TargetingSchema


class IndexValidationError(ValueError):
    """An index that must not serve; the message lists every fault found."""

    def __init__(self, path: Path, faults: list[str]) -> None:
        super().__init__(f"{path}: invalid index:\n  - " + "\n  - ".join(faults))
        self.path, self.faults = path, faults

    @property
    def summary(self) -> str:
        """The faults on one line, for logs."""
        return f"{self.path}: invalid index: " + "; ".join(self.faults)


@dataclass(frozen=True)
class ValidatedIndex:
    path: Path
    manifest: dict[str, Any]
    arrays: IndexArrays


def validate_index(
    path: Path | str,
    *,
    expect_tokenizer: str | None = None,
    expect_version: str | None = None,
    mmap: bool = True,
) -> ValidatedIndex:
    """Open and check an index directory; raise IndexValidationError listing all faults.
    `expect_tokenizer`: the SID space the index must be built for; `expect_version`: the
    version name it is published under; `mmap`: see `read_index_dir`."""
    path = Path(path)
    try:
        manifest, arrays = read_index_dir(path, mmap=mmap)
    except IndexFormatError as exc:
        raise IndexValidationError(path, [str(exc)]) from exc
    faults: list[str] = []
    if expect_version is not None and manifest["index_version"] != expect_version:
        faults.append(
            f"manifest index_version {manifest['index_version']!r} differs from the "
            f"version name {expect_version!r}"
        )
    if expect_tokenizer is not None and manifest["tokenizer_fingerprint"] != expect_tokenizer:
        faults.append(
            f"built for SID space {manifest['tokenizer_fingerprint']}, "
            f"the model's is {expect_tokenizer} (contracts/sid_space.py)"
        )
    schema = manifest_schema(manifest, path)  # read_index_dir has parsed it once already
    faults += check_trie(arrays.trie, schema)
    if not faults:  # the rest indexes through the trie
        faults += check_ads(arrays.trie, arrays.ads)
    if not faults:
        faults += check_soundness(arrays.trie, arrays.ads, schema)
    if not faults and arrays.kway is not None:
        faults += check_partitions(arrays.trie, arrays.kway)
    counts = manifest.get("counts", {})
    for key, actual in (("ads", arrays.ads.num_ads), ("nodes", arrays.trie.num_nodes)):
        if key in counts and counts[key] != actual:
            faults.append(f"manifest counts {key}={counts[key]}, arrays hold {actual}")
    if faults:
        raise IndexValidationError(path, faults)
    return ValidatedIndex(path, manifest, arrays)


def _monotone_offsets(name: str, off: np.ndarray, total: int) -> list[str]:
    if len(off) == 0 or off[0] != 0 or off[-1] != total:
        return [f"{name} must start at 0 and end at {total}"]
    if np.any(np.diff(off) < 0):
        return [f"{name} decreases at {int(np.argmax(np.diff(off) < 0))}"]
    return []


def _in_range(name: str, a: np.ndarray, hi: int, lo: int = 0) -> list[str]:
    if len(a) and (a.min() < lo or a.max() >= hi):
        return [f"{name} out of range [{lo}, {hi})"]
    return []


def check_trie(t: TrieArrays, schema: TargetingSchema) -> list[str]:
    faults: list[str] = []
    n, e = t.num_nodes, t.num_entries
    lo = t.level_offsets
    if len(lo) != SID_LENGTH + 2 or lo[0] != 0 or lo[1] != 1 or lo[-1] != n:
        return [f"level_offsets {lo.tolist()} do not describe {n} nodes in {SID_LENGTH} levels"]
    if np.any(np.diff(lo) <= 0):
        return [f"level_offsets {lo.tolist()} have an empty level"]
    faults += _monotone_offsets("node_offsets", t.node_offsets, e)
    if e != n - 1 or len(t.csr_child_nodes) != e:
        faults.append(f"{e} child entries for {n} nodes (a tree has nodes - 1)")
    if len(t.bitmask_index) != e or len(t.bloom_index) != e:
        faults.append("bitmask_index / bloom_index length differs from the child entries")
    if faults:
        return faults
    faults += _in_range("csr_tokens", t.csr_tokens, VOCAB_SIZE)
    faults += _in_range("bitmask_index", t.bitmask_index, len(t.bitmask_table))
    faults += _in_range("bloom_index", t.bloom_index, len(t.bloom_table))
    if not np.array_equal(t.csr_child_nodes, np.arange(1, n, dtype=np.int32)):
        faults.append("csr_child_nodes is not the breadth-first numbering 1..nodes-1")
    if faults:
        return faults
    depth = np.repeat(np.arange(len(lo) - 1, dtype=np.int8), np.diff(lo))  # int8 [nodes]
    parent = np.repeat(np.arange(n), np.diff(t.node_offsets))  # parent of entry j = node j+1
    if np.any(depth[1:] != depth[parent] + 1):
        faults.append("a child entry skips or repeats a level")
    has_children = np.diff(t.node_offsets) > 0
    if np.any(has_children[depth == SID_LENGTH]):
        faults.append("a leaf (full SID) has children")
    if np.any(~has_children[depth < SID_LENGTH]):
        faults.append("an inner node has no children (a prefix of no SID)")
    same_parent = parent[1:] == parent[:-1]
    if np.any(same_parent & (t.csr_tokens[1:] <= t.csr_tokens[:-1])):
        faults.append("tokens within a node are not strictly increasing")
    if np.any(t.bitmask_table & ~codec(schema).full_bitmask):
        faults.append(f"bitmask rows set padding bits beyond bit {schema.bitmask_bits}")
    return faults


def check_ads(t: TrieArrays, a: AdArrays) -> list[str]:
    faults: list[str] = []
    num_leaves = int(t.level_offsets[-1] - t.level_offsets[-2])
    n = a.num_ads
    if a.leaf_sids.shape != (num_leaves, SID_LENGTH):
        return [f"leaf_sids has shape {a.leaf_sids.shape}, the trie has {num_leaves} leaves"]
    faults += _monotone_offsets("leaf_ad_offsets", a.leaf_ad_offsets, n)
    if len(a.leaf_ad_offsets) != num_leaves + 1:
        faults.append("leaf_ad_offsets length differs from leaves + 1")
    elif not faults and np.any(np.diff(a.leaf_ad_offsets) == 0):
        faults.append("a SID maps to no ad")
    ids = np.sort(a.ad_ids)  # not np.unique: it hashes, ~100x slower on the builder's order
    if np.any(ids[1:] == ids[:-1]):
        faults.append("ad_ids are not unique")
    if a.ad_bitmask.shape[0] != n:
        faults.append("ad_bitmask rows differ from the number of ads")
    if a.ad_exclude_bitmask is not None and a.ad_exclude_bitmask.shape != a.ad_bitmask.shape:
        faults.append("ad_exclude_bitmask differs in shape from ad_bitmask")
    for name in ("ad_campaign_ids", "ad_advertiser_ids"):
        owners = getattr(a, name)
        if owners is not None and owners.shape != (n,):
            faults.append(f"{name} has {len(owners)} entries for {n} ads")
    for attr, sets in a.sets.items():
        faults += _check_set(f"sets.{attr}", sets, n)
    if faults:
        return faults
    # the SID on every leaf equals the token path from the root
    tokens = np.concatenate([[0], t.csr_tokens.astype(np.int64)])
    parent = np.concatenate([[0], np.repeat(np.arange(t.num_nodes), np.diff(t.node_offsets))])
    node = np.arange(t.level_offsets[-2], t.level_offsets[-1])
    for pos in range(SID_LENGTH - 1, -1, -1):
        if np.any(tokens[node] != a.leaf_sids[:, pos]):
            faults.append(f"leaf_sids disagree with the trie path at token {pos}")
            break
        node = parent[node]
    return faults


def _check_set(name: str, s: SetArrays, n: int) -> list[str]:
    """One set attribute's lists and vocabulary."""
    vocab = len(s.vocab_offsets) - 1
    faults = _monotone_offsets(f"{name}.vocab_offsets", s.vocab_offsets, len(s.vocab_bytes))
    lists = [("include", s.include_offsets, s.include_ids)]
    if s.exclude_offsets is not None and s.exclude_ids is not None:
        lists.append(("exclude", s.exclude_offsets, s.exclude_ids))
    for kind, offsets, ids in lists:
        faults += _monotone_offsets(f"{name}.{kind}_offsets", offsets, len(ids))
        if len(offsets) != n + 1:
            faults.append(f"{name}.{kind}_offsets length differs from ads + 1")
        faults += _in_range(f"{name}.{kind}_ids", ids, vocab)
    if faults:
        return faults
    for kind, offsets, ids in lists:  # the post stage intersects each ad's list by merge
        if not _ascending_per_list(offsets, ids):
            faults.append(f"{name}.{kind}_ids are not sorted ascending within each ad")
    try:
        strings = s.strings()
    except UnicodeDecodeError:
        return [f"{name}: the vocabulary is not valid UTF-8"]
    if any(x >= y for x, y in itertools.pairwise(strings)):
        faults.append(f"{name}: the vocabulary is not sorted and unique")
    return faults


def _ascending_per_list(offsets: np.ndarray, ids: np.ndarray) -> bool:
    """Whether each CSR list (offsets monotone and complete, ids in range) is sorted."""
    if len(ids) < 2:
        return True
    rises = np.diff(ids) >= 0  # pair (j, j + 1); ids are in range, so no overflow
    starts = offsets[1:-1]
    rises[starts[(starts > 0) & (starts < len(ids))] - 1] = True  # pairs across two lists
    return bool(rises.all())


def check_soundness(t: TrieArrays, a: AdArrays, schema: TargetingSchema) -> list[str]:
    """Every matcher contains the OR of its subtree's ads (so no false negatives): leaf
    matchers against the exact ad targeting (Bloom rows rehashed from each set attribute's
    value strings), inner ones against their children where parent and child point at
    different table rows (most entries share their parent's row: a fraction of the rows is
    read)."""
    faults: list[str] = []
    starts = a.leaf_ad_offsets[:-1]
    leaf_bm = np.bitwise_or.reduceat(a.ad_bitmask, starts, axis=0)
    vocab = {f.name: value_blooms(a.sets[f.name].strings(), f.bloom_bits, f.bloom_hashes)
             for f in schema.families}  # fmt: skip
    include = {name: s.include for name, s in a.sets.items()}
    ads_bl = codec(schema).ad_blooms(include, vocab, a.num_ads)
    leaf_bl = np.bitwise_or.reduceat(ads_bl, starts, axis=0)
    first_leaf_entry = int(t.level_offsets[-2]) - 1
    bm_index, bl_index = np.asarray(t.bitmask_index), np.asarray(t.bloom_index)
    if not _contains(t.bitmask_table, bm_index[first_leaf_entry:], leaf_bm):
        faults.append("a SID's bitmask matcher misses bits of its ads (false negatives)")
    if not _contains(t.bloom_table, bl_index[first_leaf_entry:], leaf_bl):
        faults.append("a SID's Bloom matcher misses bits of its ads (false negatives)")
    parent = np.repeat(np.arange(t.num_nodes), np.diff(t.node_offsets))  # of entry j
    inner = parent > 0  # entries whose parent is itself an entry (node p = entry p-1)
    parent_entry = parent[inner] - 1
    for what, table, index in (("bitmask", t.bitmask_table, bm_index),
                               ("Bloom", t.bloom_table, bl_index)):  # fmt: skip
        child_row, parent_row = index[inner], index[parent_entry]
        apart = child_row != parent_row
        if not _contains(table, parent_row[apart], table[child_row[apart]]):
            faults.append(f"a prefix's {what} matcher misses bits of a child (false negatives)")
    return faults


def _contains(table: np.ndarray, rows: np.ndarray, bits: np.ndarray) -> bool:
    """Whether every `table[rows[i]]` holds all of `bits[i]`'s set bits."""
    return not np.any((table[rows] & bits) != bits)


def check_partitions(t: TrieArrays, p: PartitionArrays) -> list[str]:
    faults = _monotone_offsets("kway.offsets", p.offsets, len(p.bitmask_index))
    if len(p.offsets) != t.num_entries + 1:
        faults.append("kway.offsets length differs from child entries + 1")
    if len(p.bloom_index) != len(p.bitmask_index):
        faults.append("kway bitmask/bloom index lengths differ")
    faults += _in_range("kway.bitmask_index", p.bitmask_index, len(p.bitmask_table))
    faults += _in_range("kway.bloom_index", p.bloom_index, len(p.bloom_table))
    if not faults and np.any(np.diff(p.offsets) == 0):
        faults.append("a child entry has no k-way group")
    return faults
